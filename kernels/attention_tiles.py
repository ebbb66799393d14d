"""The tiled forward of :mod:`attention`: the tiles, key blocks, groups and their masks, and the one
tile-group computation the forward runs and the backward (:mod:`attention_backward`) recomputes bit for bit.

:mod:`attention` (the public entry points, the contract and the design) and :mod:`attention_backward` both
build on this module, which imports neither: the forward dispatches to the backward, and the backward
reuses these pieces, without an import circle.
"""

from __future__ import annotations

import torch

from .caches import active
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
    rows = torch.empty(b, hkv, n_qt * Q_TILE, d, dtype=torch.float32, device=x.device)
    rows[:, :, : t * g].view(b, hkv, t, g, d).copy_(x.reshape(b, hkv, g, t, d).transpose(2, 3))
    rows[:, :, t * g :] = 0  # only the padding rows are zeroed
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
    # Fresh buffers written once: the keys and values, then zeros only where they are padding.
    k_pad = torch.empty(b, hkv, n_kb * KV_BLOCK, d, dtype=torch.float32, device=k.device)
    k_pad[:, :, :s_used] = k[:, :, :s_used]
    k_pad[:, :, s_used:] = 0
    v_pad = torch.empty(b, hkv, n_kb * KV_BLOCK, width, dtype=torch.float32, device=k.device)
    v_pad[:, :, :s_used, :dv] = v[:, :, :s_used]
    v_pad[:, :, :s_used, dv:] = 0
    v_pad[:, :, s_used:] = 0
    v_pad[..., -1] = 1.0
    return k_pad.view(b, hkv, n_kb, KV_BLOCK, d), v_pad.view(b, hkv, n_kb, KV_BLOCK, width)


class _Layout:
    """What depends only on positions and lengths: tiles, key blocks, groups and their masks.

    Every layer of a forward pass sees the same positions, so the last layout is reused when the
    same ``q_positions`` and ``kv_lens`` tensors (unchanged) come back, or fresh tensors with the
    values it was built from (vLLM's attention builds them per layer).
    """

    def __init__(
        self, q_positions: torch.Tensor, kv_lens: torch.Tensor, g: int, hkv: int, d: int, window: int | None = None
    ) -> None:
        self.values = (q_positions.clone(), kv_lens.clone())  # what it was built from (see built_for)
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


    def built_for(self, q_positions: torch.Tensor, kv_lens: torch.Tensor) -> bool:
        """Whether this layout was built from these values of ``q_positions`` and ``kv_lens`` (it is a function
        of their values alone, with the heads and window the caller compares)."""
        return all(
            a.shape == b.shape and a.device == b.device and torch.equal(a, b.to(a.dtype))
            for a, b in zip(self.values, (q_positions, kv_lens), strict=True)
        )


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter; None for an inference tensor, which has none yet can be refilled in place
    inside ``inference_mode`` (a persistent buffer), so only its values tell. Asked first: a raised error costs
    ~70 us."""
    return None if t.is_inference() else t._version


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
        same = all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(key, last[0], strict=True))
        if same and key[1] is not None and key[3] is not None:  # the same tensors, unchanged since
            return last[1]
        if key[4:] == last[0][4:] and last[1].built_for(q_positions, kv_lens):
            caches.attention_layout = (key, last[1])  # fresh tensors, the same values (vLLM's, per layer)
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
