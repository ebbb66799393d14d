"""The backward pass of :func:`attention.attention_heads_first`, on the forward's tiles and in fixed orders.

With ``P = exp(S - max) / l`` the forward's softmax (recomputed here bit for bit
from the same tile GEMMs), ``O`` its fp32 output and ``dO`` the incoming
gradient (zeroed for padding queries):

* ``dP = dO V^T`` per (tile, block): one ``[Q_TILE, D] @ [D, KV_BLOCK]`` GEMM;
  ``delta = sum_d dO * O`` per query row, a :func:`halving_sum` over ``D``;
  ``dS = P * (dP - delta)`` (exact zeros where the forward had them: masked keys).
* ``dq = scale * sum_blocks dS K``: one ``[Q_TILE, KV_BLOCK] @ [KV_BLOCK, D]`` GEMM
  per (tile, block), blocks added with :func:`pairwise_sum` exactly like the
  forward's value blocks. A query's gradient is therefore invariant in the same
  sense as its output: batch composition, padding, prefill vs chunked prefill
  vs decode.
* ``dk = scale * sum_tiles dS^T Q`` and ``dv = sum_tiles P^T dO``: one
  ``[KV_BLOCK, Q_TILE] @ [Q_TILE, D]`` GEMM per (tile, block), the query tiles
  of the sequence added left to right in tile order. A key's gradient sums over
  the queries of its own sequence only: it does not depend on the other
  sequences in the batch, on key padding, or on query padding appended after
  the sequence's queries (zero tiles), but it does depend on where the
  sequence's queries sit in their tiles (left padding, or computing the queries
  in separate chunks, regroups them).

Gradients are rounded once to the dtypes of q, k and v.
"""

from __future__ import annotations

import torch

from .attention import (
    KV_BLOCK,
    Q_TILE,
    _attention_forward,
    _from_query_tiles,
    _kv_blocks,
    _layout_of,
    _query_tiles,
    _tile_group,
)
from .fixed_order import halving_sum, pairwise_sum


class Attention(torch.autograd.Function):
    """:func:`attention_heads_first` with the fixed-order backward above."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, scale, kv_lens, window=None):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v, q_positions, kv_lens)
        ctx.scale, ctx.window = scale, window
        return _attention_forward(q, k, v, q_positions, scale, kv_lens, None, window)

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q, k, v, q_positions, kv_lens = ctx.saved_tensors
        dq, dk, dv = attention_grads(q, k, v, q_positions, ctx.scale, kv_lens, d_out, ctx.window)
        return dq, dk, dv, None, None, None, None


def _pairs(x: torch.Tensor, nk_or_nq: int, dim: int) -> torch.Tensor:
    """Expand ``[B, H, n, R, C]`` over the other tile axis (inserted at ``dim``) and flatten to ``[pairs, R, C]``."""
    shape = list(x.shape)
    shape.insert(dim, nk_or_nq)
    return x.unsqueeze(dim).expand(shape).reshape(-1, x.shape[-2], x.shape[-1])


def attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_lens: torch.Tensor,
    d_out: torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` for heads-first q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]`` and
    ``d_out`` ``[B, Hq, T, Dv]``
    (``window``: the forward's sliding window; hidden keys have zero probability, so zero gradient)."""
    b, hq, t, d = q.shape
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    layout, g = _layout_of(q, k, q_positions, kv_lens, window)
    q_tiles = _query_tiles(q, hkv, layout.n_qt)
    d_rows = torch.where(layout.has_query, d_out.reshape(b, hkv, g, t, dv), 0)
    do_tiles = _query_tiles(d_rows.reshape(b, hq, t, dv), hkv, layout.n_qt)
    k_blocks, v_blocks = _kv_blocks(k, v, layout.n_kb)
    dq_tiles = torch.zeros_like(q_tiles)
    dk_blocks = torch.zeros_like(k_blocks)
    dv_blocks = k_blocks.new_zeros(*k_blocks.shape[:-1], dv)
    for q0, q1, n_blocks, hidden in layout.groups:
        qt, do_t = q_tiles[:, :, q0:q1], do_tiles[:, :, q0:q1]
        kb, vb = k_blocks[:, :, :n_blocks], v_blocks[:, :, :n_blocks]
        acc, p = _tile_group(qt, kb, vb, hidden, scale)
        nq, nk = qt.shape[2], n_blocks
        pairs = (b, hkv, nq, nk)
        p = p / acc[..., dv:].unsqueeze(3)  # normalised, [B, Hkv, nq, nk, Q_TILE, KV_BLOCK]
        delta = halving_sum(do_t * (acc[..., :dv] / acc[..., dv:]), -1)  # [B, Hkv, nq, Q_TILE]
        dp = torch.bmm(_pairs(do_t, nk, 3), _pairs(vb[..., :dv], nq, 2).transpose(1, 2)).view(*pairs, Q_TILE, KV_BLOCK)
        ds = p * (dp - delta[:, :, :, None, :, None])
        flat_ds, flat_p = ds.view(-1, Q_TILE, KV_BLOCK), p.view(-1, Q_TILE, KV_BLOCK)
        dq_tiles[:, :, q0:q1] = pairwise_sum(torch.bmm(flat_ds, _pairs(kb, nq, 2)).view(*pairs, Q_TILE, d), 3)
        dk_part = torch.bmm(flat_ds.transpose(1, 2), _pairs(qt, nk, 3)).view(*pairs, KV_BLOCK, d)
        dv_part = torch.bmm(flat_p.transpose(1, 2), _pairs(do_t, nk, 3)).view(*pairs, KV_BLOCK, dv)
        for i in range(nq):  # query tiles in order, left to right
            dk_blocks[:, :, :nk] += dk_part[:, :, i]
            dv_blocks[:, :, :nk] += dv_part[:, :, i]
    dq = _from_query_tiles(dq_tiles.mul_(scale), t, g).reshape(b, hq, t, d).to(q.dtype)
    return dq, _unblock(dk_blocks.mul_(scale), s, k.dtype), _unblock(dv_blocks, s, v.dtype)


def _unblock(blocks: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """Key blocks ``[B, Hkv, nK, KV_BLOCK, D]`` back to ``[B, Hkv, S, D]`` (keys past the blocks: zero)."""
    b, hkv, n_kb, _, d = blocks.shape
    flat = blocks.view(b, hkv, n_kb * KV_BLOCK, d)
    out = torch.zeros(b, hkv, s, d, dtype=dtype, device=blocks.device)
    used = min(s, n_kb * KV_BLOCK)
    out[:, :, :used] = flat[:, :, :used]
    return out
