"""``logdiff check``: turn a scan result into pass/fail gates for CI.

A *gate* is one yes/no question about a result, with the number it looked at
and the limit it compared against, so a failure can always be explained in the
CI log, in JUnit XML and in a GitHub annotation. Gates come from three places:

* **Thresholds** (``--max-abs-diff``, ``--max-mean-diff``, ``--max-kl``,
  ``--max-clip-fraction``): one gate per metric and per (training, inference)
  pair; ``value <= threshold`` passes, so ``--max-abs-diff 0`` demands bitwise
  equality.
* **Classes** (``--fail-on framework_difference`` ...): fails when the verdict
  or any classified cause has that class.
* **A baseline**: a small JSON file recorded from an earlier run (never
  tensors), compared metric by metric within a stated tolerance. The
  comparison is two-sided: a change in either direction means the numerics
  moved, and an improvement is refreshed on purpose with ``--update-baseline``.

The baseline file (its key, writing, reading, validating and the gates that compare a run
with it) is ``logdiff.commands.baselines``; this module holds the gate itself
(``GateResult``, ``Tolerance``, the formatting every gate message shares), the threshold,
class and coverage gates, and the plain-words explanation of a result. ``baselines`` imports
this module, never the reverse.

This module computes; the CLI prints, writes files and picks the exit code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from logdiff.errors import InputError

#: CLI threshold option -> result metric it bounds (verl's ``k3_kl``; the share of tokens with |r - 1| > 0.2).
THRESHOLD_METRICS = {
    "max_abs_diff": "abs_diff_max",
    "max_mean_diff": "abs_diff_mean",
    "max_kl": "k3_kl",
    "max_clip_fraction": "ratio_outside_band_0.2",
}
#: Values ``--fail-on`` accepts: cause classes, the unclassified ``divergent`` verdict, and the ``unexplained``
#: verdict (a part of the gap that enters after the last compared boundary and no cause identifies).
FAIL_ON_CLASSES = ("framework_difference", "operator_path", "not_judged", "divergent", "unexplained")
#: Metrics a baseline records per pair, each with its exact "consistent" value.
#: A baseline at that value (0 difference, every token bitwise equal) tolerates no change.
#: ``kl_k3`` is the deprecated name of ``k3_kl`` (same value), kept so that recorded baselines still apply.
BASELINE_METRICS = {"abs_diff_max": 0.0, "abs_diff_mean": 0.0, "kl_k3": 0.0, "bitwise_equal_fraction": 1.0}


@dataclass(frozen=True)
class Tolerance:
    """``|value - baseline| <= rel * |baseline| + abs``; a baseline at the exact value needs that value."""

    rel: float = 0.1
    abs: float = 1e-6

    @classmethod
    def parse(cls, text: str) -> Tolerance:
        """``"0.1"`` (relative) or ``"0.1,1e-6"`` (relative, absolute)."""
        parts = [p.strip() for p in text.split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if not 1 <= len(values) <= 2 or any(not math.isfinite(v) or v < 0 for v in values):
            raise InputError(f"--tolerance expects REL or REL,ABS (non-negative numbers), got {text!r}")
        return cls(*values)

    def allows(self, value: float, base: float, exact: float) -> bool:
        if base == exact:
            return value == exact
        return abs(value - base) <= self.rel * abs(base) + self.abs

    def describe(self) -> str:
        return f"±{self.rel:.3g} relative + {self.abs:.3g} absolute"


@dataclass
class GateResult:
    """One gate: its name, whether it passed, the value it read, the limit, and a sentence."""

    name: str
    passed: bool
    value: Any
    threshold: Any
    message: str
    group: str = ""  # the option that asked for it (``--max-kl``, ``--baseline``...)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pair_name(pair: dict[str, Any]) -> str:
    return f"{pair.get('train')} vs {pair.get('infer')}"


def fmt(value: Any) -> str:
    """Numbers as ``%.6g`` (exact zero stays ``0``); anything else as text."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.6g}"


