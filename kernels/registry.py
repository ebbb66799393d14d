"""The kernel catalogue and the self-test behind ``logdiff kernels --self-test``.

:data:`KERNELS` lists every kernel with its description, precision policy and
reference (resolved lazily, so listing the catalogue does not import torch).

:func:`self_test` checks each kernel on small seeded inputs, in about a second:

* **invariance**: the same rows computed in calls of different shapes
  (batch 1 vs a mixed batch; for attention: full prefill vs chunked prefill vs
  one-query decode steps; for linear also packed vs unpacked weights) must be
  bitwise equal (``torch.equal``);
* **agreement**: the fp32 kernel's largest error against its reference
  evaluated in fp64, relative to the largest reference magnitude, must be
  within the kernel's stated ``bound``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelInfo:
    """One consistent kernel: what it computes, at what precision, and its plain reference."""

    name: str
    description: str
    precision: str
    bound: float
    """Largest allowed error of the fp32 kernel vs its fp64 reference, relative to the largest |reference|."""
    kernel_path: str
    reference_path: str

    @property
    def kernel(self) -> Callable[..., Any]:
        return _resolve(self.kernel_path)

    @property
    def reference(self) -> Callable[..., Any]:
        return _resolve(self.reference_path)


@dataclass(frozen=True)
class SelfTestResult:
    """The outcome of one kernel's self-test."""

    name: str
    invariant: bool
    max_error: float
    bound: float
    seconds: float
    detail: str

    @property
    def agrees(self) -> bool:
        return self.max_error <= self.bound

    @property
    def ok(self) -> bool:
        return self.invariant and self.agrees


def _resolve(path: str) -> Callable[..., Any]:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


KERNELS: list[KernelInfo] = [
    KernelInfo(
        "linear",
        "x @ W.T + b from fixed [64 x K] @ [K x 128] GEMM tiles (packed == unpacked weights)",
        "fp32 accumulation in the BLAS (native bf16/fp16 GEMM where the CPU has it), bias in fp32, one rounding",
        1e-5,
        "matmul.linear",
        "matmul.linear_reference",
    ),
    KernelInfo(
        "rms_norm",
        "HF RMSNorm, optional fused residual add (returns (norm(x+r), x+r))",
        "fp32 mean of squares (halving tree), x / sqrt(v + eps), one rounding, weight multiply as HF",
        1e-6,
        "rmsnorm.rms_norm",
        "rmsnorm.rms_norm_reference",
    ),
    KernelInfo(
        "rope",
        "rotary embedding (neox or gptj) at absolute positions from a shared cos/sin table",
        "cos/sin in fp64 rounded to fp32 per fixed 1024-element table block; fp32 rotation, one rounding",
        1e-6,
        "rope.rope",
        "rope.rope_reference",
    ),
    KernelInfo(
        "attention",
        "causal GQA attention, 16-query x 16-key GEMM tiles, blocks added in a zero-stable pairwise order",
        "fp32 scores, exact row max, position-independent exp, fp32 sums, one rounding",
        1e-5,
        "attention.attention",
        "attention.attention_reference",
    ),
    KernelInfo(
        "silu_and_mul",
        "silu(gate) * up = gate * up / (1 + exp(-gate))",
        "fp32 with position-independent exp, one rounding",
        1e-6,
        "activation.silu_and_mul",
        "activation.silu_and_mul_reference",
    ),
    KernelInfo(
        "log_softmax",
        "log-probabilities over the vocabulary (and token_log_probs for chosen tokens)",
        "fp32: exact max, position-independent exp/log, halving-tree sum; fp32 output",
        1e-6,
        "logsoftmax.log_softmax",
        "logsoftmax.log_softmax_reference",
    ),
    KernelInfo(
        "moe_route",
        "softmax top-k routing, ties to the lower expert id, optional renormalisation",
        "fp32 softmax (position-independent exp, halving-tree sum), rank-order renormalisation",
        1e-6,
        "moe.moe_route",
        "moe.moe_route_reference",
    ),
    KernelInfo(
        "moe_route_grouped",
        "sigmoid top-k chosen on score + correction bias within the best groups (DeepSeek-V3, GLM-4.5)",
        "fp32 sigmoid (position-independent exp), stable ranking, rank-order renormalisation, scaling",
        1e-6,
        "moe.moe_route_grouped",
        "moe.moe_route_grouped_reference",
    ),
    KernelInfo(
        "moe_combine",
        "run each expert on its routed rows, weighted sum in rank order",
        "fp32 weighted sum in rank order, one rounding",
        1e-5,
        "moe.moe_combine",
        "moe.moe_combine_reference",
    ),
    KernelInfo(
        "gemma_rms_norm",
        "Gemma RMSNorm x / rms(x) * (1 + w), optional fused residual add",
        "fp32 mean of squares (halving tree), x / sqrt(v + eps), (1 + w) in fp32, one rounding",
        1e-6,
        "rmsnorm.gemma_rms_norm",
        "rmsnorm.gemma_rms_norm_reference",
    ),
    KernelInfo(
        "gelu_tanh_and_mul",
        "gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh gated MLP)",
        "fp32 gelu in tail-free equal-size slices, one rounding",
        1e-6,
        "activation.gelu_tanh_and_mul",
        "activation.gelu_tanh_and_mul_reference",
    ),
    KernelInfo(
        "swiglu_oai_and_mul",
        "gpt-oss's clamped SwiGLU (clamp(up, ±7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)",
        "fp32 with position-independent exp, one rounding",
        1e-6,
        "activation.swiglu_oai_and_mul",
        "activation.swiglu_oai_and_mul_reference",
    ),
    KernelInfo(
        "softcap",
        "logit soft-capping cap * tanh(x / cap) (Gemma 2 final logits; attention takes softcap=)",
        "fp32 with position-independent tanh (from exp), one rounding",
        1e-6,
        "softcap.softcap",
        "softcap.softcap_reference",
    ),
    KernelInfo(
        "int8_linear",
        "INT8 W8A8 linear (compressed-tensors): per-token int8 activations x per-channel int8 weights, vLLM-CPU's bits",
        "exact integer GEMM (fp32 GEMMs of <= 1024 products, summed in fp64), fp32 epilogue, one rounding",
        1e-5,
        "int8.int8_linear",
        "int8.int8_linear_reference",
    ),
]


