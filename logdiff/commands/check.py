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

Baselines are keyed by what makes two runs comparable: model name,
architecture, the paths, dtype, hardware and consistent mode, plus the probe
sequences (source, seed, counts). Comparing runs whose key differs is a usage
error, not a gate failure. The model name only warns, since checkouts and
caches move model directories around. Config overrides (``--set``) are not part
of the key: a changed config is exactly the regression a baseline must catch.

This module computes; the CLI prints, writes files and picks the exit code.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from logdiff.errors import InputError

BASELINE_FORMAT = "logdiff-baseline/1"
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
#: environment entries about the machine, not software versions (``environment_changes`` compares the rest)
MACHINE_FACTS = ("device", "platform", "machine", "cpu_isa", "cpu_isa_emulated", "cpu_isa_host")
#: Key fields whose mismatch makes a baseline inapplicable (exit 2).
STRICT_KEYS = ("hardware", "architecture", "paths", "dtype", "consistent")


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


def _number(value: Any) -> float | None:
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
             if _number((p.get("metrics") or {}).get("abs_diff_max")) is None]  # fmt: skip
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
            value = _number((pair.get("metrics") or {}).get(metric))
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


# --- baselines -----------------------------------------------------------------------------------


def hardware_key(environment: dict[str, Any]) -> str:
    """``cpu-x86_64-avx512_bf16``, or the accelerator's name as a slug (``cuda-nvidia-h200``).

    Under ``LOGDIFF_EMULATE_ISA`` (logdiff/isa.py) the key names the host too,
    ``cpu-x86_64-avx2-emulated-on-avx512_bf16``: emulation reproduces the kernel
    choices, not every library's rounding (MKL and oneDNN still read the real
    processor), so one host's emulated baseline does not stand in for another's.
    """
    device = str(environment.get("device") or "cpu")
    if device == "cpu":
        isa, host = environment.get("cpu_isa"), environment.get("cpu_isa_host")
        emulated = ("-emulated" + (f"-on-{host}" if host else "")) if environment.get("cpu_isa_emulated") else ""
        return f"cpu-{environment.get('machine') or 'unknown'}" + (f"-{isa}{emulated}" if isa else "")
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def current_hardware() -> str:
    """The hardware key of this machine (imports torch)."""
    from logdiff.comparison.environment import environment

    return hardware_key(environment())


def resolve_baseline_path(path: Path, hardware: str | None = None) -> Path:
    """Replace ``{hw}`` in the path with this machine's hardware key."""
    text = str(path)
    if "{hw}" not in text:
        return path
    return Path(text.replace("{hw}", hardware or current_hardware()))


def baseline_key(result: dict[str, Any]) -> dict[str, Any]:
    """What must match for two runs to be comparable (see the module docstring)."""
    paths = result.get("paths") or []
    return {
        "model": Path(str(result.get("model"))).name,
        "architecture": result.get("architecture"),
        "paths": {
            "train": next((p["name"] for p in paths if p.get("role") == "train"), None),
            "infer": [p["name"] for p in paths if p.get("role") == "infer"],
        },
        "dtype": result.get("dtype"),
        "hardware": hardware_key(result.get("environment") or {}),
        "consistent": bool((result.get("settings") or {}).get("consistent")),
    }


def _sequences_key(result: dict[str, Any]) -> dict[str, Any]:
    seqs = result.get("sequences") or {}
    return {
        "source": seqs.get("source"),
        "seed": (result.get("settings") or {}).get("seed"),
        "count": seqs.get("count"),
        "prompt_tokens": sum(seqs.get("prompt_lens") or []),
        "response_tokens": sum(seqs.get("response_lens") or []),
    }


def make_baseline(result: dict[str, Any], tolerance: Tolerance) -> dict[str, Any]:
    """The baseline JSON for ``result``: key, metrics per pair, verdict and causes."""
    env = result.get("environment") or {}
    return {
        "format": BASELINE_FORMAT,
        "note": "Written by `logdiff check --update-baseline`. Refresh it the same way when a change is intended.",
        "key": baseline_key(result),
        "sequences": _sequences_key(result),
        "tolerance": {"rel": tolerance.rel, "abs": tolerance.abs},
        "pairs": {
            pair_name(p): {m: (p.get("metrics") or {}).get(m) for m in BASELINE_METRICS}
            for p in result.get("pairs") or []
        },
        "verdict": result.get("verdict"),
        "causes": [
            {k: c.get(k) for k in ("class", "kind", "boundary", "share")} for c in result.get("causes") or []
        ],
        "overrides": (result.get("settings") or {}).get("overrides") or {},
        "recorded": {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "logdiff": (result.get("tool") or {}).get("version"),
            "environment": {k: v for k, v in env.items() if k not in MACHINE_FACTS or k in ("device", "platform")},
        },
    }


