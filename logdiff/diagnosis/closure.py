"""Closure: how much of the measured token-logprob gap the ops up to the last compared boundary can explain.

Every diagnosed result (``scan``, ``compare``, the in-loop compare) ends here, once its causes are known,
so that no verdict leaves the gap unexplained or hands what enters after the last boundary to an operator path.

**The bound** (docs/causes.md, *Closure*). A token's logprob is ``log_softmax(z / T)[token]`` of its logits
row ``z`` at the scoring temperature ``T``. Let ``δ = (z' - z) / T`` be the two sides' difference there.
``LSE`` is convex with gradient ``softmax``, a probability vector, so by the mean value theorem
``LSE(x + δ) - LSE(x) = Σ_j p̃_j δ_j`` for some ``p̃`` on the simplex: it lies in ``[min δ, max δ]``. Hence

    Δ logp_i = δ_i - ΔLSE ∈ [δ_i - max δ, δ_i - min δ],   |Δ logp_i| <= max δ - min δ <= 2 max_j |δ_j|.

The logits boundary's largest difference at the token's row, ``D``, so bounds the token's difference by
``2 D / T``: whatever the ops before the logits did, they cannot move that token's logprob further. Where the
logits were not compared, the final norm's difference ``D_h`` is carried through the head with the model's
weights: ``|Δz_j| <= ||W_j||_1 D_h`` plus each side's rounding of its head output (``u |z_j|``, ``u`` the
dtype's unit roundoff, ``|z_j| <= ||W_j||_1 max |h|``), so ``D <= ||W||_inf (D_h + 2 u max|h|)``. Each side's
fp32 log-softmax adds its own rounding, allowed for with ``2^-20 (2 + |logp| + |logp'| + 2 max|z| / T)``.

The divergence table holds, per absolute position, the largest difference over the sequences compared there;
the token at position ``p`` is scored from row ``p - 1``. What a token's ``|Δ logp|`` exceeds its bound by
*enters after* the boundary: the log-softmax, the sampler's processing, a logits processor, anything between
the head and the returned number. It is never an operator path's. A cause at a later boundary (a sampling,
tokens or alignment finding at ``log_softmax``) identifies it; where none does, the verdict is
``unexplained``, with the amount.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from logdiff.comparison.cause import Json

#: the boundaries after each bounding boundary, in semantic order (a cause there can identify the excess)
AFTER = {"logits": ("log_softmax",), "model.norm": ("logits", "log_softmax")}
#: each side's fp32 log-softmax rounding, relative (16 ulps of fp32: generous against a few operations' error)
FP32_ALLOWANCE = 2.0**-20
#: the unit roundoff of each compute dtype (the head output's rounding in the final-norm bound)
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}


def head_row_norm(module: Any) -> float | None:
    """``||W||_inf``: the largest L1 norm of a row of the model's LM head (its output embeddings), or None."""
    try:
        import torch

        head = module.get_output_embeddings()
        weight = head.weight.detach()
        with torch.no_grad():
            rows = [weight[i:i + 4096].double().abs().sum(-1).max() for i in range(0, weight.shape[0], 4096)]
        return float(max(rows))
    except Exception:  # noqa: BLE001 - no weights: the final-norm bound is not available
        return None


