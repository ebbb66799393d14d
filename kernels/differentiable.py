"""When a kernel takes its differentiable path.

Every kernel has one forward implementation. Called where autograd would
record it (grad mode on and some tensor input requiring grad), the kernel runs
that forward inside its ``torch.autograd.Function``, whose ``backward`` is
written with the same fixed-tile / fixed-order discipline (see
``docs/kernels.md``, "Backward passes"). Otherwise (``torch.no_grad()``,
``inference_mode()``, inputs without grad: every inference call) it runs the
forward directly, exactly as before backward passes existed.
"""

from __future__ import annotations

import torch


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd would record an op on ``tensors`` (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
