"""Causal attention whose output for a query does not depend on how it is computed.

Contract: for a query at absolute position ``p`` the output is the softmax over
keys ``0..p`` of the scaled dot products, applied to the values, with bits that
are the same in a full prefill, a chunked prefill, a single decode step against
the KV cache, any batch composition and any amount of padding.

Design (all fp32 after an exact widening of q, k, v):

* **Tiles with one shape.** For every (sequence, kv head), the query rows
  ``(t, g)`` of the GQA group (``Hq = Hkv * G``; query head ``h`` reads kv
  head ``h // G``) are cut into tiles of :data:`Q_TILE` rows, the keys into
  blocks of :data:`KV_BLOCK` keys, both zero-padded. Every score tile is one
  ``[Q_TILE, D] @ [D, KV_BLOCK]`` GEMM and every value tile one
  ``[Q_TILE, KV_BLOCK] @ [KV_BLOCK, D]`` GEMM, all in one ``bmm`` each; so a
  (row, block) result never depends on the other rows, on T or on S.
  Block ``j`` always holds keys ``j*KV_BLOCK ...``: the partition is by absolute
  key index, identical in prefill and decode.
* **Query tiles go in groups, each up to its last visible key block.** A group
  computes every (tile, block) pair up to the last block any of its rows can
  see (a causal prefill skips the blocks above the group's diagonal). A block
  past a row's position, computed and fully masked or not computed at all,
  contributes the same exact zeros below.
* **Softmax in two exact passes.** Masked scores become ``-1e30`` (finite:
  ``-inf`` could turn a fully masked block into NaN). The row max ``M`` over
  all visible keys is exact (max is order-free). ``p = exp(s - M)`` uses the
  position-independent :func:`fixed_order.exp`, which gives exact zeros for
  masked keys. Each block's ``p @ [v | 1]`` is one tile GEMM, giving the
  block's weighted values and its ``sum(p)`` in one fixed order. The blocks are then added with
  :func:`pairwise_sum` over the block index: blocks past a query's position
  hold exact zeros and appending zeros never changes a pairwise sum, so a
  decode step (fewer blocks) and a prefill (more blocks) add a query's blocks
  in the same order. ``out = sum(p v) / sum(p)``, rounded once to ``q.dtype``.

Queries with no visible key (padding rows, position ``-1``) give zeros.

Sliding window (Mistral, Gemma 2 and 3): with ``window = W`` a query at position
``p`` sees keys ``p - W < j <= p`` only (``W`` keys, its own included), as in HF's
``sliding_window_overlay`` and vLLM. The window is one more mask term, a
function of absolute positions like the causal one, so hidden keys give the same
exact zeros and every invariance above holds unchanged (the backward's too: its
probabilities are the forward's, zero where hidden). Blocks wholly before a
query's window still take part (as exact zeros, in the same pairwise order in
prefill and decode); callers whose cache drops old keys place the kept ones at
their absolute indices and may leave the dropped ones as zeros.

Soft-capping (Gemma 2's ``attn_logit_softcapping``): each score becomes
``cap * tanh(score / cap)`` right after the scaling, with the
position-independent :func:`fixed_order.tanh`, so the invariance above holds
unchanged (the backward's too: it multiplies by the cap's slope ``1 - tanh^2``,
recomputed from the same score bits).

Attention sinks (gpt-oss): query head ``h`` has one learned logit ``sinks[h]``
that joins the softmax's denominator and attends to nothing. The row max
includes it (max is order-free), and ``exp(sink - M)`` is added to the row's
``sum(p)`` after the blocks' pairwise sum: a function of the sink and the exact
row max only, so every invariance above holds unchanged.

Value head size (MLA: DeepSeek's q/k heads are ``qk_nope + qk_rope`` = 192 wide,
its v heads 128): ``v`` may be narrower or wider than ``q``/``k``. The score GEMMs
are over the q/k dim, the value GEMMs produce ``max(Dv + 1, 16)`` columns, and every
invariance above holds unchanged (the backward's too).

Groups hold at most :data:`attention_tiles.MAX_TILE_ELEMENTS` accumulator elements; rows are
independent, so the grouping never changes a bit.

The tiling itself lives in :mod:`attention_tiles`, below both this module and the
backward (:mod:`attention_backward`): the forward dispatches to the backward when a
gradient is needed, and the backward recomputes the forward's tiles from there.
"""

