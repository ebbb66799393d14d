"""``logdiff check --baseline``: the baseline file and the gates that compare a run with it.

A baseline is a small JSON file recorded from an earlier run (never tensors): per pair the
metrics of ``check.BASELINE_METRICS``, the verdict and the causes. Each recorded metric is
compared within a stated ``check.Tolerance``; the comparison is two-sided (a change either
way means the numerics moved; an improvement is refreshed on purpose with
``--update-baseline``), and a value recorded at its exact "consistent" value allows no change.

Baselines are keyed by what makes two runs comparable: model name,
architecture, the paths, dtype, hardware and consistent mode, plus the probe
sequences (source, seed, counts). Comparing runs whose key differs is a usage
error, not a gate failure. The model name only warns, since checkouts and
caches move model directories around. Config overrides (``--set``) are not part
of the key: a changed config is exactly the regression a baseline must catch.

A baseline is read completely and checked before any gate reads it (``baseline_problem``:
every value a gate reads is a finite number in range), and never written unless it could be
read back. ``{hw}`` in a baseline's path becomes this machine's hardware key
(``hardware_key``), so one repository holds a baseline per machine kind (docs/portability.md).

This module computes; the CLI (``logdiff.commands.cli_scan``) prints, writes and picks the
exit code.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from pathlib import Path
from typing import Any

from logdiff.commands.check import BASELINE_METRICS, GateResult, Tolerance, fmt, number_or_none, pair_name
from logdiff.errors import InputError

BASELINE_FORMAT = "logdiff-baseline/1"
#: environment entries about the machine, not software versions (``environment_changes`` compares the rest)
MACHINE_FACTS = ("device", "platform", "machine", "cpu_isa", "cpu_isa_emulated", "cpu_isa_host")
#: Key fields whose mismatch makes a baseline inapplicable (exit 2).
STRICT_KEYS = ("hardware", "architecture", "paths", "dtype", "consistent")


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
            value, base = number_or_none(pairs[name].get(metric)), number_or_none(baseline["pairs"][name].get(metric))
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
