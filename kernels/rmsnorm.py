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
"""

from __future__ import annotations

import torch

from .fixed_order import halving_sum


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual`` returns ``(norm(x + residual), x + residual)``."""
    if residual is not None:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed
    x32 = x.float()
    mean_sq = halving_sum(x32 * x32, -1).div_(x.shape[-1])
    rms = torch.sqrt(mean_sq.add_(eps))
    return weight * (x32 / rms.unsqueeze(-1)).to(x.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The HF module's formula with stock torch ops (fp64 throughout for fp64 input)."""
    if residual is not None:
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xw = x.to(dtype)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
