"""Consistent mode against the default, side by side in one run.

For each model: the HF training forward (one teacher-forced batch) and vLLM
generation (sampled decode), each timed with the stock kernels and inside
consistent mode, alternating stock/consistent runs and keeping the minimum of
``--repeats`` so load from other processes hurts both sides alike. The ratio
is consistent / stock.

Models: the demo Qwen3 (``--demo DIR``, else a random one of the same shape)
and a 0.5B-class Qwen3 built from config (hidden 896, 24 layers, 14 heads /
2 kv heads, intermediate 4864; vocab 32768 to keep the lm_head realistic but
loadable on 2 cores), random bf16 weights.

Usage::

    .venv/bin/python bench/bench_consistent.py [--demo DIR] [--skip-large] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

LARGE = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 4864, "vocab_size": 32768}  # fmt: skip


def best_of(repeats: int, stock: Callable[[], object], consistent: Callable[[], object]) -> tuple[float, float]:
    """Minimum seconds of each, alternating so both see the same machine load."""
    stock(), consistent()  # warm-up: caches, weight recovery, first-call allocations
    s = c = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        stock()
        s = min(s, time.perf_counter() - t)
        t = time.perf_counter()
        consistent()
        c = min(c, time.perf_counter() - t)
    return s, c


def bench_model(name: str, model_dir: Path, repeats: int) -> list[tuple[str, str, float, float]]:
    import torch

    from logdiff.probes import checkpoint
    from logdiff.engines.base import EngineSpec
    from logdiff.engines.pool import acquire, release_all

    staged = checkpoint.stage(model_dir)
    spec = EngineSpec(str(staged.path))
    rows = []
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, staged.vocab_size, (4, 128), generator=gen)

    hf = acquire("hf", spec)

    def forward() -> object:
        with torch.no_grad():
            return hf.model(input_ids=ids).logits

    def forward_consistent() -> object:
        with hf.consistent():
            return forward()

    s, c = best_of(repeats, forward, forward_consistent)
    rows.append((name, "HF forward 4x128 tokens", s, c))

    vllm = acquire("vllm", spec)
    prompts = [p[:16].tolist() for p in ids]

    def generate() -> object:
        return vllm.sample(prompts, 32, seed=0)

    def generate_consistent() -> object:
        with vllm.consistent():
            return generate()

    s, c = best_of(repeats, generate, generate_consistent)
    rows.append((name, "vLLM generate 4x32 tokens", s, c))
    release_all()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, help="demo model directory (default: a random one of its shape)")
    ap.add_argument("--skip-large", action="store_true", help="skip the 0.5B-class model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the rows here (bench/run.py reads them)")
    args = ap.parse_args()
    import torch

    from logdiff.demo import build_random_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        demo = args.demo or build_random_model(Path(tmp) / "demo")
        rows += bench_model("demo qwen3", demo, args.repeats)
        if not args.skip_large:
            rows += bench_model("0.5B-class qwen3", build_random_model(Path(tmp) / "large", **LARGE), max(2, args.repeats // 2))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16; min of repeats, alternating")
    print(f"{'model':<18} {'workload':<26} {'stock s':>9} {'consistent s':>13} {'ratio':>6}")
    for model, what, s, c in rows:
        print(f"{model:<18} {what:<26} {s:>9.4f} {c:>13.4f} {c / s:>5.2f}x")
    if args.json:
        keys = ("model", "workload", "stock_s", "consistent_s")
        args.json.write_text(json.dumps([{**dict(zip(keys, r)), "ratio": round(r[3] / r[2], 3)} for r in rows]))


if __name__ == "__main__":
    main()