def closure(result: Any, head_norm: float | None = None) -> Json:
    """The ``closure`` section of ``result`` (a diagnosed ``ScanResult``); see the module docstring."""
    pair = result.primary
    out: Json = {"boundary": None, "bound": None, "temperature": None, "tokens": 0, "tokens_bounded": 0,
                 "gap_mean": None, "gap_max": None, "bound_max": None, "closure": None, "enters_after": None,
                 "beyond_mean": 0.0, "beyond_max": 0.0, "beyond_tokens": 0, "identified_by": [],
                 "unexplained": 0.0, "unexplained_max": 0.0, "note": None}
    tokens = getattr(pair, "tokens", None)
    if result.non_finite:
        return {**out, "note": "NaN/inf on a path (see non_finite): no finite gap to bound"}
    if tokens is None:
        return {**out, "note": "the token logprobs were not kept"}
    train, infer, masks = tokens
    gaps: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    sums: list[np.ndarray] = []
    for c, (a, b) in enumerate(zip(train, infer)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        m = np.asarray(masks[c], bool) if masks is not None and masks[c] is not None else np.ones(len(a), bool)
        r = np.flatnonzero(m[: len(a)])
        gaps.append(np.abs(a[r] - b[r]))
        sums.append(np.abs(a[r]) + np.abs(b[r]))
        rows.append(result.sequences.prompt_lens[c] + r - 1)  # the logits row that scores the token
    gap, row, mag = np.concatenate(gaps), np.concatenate(rows).astype(int), np.concatenate(sums)
    out["tokens"] = int(gap.size)
    if not gap.size:
        return {**out, "note": "no scored token"}
    out["gap_mean"], out["gap_max"] = float(gap.mean()), float(gap.max())
    if float(gap.max()) == 0.0:
        return {**out, "closure": 1.0, "note": "the token logprobs are equal: nothing to explain"}
    bound = _bound(result, head_norm)
    if bound is None:
        why = ("no boundary was compared (--depth logprobs)" if result.located.divergence_table is None else
               "neither the logits nor the final norm (with the head's weights) was compared exactly")
        return {**out, "note": f"closure not measured: {why}"}
    boundary, how, per_row, zmax, t = bound
    out.update(boundary=boundary, bound=how, temperature=t)
    b = np.array([per_row.get(int(p), np.nan) for p in row])
    known = np.isfinite(b)
    tol = FP32_ALLOWANCE * (2.0 + mag + 2.0 * zmax / t)
    limit = np.where(known, b + tol, np.inf)
    beyond = np.where(known, np.maximum(gap - limit, 0.0), 0.0)
    explained = np.where(known, np.minimum(gap, limit), 0.0)
    out["tokens_bounded"] = int(known.sum())
    if not known.any():
        return {**out, "note": f"closure not measured: the {boundary} rows of the scored tokens were not compared"}
    out["bound_max"] = float(b[known].max())
    total = float(gap.sum())
    out["beyond_mean"], out["beyond_max"] = float(beyond.sum() / gap.size), float(beyond.max())
    out["beyond_tokens"] = int((beyond > 0).sum())
    notes = []
    if not known.all():
        notes.append(f"{int((~known).sum())} scored tokens' {boundary} rows were not compared: not counted as explained")
    if out["beyond_tokens"]:
        out["enters_after"] = boundary
        identified = [f"{c.class_}/{c.kind} at {c.boundary}" for c in result.causes
                      if c.boundary in AFTER[boundary] and c.class_ == "framework_difference"]
        out["identified_by"] = identified
        if identified:
            out["closure"] = float(np.where(known, gap, 0.0).sum() / total)
        else:
            out["closure"] = float(explained.sum() / total)
            out["unexplained"], out["unexplained_max"] = out["beyond_mean"], out["beyond_max"]
    else:
        out["closure"] = float(explained.sum() / total)
    out["note"] = "; ".join(notes) or None
    return out


def _bound(result: Any, head_norm: float | None) -> tuple[str, str, dict[int, float], float, float] | None:
    """(boundary, method, the bound on |Δ logp| per scoring row, max |z|, T) from the last compared boundary
    that bounds exactly (never a sketched one: its difference is a lower bound), or None."""
    table = result.located.divergence_table
    if not table:
        return None
    rows = {r["boundary"]: r for r in result.primary.boundaries or []}
    t = _temperature(result.contracts)
    for name in ("logits", "model.norm"):
        row = rows.get(name)
        if row is None or row.get("sketched") or name not in table["boundaries"]:
            continue
        if name == "model.norm" and head_norm is None:
            continue
        cells = table["max_abs_diff"][table["boundaries"].index(name)]
        per = {int(p): float(v) for p, v in zip(table["positions"], cells) if v is not None and np.isfinite(v)}
        if not per:
            continue
        worst = float(row.get("max_abs_diff") or 0.0)
        ref = float(row.get("max_abs_ref") or 0.0) + worst
        if name == "logits":
            return name, "logits", {p: 2.0 * d / t for p, d in per.items()}, ref, t
        u = UNIT_ROUNDOFF.get(str(result.dtype), 2.0**-8)
        per = {p: 2.0 * head_norm * (d + 2.0 * u * ref) / t for p, d in per.items()}
        return name, "final_norm_through_head", per, head_norm * ref, t
    return None


def _temperature(contracts: Json | None) -> float:
    """The scoring temperature both sides divide by (the smaller where they differ: the larger amplification;
    a difference is the sampling check's cause), 1 where the contracts do not say."""
    temps = []
    for side in ("train", "infer"):
        v = ((contracts or {}).get(side) or {}).get("temperature")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            temps.append(float(v))
    return min(temps) if temps else 1.0


def close(result: Any, module: Any = None) -> None:
    """Set ``result.closure``; where the excess is not identified, one warning with the amount (the verdict,
    ``unexplained``, follows in ``ScanResult.conclude``). ``module``: the training model, whose head carries a
    final-norm difference through where the logits were not compared."""
    head = None
    rows = {r["boundary"] for r in result.primary.boundaries or []}
    if module is not None and "logits" not in rows:
        head = head_row_norm(module)
    found = result.closure = closure(result, head)
    if found["unexplained_max"] > 0:
        result.warn(f"{found['beyond_tokens']} of {found['tokens']} tokens' |Δ logprob| exceed what the ops up to "
                    f"{found['boundary']} can explain (by up to {found['unexplained_max']:.3g}, mean "
                    f"{found['unexplained']:.3g}): it enters after {found['boundary']} and no cause identifies it "
                    "(verdict unexplained)")
