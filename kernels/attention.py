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

Groups hold at most :data:`MAX_TILE_ELEMENTS` accumulator elements; rows are
independent, so the grouping never changes a bit.
"""

from __future__ import annotations

import torch

from .caches import active
from .differentiable import needs_grad
from .fixed_order import exp, pairwise_sum, tanh

Q_TILE = 16
"""Query rows per score/value GEMM."""
KV_BLOCK = 16
"""Keys per block (the online-softmax block size)."""
MAX_TILE_ELEMENTS = 1 << 24
"""Upper bound on the fp32 elements of one group's per-block accumulators."""
GROUPS = 8
"""Query-tile groups per call for long prefills (more groups skip more of the causal upper triangle)."""

_MASKED = -1.0e30


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


def _attention_forward(
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
    b, hq, t, _ = q.shape
    dv = v.shape[-1]
    layout, g = _layout_of(q, k, q_positions, kv_lens, window)
    q_tiles = _query_tiles(q, k.shape[1], layout.n_qt)
    k_blocks, v_blocks = _kv_blocks(k, v, layout.n_kb)
    rows_sink = sink_rows(sinks, k.shape[1], layout.n_qt)
    acc = torch.empty(*q_tiles.shape[:-1], v_blocks.shape[-1], dtype=torch.float32, device=q.device)
    for q0, q1, n_blocks, hidden in layout.groups:
        acc[:, :, q0:q1] = _tile_group(
            q_tiles[:, :, q0:q1], k_blocks[:, :, :n_blocks], v_blocks[:, :, :n_blocks], hidden, scale, softcap,
            None if rows_sink is None else rows_sink[:, q0:q1],
        )[0]
    out = _from_query_tiles(acc[..., :dv] / acc[..., -1:], t, g)
    out = torch.where(layout.has_query, out, 0.0)
    return out.reshape(b, hq, t, dv).to(q.dtype)


def _layout_of(
    q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, kv_lens: torch.Tensor, window: int | None = None
) -> tuple:
    """``(layout, G)`` for heads-first q ``[B, Hq, T, D]`` and k ``[B, Hkv, S, D]`` (``D`` sizes the groups'
    accumulators only: the bits never depend on it)."""
    hq, d, hkv = q.shape[1], q.shape[3], k.shape[1]
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} kv heads")
    return _layout(q_positions, kv_lens, hq // hkv, hkv, d, q.device, window), hq // hkv


def _query_tiles(x: torch.Tensor, hkv: int, n_qt: int) -> torch.Tensor:
    """Heads-first ``[B, Hq, T, D]`` as fp32 query-row tiles ``[B, Hkv, nQ, Q_TILE, D]``, row ``r = t * G + g``."""
    b, hq, t, d = x.shape
    g = hq // hkv
    rows = torch.zeros(b, hkv, n_qt * Q_TILE, d, dtype=torch.float32, device=x.device)
    rows[:, :, : t * g].view(b, hkv, t, g, d).copy_(x.reshape(b, hkv, g, t, d).transpose(2, 3))
    return rows.view(b, hkv, n_qt, Q_TILE, d)


def _from_query_tiles(tiles: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """Inverse of :func:`_query_tiles` (padding rows dropped): ``[B, Hkv, G, T, D]``."""
    b, hkv, n_qt, _, d = tiles.shape
    return tiles.reshape(b, hkv, n_qt * Q_TILE, d)[:, :, : t * g].reshape(b, hkv, t, g, d).transpose(2, 3)


def sink_rows(sinks: torch.Tensor | None, hkv: int, n_qt: int) -> torch.Tensor | None:
    """Each query-tile row's sink logit, fp32 ``[Hkv, nQ, Q_TILE]`` (row ``r`` is query head ``hkv * G + r % G``),
    or None without sinks."""
    if sinks is None:
        return None
    g = sinks.shape[0] // hkv
    per_head = sinks.detach().to(torch.float32).view(hkv, g)
    return per_head[:, torch.arange(n_qt * Q_TILE, device=sinks.device) % g].view(hkv, n_qt, Q_TILE)


#: the fewest columns a value GEMM gets: on AVX2, ``[16, 16] @ [16, N]`` with N < 16 computes a row's bits
#: depending on its place in the tile (measured for N = 5 and 9, not for 16, 17 or 65), so narrow values
#: (head dim <= 14) are padded with zero columns up to this width
VALUE_WIDTH_MIN = 16


def _kv_blocks(k: torch.Tensor, v: torch.Tensor, n_kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys in absolute fp32 blocks ``[B, Hkv, nK, KV_BLOCK, D]``; values ``[..., W]``: ``Dv`` value columns,
    zero columns up to ``VALUE_WIDTH_MIN``, and a ones column last, so that the value GEMM also yields each
    block's sum of p (the last column), in the same fixed order."""
    b, hkv, s, d = k.shape
    dv = v.shape[-1]
    width = max(dv + 1, VALUE_WIDTH_MIN)
    s_used = min(s, n_kb * KV_BLOCK)
    k_pad = torch.zeros(b, hkv, n_kb * KV_BLOCK, d, dtype=torch.float32, device=k.device)
    k_pad[:, :, :s_used] = k[:, :, :s_used]
    v_pad = torch.zeros(b, hkv, n_kb * KV_BLOCK, width, dtype=torch.float32, device=k.device)
    v_pad[:, :, :s_used, :dv] = v[:, :, :s_used]
    v_pad[..., -1] = 1.0
    return k_pad.view(b, hkv, n_kb, KV_BLOCK, d), v_pad.view(b, hkv, n_kb, KV_BLOCK, width)


class _Layout:
    """What depends only on positions and lengths: tiles, key blocks, groups and their masks.

    Every layer of a forward pass sees the same positions, so the last layout is reused when the
    same ``q_positions`` and ``kv_lens`` tensors (unchanged) come back.
    """

    def __init__(
        self, q_positions: torch.Tensor, kv_lens: torch.Tensor, g: int, hkv: int, d: int, window: int | None = None
    ) -> None:
        b, t = q_positions.shape
        rows = t * g
        self.n_qt = max(1, -(-rows // Q_TILE))
        self.n_kb = max(1, -(-int(kv_lens.max()) // KV_BLOCK))
        device = q_positions.device
        row_pos = torch.full((b, self.n_qt * Q_TILE), -1, dtype=torch.int64, device=device)
        row_pos[:, :rows] = q_positions.repeat_interleave(g, dim=1)
        row_pos = row_pos.view(b, self.n_qt, Q_TILE)
        key_pos = torch.arange(self.n_kb * KV_BLOCK, device=device).view(self.n_kb, KV_BLOCK)
        key_ok = key_pos[None] < kv_lens[:, None, None]  # [B, nK, KV_BLOCK]
        self.has_query = (q_positions >= 0)[:, None, None, :, None]
        # About GROUPS groups of query tiles, each computing the key blocks up to the last key any of
        # its rows sees (skipping the causal upper triangle); at least 8 tiles per group (fewer, larger
        # calls) and at most MAX_TILE_ELEMENTS accumulator elements.
        per_group = min(
            max(8, -(-self.n_qt // GROUPS)), max(1, MAX_TILE_ELEMENTS // (b * hkv * self.n_kb * Q_TILE * (d + 1)))
        )
        tile_last = row_pos.amax(-1).amax(0).tolist()  # [nQ]: the last key any row of the tile sees
        self.groups = []
        for q0 in range(0, self.n_qt, per_group):
            q1 = min(self.n_qt, q0 + per_group)
            n_blocks = min(self.n_kb, max(0, max(tile_last[q0:q1])) // KV_BLOCK + 1)
            visible = key_pos[None, None, :n_blocks, None, :] <= row_pos[:, q0:q1, None, :, None]
            visible &= key_ok[:, None, :n_blocks, None, :]  # [B, nq, nk, Q_TILE, KV_BLOCK]
            if window:  # the sliding window: only the last ``window`` keys up to the query's own
                visible &= key_pos[None, None, :n_blocks, None, :] > row_pos[:, q0:q1, None, :, None] - window
            self.groups.append((q0, q1, n_blocks, ~visible.unsqueeze(1)))


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (and cannot change in place)
        return -1


def _layout(
    q_positions: torch.Tensor,
    kv_lens: torch.Tensor,
    g: int,
    hkv: int,
    d: int,
    device: torch.device,
    window: int | None = None,
) -> _Layout:
    key = (q_positions, _version(q_positions), kv_lens, _version(kv_lens), g, hkv, d, device, window)
    caches = active()
    last = caches.attention_layout if caches is not None else None
    if last is not None and len(key) == len(last[0]):
        if all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(key, last[0], strict=True)):
            return last[1]
    layout = _Layout(
        q_positions.to(device=device, dtype=torch.int64),
        kv_lens.to(device=device, dtype=torch.int64),
        g,
        hkv,
        d,
        window,
    )
    if caches is not None:
        caches.attention_layout = (key, layout)
    return layout


def _scaled_scores(q_tiles: torch.Tensor, k_blocks: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q.k`` for every (tile, block) pair, ``[B, Hkv, nq, nk, Q_TILE, KV_BLOCK]`` (the backward
    recomputes a soft cap's slope from these very bits)."""
    b, hkv, nq, _, d = q_tiles.shape
    pairs = (b, hkv, nq, k_blocks.shape[2])
    # One [Q_TILE, D] @ [D, KV_BLOCK] GEMM per (sequence, head, tile, block): explicit bmm, never
    # torch.matmul, whose broadcasting may fold batches into a GEMM of another shape.
    a = q_tiles.unsqueeze(3).expand(*pairs, Q_TILE, d).reshape(-1, Q_TILE, d)
    kb = k_blocks.unsqueeze(2).expand(*pairs, KV_BLOCK, d).reshape(-1, KV_BLOCK, d)
    return torch.bmm(a, kb.transpose(1, 2)).view(*pairs, Q_TILE, KV_BLOCK).mul_(scale)


def _tile_group(
    q_tiles: torch.Tensor,  # [B, Hkv, nq, Q_TILE, D]
    k_blocks: torch.Tensor,  # [B, Hkv, nk, KV_BLOCK, D]
    v_blocks: torch.Tensor,  # [B, Hkv, nk, KV_BLOCK, W]: values, zero padding, ones (``_kv_blocks``)
    hidden: torch.Tensor,  # [B, 1, nq, nk, Q_TILE, KV_BLOCK]: masked (row, key) pairs
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hkv, nq, Q_TILE]: each row's sink logit (``sink_rows``)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([sum(p v) | 0 | sum(p)] [B, Hkv, nq, Q_TILE, W], p [B, Hkv, nq, nk, Q_TILE, KV_BLOCK])`` over every
    (tile, block) pair; ``p = exp(s - row max)`` is unnormalised. With ``sinks`` the row max includes the row's
    sink and ``sum(p)`` ends with ``exp(sink - row max)``, added after the blocks' pairwise sum (one fixed
    order: the blocks' sum, then the sink)."""
    b, hkv, nq = q_tiles.shape[:3]
    nk, d1 = k_blocks.shape[2], v_blocks.shape[-1]
    pairs = (b, hkv, nq, nk)
    scores = _scaled_scores(q_tiles, k_blocks, scale)
    if softcap:  # elementwise and position-independent: a score's bits stay a function of its value
        scores = tanh(scores.div_(softcap)).mul_(softcap)
    scores.masked_fill_(hidden, _MASKED)
    # Exact row max over all blocks, then p = exp(s - max) with exact zeros where masked.
    row_max = scores.amax(-1).amax(3)  # [B, Hkv, nq, Q_TILE]
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks)
    p = exp(scores.sub_(row_max[:, :, :, None, :, None]))
    # One [Q_TILE, KV_BLOCK] @ [KV_BLOCK, W] GEMM per pair: the block's [p v | 0 | sum p].
    vb = v_blocks.unsqueeze(2).expand(*pairs, KV_BLOCK, d1).reshape(-1, KV_BLOCK, d1)
    pv = torch.bmm(p.view(-1, Q_TILE, KV_BLOCK), vb).view(*pairs, Q_TILE, d1)
    summed = pairwise_sum(pv, 3)
    if sinks is not None:
        summed[..., -1] += exp(sinks - row_max)
    return summed, p


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
