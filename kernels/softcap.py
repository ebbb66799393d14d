"""Batch-invariant logit soft-capping, ``cap * tanh(x / cap)`` (Gemma 2's attention and final logits).

In fp32 (fp64 for fp64 input), rounded once to ``x.dtype``. ``torch.tanh`` has
the vector-body/scalar-tail problem of every transcendental op (a row's bits
would depend on where it sits in the batch), so the tanh is
:func:`fixed_order.tanh`, whose bits depend on each element's value alone.
HF soft-caps in the model dtype (three roundings: divide, tanh, multiply) and
vLLM's logits processor likewise; under consistent mode both call this.

Backward (a training step through Gemma 2's final cap): ``dx = dy * (1 - t^2)``
with ``t = tanh(x / cap)`` recomputed exactly as the forward computes it, in the
same precision, rounded once to ``x.dtype``; elementwise, so a row's gradient is
a function of its own values alone.
"""

from __future__ import annotations

import torch

from .differentiable import needs_grad
from .fixed_order import tanh


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` elementwise, fp32 inside, one rounding to ``x.dtype``."""
    if needs_grad(x):
        return _Softcap.apply(x, cap)
    return _tanh_over_cap(x, cap).mul_(cap).to(x.dtype)


def _tanh_over_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap)`` in the kernel's precision: :func:`fixed_order.tanh` in fp32, ``torch.tanh`` for fp64."""
    if x.dtype == torch.float64:
        return torch.tanh(x / cap)
    return tanh(x.float() / cap)


class _Softcap(torch.autograd.Function):
    """:func:`softcap` with the elementwise backward ``dy * (1 - tanh^2(x / cap))``."""

    @staticmethod
    def forward(ctx, x, cap):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        ctx.cap = cap
        return _tanh_over_cap(x, cap).mul_(cap).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        t = _tanh_over_cap(x, ctx.cap)
        return (dy.to(t.dtype) * t.mul_(t).neg_().add_(1.0)).to(x.dtype), None


def softcap_reference(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * torch.tanh(x / cap)`` in fp32 (fp64 for fp64 input), rounded once."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (cap * torch.tanh(x.to(dtype) / cap)).to(x.dtype)
