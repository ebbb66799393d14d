"""Batch-invariant SiLU-and-mul, the gated MLP activation ``silu(gate) * up``.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 16384


def _silu_fixed_calls(g: torch.Tensor) -> torch.Tensor:
    """``F.silu`` of a float tensor, evaluated in tail-free, serial, equal-size slices."""
    if g.device.type == "cuda":
        return F.silu(g)
    n = g.numel()
    flat = torch.zeros(-(-n // CHUNK) * CHUNK, dtype=g.dtype, device=g.device)
    flat[:n] = g.reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        F.silu(flat[start : start + CHUNK], inplace=True)
    return flat[:n].view(g.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32 (fp64 for fp64 input), rounded once to ``gate.dtype``."""
    dtype = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (_silu_fixed_calls(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in fp32 (fp64 for fp64 input), rounded once."""
    dtype = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)
