"""MLA (DeepSeek-V2/V3): attention with v heads narrower than q/k heads, and attention from the cached latent.

``kernels.latent_attention`` up-projects the cached latent with the ``linear``
kernel and runs the attention kernel on q/k heads of ``qk_nope + qk_rope`` and v
heads of ``v_head_dim``. A query's output must have the same bits in a full
prefill, in decode steps (which up-project the whole cache again), alone or in
any padded batch; and be close to a plain-torch reference. Controls: the
absorbed decode vLLM runs (``kv_b_proj`` folded into the query and output) is
another association of the same products and does not give these bits, and
stock ``F.linear`` on one row vs many is checked where the CPU lets it vary.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from logdiff.kernels import KERNELS, attention, attention_batched, attention_reference
from logdiff.kernels.mla import latent_attention, latent_attention_reference, latent_kv

BOUND = {k.name: k.bound for k in KERNELS}["attention"]
DTYPES = [torch.float32, torch.bfloat16]
HEADS, RANK, NOPE, ROPE, V = 4, 96, 32, 16, 24  # the real model: 512, 128, 64, 128 (vLLM's tests run those)


def _qkv(gen, s=45, hq=4, hkv=2, d=48, dv=32, dtype=torch.float32):
    return tuple(torch.randn(s, h, n, generator=gen).to(dtype) for h, n in ((hq, d), (hkv, d), (hkv, dv)))


def _mla(gen, s=45, batch=None, dtype=torch.float32):
    lead = () if batch is None else (batch,)
    q = torch.randn(*lead, s, HEADS, NOPE + ROPE, generator=gen).to(dtype)
    latent = torch.randn(*lead, s, RANK, generator=gen).to(dtype)
    k_pe = torch.randn(*lead, s, ROPE, generator=gen).to(dtype)
    w = (torch.randn(HEADS * (NOPE + V), RANK, generator=gen) / RANK**0.5).to(dtype)
    return q, latent, k_pe, w


def _one(q, latent, k_pe, w, positions, scale=0.15):
    """latent_attention on one sequence, through the batched entry point."""
    kv_len = torch.tensor([latent.shape[0]])
    return latent_attention(q[None], latent[None], k_pe[None], w, positions[None], scale, kv_len, V)[0]


# ----------------------------------------------------------------------------- attention, Dv != D


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dv", [32, 80])  # narrower and wider than the 48-wide q/k heads
def test_v_head_dim_other_than_qk_prefill_equals_chunks_and_decode_steps(gen, dtype, dv):
    q, k, v = _qkv(gen, dv=dv, dtype=dtype)
    s, pos = q.shape[0], torch.arange(q.shape[0])
    full = attention(q, k, v, pos, 0.2)
    assert full.shape == (s, 4, dv)
    chunked = torch.cat([attention(q[a:b], k[:b], v[:b], pos[a:b], 0.2) for a, b in ((0, 17), (17, 33), (33, s))])
    decode = torch.cat([attention(q[i : i + 1], k[: i + 1], v[: i + 1], pos[i : i + 1], 0.2) for i in range(s)])
    assert torch.equal(full, chunked) and torch.equal(full, decode)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v_head_dim_other_than_qk_in_a_padded_batch_equals_each_sequence_alone(gen, dtype):
    lengths = [5, 45, 17, 1]
    q = torch.randn(4, 45, 4, 48, generator=gen).to(dtype)
    k = torch.randn(4, 45, 2, 48, generator=gen).to(dtype)
    v = torch.randn(4, 45, 2, 32, generator=gen).to(dtype)
    pos = torch.arange(45).expand(4, 45).clone()
    for i, n in enumerate(lengths):
        pos[i, n:] = -1
    out = attention_batched(q, k, v, pos, 0.2, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        alone = attention(q[i, :n], k[i, :n], v[i, :n], torch.arange(n), 0.2)
        assert torch.equal(out[i, :n], alone), i
        assert not out[i, n:].any()


@pytest.mark.parametrize("dv", [32, 80])
def test_v_head_dim_other_than_qk_is_within_the_bound_of_fp64(gen, dv):
    q, k, v = _qkv(gen, s=70, dv=dv)
    pos = torch.arange(70)
    ref = attention_reference(q.double() * 3, k.double(), v.double(), pos, 0.125)
    ours = attention(q * 3, k, v, pos, 0.125).double()
    assert (ours - ref).abs().max() / ref.abs().max() <= BOUND


def test_v_head_dim_other_than_qk_backward():
    """gradcheck in fp64 (padding, GQA, Dv != D); the v gradient has v's shape."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 5, 4, 6), (2, 5, 2, 6), (2, 5, 2, 3))
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes)
    positions, kv_lens = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]), torch.tensor([5, 3])
    fn = lambda *a: attention_batched(*a, positions, 0.5, kv_lens)  # noqa: E731
    # the kernel computes in fp32 even for fp64 input: the numerical Jacobian has fp32 noise
    assert gradcheck(fn, (q, k, v), fast_mode=True, eps=1e-3, atol=1e-3, rtol=1e-3)
    dy = torch.randn(2, 5, 4, 3, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), dy)
    assert [tuple(g.shape) for g in grads] == [tuple(s) for s in shapes]
    for i, n in enumerate((5, 3)):  # each sequence against fp64 autograd of the reference
        leaves = [t[i, :n].detach().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(attention_reference(*leaves, torch.arange(n), 0.5), leaves, dy[i, :n])
        for g, r in zip(grads, ref, strict=True):
            assert (g[i, :n] - r).abs().max() <= 1e-5 * r.abs().max()


# ----------------------------------------------------------------------------- attention from the latent


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_is_the_up_projection_then_the_attention_kernel(gen, dtype):
    q, latent, k_pe, w = _mla(gen, batch=2, dtype=dtype)
    pos, kv_lens = torch.arange(45).expand(2, 45), torch.tensor([45, 45])
    k, v = latent_kv(latent, k_pe, w, NOPE, V)
    assert k.shape == (2, 45, HEADS, NOPE + ROPE) and v.shape == (2, 45, HEADS, V)
    assert torch.equal(k[..., NOPE:], k_pe[:, :, None].expand(-1, -1, HEADS, -1))  # the shared RoPE key, copied
    expected = attention_batched(q, k, v, pos, 0.15, kv_lens)
    assert torch.equal(latent_attention(q, latent, k_pe, w, pos, 0.15, kv_lens, V), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_prefill_equals_decode_steps_over_the_whole_cache(gen, dtype):
    """Decode step i up-projects the i + 1 cached latents again (1..45 rows): every step, the prefill's bits."""
    q, latent, k_pe, w = _mla(gen, dtype=dtype)
    s, pos = q.shape[0], torch.arange(q.shape[0])
    full = _one(q, latent, k_pe, w, pos)
    steps = torch.cat([_one(q[i : i + 1], latent[: i + 1], k_pe[: i + 1], w, pos[i : i + 1]) for i in range(s)])
    assert torch.equal(full, steps)
    chunks = torch.cat([_one(q[a:b], latent[:b], k_pe[:b], w, pos[a:b]) for a, b in ((0, 20), (20, 21), (21, s))])
    assert torch.equal(full, chunks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [2, 3, 5])
def test_latent_attention_in_a_padded_batch_equals_each_sequence_alone(gen, dtype, batch):
    """Mixed prefill lengths and decode rows (one query at the end of its context), zero-padded: rtol=0, atol=0."""
    lengths = [45, 7, 30, 1, 16][:batch]
    queries = [n if i % 2 == 0 else 1 for i, n in enumerate(lengths)]  # odd ones: a decode step
    q, latent, k_pe, w = _mla(gen, batch=batch, dtype=dtype)
    longest_q = max(queries)
    qb = torch.zeros(batch, longest_q, HEADS, NOPE + ROPE, dtype=dtype)
    pos = torch.full((batch, longest_q), -1)
    for i, (n, t) in enumerate(zip(lengths, queries, strict=True)):
        qb[i, :t] = q[i, n - t : n]
        pos[i, :t] = torch.arange(n - t, n)
        latent[i, n:], k_pe[i, n:] = torch.nan, torch.nan  # past kv_len: never read into a visible score
    safe_latent, safe_pe = latent.nan_to_num(0.0), k_pe.nan_to_num(0.0)
    out = latent_attention(qb, safe_latent, safe_pe, w, pos, 0.15, torch.tensor(lengths), V)
    for i, (n, t) in enumerate(zip(lengths, queries, strict=True)):
        alone = _one(q[i, n - t : n], safe_latent[i, :n], safe_pe[i, :n], w, torch.arange(n - t, n))
        assert torch.equal(out[i, :t], alone), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_is_close_to_the_plain_torch_reference(gen, dtype):
    q, latent, k_pe, w = _mla(gen, s=60, dtype=dtype)
    pos = torch.arange(60)
    ref = latent_attention_reference(q.double(), latent.double(), k_pe.double(), w.double(), pos, 0.15, 60, V)
    ours = _one(q, latent, k_pe, w, pos).double()
    # bf16: the up-projection's output is rounded to bf16 before attention (as both engines do)
    bound = BOUND if dtype == torch.float32 else 2**-6
    assert (ours - ref).abs().max() / ref.abs().max() <= bound


def test_negative_control_the_absorbed_decode_does_not_give_these_bits(gen):
    """vLLM's decode: q_nope @ W_UK per head against the latent, then W_UV: the same products, another order."""
    q, latent, k_pe, w = _mla(gen)
    pos = torch.arange(q.shape[0])
    ours = _one(q, latent, k_pe, w, pos)
    w_heads = w.view(HEADS, NOPE + V, RANK)
    w_uk, w_uv = w_heads[:, :NOPE], w_heads[:, NOPE:]  # [H, nope, R], [H, v, R]
    q_latent = torch.einsum("thn,hnr->thr", q[..., :NOPE], w_uk)  # absorbed query, [T, H, R]
    scores = (torch.einsum("thr,sr->hts", q_latent, latent) + torch.einsum("thp,sp->hts", q[..., NOPE:], k_pe)) * 0.15
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    ctx = torch.einsum("hts,sr->thr", scores.softmax(-1), latent)
    absorbed = torch.einsum("thr,hvr->thv", ctx, w_uv)
    assert (absorbed - ours).abs().max() <= 1e-4 * ours.abs().max()  # the same attention...
    assert not torch.equal(absorbed, ours)  # ...but not the same bits


def test_negative_control_stock_linear_of_one_row_and_of_many(gen, stock_varies):
    """Where the CPU's GEMM gives a row other bits at M=1 than at M=45 (a decode step vs the prefill)."""
    _, latent, _, w = _mla(gen)
    many = torch.nn.functional.linear(latent, w)
    ones = torch.cat([torch.nn.functional.linear(latent[i : i + 1], w) for i in range(latent.shape[0])])
    stock_varies(torch.equal(many, ones), "stock F.linear gives one row the same bits at M=1 and M=45")
    pe = latent[:, :ROPE]
    assert torch.equal(latent_kv(latent, pe, w, NOPE, V)[1][3:4], latent_kv(latent[3:4], pe[3:4], w, NOPE, V)[1])
