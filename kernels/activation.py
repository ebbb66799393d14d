"""Batch-invariant SiLU-and-mul, the gated MLP activation ``silu(gate) * up`` (and Gemma's gelu-tanh-and-mul).

``silu(gate)`` in fp32, times ``up`` in fp32, rounded once to ``gate.dtype``.
HF computes ``act_fn(gate)`` rounded to the model dtype and then multiplies by
``up`` (rounded again); vLLM's fused op rounds once. Both paths calling this
kernel get the same single-rounding result.

Why the stock op is not invariant: ``F.silu`` computes an element in the
vectorised body or in the scalar tail of its loop depending on where the
element lands in the tensor (and where a thread split falls), and the two paths
differ in the last bit for a few percent of inputs. A token's activation then
depends on the other tokens in the batch.

Design: **every ``F.silu`` call has the same size and no tail.** The fp32 gate
is copied into a flat buffer padded to a multiple of :data:`CHUNK` elements and
``F.silu`` runs on consecutive ``CHUNK``-element slices. ``CHUNK`` (16384) is a
multiple of twice every CPU vector width (up to 2048-bit SVE), so a slice has
no scalar tail, and it is below ATen's 32768-element threshold for splitting an
elementwise op across threads, so every element of every slice goes through the
same vector code, whose lanes are independent. This rests on ATen's loop
structure (vector body + scalar tail, serial below the grain size), which the
tests check; it is about 5x cheaper than the position-independent
:func:`fixed_order.exp` on the MLP's large activations. On CUDA every element
runs the same code, and the slicing is skipped.

:func:`gelu_tanh_and_mul` is Gemma's ``gelu_pytorch_tanh`` gated MLP (vLLM's
``GeluAndMul(approximate="tanh")``), built the same way around
``F.gelu(approximate="tanh")``; its backward is ATen's ``gelu_backward(approximate="tanh")``
in the same slices, as SiLU's is ``silu_backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .differentiable import needs_grad

CHUNK = 16384


def _flat_chunks(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened into a fresh zero buffer of whole CHUNK-element slices."""
    flat = torch.empty(-(-t.numel() // CHUNK) * CHUNK, dtype=t.dtype, device=t.device)
    flat[: t.numel()] = t.reshape(-1)
    flat[t.numel() :] = 0  # only the padding is zeroed: the elements above are written once
    return flat


def _silu_fixed_calls(g: torch.Tensor) -> torch.Tensor:
    """``F.silu`` of a float tensor, evaluated in tail-free, serial, equal-size slices."""
    if g.device.type == "cuda":
        return F.silu(g)
    flat = _flat_chunks(g)
    for start in range(0, flat.numel(), CHUNK):
        F.silu(flat[start : start + CHUNK], inplace=True)
    return flat[: g.numel()].view(g.shape)


def _silu_grad_fixed_calls(dy: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``dy * silu'(g)`` (ATen's ``silu_backward``) in the same tail-free, equal-size slices."""
    if g.device.type == "cuda":
        return torch.ops.aten.silu_backward(dy, g)
    flat_dy, flat_g = _flat_chunks(dy), _flat_chunks(g)
    for start in range(0, flat_g.numel(), CHUNK):
        part = slice(start, start + CHUNK)
        flat_dy[part] = torch.ops.aten.silu_backward(flat_dy[part], flat_g[part])
    return flat_dy[: g.numel()].view(g.shape)


def _compute_dtype(gate: torch.Tensor) -> torch.dtype:
    return torch.float64 if gate.dtype == torch.float64 else torch.float32


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32 (fp64 for fp64 input), rounded once to ``gate.dtype``."""
    if needs_grad(gate, up):
        return _Gated.apply(gate, up, _silu_fixed_calls, _silu_grad_fixed_calls)
    dtype = _compute_dtype(gate)
    return (_silu_fixed_calls(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


class _Gated(torch.autograd.Function):
    """``act(gate) * up`` with an elementwise backward in the forward's fixed slices:
    ``d_up = dy * act(gate)``, ``d_gate = act_grad(dy * up, gate)`` (``silu_backward``, ``gelu_backward``)."""

    @staticmethod
    def forward(ctx, gate, up, act, act_grad):  # noqa: ANN001, ANN205
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.act_grad = act, act_grad
        with torch.no_grad():  # the inference path's expression: the same bits
            dtype = _compute_dtype(gate)
            return (act(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        gate, up = ctx.saved_tensors
        dtype = _compute_dtype(gate)
        g, u, d = gate.to(dtype), up.to(dtype), dy.to(dtype)
        d_gate = ctx.act_grad(d * u, g).to(gate.dtype) if ctx.needs_input_grad[0] else None
        d_up = (d * ctx.act(g)).to(up.dtype) if ctx.needs_input_grad[1] else None
        return d_gate, d_up, None, None


def _gelu_tanh_fixed_calls(g: torch.Tensor) -> torch.Tensor:
    """``F.gelu(g, approximate="tanh")`` in the same tail-free, serial, equal-size slices as SiLU."""
    if g.device.type == "cuda":
        return F.gelu(g, approximate="tanh")
    flat = _flat_chunks(g)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK]
        part.copy_(F.gelu(part, approximate="tanh"))
    return flat[: g.numel()].view(g.shape)


def _gelu_tanh_grad_fixed_calls(dy: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``dy * gelu_tanh'(g)`` (ATen's ``gelu_backward``) in the same tail-free, equal-size slices."""
    if g.device.type == "cuda":
        return torch.ops.aten.gelu_backward(dy, g, approximate="tanh")
    flat_dy, flat_g = _flat_chunks(dy), _flat_chunks(g)
    for start in range(0, flat_g.numel(), CHUNK):
        part = slice(start, start + CHUNK)
        flat_dy[part] = torch.ops.aten.gelu_backward(flat_dy[part], flat_g[part], approximate="tanh")
    return flat_dy[: g.numel()].view(g.shape)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh`` gated MLP) in fp32 (fp64 for fp64), rounded once."""
    if needs_grad(gate, up):
        return _Gated.apply(gate, up, _gelu_tanh_fixed_calls, _gelu_tanh_grad_fixed_calls)
    dtype = _compute_dtype(gate)
    return (_gelu_tanh_fixed_calls(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


def gelu_tanh_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` in fp32 (fp64 for fp64 input), rounded once."""
    dtype = _compute_dtype(gate)
    return (F.gelu(gate.to(dtype), approximate="tanh") * up.to(dtype)).to(gate.dtype)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in fp32 (fp64 for fp64 input), rounded once."""
    dtype = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


# ---- gpt-oss's clamped SwiGLU ------------------------------------------------------------------
#
# ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)`` (HF ``GptOssExperts._apply_gate``,
# vLLM ``SwigluOAIAndMul``), in fp32 and rounded once. The sigmoid is ``1 / (1 + exp(-alpha * g))`` with the
# position-independent :func:`fixed_order.exp`, so an element's bits never depend on where it sits in the tensor.


def _swiglu_oai_parts(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> tuple[torch.Tensor, ...]:
    """(clamped gate g, clamped up u, sigmoid(alpha * g)) in the compute dtype."""
    from .fixed_order import exp

    dtype = _compute_dtype(gate)
    g = gate.to(dtype).clamp(max=limit)
    u = up.to(dtype).clamp(min=-limit, max=limit)
    e = exp(g * -alpha) if dtype == torch.float32 else torch.exp(g * -alpha)  # fp64: the reference's exp
    return g, u, 1.0 / (1.0 + e)


def swiglu_oai_and_mul(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, l)``, fp32, rounded once."""
    if needs_grad(gate, up):
        return _SwigluOai.apply(gate, up, alpha, limit)
    g, u, sig = _swiglu_oai_parts(gate, up, alpha, limit)
    return ((u + 1.0) * (g * sig)).to(gate.dtype)


class _SwigluOai(torch.autograd.Function):
    """Elementwise backward (zero where a clamp holds): ``d_up = dy * g * s``,
    ``d_gate = dy * (u + 1) * (s + alpha * g * s * (1 - s))``."""

    @staticmethod
    def forward(ctx, gate, up, alpha, limit):  # noqa: ANN001, ANN205
        ctx.save_for_backward(gate, up)
        ctx.alpha, ctx.limit = alpha, limit
        with torch.no_grad():
            return swiglu_oai_and_mul(gate, up, alpha, limit)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        gate, up = ctx.saved_tensors
        g, u, sig = _swiglu_oai_parts(gate, up, ctx.alpha, ctx.limit)
        d = dy.to(g.dtype)
        d_gate = d_up = None
        if ctx.needs_input_grad[0]:
            slope = sig + ctx.alpha * g * sig * (1.0 - sig)
            d_gate = torch.where(gate.to(g.dtype) < ctx.limit, d * (u + 1.0) * slope, 0.0).to(gate.dtype)
        if ctx.needs_input_grad[1]:
            inside = up.to(g.dtype).abs() < ctx.limit
            d_up = torch.where(inside, d * g * sig, 0.0).to(up.dtype)
        return d_gate, d_up, None, None


def swiglu_oai_and_mul_reference(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """HF's ``GptOssExperts._apply_gate`` on split gate/up in fp32 (fp64 for fp64 input), rounded once."""
    dtype = _compute_dtype(gate)
    g = gate.to(dtype).clamp(max=limit)
    u = up.to(dtype).clamp(min=-limit, max=limit)
    return ((u + 1) * (g * torch.sigmoid(g * alpha))).to(gate.dtype)