def consistent_kernels() -> list[KernelInfo]:
    """The catalogue (a copy of :data:`KERNELS`)."""
    return list(KERNELS)


# ----------------------------------------------------------------------------- self-test


def _rel_error(out: Any, ref: Any) -> float:
    scale = float(ref.abs().max()) or 1.0
    return float((out.double() - ref.double()).abs().max()) / scale


def _same_rows(rows_of: Callable[[int], Any], sizes: tuple[int, ...]) -> bool:
    """Row 0's result must be bitwise the same however many rows share the call."""
    import torch

    first = rows_of(sizes[0])[:1]
    return all(torch.equal(rows_of(m)[:1], first) for m in sizes[1:])


def _check_linear(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .caches import kernel_caches
    from .matmul import linear, linear_reference

    x = torch.randn(70, 256, generator=gen)
    parts = [torch.randn(n, 256, generator=gen) / 16 for n in (128, 256, 64)]
    w = torch.cat(parts)
    b = torch.randn(w.shape[0], generator=gen)
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd, pd = x.to(dtype), w.to(dtype), [p.to(dtype) for p in parts]
        invariant &= _same_rows(lambda m, xd=xd, wd=wd: linear(xd[-m:].flip(0), wd), (1, 3, 8, 65, 70))
        unpacked = [linear(xd, p) for p in pd]
        invariant &= torch.equal(linear(xd, wd[:384]), torch.cat(unpacked[:2], -1))  # whole N tiles
        invariant &= torch.equal(linear(xd, wd, output_sizes=(128, 256, 64)), torch.cat(unpacked, -1))
    # Prefill-sized calls inside kernel_caches() (wide row tiles where the BLAS was checked to allow them), on
    # bf16 rows whose outputs are pure accumulation error (columns repeated, a and -a: exact dot products of 0),
    # at a K where oneDNN's bf16 GEMM on AMX CPUs adds in another order for 64 rows than for 16.
    half = torch.randn(128, 256, generator=gen).to(torch.bfloat16)
    a = torch.randn(70, 256, generator=gen).to(torch.bfloat16)
    wc, xc = torch.cat([half, half], 1), torch.cat([a, -a], 1)
    with kernel_caches():  # 70 rows in one call (64 of them in a wide tile if allowed) == in calls of 16 rows
        invariant &= torch.equal(linear(xc, wc), torch.cat([linear(xc[i : i + 16], wc) for i in range(0, 70, 16)]))
    err = _rel_error(linear(x, w, b), linear_reference(x.double(), w.double(), b.double()))
    return invariant, err, "rows at M=1,3,8,65,70 in fp32 and bf16 (and bf16 in wide tiles); packed weights == unpacked"


def _check_rms_norm(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .rmsnorm import rms_norm, rms_norm_reference

    x, r = torch.randn(9, 384, generator=gen), torch.randn(9, 384, generator=gen)
    w = torch.rand(384, generator=gen) + 0.5
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        xd, rd, wd = x.to(dtype), r.to(dtype), w.to(dtype)
        invariant &= _same_rows(lambda m, xd=xd, wd=wd: rms_norm(xd[-m:].flip(0), wd, 1e-6), (1, 2, 9))
        invariant &= _same_rows(
            lambda m, xd=xd, wd=wd, rd=rd: rms_norm(xd[-m:].flip(0), wd, 1e-6, rd[-m:].flip(0))[0], (1, 9)
        )
    err = _rel_error(rms_norm(x, w, 1e-6), rms_norm_reference(x.double(), w.double(), 1e-6))
    return invariant, err, "rows at M=1,2,9, with and without residual, fp32 and bf16"


def _check_rope(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .rope import rope, rope_reference

    x = torch.randn(40, 4, 64, generator=gen)
    pos = torch.arange(40)
    invariant = True
    for style in ("neox", "gptj"):
        full = rope(x, pos, 10000.0, style)
        singles = torch.cat([rope(x[i : i + 1], pos[i : i + 1], 10000.0, style) for i in range(40)])
        invariant &= torch.equal(full, singles)
    err = _rel_error(rope(x, pos, 10000.0), rope_reference(x.double(), pos, 10000.0))
    return invariant, err, "40 positions at once vs one at a time, neox and gptj"


def _check_attention(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .attention import attention, attention_reference

    s, hq, hkv, d = 37, 4, 2, 32
    q, k, v = (torch.randn(s, h, d, generator=gen) for h in (hq, hkv, hkv))
    pos = torch.arange(s)
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        full = attention(qd, kd, vd, pos, d**-0.5)
        chunked = torch.cat(
            [attention(qd[a:b], kd[:b], vd[:b], pos[a:b], d**-0.5) for a, b in ((0, 13), (13, 30), (30, s))]
        )
        steps = (0, 15, 16, 17, 31, 32, s - 1)  # decode steps around block and tile edges
        decode = torch.cat([attention(qd[i : i + 1], kd[: i + 1], vd[: i + 1], pos[i : i + 1], d**-0.5) for i in steps])
        invariant &= torch.equal(full, chunked) and torch.equal(full[list(steps)], decode)
    err = _rel_error(
        attention(q, k, v, pos, d**-0.5), attention_reference(q.double(), k.double(), v.double(), pos, d**-0.5)
    )
    return invariant, err, "full prefill vs chunked prefill vs one-token decode steps, GQA 4/2, fp32 and bf16"


def _check_gated(gen: Any, kernel: Callable[..., Any], reference: Callable[..., Any]) -> tuple[bool, float, str]:
    """A gated activation ``act(gate) * up``: rows at shifted tensor offsets, and the fp64 error."""
    import torch

    g, u = torch.randn(9, 300, generator=gen) * 4, torch.randn(9, 300, generator=gen)
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        gd, ud = g.to(dtype), u.to(dtype)
        invariant &= _same_rows(lambda m, gd=gd, ud=ud: kernel(gd[-m:].flip(0), ud[-m:].flip(0)), (1, 2, 5, 9))
    err = _rel_error(kernel(g, u), reference(g.double(), u.double()))
    return invariant, err, "rows at M=1,2,5,9 (elements at shifted tensor offsets), fp32 and bf16"


def _check_silu_and_mul(gen: Any) -> tuple[bool, float, str]:
    from .activation import silu_and_mul, silu_and_mul_reference

    return _check_gated(gen, silu_and_mul, silu_and_mul_reference)


def _check_log_softmax(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .logsoftmax import log_softmax, log_softmax_reference, token_log_probs

    x = torch.randn(7, 1000, generator=gen) * 5
    invariant = _same_rows(lambda m: log_softmax(x[-m:].flip(0)), (1, 3, 7))
    tokens = torch.randint(0, 1000, (7,), generator=gen)
    invariant &= torch.equal(token_log_probs(x, tokens), log_softmax(x).gather(-1, tokens[:, None])[:, 0])
    err = _rel_error(log_softmax(x), log_softmax_reference(x.double()))
    return invariant, err, "rows at M=1,3,7; token_log_probs == gathered log_softmax"


def _check_moe_route(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .moe import moe_route, moe_route_reference

    logits = torch.randn(9, 16, generator=gen)
    logits[0, 3] = logits[0, 11] = logits[0].max() + 1.0  # a tie: expert 3 must rank first
    invariant = _same_rows(lambda m: torch.cat([t.float() for t in moe_route(logits[:m], 4, True)], -1), (1, 4, 9))
    invariant &= moe_route(logits, 4, True)[1][0, :2].tolist() == [3, 11]
    w, ids = moe_route(logits, 4, True)
    ref_w, _ = moe_route_reference(logits.double(), 4, True)
    return invariant, _rel_error(w, ref_w), "rows at M=1,4,9; a tie goes to the lower expert id"


def _check_moe_route_grouped(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .moe import moe_route_grouped, moe_route_grouped_reference

    logits, bias = torch.randn(9, 16, generator=gen), torch.randn(16, generator=gen) * 0.3
    rule = {"bias": bias, "n_group": 4, "topk_group": 2, "scaling": 2.5}
    routed = lambda m: torch.cat([t.float() for t in moe_route_grouped(logits[:m], 4, True, **rule)], -1)  # noqa: E731
    invariant = _same_rows(routed, (1, 4, 9))
    w, ids = moe_route_grouped(logits, 4, True, **rule)
    ref_w, ref_ids = moe_route_grouped_reference(logits.double(), 4, True, **rule)
    invariant &= torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    by_id = lambda w_, i_: w_.gather(1, i_.sort(-1).indices)  # noqa: E731
    return invariant, _rel_error(by_id(w, ids), by_id(ref_w, ref_ids)), "rows at M=1,4,9; HF's expert sets"


def _check_moe_combine(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .moe import moe_combine, moe_combine_reference, moe_route

    x = torch.randn(9, 64, generator=gen)
    w13, w2 = torch.randn(8, 96, 64, generator=gen) / 8, torch.randn(8, 64, 48, generator=gen) / 8

    def expert(e: int, rows: Any) -> Any:
        from .activation import silu_and_mul
        from .matmul import linear

        gate_up = linear(rows, w13[e].to(rows.dtype))
        return linear(silu_and_mul(gate_up[:, :48], gate_up[:, 48:]), w2[e].to(rows.dtype))

    weights, ids = moe_route(torch.randn(9, 8, generator=gen), 2, True)
    invariant = _same_rows(lambda m: moe_combine(x[:m], weights[:m], ids[:m], expert), (1, 4, 9))
    err = _rel_error(moe_combine(x, weights, ids, expert), moe_combine_reference(x.double(), weights, ids, expert))
    return invariant, err, "tokens at M=1,4,9 (different expert groupings)"


def _check_gemma_rms_norm(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .rmsnorm import gemma_rms_norm, gemma_rms_norm_reference

    x, w = torch.randn(9, 256, generator=gen) * 3, torch.randn(256, generator=gen) * 0.1
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        invariant &= _same_rows(lambda m, xd=xd, wd=wd: gemma_rms_norm(xd[-m:].flip(0), wd, 1e-6), (1, 2, 5, 9))
    err = _rel_error(gemma_rms_norm(x, w, 1e-6), gemma_rms_norm_reference(x.double(), w.double(), 1e-6))
    return invariant, err, "rows at M=1,2,5,9, fp32 and bf16"


def _check_gelu_tanh_and_mul(gen: Any) -> tuple[bool, float, str]:
    from .activation import gelu_tanh_and_mul, gelu_tanh_and_mul_reference

    return _check_gated(gen, gelu_tanh_and_mul, gelu_tanh_and_mul_reference)


def _check_swiglu_oai_and_mul(gen: Any) -> tuple[bool, float, str]:
    from .activation import swiglu_oai_and_mul, swiglu_oai_and_mul_reference

    return _check_gated(gen, swiglu_oai_and_mul, swiglu_oai_and_mul_reference)


def _check_softcap(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .softcap import softcap, softcap_reference

    x = torch.randn(7, 1000, generator=gen) * 40
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        invariant &= _same_rows(lambda m, xd=xd: softcap(xd[-m:].flip(0), 30.0), (1, 3, 7))
    err = _rel_error(softcap(x, 30.0), softcap_reference(x.double(), 30.0))
    return invariant, err, "rows at M=1,3,7, fp32 and bf16"


def _check_int8_linear(gen: Any) -> tuple[bool, float, str]:
    import torch

    from .int8 import fake_quant_linear, int8_linear, int8_linear_reference, quantize_weight

    x = torch.randn(70, 1100, generator=gen) * torch.rand(70, 1, generator=gen) * 4  # K over one exact GEMM chunk
    w, b = torch.randn(96, 1100, generator=gen) / 32, torch.randn(96, generator=gen)
    q_w, s_w = quantize_weight(w)
    invariant = True
    for dtype in (torch.float32, torch.bfloat16):
        xd, bd = x.to(dtype), b.to(dtype)
        invariant &= _same_rows(lambda m, xd=xd, bd=bd: int8_linear(xd[-m:].flip(0), q_w, s_w, bd), (1, 3, 17, 70))
        invariant &= torch.equal(fake_quant_linear(xd, w, bd), int8_linear(xd, q_w, s_w, bd))
    err = _rel_error(int8_linear(x, q_w, s_w, b), int8_linear_reference(x, q_w, s_w, b))
    return invariant, err, "rows at M=1,3,17,70 in fp32 and bf16 (K=1100: two integer GEMM chunks); fake-quant == int8"


_CHECKS: dict[str, Callable[[Any], tuple[bool, float, str]]] = {
    "linear": _check_linear,
    "rms_norm": _check_rms_norm,
    "rope": _check_rope,
    "attention": _check_attention,
    "silu_and_mul": _check_silu_and_mul,
    "log_softmax": _check_log_softmax,
    "moe_route": _check_moe_route,
    "moe_route_grouped": _check_moe_route_grouped,
    "moe_combine": _check_moe_combine,
    "gemma_rms_norm": _check_gemma_rms_norm,
    "gelu_tanh_and_mul": _check_gelu_tanh_and_mul,
    "swiglu_oai_and_mul": _check_swiglu_oai_and_mul,
    "softcap": _check_softcap,
    "int8_linear": _check_int8_linear,
}


def self_test(seed: int = 0) -> list[SelfTestResult]:
    """Check every kernel's invariance and its agreement with its fp64 reference."""
    import torch

    results = []
    for info in KERNELS:
        gen = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        invariant, err, detail = _CHECKS[info.name](gen)
        results.append(SelfTestResult(info.name, bool(invariant), err, info.bound, time.perf_counter() - start, detail))
    return results
