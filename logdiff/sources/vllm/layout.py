"""Discover how an engine op lays data out, by running the op on a known pattern.

vLLM's CPU build stores some tensors in private layouts: the paged KV cache
(K transposed inside each block and head slab, in an ISA-dependent way) and the
prepacked MoE expert weights (a grouped-GEMM tiling). Hard-coding those layouts
would silently break with the next vLLM release or on another ISA. Instead we
run the engine's *own* write/pack op on a tensor whose elements encode their
source index, and read back where every source element landed.

The encoding has to survive the op exactly in a 16-bit float: an index is
written in base-256 digits, one op call per digit, each digit stored as
``digit + 1`` (integers 1..256 are exact in bf16, fp16 and fp32). A zero in the
output marks an element the op did not fill from the source (padding, or
another tensor's region). The result is checked to be a bijection between the
source elements and the filled output elements, so a layout that is not a pure
permutation raises instead of being half-understood.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BASE = 256


def discover_permutation(
    transform: Callable[[Any], Any],
    source_shape: tuple[int, ...],
    dtype: Any,
) -> Any:
    """For every element of ``transform``'s output, the flat source index it holds, or -1.

    ``transform(src)`` must take a tensor of ``source_shape``/``dtype`` and return
    a fresh output tensor (zero-filled wherever the op writes nothing) that
    places source elements without arithmetic. Returns an int64 tensor shaped
    like the output.
    """
    import torch

    n = 1
    for s in source_shape:
        n *= s
    flat_index = torch.arange(n, dtype=torch.int64)
    decoded = None
    written = None
    scale = 1
    remaining = flat_index.clone()
    passes = 0
    while passes == 0 or int(remaining.max()) > 0:
        digit = remaining % BASE
        remaining = remaining // BASE
        out = transform((digit + 1).to(dtype).reshape(source_shape))
        value = out.to(torch.float32).round().to(torch.int64)
        if decoded is None:
            decoded = torch.zeros_like(value)
            written = value > 0
        elif not torch.equal(written, value > 0):
            raise RuntimeError("layout discovery: the op filled different elements on different passes")
        decoded += (value - 1).clamp(min=0) * scale
        scale *= BASE
        passes += 1
    assert decoded is not None and written is not None
    decoded = torch.where(written, decoded, torch.full_like(decoded, -1))
    hits = decoded[written]
    if hits.numel() != n or not torch.equal(torch.sort(hits).values, flat_index):
        raise RuntimeError(
            f"layout discovery: the op is not a permutation of its {n} source elements "
            f"({hits.numel()} output elements filled)"
        )
    return decoded


def inverse_gather_index(source_of: Any, n_source: int) -> Any:
    """Invert ``discover_permutation``: for every source index, the flat output position holding it."""
    import torch

    flat = source_of.reshape(-1)
    positions = torch.nonzero(flat >= 0).squeeze(1)
    gather = torch.empty(n_source, dtype=torch.int64)
    gather[flat[positions]] = positions
    return gather
