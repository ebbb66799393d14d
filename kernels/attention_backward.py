"""The backward pass of :func:`attention.attention_heads_first`, on the forward's tiles and in fixed orders.

With ``P = exp(S - max) / l`` the forward's softmax (recomputed here bit for bit
from the same tile GEMMs), ``O`` its fp32 output and ``dO`` the incoming
gradient (zeroed for padding queries):

* ``dP = dO V^T`` per (tile, block): one ``[Q_TILE, D] @ [D, KV_BLOCK]`` GEMM;
  ``delta = sum_d dO * O`` per query row, a :func:`halving_sum` over ``D``;
  ``dS = P * (dP - delta)`` (exact zeros where the forward had them: masked keys).
  With a soft cap (scores ``c = cap * tanh(s / cap)``) the chain rule adds the cap's slope:
  ``dS *= 1 - t^2`` with ``t = tanh(s / cap)`` recomputed by :func:`fixed_order.tanh` from the
  forward's own score GEMM (:func:`attention_tiles._scaled_scores`), so the same bits; elementwise.
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

Sinks (gpt-oss): a sink is one more key whose value is zero, so ``P`` above is the
forward's (its denominator includes ``exp(sink - max)``), ``dP_sink = 0`` and
``d sink_h = -sum_i P_i,sink * delta_i`` over the rows ``i`` of head ``h`` (every
sequence and query), ``P_sink = exp(sink - max) / l`` from the forward's own row
max and denominator, the rows added by one :func:`halving_sum`.

Gradients are rounded once to the dtypes of q, k and v (and of the sinks).
"""

from __future__ import annotations

import torch

from .attention_tiles import (
    _MASKED,
    KV_BLOCK,
    Q_TILE,
    _attention_forward,
    _from_query_tiles,
    _kv_blocks,
    _layout_of,
    _query_tiles,
    _scaled_scores,
    _tile_group,
    sink_rows,
)
from .fixed_order import exp, halving_sum, pairwise_sum, tanh


