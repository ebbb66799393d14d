"""NaN and inf are findings: where they appear, on which path, and whether the weights held them.

Three sources, whatever the depth:

* the weights, read from the staged checkpoint of each side in the scan's dtype
  (``probes.nonfinite``);
* every path's logprobs (response tokens whose logprob is NaN or inf);
* at ``--depth modules|ops``, the first boundary in semantic order where either
  path holds a NaN or inf (``locate.first_nonfinite``).

Any of them makes ``result["non_finite"]`` (with a one-line ``summary``), a
warning first in ``warnings``, and a ``framework_difference``/``non_finite``
cause, so the verdict is never a clean-looking one and ``check`` fails.
``add_non_finite`` puts them on a result, a scan's or a comparison of bundles'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from logdiff.comparison.result import Cause
from logdiff.diagnosis import classify


def path_counts(paths: list[Any]) -> dict[str, list[int]]:
    """Path name -> [tokens whose logprob is NaN/inf, tokens], for paths that have any."""
    out = {}
    for p in paths:
        flat = np.concatenate([np.asarray(a, np.float64) for a in p.logprobs]) if p.logprobs else np.zeros(0)
        bad = int((~np.isfinite(flat)).sum())
        if bad:
            out[p.path] = [bad, int(flat.size)]
    return out


def finding(paths: dict[str, list[int]], weights: dict[str, list[str]], first: dict[str, Any] | None,
            dtype: str) -> dict[str, Any] | None:  # fmt: skip
    """The ``non_finite`` block of result.json, or None when everything checked is finite."""
    if not paths and not any(weights.values()) and first is None:
        return None
    parts = []
    if paths:
        parts.append("logprobs of " + ", ".join(f"{p} ({n} of {total} tokens)" for p, (n, total) in paths.items()))
    if first is not None:
        parts.append(f"first at {first['boundary']} on {', '.join(first['paths'])}")
    held = _held(weights)
    if held:
        parts.append(f"the weights hold it ({dtype}): {held}")
    elif paths or first is not None:
        parts.append("every weight is finite: the values are computed, not loaded")
    return {"summary": "NaN/inf found: " + "; ".join(parts), "paths": paths, "weights": weights, "first": first}


def _held(weights: dict[str, list[str]]) -> str:
    train, infer = weights.get("train") or [], weights.get("infer") or []
    if train == infer:
        return _names(train) + (" (both sides)" if train else "")
    return "; ".join(f"{side}: {_names(names)}" for side, names in (("train", train), ("infer", infer)) if names)


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def cause(found: dict[str, Any], localized: bool) -> Cause:
    """The ``non_finite`` cause for a finding (class ``framework_difference``)."""
    first, weights = found["first"], found["weights"]
    names = list(dict.fromkeys([*(weights.get("train") or []), *(weights.get("infer") or [])]))
    evidence = []
    if first is not None:
        where = f"sequence {first['sequence']}, position {first['position']}"
        evidence.append(f"NaN/inf first appears at {first['boundary']} ({where}) on {', '.join(first['paths'])}; "
                        "every boundary before it is finite")  # fmt: skip
    elif not localized:
        evidence.append("not localized: rerun with --depth modules to find the first boundary that holds it")
    for path, (n, total) in found["paths"].items():
        evidence.append(f"{path}: {n} of {total} response-token logprobs are NaN/inf")
    if names:
        evidence.append(f"weights holding NaN/inf: {_held(weights)}")
        fix = (f"replace the non-finite values in {_names(names)}: the checkpoint is corrupt or training "
               "diverged before it was written")  # fmt: skip
    else:
        evidence.append("every weight is finite in the scan's dtype: the value is computed on the path")
        at = first["boundary"] if first is not None else "the first boundary that holds it"
        fix = (f"find what overflows or divides by zero at {at}: a config override (an eps <= 0, say), "
               "float16 overflow (try bfloat16), or the op's kernel")  # fmt: skip
    out = classify.non_finite_cause(first, names, evidence, fix)
    out.paths = list(first["paths"]) if first is not None else list(found["paths"])
    return out


def add_non_finite(result: Any, cfg: Any, scores: list[Any], weights: dict[str, list[str]]) -> None:
    """Record NaN/inf as a finding on ``result`` (a ``ScanResult`` of ``cfg``): ``non_finite``, a first warning
    and a ``non_finite`` cause, from the paths' ``scores`` (``PathScores``) and the weights' names holding any."""
    recorded = [p for p in scores if p.mode != "recorded"]  # validated input, finite by construction
    found = finding(path_counts(recorded), weights, result.located.first_nonfinite, cfg.dtype)
    result.non_finite = found
    if found is not None:
        result.warnings.insert(0, found["summary"])
        result.causes = [cause(found, localized=cfg.depth != "logprobs")]