def number_or_none(value: Any) -> float | None:
    """``value`` as a float, or None for a bool, a non-number or NaN (what a gate cannot compare)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


# --- gates ---------------------------------------------------------------------------------------


def completeness_gate(result: dict[str, Any]) -> GateResult:
    """A scan that stopped early cannot vouch for its numbers."""
    ok = result.get("complete") is not False
    why = "; ".join(result.get("warnings") or []) or "no reason given"
    msg = "the scan completed" if ok else f"the scan stopped early: {why}"
    return GateResult("scan complete", ok, bool(result.get("complete", True)), True, msg)


def finite_gate(result: dict[str, Any]) -> GateResult:
    """NaN or inf anywhere on a path (weights, activations, logits, logprobs) fails the check."""
    found = result.get("non_finite")
    nulls = [pair_name(p) for p in result.get("pairs") or []
             if number_or_none((p.get("metrics") or {}).get("abs_diff_max")) is None]  # fmt: skip
    ok = not found and not nulls
    if ok:
        msg = "finite values: every weight, logprob and probed value is finite"
    elif found:
        msg = f"finite values: {found.get('summary') or 'non-finite values found'}"
    else:
        msg = f"finite values: abs_diff_max is not a finite number for {', '.join(nulls)}"
    return GateResult("finite values", ok, "finite" if ok else "non-finite", "finite", msg)


def threshold_gates(result: dict[str, Any], thresholds: dict[str, float | None]) -> list[GateResult]:
    """One gate per given threshold (keys of THRESHOLD_METRICS) and per pair."""
    gates = []
    for option, limit in thresholds.items():
        if limit is None:
            continue
        metric = THRESHOLD_METRICS[option]
        flag = "--" + option.replace("_", "-")
        for pair in result.get("pairs") or []:
            name = f"{metric} ({pair_name(pair)})"
            value = number_or_none((pair.get("metrics") or {}).get(metric))
            if value is None:
                gates.append(GateResult(name, False, None, limit, f"{name}: no finite value in the result", flag))
                continue
            ok = value <= limit
            rel = "<=" if ok else ">"
            msg = f"{name} = {fmt(value)} {rel} {fmt(limit)} ({flag})"
            gates.append(GateResult(name, ok, value, limit, msg, flag))
    return gates


def _cause_label(cause: dict[str, Any]) -> str:
    share = cause.get("share")
    share_text = f", share {share:.0%}" if isinstance(share, (int, float)) else ""
    return f"{cause.get('class')}/{cause.get('kind')} at {cause.get('boundary')}{share_text}"


def parse_fail_on(items: list[str]) -> list[str]:
    """``--fail-on`` values (repeatable, comma-separated) -> classes; InputError on an unknown one."""
    classes = [c.strip() for item in items for c in item.split(",") if c.strip()]
    unknown = [c for c in classes if c not in FAIL_ON_CLASSES]
    if unknown:
        raise InputError(f"--fail-on: unknown class {unknown[0]!r}; choose from {', '.join(FAIL_ON_CLASSES)}")
    return list(dict.fromkeys(classes))


def fail_on_gates(result: dict[str, Any], classes: list[str]) -> list[GateResult]:
    """Fail when the verdict or any cause has one of ``classes``."""
    classes = parse_fail_on(classes)
    verdict = result.get("verdict")
    gates = []
    for cls in classes:
        hits = [_cause_label(c) for c in result.get("causes") or [] if c.get("class") == cls]
        if verdict == cls and not hits:
            hits = [f"verdict {verdict}"]
        name = f"fail-on {cls}"
        if hits:
            msg = f"{name}: found {'; '.join(hits)}"
        else:
            msg = f"{name}: none found (verdict {verdict})"
        gates.append(GateResult(name, not hits, verdict, f"no {cls}", msg, "--fail-on"))
    return gates


def coverage_gates(gates: list[GateResult], asked: dict[str, int]) -> list[GateResult]:
    """A failing gate for each option that produced fewer gates than it asked for (``asked``: group -> count)."""
    out = []
    for group, wanted in asked.items():
        got = sum(1 for g in gates if g.group == group)
        if got < wanted:
            msg = f"gates evaluated ({group}): {got} of the {wanted} asked for; a gate not evaluated cannot pass"
            out.append(GateResult(f"gates evaluated ({group})", False, got, wanted, msg, group))
    return out


def asked_gates(result: dict[str, Any], thresholds: dict[str, float | None], classes: list[str],
                baseline: dict[str, Any] | None) -> dict[str, int]:  # fmt: skip
    """How many gates each option asked for: one per pair and threshold, one per class, the baseline's."""
    pairs = max(1, len(result.get("pairs") or []))
    asked = {"--" + k.replace("_", "-"): pairs for k, v in thresholds.items() if v is not None}
    if classes:
        asked["--fail-on"] = len(classes)
    if baseline is not None:
        asked["--baseline"] = len(BASELINE_METRICS) * len(baseline.get("pairs") or {}) + 1
    return asked


# --- explaining a result -------------------------------------------------------------------------


def top_cause(result: dict[str, Any]) -> dict[str, Any] | None:
    """The cause with the largest share (the first listed when no share was measured)."""
    causes = [c for c in result.get("causes") or [] if isinstance(c, dict)]
    if not causes:
        return None
    return max(causes, key=lambda c: c.get("share") if isinstance(c.get("share"), (int, float)) else -1.0)


def explain(result: dict[str, Any]) -> list[str]:
    """Lines that say what the scan found: verdict, size of the gap, where it starts, top cause."""
    lp = result.get("logprobs") or {}
    pairs = result.get("pairs") or []
    lines = [
        f"verdict: {result.get('verdict')} (max |Δ logprob| {fmt(lp.get('abs_diff_max'))}, "
        f"mean {fmt(lp.get('abs_diff_mean'))}, {pair_name(pairs[0]) if pairs else 'no pairs'})"
    ]
    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        from logdiff.reports import positions

        rows = positions.first_divergence(result)
        where = "; ".join(x for x in (f"layer {fd.get('layer')}", positions.first_text(rows),
                                        positions.worst_text(rows, fmt)) if x)
        lines.append(f"first divergence: {fd.get('boundary')} ({where})")
    cause = top_cause(result)
    if cause is not None:
        fix = f"; fix: {cause.get('fix')}" if cause.get("fix") else ""
        lines.append(f"top cause: {_cause_label(cause)}{fix}")
    else:
        lines.append("top cause: none classified")
    return lines
