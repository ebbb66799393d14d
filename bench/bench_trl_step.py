"""What logdiff costs inside a real RL loop: TRL GRPO steps uninstrumented, captured, and captured + compared.

Each workload is ``examples/trl_grpo.py`` in its own process (TRL's ``GRPOTrainer``, vLLM colocated, two steps
on the demo model, a bf16 trainer), as a user runs it:

* ``plain``: TRL alone (``--no-capture``);
* ``capture``: ``logdiff.integrations.trl.instrument(..., compare=False)``: both bundles of every step written;
* ``capture+compare``: the default, ``logdiff compare`` of each step inside it (with the live model's replay
  and conformance), its numbers in TRL's logs.

Rounds alternate the workloads so that load from other processes hurts them alike. The figures are TRL's own
``step_time`` of the second step (the first includes vLLM's warm-up and TRL's first sync in every workload),
its median over the rounds, and each process's peak RSS (``wait4``'s ``ru_maxrss``); ratios are over
``plain``'s medians.

Usage::

    .venv/bin/python bench/bench_trl_step.py MODEL [--repeats 3] [--json out.json]
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

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
WORKLOADS = {"plain": ["--no-capture"], "capture": ["--no-compare"], "capture+compare": []}


def run_once(model: str, flags: list[str]) -> tuple[float, int]:
    """One process: the second step's ``step_time`` (s) and the peak RSS (bytes)."""
    with tempfile.TemporaryDirectory(prefix="logdiff-bench-trl-") as tmp:
        out = Path(tmp)
        argv = [sys.executable, str(EXAMPLE), model, "--out", str(out), "--dtype", "bfloat16", "--json",
                str(out / "run.json"), *flags]
        pid = os.fork()
        if pid == 0:  # the child: the example, its output discarded
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.execv(sys.executable, argv)
        _, status, usage = os.wait4(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{' '.join(argv)} failed")
        steps = [h["step_time"] for h in json.loads((out / "run.json").read_text())["log_history"] if "step_time" in h]
        return float(steps[-1]), int(usage.ru_maxrss) * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    seen: dict[str, list[tuple[float, int]]] = {name: [] for name in WORKLOADS}
    for _ in range(args.repeats):
        for name, flags in WORKLOADS.items():
            seen[name].append(run_once(args.model, flags))
    table: dict[str, Any] = {}
    for name, runs in seen.items():
        times, rss = [t for t, _ in runs], [r for _, r in runs]
        table[name] = {"step_time_s": statistics.median(times), "min": min(times), "max": max(times),
                       "peak_rss_bytes": statistics.median(rss)}
    base = table["plain"]
    print(f"{'workload':<16} {'step (s)':>9} {'min-max':>13} {'x plain':>8} {'peak RSS':>10} {'x plain':>8}")
    for name, row in table.items():
        row["time_ratio"] = row["step_time_s"] / base["step_time_s"]
        row["rss_ratio"] = row["peak_rss_bytes"] / base["peak_rss_bytes"]
        print(f"{name:<16} {row['step_time_s']:>9.2f} {row['min']:>6.2f}-{row['max']:<6.2f} {row['time_ratio']:>8.2f} "
              f"{row['peak_rss_bytes'] / 2**20:>8.0f}MB {row['rss_ratio']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "repeats": args.repeats, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
