"""What the kernels may remember between calls, owned by the block that asked for it.

The kernels are pure functions: called alone, they keep nothing. Repeated work
between calls (a weight widened and column-padded for the fixed-tile GEMM, whether
the BLAS gives wide row tiles the bits of narrow ones, the RoPE cos/sin table, the
attention mask layout that every layer of one forward shares) is cached only inside ``kernel_caches()``, in a ``KernelCaches`` object
that the block creates and drops on exit. The block is found through a
``ContextVar``, the way ``torch.no_grad()`` is: nested blocks share the outer
one's caches, and code outside every block (or on another thread) sees none.

Caching never changes a result: every cached value is a pure function of its
key, and every kernel computes the same bits with or without it. A prepared
weight's key holds the tensor's version counter, which in-place updates bump,
except a fused optimizer's: ``torch.optim.AdamW(fused=True)`` (HF Trainer's
default ``adamw_torch_fused``) writes the parameters without bumping it. So a
block also drops the prepared copies of every parameter an optimizer steps
(``torch.optim``'s global step hook, removed with the block): a training step's
next forward sees the new weights whatever optimizer made them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KernelCaches:
    """The caches of one ``kernel_caches()`` block."""

    weights: dict[int, tuple[Any, tuple, Any]] = field(default_factory=dict)  # id -> (weakref, key, prepared)
    rope_tables: dict[tuple[Any, str], tuple[Any, Any]] = field(default_factory=dict)  # (RopeParams, device) -> (cos, sin)
    attention_layout: tuple[tuple, Any] | None = None  # (key, layout) of the last call
    wide_tiles: dict[tuple, bool] = field(default_factory=dict)  # GEMM shape -> wide row tiles give the narrow bits
    int8_weights: dict[int, tuple[Any, tuple, Any]] = field(default_factory=dict)  # id -> (weakref, key, (q, scale))


_ACTIVE: ContextVar[KernelCaches | None] = ContextVar("logdiff_kernel_caches", default=None)


@contextlib.contextmanager
def kernel_caches() -> Iterator[KernelCaches]:
    """Let the kernels cache prepared weights, RoPE tables and attention layouts inside the block."""
    outer = _ACTIVE.get()
    if outer is not None:
        yield outer
        return
    caches = KernelCaches()
    token = _ACTIVE.set(caches)
    stepped = _forget_stepped_parameters(caches)
    try:
        yield caches
    finally:
        stepped.remove()
        _ACTIVE.reset(token)


def _forget_stepped_parameters(caches: KernelCaches) -> Any:
    """A global optimizer step hook dropping the prepared copies of the parameters each step updated."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def forget(optimizer: Any, *_: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                caches.weights.pop(id(p), None)
                caches.int8_weights.pop(id(p), None)

    return register_optimizer_step_post_hook(forget)


def active() -> KernelCaches | None:
    """The caches of the innermost open block, or None (then nothing is cached)."""
    return _ACTIVE.get()
