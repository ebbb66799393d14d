"""Batch-invariant logit soft-capping, ``cap * tanh(x / cap)`` (Gemma 2's attention and final logits).

In fp32 (fp64 for fp64 input), rounded once to ``x.dtype``. ``torch.tanh`` has
the vector-body/scalar-tail problem of every transcendental op (a row's bits
would depend on where it sits in the batch), so the tanh is
:func:`fixed_order.tanh`, whose bits depend on each element's value alone.
HF soft-caps in the model dtype (three roundings: divide, tanh, multiply) and
vLLM's logits processor likewise; under consistent mode both call this.
"""

from __future__ import annotations

import torch

from .fixed_order import tanh


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` elementwise, fp32 inside, one rounding to ``x.dtype``."""
    if x.dtype == torch.float64:
        return cap * torch.tanh(x / cap)
    return tanh(x.float() / cap).mul_(cap).to(x.dtype)


def softcap_reference(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * torch.tanh(x / cap)`` in fp32 (fp64 for fp64 input), rounded once."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (cap * torch.tanh(x.to(dtype) / cap)).to(x.dtype)
