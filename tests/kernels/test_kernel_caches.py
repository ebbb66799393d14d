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



def test_a_fused_optimizer_step_is_seen_though_it_leaves_the_version_counter() -> None:
    """``AdamW(fused=True)`` (HF Trainer's default) updates a parameter in place without bumping its version
    counter (the negative control), so the prepared copy keyed by it would stay stale: the block drops the
    prepared copies of every parameter an optimizer steps, and the next call computes with the new weights."""
    x, w, *_ = _inputs(0)
    param = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, fused=True)
    with kernel_caches() as caches:
        before = linear(x, param.detach())
        linear(x, param)
        assert id(param) in caches.weights
        param.grad = torch.ones_like(param)
        version = param._version
        opt.step()
        assert param._version == version  # the fused step leaves the version counter: no key would change
        assert id(param) not in caches.weights
        after = linear(x, param)
        assert not torch.equal(after, before) and torch.equal(after, linear(x, param.detach().clone()))
    with kernel_caches():
        pass
    opt.step()  # outside every block: the hook went with its block
