"""attention with sinks (gpt-oss): the same invariance as without, and the sinks really take probability mass."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import attention, attention_batched, attention_reference

DTYPES = [torch.float32, torch.bfloat16]


def _qkv(gen, s=70, hq=6, hkv=2, d=32, dtype=torch.float32):
    q = torch.randn(s, hq, d, generator=gen)
    k = torch.randn(s, hkv, d, generator=gen)
    v = torch.randn(s, hkv, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _sinks(gen, hq=6, dtype=torch.float32):
    return (torch.randn(hq, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 8])
def test_prefill_equals_chunked_prefill_equals_decode_steps(gen, dtype, window):
    q, k, v = _qkv(gen, dtype=dtype)
    sinks = _sinks(gen, dtype=dtype)
    s, scale = q.shape[0], q.shape[-1] ** -0.5
    pos = torch.arange(s)
    full = attention(q, k, v, pos, scale, window=window, sinks=sinks)
    for splits in ((0, 1, 16, 17, 40, s), (0, 33, s)):
        chunked = torch.cat(
            [attention(q[a:b], k[:b], v[:b], pos[a:b], scale, window=window, sinks=sinks)
             for a, b in zip(splits, splits[1:])]  # fmt: skip
        )
        assert torch.equal(full, chunked), splits
    decode = torch.cat(
        [attention(q[i : i + 1], k[: i + 1], v[: i + 1], pos[i : i + 1], scale, window=window, sinks=sinks)
         for i in range(s)]  # fmt: skip
    )
    assert torch.equal(full, decode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_with_mixed_lengths_equals_each_sequence_alone(gen, dtype, batch):
    lengths = [5, 70, 17, 33, 1, 64, 16, 49][:batch]
    s_max = max(lengths)
    q = torch.randn(batch, s_max, 4, 16, generator=gen).to(dtype)
    k = torch.randn(batch, s_max, 2, 16, generator=gen).to(dtype)
    v = torch.randn(batch, s_max, 2, 16, generator=gen).to(dtype)
    sinks = _sinks(gen, 4, dtype)
    pos = torch.arange(s_max).expand(batch, s_max).clone()
    for b, n in enumerate(lengths):
        pos[b, n:] = -1
    out = attention_batched(q, k, v, pos, 0.25, torch.tensor(lengths), window=12, sinks=sinks)
    for b, n in enumerate(lengths):
        alone = attention(q[b, :n], k[b, :n], v[b, :n], pos[b, :n], 0.25, window=12, sinks=sinks)
        assert torch.equal(out[b, :n], alone), (b, n)
        assert not out[b, n:].any()  # padding rows give zeros


def test_matches_the_fp64_reference_and_hfs_concatenated_column(gen):
    q, k, v = _qkv(gen, dtype=torch.float64)
    sinks = _sinks(gen, dtype=torch.float64)
    pos = torch.arange(q.shape[0])
    ref = attention_reference(q, k, v, pos, 0.2, window=8, sinks=sinks)
    mine = attention(q.float(), k.float(), v.float(), pos, 0.2, window=8, sinks=sinks.float()).double()
    assert (mine - ref).abs().max() < 1e-5
    # the reference is HF's formula: the sink as one more column of the softmax, dropped afterwards
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1)) * 0.2
    visible = (torch.arange(70)[None] <= pos[:, None]) & (torch.arange(70)[None] > pos[:, None] - 8)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(torch.cat([scores, sinks[:, None, None].expand(-1, 70, 1)], -1), -1)[..., :-1]
    assert torch.allclose(torch.einsum("hts,shd->thd", probs, v.repeat_interleave(g, 1)), ref)


def test_sinks_change_the_output_and_a_huge_sink_silences_the_head(gen):
    """Negative control: the sink is not ignored; a sink far above every score leaves the head ~zero."""
    q, k, v = _qkv(gen)
    pos = torch.arange(q.shape[0])
    plain = attention(q, k, v, pos, 0.2)
    low = attention(q, k, v, pos, 0.2, sinks=torch.full((6,), -1e4))
    assert torch.equal(plain, low)  # exp(-1e4 - max) is an exact 0 in fp32: the same bits as no sink
    sinks = torch.full((6,), -1e4)
    sinks[1] = 1e4
    out = attention(q, k, v, pos, 0.2, sinks=sinks)
    assert out[:, 1].abs().max() == 0 and torch.equal(out[:, [0, *range(2, 6)]], plain[:, [0, *range(2, 6)]])
    assert not torch.equal(attention(q, k, v, pos, 0.2, sinks=torch.zeros(6)), plain)


def test_wrong_sink_shape_is_refused(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(ValueError, match="one logit per query head"):
        attention(q, k, v, torch.arange(70), 0.2, sinks=torch.zeros(2))
