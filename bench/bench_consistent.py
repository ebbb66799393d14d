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
    .venv/bin/python bench/bench_consistent.py --per-kernel [--skip-large] [--repeats 20]

``--per-kernel`` times each kernel family alone, stock op against the consistent kernel (inside
``kernel_caches()``, as consistent mode runs it), at the demo's and the 0.5B class's shapes, for a
prefill of 4x128 tokens and a decode step of 4 rows; it names the ISA (``logdiff.isa``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

LARGE = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 4864, "vocab_size": 32768}  # fmt: skip
DEMO = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 768, "vocab_size": 4096}  # fmt: skip
"""The demo Qwen3's shapes (``logdiff demo-model``), for ``--per-kernel``."""


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

    from logdiff.sources import checkpoint
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire, release_all

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


def _stock_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor (``rotate_half``)."""
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def kernel_cases(shape: dict, rows: int, kv_len: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """``(family, stock, consistent)`` for one model shape: ``rows`` tokens as 4 sequences, keys up to ``kv_len``."""
    import torch
    import torch.nn.functional as F

    from logdiff import kernels

    gen = torch.Generator().manual_seed(0)
    h, d, hq, hkv = shape["hidden_size"], shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    inter, vocab, bf = shape["intermediate_size"], shape["vocab_size"], torch.bfloat16

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(bf)

    x, xi, w_norm = rand(rows, h), rand(rows, 2 * inter), rand(h)
    weights = {"qkv": rand((hq + 2 * hkv) * d, h), "o": rand(h, hq * d), "gate_up": rand(2 * inter, h),
               "down": rand(h, inter), "lm_head": rand(vocab, h)}  # fmt: skip
    inputs = {"qkv": x, "o": rand(rows, hq * d), "gate_up": x, "down": xi[:, :inter], "lm_head": x}
    t = rows // 4
    q, k, v = rand(4, t, hq, d), rand(4, kv_len, hkv, d), rand(4, kv_len, hkv, d)
    pos = torch.arange(kv_len - t, kv_len).expand(4, t)
    kv_lens = torch.full((4,), kv_len)
    causal = t == kv_len
    rope_x, rope_pos = rand(rows, hq, d), pos.reshape(-1)
    cos, sin = (torch.randn(rows, 1, d, generator=gen).to(bf) for _ in range(2))
    logits = rand(rows, vocab)

    def sdpa() -> object:
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if causal:
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)

    cases = [(f"linear {name}", lambda n=name: F.linear(inputs[n], weights[n]),
              lambda n=name: kernels.linear(inputs[n], weights[n])) for name in weights]  # fmt: skip
    cases += [
        ("rms_norm", lambda: kernels.rms_norm_reference(x, w_norm, 1e-6), lambda: kernels.rms_norm(x, w_norm, 1e-6)),
        ("rope", lambda: _stock_rope(rope_x, cos, sin), lambda: kernels.rope(rope_x, rope_pos, 1e6)),
        ("silu_and_mul", lambda: F.silu(xi[:, :inter]) * xi[:, inter:], lambda: kernels.silu_and_mul(xi[:, :inter], xi[:, inter:])),
        ("attention", sdpa, lambda: kernels.attention_batched(q, k, v, pos, d**-0.5, kv_lens)),
        ("log_softmax", lambda: torch.log_softmax(logits.float(), -1), lambda: kernels.log_softmax(logits)),
    ]  # fmt: skip
    return cases


def per_kernel(skip_large: bool, repeats: int) -> None:
    """Print stock and consistent seconds (min of ``repeats``, alternating) per kernel family and shape."""
    import torch

    from logdiff import kernels
    from logdiff.isa import cpu_isa

    shapes = {"demo": DEMO} | ({} if skip_large else {"0.5B": LARGE})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, ISA {cpu_isa()}; min of {repeats}")
    print(f"{'shape':<6} {'workload':<18} {'family':<16} {'stock ms':>9} {'consistent ms':>14} {'ratio':>6}")
    with torch.no_grad(), kernels.kernel_caches():
        for shape_name, shape in shapes.items():
            for workload, rows, kv_len in (("prefill 4x128", 512, 128), ("decode 4x1 @48", 4, 48)):
                for family, stock, consistent in kernel_cases(shape, rows, kv_len):
                    s, c = best_of(repeats, stock, consistent)
                    print(f"{shape_name:<6} {workload:<18} {family:<16} {s * 1e3:>9.3f} {c * 1e3:>14.3f} {c / s:>5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, help="demo model directory (default: a random one of its shape)")
    ap.add_argument("--skip-large", action="store_true", help="skip the 0.5B-class model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the rows here (bench/run.py reads them)")
    ap.add_argument("--per-kernel", action="store_true", help="time each kernel family alone, stock vs consistent")
    args = ap.parse_args()
    if args.per_kernel:
        per_kernel(args.skip_large, args.repeats)
        return
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
