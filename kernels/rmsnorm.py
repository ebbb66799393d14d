"""Batch-invariant RMSNorm, with and without the fused residual add.

Semantics are HF's (Qwen2/Qwen3/Llama ``*RMSNorm``)::

    y = weight * (x32 / sqrt(mean(x32^2) + eps)).to(x.dtype)

With ``residual``: ``s = x + residual`` rounded to ``x.dtype`` (exactly what
HF's separate ``residual + hidden_states`` produces), and the result is
``(rms_norm(s), s)``, the pair vLLM's fused add+norm returns.

Why it is invariant: the mean of squares is a :func:`halving_sum` over the
hidden dimension, a tree of elementwise adds whose order depends only on the
hidden size (``torch.mean`` may split a long row across threads when few rows
share the call). The row is divided by ``sqrt(v)``: square root and division
are correctly rounded in every code path, unlike a vectorised ``rsqrt``, which
was seen to differ from its scalar tail in bf16.

Precision policy: square, sum, mean, root and scaling in fp32; one rounding to
``x.dtype``; then the weight multiply in the weight/activation dtype as HF does.

:func:`gemma_rms_norm` is Gemma's variant (HF ``Gemma2RMSNorm``, vLLM
``GemmaRMSNorm``): the same invariant rms, times ``(1 + w)`` in fp32, and only
then one rounding to ``x.dtype``.
"""

from __future__ import annotations

import torch

from .differentiable import needs_grad
from .fixed_order import halving_sum, pairwise_sum


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual`` returns ``(norm(x + residual), x + residual)``."""
    if residual is not None:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps, False)
    return _rms_norm(x, weight, eps)


def _rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(mean(x32^2) + eps)`` per row, ``[..., 1]``: a halving sum over the hidden size."""
    mean_sq = halving_sum(x32 * x32, -1).div_(x32.shape[-1])
    return torch.sqrt(mean_sq.add_(eps)).unsqueeze(-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 / _rms(x32, eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """``rms_norm`` (``offset`` False) or ``gemma_rms_norm`` (True) with a row-local backward for x and a
    fixed-order (pairwise over rows) sum for the weight. Gemma's ``(1 + w)`` is in fp32 and its normalised
    row ``u`` is never rounded; the plain norm rounds ``u`` to ``x.dtype`` before the weight, as its forward."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset = eps, offset
        return _gemma_rms_norm(x, weight, eps) if offset else _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        x32 = x.float()  # the forward's precision (fp32 for every input dtype)
        rms = _rms(x32, ctx.eps)
        u = x32 / rms  # the forward's normalised row, before its rounding
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dn = dy.float() * (weight.float() + 1.0 if ctx.offset else weight.float())
            dot = halving_sum(dn * u, -1).div_(x.shape[-1]).unsqueeze(-1)
            dx = ((dn - u * dot) / rms).to(x.dtype)
        if ctx.needs_input_grad[1]:
            rows = (dy.float() * (u if ctx.offset else u.to(x.dtype).float())).reshape(-1, x.shape[-1])
            dw = pairwise_sum(rows, 0).to(weight.dtype)
        return dx, dw, None, None


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm, ``(x32 / rms(x32) * (1 + w32)).to(x.dtype)``: the offset weight in fp32, one rounding.

    With ``residual``: ``(gemma_rms_norm(x + residual), x + residual)``, like :func:`rms_norm`.
    """
    if residual is not None:
        summed = x + residual
        return gemma_rms_norm(summed, weight, eps), summed
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps, True)
    return _gemma_rms_norm(x, weight, eps)


def _gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 / _rms(x32, eps)).mul_(weight.float() + 1.0).to(x.dtype)


def gemma_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF's ``Gemma2RMSNorm`` with stock torch ops (fp64 throughout for fp64 input)."""
    if residual is not None:
        summed = x + residual
        return gemma_rms_norm_reference(summed, weight, eps), summed
    y = _normalized_reference(x, eps)
    return (y * (1.0 + weight.to(y.dtype))).to(x.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The HF module's formula with stock torch ops (fp64 throughout for fp64 input)."""
    if residual is not None:
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    return weight * _normalized_reference(x, eps).to(x.dtype)


def _normalized_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` in fp32 (fp64 for fp64 input), as HF's norms compute it."""
    xw = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
