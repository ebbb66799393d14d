"""What logdiff costs inside a real RL loop: TRL GRPO steps uninstrumented, captured and compared, side by side.

Each workload is ``examples/trl_grpo.py`` in its own process (TRL's ``GRPOTrainer``, vLLM colocated and eager,
three steps unless said, a bf16 trainer), as a user runs it:

* ``TRL alone``: no logdiff (``--no-capture``);
* ``instrumented (step not captured)``: ``instrument(..., every=10)``: the third step is one logdiff leaves
  alone (its wrappers only test the step number; the first step's capture has had a step to finish writing):
  what leaving logdiff on costs between captures;
* ``capture (default window)``: ``instrument(..., compare=False)``: both bundles of every step written, the
  first 2 layers whole, row sketches beyond (the default);
* ``capture (every record whole)``: the same with ``window="all"``;
* ``capture + compare``: the default ``instrument``: ``logdiff compare`` of each step inside it;
* ``capture (default window; parts timed)``: the default capture again with ``LOGDIFF_COSTS=1``
  (``logdiff.phases``): each part of logdiff's work in the step is timed where it runs, and the **breakdown**
  printed below the table is this workload's: per captured step, each part's calls, wall ms and CPU ms of the
  thread that ran it (the hooks' Python with their copies and in-hook sketches, the copies alone, sketches, the
  device-to-host copies and files in the writer's thread, the writer thread's whole CPU, the step's waits for the
  writer, the trainer's and the engine's weight fingerprints and contracts), and per hook call. Its ratio in the
  table is the timers' own cost beside the untimed capture's.
* ``capture + compare after the step``: ``compare="after"``: the comparison in a worker thread after the step
  (the step copies the model's weights); its own wall and CPU time per step are in the JSON (``compare_s``), and
  the steps it left uncompared because the worker's queue was full (``skipped``; ``when_full="skip"``).
* ``capture every=10 (amortized)`` and ``capture + compare after at every=10 (amortized)``: eleven steps of
  ``every=10`` (captured: steps 1 and 11), the figure the mean of steps 2 to 11 against TRL alone's (which runs
  eleven steps in every round): what a run pays per step, the bundles' writing and the comparison left to the steps
  after a capture included, measured rather than computed.

Below the table, the cost **as a user plans it**: a captured step's ratio and overhead (also in ms per decoder
layer per 1,000 tokens both sides recorded, which carries over to other models and hosts), a step's between
captures, the amortized ratio at ``every`` = 10 and 100 computed from those two, the measured every=10 rows, each
comparison's own CPU time with ``compare="after"``, and the host's ISA (``logdiff.isa``). And per workload, TRL's
own parts of its steps (the rollout's ``generate``, the weight sync, the trainer's log-prob passes, the loss, the
rest; the example's ``StepClock``): where a capture's cost lands, and which part a step between captures pays in.

Rounds alternate the workloads so that load from other processes hurts them alike. Per process: each step's
wall time and the process's CPU time in it (every thread's: logdiff's writer thread included), from the
example's step clock; the first step is left out (vLLM's warm-up and TRL's first sync happen in every workload).
A captured workload's figure is the mean of steps 2 and 3 (both captured); the not-captured figure is step 3
alone, against TRL alone's step 3. ``--baseline-rev REV`` adds ``capture (default window) @REV``: the same
capture with logdiff as of git revision REV (the example's own code is this one's), side by side. Ratios are medians over rounds of the per-round ratio to ``TRL alone`` of
the same round. Also each process's peak RSS (``wait4``'s ``ru_maxrss``) and the bytes its bundles hold per
captured step (the scratch a capture writes).

Usage::

    .venv/bin/python bench/bench_trl_step.py MODEL [--repeats 3] [--workloads A,B] [--baseline-rev REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from run import quiet_child  # bench/run.py, beside this file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
PLAIN = "TRL alone"
TIMED = "capture (default window; parts timed)"
AMORTIZED = "capture every=10 (amortized)"
AMORTIZED_AFTER = "capture + compare after at every=10 (amortized)"
#: the steps every process runs: TRL alone runs them all, so that each workload's figure has TRL alone's same steps
STEPS = 11
#: workload -> (the example's flags, the steps its figure averages: indices into the steps it runs, how many it runs)
WORKLOADS: dict[str, tuple[list[str], tuple[int, ...], int]] = {
    PLAIN: (["--no-capture"], (1, 2), STEPS),
    "instrumented (step not captured)": (["--every", "10", "--no-compare"], (2,), 3),
    "capture (default window)": (["--no-compare"], (1, 2), 3),
    "capture (every record whole)": (["--no-compare", "--window", "all"], (1, 2), 3),
    "capture + compare": ([], (1, 2), 3),
    "capture + compare after the step": (["--compare-after"], (1, 2), 3),
    TIMED: (["--no-compare"], (1, 2), 3),
    # steps 2 to 11 of every=10: nine between captures (the two after step 1's capture finish its bundles) and the
    # captured step 11: what a run pays per step, measured rather than computed
    AMORTIZED: (["--every", "10", "--no-compare"], tuple(range(1, STEPS)), STEPS),
    AMORTIZED_AFTER: (["--every", "10", "--compare-after"], tuple(range(1, STEPS)), STEPS),
}
#: workloads run with ``LOGDIFF_COSTS=1`` (their step parts timed, ``logdiff.phases.COSTS``)
TIMED_ENV = {TIMED: {"LOGDIFF_COSTS": "1"}}


def run_once(model: str, flags: list[str], env: dict[str, str] | None = None, steps: int = 3) -> dict[str, Any]:
    """One process: its steps' wall and CPU seconds, its peak RSS (bytes) and its bundles' bytes."""
    with tempfile.TemporaryDirectory(prefix="logdiff-bench-trl-") as tmp:
        out = Path(tmp)
        argv = [sys.executable, str(EXAMPLE), model, "--out", str(out / "runs"), "--dtype", "bfloat16", "--steps",
                str(steps), "--json", str(out / "run.json"), *flags]
        rss = quiet_child(argv, env if env is not None else dict(os.environ))
        run = json.loads((out / "run.json").read_text())
        steps = sorted((out / "runs").glob("step-*")) if (out / "runs").is_dir() else []
        written = sum(f.stat().st_size for step in steps for side in ("train", "infer")
                      for f in (step / side).rglob("*") if f.is_file())  # fmt: skip
        compared = list((run.get("logdiff") or {}).values())
        rows, layers = _rows_and_layers(steps)
        return {"wall": run["step_wall_s"], "cpu": run["step_cpu_s"], "rss": rss, "costs": run.get("step_costs"),
                "phases": run.get("step_phases"),
                "compare_s": [c.get("compare_s") for c in compared],
                "compare_cpu_s": [c.get("compare_cpu_s") for c in compared],
                "skipped": run.get("logdiff_skipped", []),
                "bundle_bytes_per_step": written / len(steps) if steps else 0,
                "rows_per_step": rows, "layers": layers}


def _rows_and_layers(steps: list[Path]) -> tuple[float, int]:
    """The rows (tokens) both sides' bundles recorded per captured step, summed over their forwards (a rollout
    engine's prefill and each decode step), and the model's decoder layers: what a capture's cost scales with."""
    rows, layers = 0, 0
    for step in steps:
        for side in ("train", "infer"):
            manifest = json.loads((step / side / "rank-00000" / "manifest.json").read_text())
            layers = int((manifest["meta"].get("config") or {}).get("num_hidden_layers") or 0)
            rows += sum(max((r["shape"][0] for r in entry["records"].values()), default=0)
                        for entry in manifest["steps"])
    return (rows / len(steps) if steps else 0.0), layers