from __future__ import annotations

import torch

from .attention_tiles import KV_BLOCK, Q_TILE, _attention_forward  # noqa: F401 - the tile sizes are public here
from .differentiable import needs_grad


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_len: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: q ``[T, Hq, D]``, k ``[S, Hkv, D]``, v ``[S, Hkv, Dv]`` (keys at positions 0..S-1)
    -> ``[T, Hq, Dv]``.

    Query ``i`` sees key ``j`` iff ``j <= q_positions[i]`` (and ``j < kv_len``, and
    ``j > q_positions[i] - window`` with a ``window``). ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2). ``sinks`` ``[Hq]``: one more logit per
    query head in the softmax's denominator, attending to nothing (gpt-oss).
    """
    s = k.shape[0] if kv_len is None else int(kv_len)
    kv_lens = torch.tensor([s], dtype=torch.int64, device=q.device)
    out = attention_heads_first(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        q_positions.reshape(1, -1),
        scale,
        kv_lens,
        softcap,
        window,
        sinks,
    )
    return out[0].transpose(0, 1)


def attention_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_lens: torch.Tensor,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Padded batch: q ``[B, T, Hq, D]``, k ``[B, S, Hkv, D]``, v ``[B, S, Hkv, Dv]``, q_positions ``[B, T]``
    (-1: no query), kv_lens ``[B]`` -> ``[B, T, Hq, Dv]``. Sequence ``b``'s keys are ``k[b, :kv_lens[b]]``."""
    out = attention_heads_first(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q_positions, scale, kv_lens, softcap, window, sinks
    )
    return out.transpose(1, 2)


def attention_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_lens: torch.Tensor,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention_batched` in the heads-first layout of HF: q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``,
    v ``[B, Hkv, S, Dv]`` -> ``[B, Hq, T, Dv]``."""
    if window is not None and int(window) < 1:
        raise ValueError(f"attention: window must be at least 1, got {window}")
    softcap = softcap or None
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"attention: sinks must hold one logit per query head ({q.shape[1]}), got {tuple(sinks.shape)}")
    if sinks is not None and needs_grad(q, k, v, sinks):
        from .attention_backward import SinkAttention  # the backward builds on this module

        return SinkAttention.apply(q, k, v, q_positions, scale, kv_lens, window, softcap, sinks)
    if needs_grad(q, k, v):
        from .attention_backward import Attention  # the backward builds on this module

        return Attention.apply(q, k, v, q_positions, scale, kv_lens, window, softcap)
    return _attention_forward(q, k, v, q_positions, scale, kv_lens, softcap, window, sinks)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_len: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain masked softmax attention for one sequence, fp32 (fp64 for fp64 input), scores optionally soft-capped,
    keys optionally limited to the last ``window`` positions, one ``sinks`` logit per head optionally in the
    denominator (a column HF's gpt-oss concatenates and drops)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = k.shape[0] if kv_len is None else int(kv_len)
    g = q.shape[1] // k.shape[1]
    kk = k[:s].to(dtype).repeat_interleave(g, dim=1)  # [S, Hq, D]
    vv = v[:s].to(dtype).repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,shd->hts", q.to(dtype), kk) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.arange(s)[None, :] <= q_positions.long()[:, None]  # [T, S]
    if window:
        visible &= torch.arange(s)[None, :] > q_positions.long()[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        column = sinks.to(dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", probs, vv)
    return out.to(q.dtype)
