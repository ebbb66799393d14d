"""Score given sequences in an FSDP2-wrapped HF model on every rank, and capture them, as an RL step would.

    torchrun --nproc-per-node 2 examples/capture_fsdp.py MODEL --sequences SEQS --out DIR

``SEQS`` is any sequences file ``logdiff scan`` reads (JSONL of ``prompt_ids`` and
``response_ids``) or a capture bundle (its captured sequences, e.g. a rollout
engine's). The sequences are dealt to the ranks round robin (data parallel, as
an actor's ``compute_log_prob`` sees its shard of the batch); each rank scores
its share in right-padded batches inside ``logdiff.capture`` and writes its part
of the bundle at ``DIR``: whole records for the first ``--window`` layers (2; ``all``
for every layer), row sketches for the rest. gloo on CPU, NCCL on CUDA. Each rank
prints one line.

As in a training loop, the capture does not hold the step up: its block returns at
once (``wait=False``) while each rank's writer thread finishes the files, and the
rank waits for them after the pass. ``--timing FILE``: rank 0 writes the scoring
pass's wall time (every rank's forwards, after one warm-up forward, until the
slowest rank's capture block has returned) and the writers' drain after it, as
JSON; ``--no-capture`` scores without logdiff, the baseline of
``bench/bench_fsdp_capture.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path


def load_sequences(path: Path) -> list[list[int]]:
    """Token ids per sequence (prompt + response) from a sequences file or a capture bundle."""
    if path.is_dir():
        from logdiff.records.bundle import Bundle

        return Bundle(path).sequences()
    from logdiff.records.sequences import load_jsonl

    return [s.prompt_ids + s.response_ids for s in load_jsonl(path)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sequences", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=4, help="sequences per forward on each rank")
    parser.add_argument("--window", default="2", help="decoder layers whose records are kept whole (the rest as row "
                        "sketches), or 'all' (default: 2)")
    parser.add_argument("--no-capture", action="store_true", help="score without logdiff (a baseline)")
    parser.add_argument("--timing", type=Path, help="rank 0 writes the pass's wall time and the writers' drain here")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from logdiff.probes.arch import adapter_of
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import logdiff

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        every = load_sequences(args.sequences)
        seqs = every[rank::world]
        # FSDP2 gathers weights in every forward, so every rank runs as many forwards as the busiest one
        forwards = max(-(-len(every[r::world]) // args.batch) for r in range(world))
        model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval()
        mesh = init_device_mesh(device, (world,))
        for layer in adapter_of(model).layers(model):  # the architecture adapter knows where the layers are
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():  # FSDP's first gathers, before the pass (a training loop has run steps before)
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
        dist.barrier()
        started = time.perf_counter()
        capture = contextlib.nullcontext() if args.no_capture else logdiff.capture(
            model, args.out, role="train", window=args.window, wait=False)
        with capture as cap, torch.no_grad():
            if cap is not None:  # what this scoring does to the logits: nothing (log_softmax at T = 1)
                cap.applied_processing(temperature=1.0)
            for start in range(0, len(seqs), args.batch):
                batch = seqs[start : start + args.batch]
                width = max(len(s) for s in batch)
                ids = torch.tensor([s + [0] * (width - len(s)) for s in batch], device=device)
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch], device=device)
                model(input_ids=ids, attention_mask=mask)
        with torch.no_grad():  # after the capture, so not recorded: keeps the ranks' collectives in step
            for _ in range(forwards - -(-len(seqs) // args.batch)):
                model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
        dist.barrier()
        step = time.perf_counter() - started
        if not args.no_capture:
            capture.wait()  # the bundle's files, written while the pass went on
        dist.barrier()
        if args.timing is not None and rank == 0:
            args.timing.write_text(json.dumps({"step_s": step, "drain_s": time.perf_counter() - started - step}))
        done = "scored" if args.no_capture else "captured"
        line = f"rank {rank}/{world}: {done} {len(seqs)} sequences" + ("" if args.no_capture else f" into {args.out}")
        sys.stdout.write(line + "\n")  # one write: ranks share the stdout, and print() writes the newline apart
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