def plan(rows: dict[str, dict[str, Any]], seen: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The cost as a user plans it (docs/capture.md, "Choosing every"): a captured step's overhead, a step's between
    captures, the amortized ratio at ``every`` = 10 and 100 (``(captured + (every - 1) x between) / every`` over
    TRL alone), and the captured overhead in ms per decoder layer per 1,000 recorded tokens (both sides)."""
    captured, between = rows.get("capture (default window)"), rows.get("instrumented (step not captured)")
    if captured is None:
        return None
    plain = rows[PLAIN]["wall_s"]
    ratio_between = between["wall_ratio"] if between else 1.0
    runs = seen["capture (default window)"]
    tokens, layers = statistics.median(r["rows_per_step"] for r in runs), runs[0]["layers"]
    overhead = captured["wall_s"] - plain
    out = {"captured_ratio": captured["wall_ratio"], "between_ratio": ratio_between,
           "captured_overhead_ms": 1e3 * overhead, "tokens_per_step": tokens, "layers": layers,
           "ms_per_layer_per_1k_tokens": 1e3 * overhead / (layers * tokens / 1e3) if layers and tokens else None}
    for every in (10, 100):
        out[f"amortized_every_{every}"] = (captured["wall_ratio"] + (every - 1) * ratio_between) / every
    for name, key in ((AMORTIZED, "measured_every_10"), (AMORTIZED_AFTER, "measured_every_10_compare_after")):
        if name in rows:
            out[key] = rows[name]["wall_ratio"]
    after = rows.get("capture + compare after the step")
    if after is not None:
        cpu = [c for r in seen["capture + compare after the step"] for c in r["compare_cpu_s"] if c is not None]
        out["compare_after_ratio"] = after["wall_ratio"]
        out["comparison_cpu_s"] = statistics.median(cpu) if cpu else None
    return out


def print_plan(p: dict[str, Any]) -> None:
    per = p["ms_per_layer_per_1k_tokens"]
    print(f"\nas a user plans it: a captured step {p['captured_ratio']:.2f}x (+{p['captured_overhead_ms']:.0f} ms; "
          f"{per:.1f} ms per layer per 1k tokens, {p['layers']} layers, {p['tokens_per_step']:.0f} tokens recorded "
          f"per step by both sides), a step between captures {p['between_ratio']:.2f}x; amortized: every=10 "
          f"{p['amortized_every_10']:.3f}x, every=100 {p['amortized_every_100']:.3f}x" if per is not None else
          f"\nas a user plans it: a captured step {p['captured_ratio']:.2f}x")
    for key, what in (("measured_every_10", "capture"), ("measured_every_10_compare_after", "capture + compare after")):
        if key in p:
            print(f"measured, every=10 over steps 2-11 ({what}): {p[key]:.3f}x")
    if "compare_after_ratio" in p:
        cpu = p["comparison_cpu_s"]
        print(f"with compare='after': the captured step {p['compare_after_ratio']:.2f}x; each comparison's own CPU "
              + (f"{cpu:.2f} s (the worker thread's), off the step" if cpu is not None else "not reported"))


def _figure(run: dict[str, Any], clock: str, steps: tuple[int, ...]) -> float:
    return statistics.fmean(run[clock][k] for k in steps)


def table(seen: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per workload: median step seconds (wall, CPU), the median per-round ratio to TRL alone's same steps, the
    peak RSS and its ratio, and the bundle bytes per captured step."""
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in seen.items():
        steps = WORKLOADS[name][1]
        row: dict[str, Any] = {"steps": [k + 1 for k in steps]}
        for clock in ("wall", "cpu"):
            row[f"{clock}_s"] = statistics.median(_figure(r, clock, steps) for r in runs)
            row[f"{clock}_ratio"] = statistics.median(
                _figure(r, clock, steps) / _figure(p, clock, steps) for r, p in zip(runs, seen[PLAIN]))
            row[f"{clock}_ratio_range"] = [min(_figure(r, clock, steps) / _figure(p, clock, steps)
                                               for r, p in zip(runs, seen[PLAIN])),
                                           max(_figure(r, clock, steps) / _figure(p, clock, steps)
                                               for r, p in zip(runs, seen[PLAIN]))]
        row["peak_rss_bytes"] = statistics.median(r["rss"] for r in runs)
        row["rss_ratio"] = statistics.median(r["rss"] / p["rss"] for r, p in zip(runs, seen[PLAIN]))
        row["bundle_bytes_per_step"] = statistics.median(r["bundle_bytes_per_step"] for r in runs)
        rows[name] = row
    return rows


def breakdown(runs: list[dict[str, Any]], steps: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Per part of a timed workload's captured steps: the median over rounds of the mean over ``steps`` of its
    calls, wall ms and CPU ms per step, and its CPU microseconds per call."""
    parts = sorted({part for r in runs for k in steps for part in (r["costs"] or [{}] * (k + 1))[k]})
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        def per_step(r: dict[str, Any], key: str) -> float:
            return statistics.fmean(((r["costs"] or [{}] * (k + 1))[k].get(part) or {}).get(key, 0.0) for k in steps)

        calls = statistics.median(per_step(r, "calls") for r in runs)
        cpu = statistics.median(per_step(r, "cpu_s") for r in runs)
        out[part] = {"calls": calls, "wall_ms": 1e3 * statistics.median(per_step(r, "wall_s") for r in runs),
                     "cpu_ms": 1e3 * cpu, "cpu_us_per_call": 1e6 * cpu / calls if calls else 0.0}
    return out


def trl_parts(seen: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """TRL's own parts of a step (the example's ``PHASES``: the rollout, the weight sync, the trainer's log-prob
    passes, the rest of the loss; ``other``: the rest of the step), in wall seconds per step: TRL alone's over its
    figure's steps, and for each other workload what it adds to each part over TRL alone's same steps of the same
    round (median over rounds): where a capture's cost lands, and which part a step between captures pays in."""
    if not all(r.get("phases") for runs in seen.values() for r in runs):
        return {}

    def mean(r: dict[str, Any], part: str, steps: tuple[int, ...]) -> float:
        if part == "other":
            return statistics.fmean(r["wall"][k] - sum(r["phases"][k].values()) for k in steps)
        return statistics.fmean(r["phases"][k].get(part, 0.0) for k in steps)

    parts = sorted({p for runs in seen.values() for r in runs for step in r["phases"] for p in step}) + ["other"]
    plain_steps = WORKLOADS[PLAIN][1]
    out = {PLAIN: {p: statistics.median(mean(r, p, plain_steps) for r in seen[PLAIN]) for p in parts}}
    for name, runs in seen.items():
        if name != PLAIN:
            steps = WORKLOADS[name][1]
            out[name] = {p: statistics.median(mean(r, p, steps) - mean(b, p, steps) for r, b in zip(runs, seen[PLAIN]))
                         for p in parts}
    return out


def print_trl_parts(parts: dict[str, dict[str, float]]) -> None:
    names = list(parts[PLAIN])
    print("\nTRL's parts of a step, wall s (logps: both log-prob passes, loss: the rest of compute_loss, other: the "
          "rest of the step): TRL alone's, then what each workload adds to each, over its steps (median over rounds)")
    print(f"{'workload':<48}" + "".join(f"{n:>9}" for n in names))
    for workload, row in parts.items():
        spec = "9.3f" if workload == PLAIN else "+9.3f"  # TRL alone's seconds, then what a workload adds
        print(f"{workload:<48}" + "".join(format(row[n], spec) for n in names))


def print_breakdown(parts: dict[str, dict[str, float]], rows: dict[str, dict[str, Any]]) -> None:
    plain, timed = rows[PLAIN], rows[TIMED]
    print(f"\nwhere a captured step's time goes ({TIMED}; per captured step, median over rounds): the step "
          f"{1e3 * timed['wall_s']:.0f} ms wall / {1e3 * timed['cpu_s']:.0f} ms CPU against TRL alone's "
          f"{1e3 * plain['wall_s']:.0f} / {1e3 * plain['cpu_s']:.0f}; a part's CPU is its own thread's")
    print(f"{'part':<45} {'calls':>6} {'wall ms':>8} {'cpu ms':>7} {'cpu us/call':>11}")
    for part, row in parts.items():
        print(f"{part:<45} {row['calls']:>6.0f} {row['wall_ms']:>8.1f} {row['cpu_ms']:>7.1f} "
              f"{row['cpu_us_per_call']:>11.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, from: " + ", ".join(WORKLOADS))
    parser.add_argument("--baseline-rev", help="also capture (default window) with logdiff as of this git revision")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    chosen = [PLAIN] + [w for w in args.workloads.split(",") if w and w != PLAIN]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s): {', '.join(unknown)}")
    envs: dict[str, dict[str, str] | None] = {name: ({**os.environ, **TIMED_ENV[name]} if name in TIMED_ENV else None)
                                             for name in chosen}
    with tempfile.TemporaryDirectory(prefix="logdiff-bench-baseline-") as tmp:
        if args.baseline_rev:
            from run import baseline_tree

            old = f"capture (default window) @{args.baseline_rev}"
            WORKLOADS[old] = WORKLOADS["capture (default window)"]
            chosen.append(old)
            envs[old] = baseline_tree(args.baseline_rev, Path(tmp))
        seen: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
        for _ in range(args.repeats):
            for name in chosen:
                flags, _, steps = WORKLOADS[name]
                seen[name].append(run_once(args.model, flags, envs[name], steps))
    rows = table(seen)
    print(f"{'workload':<40} {'steps':>5} {'wall s':>7} {'x plain':>8} {'cpu s':>7} {'x plain':>8} {'peak RSS':>9} "
          f"{'x plain':>8} {'bundles/step':>12}")
    for name, row in rows.items():
        print(f"{name:<40} {','.join(map(str, row['steps'])):>5} {row['wall_s']:>7.2f} {row['wall_ratio']:>8.2f} "
              f"{row['cpu_s']:>7.2f} {row['cpu_ratio']:>8.2f} {row['peak_rss_bytes'] / 2**20:>7.0f}MB "
              f"{row['rss_ratio']:>8.2f} {row['bundle_bytes_per_step'] / 2**20:>10.1f}MB")
    parts = breakdown(seen[TIMED], WORKLOADS[TIMED][1]) if TIMED in seen else None
    if parts:
        print_breakdown(parts, rows)
    phases = trl_parts(seen)
    if phases:
        print_trl_parts(phases)
    planned = plan(rows, seen)
    if planned:
        print_plan(planned)
    from logdiff.isa import host_isa

    print(f"host ISA: {host_isa()}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "repeats": args.repeats, "isa": host_isa(),
                                         "table": rows, "breakdown": parts, "trl_parts": phases, "plan": planned,
                                         "runs": seen},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
