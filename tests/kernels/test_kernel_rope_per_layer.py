"""rope with a base per layer (Gemma 3's local and global layers): each base keeps its own table and bits."""

from __future__ import annotations

import torch

from logdiff.kernels import kernel_caches, rope, rope_reference

LOCAL, GLOBAL = 10_000.0, 1_000_000.0


def test_interleaved_bases_give_the_bits_of_each_base_alone(gen):
    """Layers alternating two bases in one forward (one cache scope) rotate as if each ran alone."""
    x = torch.randn(40, 4, 64, generator=gen).to(torch.bfloat16)
    pos = torch.arange(40)
    with kernel_caches():
        alone_local = rope(x, pos, LOCAL)
    with kernel_caches():
        alone_global = rope(x, pos, GLOBAL)
    with kernel_caches():
        for _ in range(2):  # sliding, full, sliding, full
            assert torch.equal(rope(x, pos, LOCAL), alone_local)
            assert torch.equal(rope(x[:7], pos[:7], GLOBAL), alone_global[:7])  # a shorter call first grows less
            assert torch.equal(rope(x, pos, GLOBAL), alone_global)


def test_negative_control_the_bases_differ_and_each_matches_its_reference(gen):
    x = torch.randn(40, 4, 64, generator=gen)
    pos = torch.arange(40)
    local, glob = rope(x, pos, LOCAL), rope(x, pos, GLOBAL)
    assert not torch.equal(local[1:], glob[1:])  # position 0 is the identity under any base
    assert torch.equal(local[0], glob[0])
    for theta, got in ((LOCAL, local), (GLOBAL, glob)):
        assert (got.double() - rope_reference(x.double(), pos, theta).double()).abs().max() < 1e-5
