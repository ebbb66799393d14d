"""attention with a sliding window: the same invariance as without one, and the window really hides keys."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import KERNELS, attention, attention_batched, attention_reference

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}["attention"]
WINDOWS = [1, 8, 16, 23]  # one key, within a block, a whole block, across blocks


def _qkv(gen, s=70, hq=6, hkv=2, d=32, dtype=torch.float32):
    q = torch.randn(s, hq, d, generator=gen)
    k = torch.randn(s, hkv, d, generator=gen)
    v = torch.randn(s, hkv, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_prefill_equals_chunked_prefill_equals_decode_steps(gen, dtype, window):
    q, k, v = _qkv(gen, dtype=dtype)
    s, scale = q.shape[0], q.shape[-1] ** -0.5
    pos = torch.arange(s)
    full = attention(q, k, v, pos, scale, window=window)
    for splits in ((0, 1, 16, 17, 40, s), (0, 33, s), (0, 15, 16, 31, 32, 48, s)):
        chunked = torch.cat(
            [attention(q[a:b], k[:b], v[:b], pos[a:b], scale, window=window) for a, b in zip(splits, splits[1:])]
        )
        assert torch.equal(full, chunked), splits
    decode = torch.cat(
        [attention(q[i : i + 1], k[: i + 1], v[: i + 1], pos[i : i + 1], scale, window=window) for i in range(s)]
    )
    assert torch.equal(full, decode)


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_before_the_window_may_be_dropped_to_zeros_or_garbage_free(gen, dtype):
    """A cache that dropped the keys before the window (zeros in their place) gives the same bits."""
    q, k, v = _qkv(gen, dtype=dtype)
    window, i = 8, 50
    full = attention(q, k, v, torch.arange(70), 0.2, window=window)
    k_cut, v_cut = k[: i + 1].clone(), v[: i + 1].clone()
    k_cut[: i - window + 1] = 0
    v_cut[: i - window + 1] = 0
    assert torch.equal(attention(q[i : i + 1], k_cut, v_cut, torch.tensor([i]), 0.2, window=window), full[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_windowed_batch_with_mixed_lengths_equals_each_sequence_alone(gen, dtype, batch):
    lengths = [5, 70, 17, 33, 1, 64, 16, 49][:batch]
    s_max, window = max(lengths), 12
    q = torch.randn(batch, s_max, 4, 16, generator=gen).to(dtype)
    k = torch.randn(batch, s_max, 1, 16, generator=gen).to(dtype)
    v = torch.randn(batch, s_max, 1, 16, generator=gen).to(dtype)
    pos = torch.arange(s_max).expand(batch, s_max).clone()
    for i, n in enumerate(lengths):
        pos[i, n:] = -1
    out = attention_batched(q, k, v, pos, 0.25, torch.tensor(lengths), window=window)
    for i, n in enumerate(lengths):
        alone = attention(q[i, :n], k[i, :n], v[i, :n], torch.arange(n), 0.25, window=window)
        assert torch.equal(out[i, :n], alone), (i, n)
        assert torch.equal(out[i, n:], torch.zeros_like(out[i, n:]))
    # the decode steps of a batch (one query per sequence, each at its last position) agree too
    q_last = torch.stack([q[i, n - 1 : n] for i, n in enumerate(lengths)])
    kv_lens = torch.tensor(lengths)
    last = attention_batched(q_last, k, v, kv_lens[:, None] - 1, 0.25, kv_lens, window=window)
    for i, n in enumerate(lengths):
        assert torch.equal(last[i, 0], out[i, n - 1])


@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_attention_is_close_to_the_reference(gen, window):
    q, k, v = _qkv(gen)
    pos = torch.arange(q.shape[0])
    ref = attention_reference(q.double(), k.double(), v.double(), pos, 0.125, window=window)
    got = attention(q, k, v, pos, 0.125, window=window).double()
    assert (got - ref).abs().max() / ref.abs().max() <= BOUND


def test_window_one_is_the_value_at_the_query_itself(gen):
    q, k, v = _qkv(gen, hq=2, hkv=2)
    out = attention(q, k, v, torch.arange(q.shape[0]), 0.125, window=1)
    assert torch.equal(out, v)


def test_negative_control_the_window_changes_what_a_query_sees(gen):
    """Without the window a late query reads keys the window hides; and the reference agrees on which."""
    q, k, v = _qkv(gen)
    pos = torch.arange(q.shape[0])
    windowed, causal = attention(q, k, v, pos, 0.125, window=8), attention(q, k, v, pos, 0.125)
    assert torch.equal(windowed[:8], causal[:8])  # the first 8 queries see every earlier key either way
    assert not torch.equal(windowed[8:], causal[8:])
    k_far = k.clone()
    k_far[:40] += 5.0  # keys far behind query 60 (outside its window) changed: its output does not move
    assert torch.equal(attention(q, k_far, v, pos, 0.125, window=8)[60], windowed[60])
    assert not torch.equal(attention(q, k_far, v, pos, 0.125)[60], causal[60])


def test_window_must_be_positive(gen):
    q, k, v = _qkv(gen, s=8)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, torch.arange(8), 0.125, window=0)


@pytest.mark.parametrize("window", [1, 8, 23])
def test_windowed_gradients_agree_with_fp64_autograd_of_the_reference(gen, window):
    q, k, v = _qkv(gen, s=40, hq=4, hkv=2, d=16)
    dy = torch.randn(q.shape, generator=gen)
    pos = torch.arange(40)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = torch.autograd.grad(attention(*leaves, pos, 0.3, window=window), leaves, dy)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_reference(*ref_leaves, pos, 0.3, window=window), ref_leaves, dy.double())
    for got, want in zip(ours, ref):
        assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    k_far = k.clone().requires_grad_()
    dk = torch.autograd.grad(attention(q, k_far, v, pos, 0.3, window=window)[-1:].sum(), k_far)[0]
    assert torch.equal(dk[: 40 - window], torch.zeros_like(dk[: 40 - window]))  # keys outside the last query's window


@pytest.mark.parametrize("dtype", DTYPES)
def test_windowed_query_gradients_are_the_same_in_prefill_and_in_decode_steps(gen, dtype):
    q, k, v = _qkv(gen, s=37, hq=4, hkv=2, d=16, dtype=dtype)
    dy = torch.randn(q.shape, generator=gen).to(dtype)
    pos = torch.arange(37)

    def dq(rows: slice, kv: int) -> torch.Tensor:
        leaf = q[rows].clone().requires_grad_()
        out = attention(leaf, k[:kv], v[:kv], pos[rows], 0.3, window=8)
        return torch.autograd.grad(out, leaf, dy[rows])[0]

    prefill = dq(slice(0, 37), 37)
    for step in (0, 9, 16, 36):
        assert torch.equal(dq(slice(step, step + 1), step + 1), prefill[step : step + 1]), step
