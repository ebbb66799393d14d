"""The cost of consistent mode against an INT8 W8A8 rollout (issue 51, item 5), side by side in one run.

Per linear shape (the demo Qwen3's and a 0.5B-class Qwen3's projections), for a prefill of 4 x 128 rows
and a decode step of 4 rows, single-thread CPU time (user + sys of this process, ``time.process_time``; minimum of
``--repeats`` alternating runs, so load from other processes hurts all alike) of:

* ``stock``: ``F.linear`` in bf16 (the trainer's default linear);
* ``linear``: ``kernels.linear`` (consistent mode's bf16 linear);
* ``fake_quant``: ``kernels.fake_quant_linear`` on the bf16 weight (the trainer's side against an INT8
  rollout; its quantized weight cached as inside consistent mode);
* ``int8``: ``kernels.int8_linear`` on the int8 weight as stored (the engine's side; consistent mode's vLLM
  side widens it to fp32 once, as ``fake_quant`` does);

and, with ``--demo DIR``, the HF forward of one 4 x 128 batch of the demo model: consistent mode, and
consistent mode with ``consistent_quantized`` (the ratio is the whole-model cost of the quantized trainer).

Usage::

    .venv/bin/python bench/bench_int8.py [--demo DIR] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

SHAPES = {  # (N, K) per projection
    "demo": {"qkv": (512, 256), "o": (256, 256), "gate_up": (1536, 256), "down": (256, 768)},
    "0.5B": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)},
}


def cpu_best(repeats: int, fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Minimum CPU seconds of each function, run in turn ``repeats`` times after one warm-up."""
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.process_time()
            f()
            best[k] = min(best[k], time.process_time() - t)
    return best


def per_linear(repeats: int) -> dict[str, dict[str, float]]:
    import torch

    from logdiff import kernels
    from logdiff.kernels.int8 import quantize_weight

    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    with kernels.kernel_caches():
        for model, shapes in SHAPES.items():
            for name, (n, k) in shapes.items():
                w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
                q_w, s_w = quantize_weight(w)
                for phase, rows in (("prefill", 512), ("decode", 4)):
                    x = torch.randn(rows, k, generator=gen).bfloat16()
                    with torch.no_grad():
                        t = cpu_best(repeats, {
                            "stock": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                            "linear": lambda x=x, w=w: kernels.linear(x, w),
                            "fake_quant": lambda x=x, w=w: kernels.fake_quant_linear(x, w),
                            "int8": lambda x=x, q=q_w, s=s_w: kernels.int8_linear(x, q, s),
                        })  # fmt: skip
                    out[f"{model} {name} {phase}"] = t
                    print(f"{model:5s} {name:8s} {phase:8s} " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in t.items())
                          + f"   fake_quant/linear {t['fake_quant'] / t['linear']:.2f}x", flush=True)  # fmt: skip
    return out


def whole_model(demo: str, repeats: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.hf.consistent_quant import consistent_quantized

    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.bfloat16).eval()
    ids = torch.randint(5, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), consistent_hf(model):
        consistent = cpu_best(repeats, {"consistent": lambda: model(ids)})["consistent"]
        with consistent_quantized(model, "int8-w8a8"):
            quantized = cpu_best(repeats, {"quantized": lambda: model(ids)})["quantized"]
    result = {"consistent": consistent, "consistent_int8": quantized, "ratio": quantized / consistent}
    print(f"demo forward 4x128: consistent {consistent * 1e3:.1f} ms, consistent + int8 {quantized * 1e3:.1f} ms"
          f" ({result['ratio']:.2f}x)")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", help="the demo model's directory (whole-model timing)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the timings here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU time without spinning)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    from logdiff.isa import cpu_isa

    result = {"isa": cpu_isa(), "threads": torch.get_num_threads(), "linear": per_linear(args.repeats)}
    if args.demo:
        result["demo_forward"] = whole_model(args.demo, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
