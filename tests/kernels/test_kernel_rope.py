"""rope: a position's rotation does not depend on the call; one table for every caller."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import KERNELS, rope, rope_apply, rope_cos_sin, rope_reference
from logdiff.kernels.rope import RopeParams, block_positions, table_block

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}["rope"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_prefill_chunks_and_decode_steps_agree(gen, dtype, style):
    x = torch.randn(50, 4, 32, generator=gen).to(dtype)
    pos = torch.arange(50)
    full = rope(x, pos, 1e6, style)
    chunks = torch.cat([rope(x[a:b], pos[a:b], 1e6, style) for a, b in ((0, 1), (1, 17), (17, 50))])
    steps = torch.cat([rope(x[i : i + 1], pos[i : i + 1], 1e6, style) for i in range(50)])
    assert torch.equal(full, chunks) and torch.equal(full, steps)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_leading_dims_equal_single_sequences(gen, batch):
    x = torch.randn(batch, 9, 2, 16, generator=gen).bfloat16()
    pos = torch.arange(100, 109)
    out = rope(x, pos, 1e4)
    for b in range(batch):
        assert torch.equal(out[b], rope(x[b], pos, 1e4))


def test_table_entries_do_not_depend_on_how_the_table_grew():
    theta, dim = 12345.0, 48  # a fresh table key
    late = rope_cos_sin(torch.tensor([3000]), theta, dim)  # grows the table to 3001 positions at once
    rows = block_positions(dim // 2)
    block = table_block(3000 // rows, RopeParams(theta, dim), torch.device("cpu"))
    assert torch.equal(late[0][0], block[0][3000 % rows]) and torch.equal(late[1][0], block[1][3000 % rows])


def test_rope_apply_with_looked_up_cos_sin_equals_rope(gen):
    x = torch.randn(2, 4, 7, 32, generator=gen).bfloat16()  # HF layout [B, H, T, D]
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]])
    cos, sin = rope_cos_sin(pos, 1e4, 32)
    out = rope_apply(x, cos[:, None], sin[:, None])
    for b in range(2):
        assert torch.equal(out[b], rope(x[b].transpose(0, 1), pos[b], 1e4).transpose(0, 1))


def test_partial_rotary_dim_passes_the_rest_through(gen):
    x = torch.randn(5, 2, 32, generator=gen)
    out = rope(x, torch.arange(5), 1e4, rotary_dim=16)
    assert torch.equal(out[..., 16:], x[..., 16:])
    assert torch.equal(out[..., :16], rope(x[..., :16].contiguous(), torch.arange(5), 1e4))


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_error_against_fp64_is_within_the_stated_bound(gen, style):
    x = torch.randn(300, 2, 64, generator=gen)
    pos = torch.arange(0, 3000, 10)
    ref = rope_reference(x.double(), pos, 1e6, style)
    assert (rope(x, pos, 1e6, style).double() - ref).abs().max() / ref.abs().max() <= BOUND


def test_bf16_is_one_rounding_of_the_fp32_rotation(gen):
    x = torch.randn(64, 2, 64, generator=gen).bfloat16()
    pos = torch.arange(64)
    assert torch.equal(rope(x, pos, 1e4), rope(x.float(), pos, 1e4).bfloat16())