def load_baseline(path: Path, hardware: str | None = None) -> dict[str, Any]:
    """Read and validate a baseline file completely; InputError (exit 2) when missing or malformed."""
    if not path.is_file():
        hw = f" for hardware key {hardware}" if hardware else ""
        raise InputError(f"no baseline{hw} at {path}; record one by running the same command with --update-baseline")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"baseline {path}: not valid JSON ({e})") from None
    problem = baseline_problem(data)
    if problem:
        raise InputError(f"baseline {path}: {problem}")
    return data


VERDICTS = ("consistent", "divergent", "operator_path", "framework_difference", "mixed", "unexplained")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def baseline_problem(data: Any) -> str | None:
    """What is wrong with a baseline's contents (every value a gate reads), or None."""
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        return f"not a {BASELINE_FORMAT} file"
    key, pairs = data.get("key"), data.get("pairs")
    if not isinstance(key, dict) or not isinstance(pairs, dict) or not pairs:
        return "missing 'key' or 'pairs'"
    missing = [f for f in STRICT_KEYS if f not in key]
    if missing:
        return f"key has no {missing[0]!r}"
    for name, metrics in pairs.items():
        if not isinstance(metrics, dict):
            return f"pairs[{name!r}] is not an object"
        for metric, exact in BASELINE_METRICS.items():
            value = metrics.get(metric)
            if not _finite(value):
                return f"pairs[{name!r}].{metric} is {value!r}, not a finite number"
            if value < 0 or (exact == 1.0 and value > 1):
                return f"pairs[{name!r}].{metric} is {value!r}, out of range"
    tol = data.get("tolerance")
    if tol is not None:
        if not isinstance(tol, dict) or set(tol) - {"rel", "abs"}:
            return "tolerance must be an object with 'rel' and 'abs'"
        for part in ("rel", "abs"):
            if part in tol and not (_finite(tol[part]) and tol[part] >= 0):
                return f"tolerance.{part} is {tol[part]!r}, not a finite number >= 0"
    if data.get("verdict") not in VERDICTS:
        return f"verdict is {data.get('verdict')!r}, not one of {', '.join(VERDICTS)}"
    causes = data.get("causes", [])
    if not isinstance(causes, list) or not all(isinstance(c, dict) for c in causes):
        return "causes must be a list of objects"
    for field in ("sequences", "overrides"):
        if data.get(field) is not None and not isinstance(data[field], dict):
            return f"{field} must be an object"
    return None


def try_load_baseline(path: Path) -> dict[str, Any] | None:
    """The baseline at ``path``, or None when there is none (or it is unreadable) to refresh."""
    try:
        return load_baseline(path)
    except InputError:
        return None


def write_baseline(path: Path, baseline: dict[str, Any]) -> None:
    """Write a baseline atomically; refuses one that could not be loaded back (a null metric)."""
    from logdiff.commands.outputs import write_text

    problem = baseline_problem(baseline)
    if problem:
        raise InputError(f"baseline not written to {path}: {problem}")
    write_text(path, json.dumps(baseline, indent=2, allow_nan=False) + "\n", "--baseline")


def baseline_tolerance(baseline: dict[str, Any]) -> Tolerance:
    tol = baseline.get("tolerance") or {}
    return Tolerance(float(tol.get("rel", Tolerance.rel)), float(tol.get("abs", Tolerance.abs)))


def check_applicable(result: dict[str, Any], baseline: dict[str, Any], path: Path) -> list[str]:
    """Raise InputError when the baseline was recorded for another setup; return notes (warnings)."""
    key, base_key = baseline_key(result), baseline["key"]
    for field in STRICT_KEYS:
        if base_key.get(field) != key[field]:
            raise InputError(
                f"baseline {path} was recorded for {field} {base_key.get(field)!r}, this run has {key[field]!r}; "
                "use a baseline for this setup or refresh it with --update-baseline"
            )
    seqs, base_seqs = _sequences_key(result), baseline.get("sequences") or {}
    for field, value in seqs.items():
        if field in base_seqs and base_seqs[field] != value:
            raise InputError(
                f"baseline {path} was recorded with sequences {field}={base_seqs[field]!r}, this run has {value!r}; "
                "run with the same sequence options or refresh it with --update-baseline"
            )
    notes = []
    if base_key.get("model") != key["model"]:
        notes.append(f"baseline model {base_key.get('model')!r}, this run {key['model']!r}")
    overrides = (result.get("settings") or {}).get("overrides") or {}
    if baseline.get("overrides") is not None and baseline.get("overrides") != overrides:
        notes.append(f"--set overrides differ from the baseline's: {overrides} vs {baseline.get('overrides')}")
    return notes