class Attention(torch.autograd.Function):
    """:func:`attention_heads_first` with the fixed-order backward above."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, scale, kv_lens, window=None, softcap=None):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v, q_positions, kv_lens)
        ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
        return _attention_forward(q, k, v, q_positions, scale, kv_lens, softcap, window)

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q, k, v, q_positions, kv_lens = ctx.saved_tensors
        dq, dk, dv = attention_grads(q, k, v, q_positions, ctx.scale, kv_lens, d_out, ctx.window, ctx.softcap)
        return dq, dk, dv, None, None, None, None, None


class SinkAttention(torch.autograd.Function):
    """:func:`attention_heads_first` with sinks (gpt-oss): the backward above plus ``d sinks``."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, scale, kv_lens, window, softcap, sinks):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v, q_positions, kv_lens, sinks)
        ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
        return _attention_forward(q, k, v, q_positions, scale, kv_lens, softcap, window, sinks)

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q, k, v, q_positions, kv_lens, sinks = ctx.saved_tensors
        grads = attention_grads(q, k, v, q_positions, ctx.scale, kv_lens, d_out, ctx.window, ctx.softcap, sinks)
        return (*grads[:3], None, None, None, None, None, grads[3])


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` (and ``d sinks`` with ``sinks``) for heads-first q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]`` and
    ``d_out`` ``[B, Hq, T, Dv]``
    (``window``: the forward's sliding window; hidden keys have zero probability, so zero gradient;
    ``softcap``: the forward's score cap)."""
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
    rows_sink = sink_rows(sinks, hkv, layout.n_qt)
    d_sink_rows = q_tiles.new_zeros(q_tiles.shape[:-1]) if sinks is not None else None  # [B, Hkv, nQ, Q_TILE]
    for q0, q1, n_blocks, hidden in layout.groups:
        qt, do_t = q_tiles[:, :, q0:q1], do_tiles[:, :, q0:q1]
        kb, vb = k_blocks[:, :, :n_blocks], v_blocks[:, :, :n_blocks]
        row_sink = None if rows_sink is None else rows_sink[:, q0:q1]
        acc, p = _tile_group(qt, kb, vb, hidden, scale, softcap, row_sink)
        nq, nk = qt.shape[2], n_blocks
        pairs = (b, hkv, nq, nk)
        p = p / acc[..., -1:].unsqueeze(3)  # normalised, [B, Hkv, nq, nk, Q_TILE, KV_BLOCK]
        delta = halving_sum(do_t * (acc[..., :dv] / acc[..., -1:]), -1)  # [B, Hkv, nq, Q_TILE]
        dp = torch.bmm(_pairs(do_t, nk, 3), _pairs(vb[..., :dv], nq, 2).transpose(1, 2)).view(*pairs, Q_TILE, KV_BLOCK)
        ds = p * (dp - delta[:, :, :, None, :, None])
        if row_sink is not None:  # the sink: a key with value 0, so dP_sink = 0 and dsink = -P_sink * delta
            d_sink_rows[:, :, q0:q1] = _sink_probability(qt, kb, hidden, scale, softcap, row_sink, acc[..., -1])
            d_sink_rows[:, :, q0:q1] *= -delta
        if softcap:  # through c = cap * tanh(s / cap): dS *= 1 - tanh^2, t from the forward's score bits
            capped = tanh(_scaled_scores(qt, kb, scale).div_(softcap))
            ds.mul_(capped.mul_(capped).neg_().add_(1.0))
        flat_ds, flat_p = ds.view(-1, Q_TILE, KV_BLOCK), p.view(-1, Q_TILE, KV_BLOCK)
        dq_tiles[:, :, q0:q1] = pairwise_sum(torch.bmm(flat_ds, _pairs(kb, nq, 2)).view(*pairs, Q_TILE, d), 3)
        dk_part = torch.bmm(flat_ds.transpose(1, 2), _pairs(qt, nk, 3)).view(*pairs, KV_BLOCK, d)
        dv_part = torch.bmm(flat_p.transpose(1, 2), _pairs(do_t, nk, 3)).view(*pairs, KV_BLOCK, dv)
        for i in range(nq):  # query tiles in order, left to right
            dk_blocks[:, :, :nk] += dk_part[:, :, i]
            dv_blocks[:, :, :nk] += dv_part[:, :, i]
    dq = _from_query_tiles(dq_tiles.mul_(scale), t, g).reshape(b, hq, t, d).to(q.dtype)
    grads = (dq, _unblock(dk_blocks.mul_(scale), s, k.dtype), _unblock(dv_blocks, s, v.dtype))
    if sinks is None:
        return grads
    # head h = kv head * G + g: its rows are (t, g) of every sequence; summed by halving_sum in one fixed order
    per_row = d_sink_rows.reshape(b, hkv, -1)[:, :, : t * g].reshape(b, hkv, t, g)
    d_sinks = halving_sum(per_row.permute(1, 3, 0, 2).reshape(hkv, g, b * t), -1).reshape(hq)
    return (*grads, d_sinks.to(sinks.dtype))


def _sink_probability(
    qt: torch.Tensor, kb: torch.Tensor, hidden: torch.Tensor, scale: float, softcap: float | None,
    row_sink: torch.Tensor, total: torch.Tensor,
) -> torch.Tensor:
    """Each row's sink probability ``exp(sink - M) / l``, ``M`` and ``l`` bit for bit the forward's (the row max
    over the same score GEMMs and the sink, the forward's denominator ``total``)."""
    scores = _scaled_scores(qt, kb, scale)
    if softcap:
        scores = tanh(scores.div_(softcap)).mul_(softcap)
    row_max = torch.maximum(scores.masked_fill_(hidden, _MASKED).amax(-1).amax(3), row_sink)
    return exp(row_sink - row_max) / total


def _unblock(blocks: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """Key blocks ``[B, Hkv, nK, KV_BLOCK, D]`` back to ``[B, Hkv, S, D]`` (keys past the blocks: zero)."""
    b, hkv, n_kb, _, d = blocks.shape
    flat = blocks.view(b, hkv, n_kb * KV_BLOCK, d)
    out = torch.zeros(b, hkv, s, d, dtype=dtype, device=blocks.device)
    used = min(s, n_kb * KV_BLOCK)
    out[:, :, :used] = flat[:, :, :used]
    return out
