"""Cost of a consistent training step: forward + backward under ``consistent_training`` against stock.

One step is what an RL trainer does per micro-batch: a teacher-forced forward
of the policy in train mode, the token logprobs of the batch, and the backward
of a loss on them (the sum of the logprobs, which exercises every backward the
policy loss does). Stock = HF's own kernels (``sdpa`` attention) and
``torch.log_softmax(...).gather``; consistent = the same model inside
``logdiff.consistent_training`` with ``kernels.token_log_probs``. Runs
alternate stock/consistent and keep the minimum of ``--repeats`` times, so load from other processes hurts both
sides alike. The ratio is consistent / stock.

The clock is the thread's CPU time (``time.thread_time``) with one torch
thread by default: on a machine shared with other jobs the wall time of a step
measured here was 3-7x its CPU time, and varied run to run far more than the
ratio (``--clock wall --threads 0`` measures wall time with torch's threads).

Model: the demo Qwen3 (``--demo DIR``; ``logdiff demo-model DIR`` builds it),
bf16 and fp32, batches of 4 x 128 and 8 x 256 tokens.

Usage::

    .venv/bin/python bench/bench_training.py --demo DIR [--repeats 5] [--threads 1] [--clock cpu|wall] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = ((4, 128), (8, 256))
DTYPES = ("bfloat16", "float32")


def best_of(repeats: int, clock: Callable[[], float], *runs: Callable[[], None]) -> list[float]:
    """Minimum ``clock`` seconds of each run, alternating them so both see the same load; one warm-up each."""
    for run in runs:
        run()
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = clock()
            run()
            best[i] = min(best[i], clock() - start)
    return best


def bench(model_dir: Path, dtype: str, batch: int, length: int, repeats: int, clock: Callable[[], float]) -> list[float]:
    """(stock, consistent) minimum seconds of one forward + backward step."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff import consistent_training, kernels

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).train()
    ids = torch.randint(5, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))

    def stock() -> None:
        logits = model(input_ids=ids).logits[:, :-1].float()
        torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum().backward()
        model.zero_grad(set_to_none=True)

    def consistent() -> None:
        logits = model(input_ids=ids).logits[:, :-1].float()
        kernels.token_log_probs(logits, ids[:, 1:]).sum().backward()
        model.zero_grad(set_to_none=True)

    def consistent_step() -> None:
        # installed per step: the weights change every step, so their prepared copies are rebuilt anyway
        with consistent_training(model):
            consistent()

    return best_of(repeats, clock, stock, consistent_step)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", type=Path, required=True, help="demo Qwen3 directory (logdiff demo-model DIR)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU time (default) or wall")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for dtype in DTYPES:
        for batch, length in SHAPES:
            s, c = bench(args.demo, dtype, batch, length, args.repeats, clock)
            rows.append({"dtype": dtype, "batch": batch, "tokens": length, "stock_s": s, "consistent_s": c, "ratio": c / s})
            print(f"{dtype:>9} {batch}x{length:<4} fwd+bwd  stock {s * 1e3:8.1f} ms  consistent {c * 1e3:8.1f} ms  {c / s:5.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "clock": args.clock, "repeats": args.repeats, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
