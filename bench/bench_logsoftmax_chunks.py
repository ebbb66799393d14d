"""The consistent log-softmax by chunk size: ``kernels.logsoftmax.CHUNK_ELEMENTS`` changes the time, never a bit.

For a prefill-sized and a decode-sized batch of bf16 logits over a 32,768- and a 151,936-token vocabulary,
``log_softmax`` plus ``token_log_probs`` at each chunk size, alternating, minimum of ``--repeats``; every size's
outputs are asserted bitwise equal to the first's.

Usage::

    .venv/bin/python bench/bench_logsoftmax_chunks.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

SIZES = (1 << 22, 1 << 20, 1 << 18, 1 << 16)
SHAPES = ((32768, 512), (151936, 256), (151936, 8))  # (vocabulary, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    from logdiff.kernels import logsoftmax

    torch.set_num_threads(args.threads)
    default = logsoftmax.CHUNK_ELEMENTS
    for vocab, rows in SHAPES:
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
        tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
        best, first = dict.fromkeys(SIZES, float("inf")), None
        for _ in range(args.repeats):
            for size in SIZES:
                logsoftmax.CHUNK_ELEMENTS = size
                start = time.perf_counter()
                out = (logsoftmax.log_softmax(logits), logsoftmax.token_log_probs(logits, tokens))
                best[size] = min(best[size], time.perf_counter() - start)
                first = first or out
                assert all(torch.equal(a, b) for a, b in zip(out, first)), f"chunk {size} changed the bits"
        logsoftmax.CHUNK_ELEMENTS = default
        print(f"V {vocab} rows {rows}: " + ", ".join(f"2^{s.bit_length() - 1}: {best[s] * 1e3:.0f} ms" for s in SIZES),
              flush=True)


if __name__ == "__main__":
    main()
