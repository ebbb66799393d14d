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
``F.gelu(approximate="tanh")``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .differentiable import needs_grad

CHUNK = 16384


def _flat_chunks(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened into a fresh zero buffer of whole CHUNK-element slices."""
    flat = torch.zeros(-(-t.numel() // CHUNK) * CHUNK, dtype=t.dtype, device=t.device)
    flat[: t.numel()] = t.reshape(-1)
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
        return _SiluAndMul.apply(gate, up)
    dtype = _compute_dtype(gate)
    return (_silu_fixed_calls(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


class _SiluAndMul(torch.autograd.Function):
    """Elementwise backward: ``d_up = dy * silu(gate)``, ``d_gate = silu_backward(dy * up, gate)``, fixed slices."""

    @staticmethod
    def forward(ctx, gate, up):  # noqa: ANN001, ANN205
        ctx.save_for_backward(gate, up)
        with torch.no_grad():
            return silu_and_mul(gate, up)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        gate, up = ctx.saved_tensors
        dtype = _compute_dtype(gate)
        g, u, d = gate.to(dtype), up.to(dtype), dy.to(dtype)
        d_gate = _silu_grad_fixed_calls(d * u, g).to(gate.dtype) if ctx.needs_input_grad[0] else None
        d_up = (d * _silu_fixed_calls(g)).to(up.dtype) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def _gelu_tanh_fixed_calls(g: torch.Tensor) -> torch.Tensor:
    """``F.gelu(g, approximate="tanh")`` in the same tail-free, serial, equal-size slices as SiLU."""
    if g.device.type == "cuda":
        return F.gelu(g, approximate="tanh")
    flat = _flat_chunks(g)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK]
        part.copy_(F.gelu(part, approximate="tanh"))
    return flat[: g.numel()].view(g.shape)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh`` gated MLP) in fp32, rounded once.

    Inference only: with autograd recording it raises (its fixed calls write in place).
    """
    if needs_grad(gate, up):
        raise NotImplementedError("gelu_tanh_and_mul: no backward")
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
