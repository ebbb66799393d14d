"""The kernels keep nothing between calls, except inside a ``kernel_caches()`` block that owns it."""

from __future__ import annotations

import torch

from logdiff.kernels import attention, kernel_caches, linear, rope
from logdiff.kernels.caches import active


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.randn(100, 64, generator=gen).bfloat16()  # 100 columns: padded to a whole N tile, so prepared
    return [x, w, *(torch.randn(12, 2, 16, generator=gen) for _ in range(3))]


def _run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    x, w, q, k, v = inputs
    pos = torch.arange(12)
    return [linear(x, w), rope(q, pos, 1e4), attention(q, k, v, pos, 0.25)]


def test_outside_a_block_nothing_is_cached() -> None:
    assert active() is None
    _run(_inputs(0))
    assert active() is None


def test_a_block_owns_its_caches_and_nested_blocks_share_them() -> None:
    inputs = _inputs(0)  # alive for the whole test: a dead weight's prepared copy is dropped
    with kernel_caches() as outer:
        _run(inputs)
        assert outer.weights and outer.rope_tables and outer.attention_layout is not None
        with kernel_caches() as inner:
            assert inner is outer
    assert active() is None
    with kernel_caches() as fresh:
        assert fresh is not outer and not fresh.weights and not fresh.rope_tables


def test_caching_changes_no_bits() -> None:
    inputs = _inputs(1)
    plain = _run(inputs)
    with kernel_caches() as caches:
        first = _run(inputs)
        assert caches.weights
        again = _run(inputs)  # served from the caches
    for a, b, c in zip(plain, first, again):
        assert torch.equal(a, b) and torch.equal(a, c)
