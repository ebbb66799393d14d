"""What capture costs inside an FSDP2 scoring pass: ``examples/capture_fsdp.py`` without and with logdiff, side by side.

Each workload is the example in its own ``torchrun`` (2 ranks, gloo on the CPU, one thread each), scoring the
same sequences as an actor's ``compute_log_prob`` does, dealt round robin to the ranks:

* ``FSDP alone``: no logdiff (``--no-capture``);
* ``capture (default window)``: ``logdiff.capture(..., wait=False)``: the first 2 layers whole, row sketches
  beyond, the weights' fingerprints gathered as the capture starts;
* ``capture (every record whole)``: the same with ``window="all"``.

The figure is the example's own clock (``--timing``): the pass's wall time from the first forward after a
warm-up one until the slowest rank's capture block has returned (the writers still working), and the drain,
the time the ranks then wait for their writers. Rounds alternate the workloads; ratios are medians over rounds
of the per-round ratio to ``FSDP alone``. Also the peak RSS of the largest process (``wait4`` on torchrun: its
ranks are its children) and the bundle's bytes.

Usage::

    .venv/bin/python bench/bench_fsdp_capture.py MODEL [--sequences 16] [--prompt-len 128] [--response-len 64]
                                                 [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from run import quiet_child  # bench/run.py, beside this file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "capture_fsdp.py"
PLAIN = "FSDP alone"
WORKLOADS: dict[str, list[str]] = {
    PLAIN: ["--no-capture"],
    "capture (default window)": [],
    "capture (every record whole)": ["--window", "all"],
}


def sequences(model: Path, n: int, prompt: int, response: int, path: Path) -> Path:
    """``n`` random sequences of the model's vocabulary, as the example reads them (JSONL)."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            ids = [rng.randrange(vocab) for _ in range(prompt + response)]
            f.write(json.dumps({"prompt_ids": ids[:prompt], "response_ids": ids[prompt:]}) + "\n")
    return path


def run_once(model: Path, seqs: Path, batch: int, flags: list[str]) -> dict[str, Any]:
    """One torchrun: the pass's wall seconds, the drain after it, the largest process's peak RSS, the bundle's bytes."""
    with tempfile.TemporaryDirectory(prefix="logdiff-bench-fsdp-") as tmp:
        out, timing = Path(tmp) / "bundle", Path(tmp) / "timing.json"
        argv = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                str(EXAMPLE), str(model), "--sequences", str(seqs), "--out", str(out), "--batch", str(batch),
                "--timing", str(timing), *flags]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        rss = quiet_child(argv, env)
        clock = json.loads(timing.read_text())
        written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else 0
        return {"step": clock["step_s"], "drain": clock["drain_s"], "rss": rss,
                "bundle_bytes": written}


def table(seen: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per workload: median pass and drain seconds, the median per-round ratio to ``FSDP alone`` (and its range),
    the peak RSS and its ratio, the bundle's bytes."""
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in seen.items():
        ratios = [r["step"] / p["step"] for r, p in zip(runs, seen[PLAIN])]
        rows[name] = {"step_s": statistics.median(r["step"] for r in runs),
                      "step_ratio": statistics.median(ratios), "step_ratio_range": [min(ratios), max(ratios)],
                      "drain_s": statistics.median(r["drain"] for r in runs),
                      "peak_rss_bytes": statistics.median(r["rss"] for r in runs),
                      "rss_ratio": statistics.median(r["rss"] / p["rss"] for r, p in zip(runs, seen[PLAIN])),
                      "bundle_bytes": statistics.median(r["bundle_bytes"] for r in runs)}  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per forward on each rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="logdiff-bench-fsdp-seqs-") as tmp:
        seqs = sequences(args.model, args.sequences, args.prompt_len, args.response_len, Path(tmp) / "seqs.jsonl")
        for _ in range(args.repeats):
            for name, flags in WORKLOADS.items():
                seen[name].append(run_once(args.model, seqs, args.batch, flags))
    rows = table(seen)
    print(f"{'workload':<30} {'pass s':>7} {'x plain':>8} {'drain s':>8} {'peak RSS':>9} {'x plain':>8} {'bundle':>9}")
    for name, row in rows.items():
        print(f"{name:<30} {row['step_s']:>7.2f} {row['step_ratio']:>8.2f} {row['drain_s']:>8.2f} "
              f"{row['peak_rss_bytes'] / 2**20:>7.0f}MB {row['rss_ratio']:>8.2f} {row['bundle_bytes'] / 2**20:>7.1f}MB")
    if args.json:
        shape = {"sequences": args.sequences, "prompt_len": args.prompt_len, "response_len": args.response_len,
                 "batch": args.batch}
        args.json.write_text(json.dumps({"model": str(args.model), "shape": shape, "repeats": args.repeats,
                                         "table": rows, "runs": seen}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