def environment_changes(result: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Software versions (python, torch, every engine's packages) that changed since the baseline (the usual
    reason numbers move)."""
    env = result.get("environment") or {}
    base_env = (baseline.get("recorded") or {}).get("environment") or {}
    return [
        f"{k} {base_env[k]} -> {env.get(k)}"
        for k in base_env
        if k not in MACHINE_FACTS and base_env[k] != env.get(k)
    ]


def baseline_gates(result: dict[str, Any], baseline: dict[str, Any], tolerance: Tolerance) -> list[GateResult]:
    """Each pair's key metrics within ``tolerance`` of the baseline, then the verdict and causes."""
    gates = []
    pairs = {pair_name(p): p.get("metrics") or {} for p in result.get("pairs") or []}
    for name in dict.fromkeys([*baseline["pairs"], *pairs]):
        if name not in pairs or name not in baseline["pairs"]:
            where = "this run" if name not in pairs else "the baseline"
            msg = f"pair {name} is missing from {where}"
            gates.append(GateResult(f"baseline ({name})", False, None, None, msg, "--baseline"))
            continue
        for metric, exact in BASELINE_METRICS.items():
            gate = f"baseline {metric} ({name})"
            value, base = _number(pairs[name].get(metric)), _number(baseline["pairs"][name].get(metric))
            if base is None or value is None:  # a gate never silently drops out
                where = "the baseline" if base is None else "this run"
                gates.append(GateResult(gate, False, value, base, f"{gate}: no finite value in {where}", "--baseline"))
                continue
            ok = tolerance.allows(value, base, exact)
            msg = _baseline_message(gate, value, base, exact, ok, tolerance)
            gates.append(GateResult(gate, ok, value, base, msg, "--baseline"))
    gates.append(_causes_gate(result, baseline))
    return gates


def refresh_changes(result: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
    """What a refresh changes: every recorded value that differs from this run, however little."""
    if old is None:
        return []
    try:
        check_applicable(result, old, Path("(previous)"))
    except InputError as e:
        return [f"the previous baseline was for another setup ({e})"]
    changes = []
    for gate in baseline_gates(result, old, Tolerance(0.0, 0.0)):
        if gate.passed:
            continue
        if isinstance(gate.threshold, float) and gate.value is not None:
            changes.append(f"{gate.name.removeprefix('baseline ')}: {fmt(gate.threshold)} -> {fmt(gate.value)}")
        else:
            changes.append(gate.message)
    return changes


def _baseline_message(gate: str, value: float, base: float, exact: float, ok: bool, tol: Tolerance) -> str:
    head = f"{gate} = {fmt(value)}, baseline {fmt(base)}"
    if base == exact:
        return f"{head} (exact: the baseline allows no change)" if not ok else f"{head} (exact)"
    allowed = tol.rel * abs(base) + tol.abs
    if ok:
        return f"{head} (within ±{fmt(allowed)})"
    worse = (value > base) if exact == 0.0 else (value < base)
    direction = "worse" if worse else "better"
    hint = "" if worse else "; if intended, refresh the baseline with --update-baseline"
    off = fmt(abs(value - base))
    return f"{head}: {direction} by {off}, more than the allowed ±{fmt(allowed)} ({tol.describe()}){hint}"


def _causes_gate(result: dict[str, Any], baseline: dict[str, Any]) -> GateResult:
    def ids(causes: list[dict[str, Any]]) -> set[str]:
        return {f"{c.get('class')}/{c.get('kind')} at {c.get('boundary')}" for c in causes}

    now, before = ids(result.get("causes") or []), ids(baseline.get("causes") or [])
    verdict, base_verdict = result.get("verdict"), baseline.get("verdict")
    problems = []
    if verdict != base_verdict:
        problems.append(f"verdict {base_verdict} -> {verdict}")
    problems += [f"new cause {c}" for c in sorted(now - before)]
    problems += [f"cause gone: {c}" for c in sorted(before - now)]
    msg = "baseline verdict and causes: " + ("; ".join(problems) if problems else f"unchanged ({verdict})")
    return GateResult("baseline verdict and causes", not problems, verdict, base_verdict, msg, "--baseline")


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
