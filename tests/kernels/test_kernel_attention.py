"""attention: a query's output is the same in full prefill, chunked prefill, decode and any batch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from logdiff.kernels import KERNELS, attention, attention_batched, attention_reference

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}["attention"]


def _qkv(gen, s=70, hq=6, hkv=2, d=32, dtype=torch.float32):
    q = torch.randn(s, hq, d, generator=gen)
    k = torch.randn(s, hkv, d, generator=gen)
    v = torch.randn(s, hkv, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_prefill_equals_chunked_prefill_equals_decode_steps(gen, dtype):
    q, k, v = _qkv(gen, dtype=dtype)
    s, scale = q.shape[0], q.shape[-1] ** -0.5
    pos = torch.arange(s)
    full = attention(q, k, v, pos, scale)
    for splits in ((0, 1, 16, 17, 40, s), (0, 33, s), (0, 15, 16, 31, 32, 48, s)):
        chunked = torch.cat(
            [attention(q[a:b], k[:b], v[:b], pos[a:b], scale) for a, b in zip(splits, splits[1:], strict=False)]
        )
        assert torch.equal(full, chunked), splits
    decode = torch.cat([attention(q[i : i + 1], k[: i + 1], v[: i + 1], pos[i : i + 1], scale) for i in range(s)])
    assert torch.equal(full, decode)


@pytest.mark.parametrize("d", [4, 8, 15])
def test_narrow_heads_prefill_equals_every_decode_step(gen, d):
    """Head dims whose value GEMM would be narrower than 16 columns: padded (``VALUE_WIDTH_MIN``), every step
    of a decode gives the prefill's bits (unpadded, D = 8 failed at steps 5, 9, 11, ... on an AVX2 CPU)."""
    q, k, v = _qkv(gen, s=40, d=d)
    pos = torch.arange(40)
    full = attention(q, k, v, pos, d**-0.5)
    for i in range(40):
        assert torch.equal(attention(q[i : i + 1], k[: i + 1], v[: i + 1], pos[i : i + 1], d**-0.5), full[i : i + 1]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_against_a_longer_cache_buffer_with_kv_len(gen, dtype):
    q, k, v = _qkv(gen, dtype=dtype)
    pos = torch.arange(q.shape[0])
    full = attention(q, k, v, pos, 0.2)
    # a preallocated cache: garbage after kv_len must not matter
    k_buf = torch.cat([k[:30], torch.randn(20, *k.shape[1:], generator=gen).to(dtype)])
    v_buf = torch.cat([v[:30], torch.randn(20, *v.shape[1:], generator=gen).to(dtype)])
    assert torch.equal(attention(q[29:30], k_buf, v_buf, pos[29:30], 0.2, kv_len=30), full[29:30])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_mixed_lengths_equal_each_sequence_alone(gen, dtype, batch):
    lengths = [5, 70, 17, 33, 1, 64, 16, 49][:batch]
    s_max = max(lengths)
    q = torch.randn(batch, s_max, 4, 16, generator=gen).to(dtype)
    k = torch.randn(batch, s_max, 1, 16, generator=gen).to(dtype)
    v = torch.randn(batch, s_max, 1, 16, generator=gen).to(dtype)
    pos = torch.arange(s_max).expand(batch, s_max).clone()
    for i, n in enumerate(lengths):
        pos[i, n:] = -1  # right padding: no query
    out = attention_batched(q, k, v, pos, 0.25, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        alone = attention(q[i, :n], k[i, :n], v[i, :n], torch.arange(n), 0.25)
        assert torch.equal(out[i, :n], alone)
        assert not out[i, n:].any()  # padding queries give zeros


def test_decode_batch_of_sequences_at_different_positions(gen):
    """One decode step for 3 sequences with different cache lengths equals each alone."""
    q, k, v = _qkv(gen, s=60, dtype=torch.bfloat16)
    lengths = [7, 60, 31]
    qb = torch.stack([q[n - 1 : n] for n in lengths])  # [3, 1, Hq, D]
    kb = torch.zeros(3, 60, *k.shape[1:], dtype=k.dtype)
    vb = torch.zeros_like(kb)
    for i, n in enumerate(lengths):
        kb[i, :n], vb[i, :n] = k[:n], v[:n]
    out = attention_batched(qb, kb, vb, torch.tensor(lengths)[:, None] - 1, 0.2, torch.tensor(lengths))
    full = attention(q, k, v, torch.arange(60), 0.2)
    for i, n in enumerate(lengths):
        assert torch.equal(out[i, 0], full[n - 1])


def test_memory_grouping_does_not_change_bits(gen, monkeypatch):
    q, k, v = _qkv(gen, s=70)
    pos = torch.arange(70)
    whole = attention(q, k, v, pos, 0.2)
    monkeypatch.setattr(sys.modules["logdiff.kernels.attention_tiles"], "MAX_TILE_ELEMENTS", 1)
    assert torch.equal(attention(q, k, v, pos, 0.2), whole)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_error_against_fp64_is_within_the_stated_bound(gen, hq, hkv):
    q, k, v = _qkv(gen, s=90, hq=hq, hkv=hkv, d=64)
    q = q * 3  # peaked attention
    pos = torch.arange(90)
    ref = attention_reference(q.double(), k.double(), v.double(), pos, 0.125)
    assert (attention(q, k, v, pos, 0.125).double() - ref).abs().max() / ref.abs().max() <= BOUND


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_stock_sdpa_prefill_differs_from_decode(gen, dtype, stock_varies):
    q, k, v = (t.transpose(0, 1)[None] for t in _qkv(gen, s=40, hq=4, hkv=4, dtype=dtype))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    steps = torch.cat(
        [F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in range(40)], 2
    )
    stock_varies(torch.equal(full, steps), "stock SDPA is prefill/decode-invariant here")
