"""Consistent mode's attention for HF models: the attention function and the mask function it reads.

Both are registered under ``consistent.ATTN_IMPLEMENTATION`` in transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` by ``consistent.consistent_hf``;
the core is ``logdiff.kernels.attention_batched``.

Attention: HF hands the function the whole cache (decode) or the whole padded
batch (prefill) and a boolean 4-D mask. The consistent mask function tags the
mask with each query's and key's absolute position (from the 2-D padding mask
and the cache's offsets: a sliding-window cache holds only the last
``window - 1`` keys), and each sequence's keys go to their absolute slots, so
key ``j`` of the kernel is the sequence's ``j``-th real token; slots of keys a
sliding-window cache dropped stay zero. The layer's ``sliding_window`` goes to
the kernel's ``window``. The mask must equal what the kernel then sees (causal,
within the window) for every real query, and every key a query sees must be in
the cache; anything else (packed sequences, bidirectional masks) raises
``NotImplementedError``. An untagged mask is compacted instead (visible keys to
the front, a causal prefix required, no window). Soft-capped scores (Gemma 2's
``softcap``) go to the kernel's ``softcap``, attention sinks (gpt-oss's ``s_aux``) to its ``sinks``.
The layout is computed once per
mask object (layers of one type share it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_POSITIONS_TAG = "_logdiff_consistent_positions"  # on a mask: (query positions [B, T], key positions [B, S])


class _MaskLayout:
    """Per-sequence key compaction and query positions derived from HF's 4-D mask, cached per mask."""

    def __init__(self) -> None:
        self._mask: Any = None
        self._shape: tuple[int, ...] = ()
        self._layout: tuple[Any, Any, Any] = (None, None, None)

    def get(self, mask: Any, b: int, t: int, s: int, device: Any) -> tuple[Any, Any, Any]:
        """``(q_positions [B, T], key_index [B, S'] or None, kv_lens [B])``."""
        if mask is not None and mask is self._mask and self._shape == (b, t, s):
            return self._layout
        layout = self._compute(mask, b, t, s, device)
        self._mask, self._shape, self._layout = mask, (b, t, s), layout
        return layout

    @staticmethod
    def _compute(mask: Any, b: int, t: int, s: int, device: Any) -> tuple[Any, Any, Any]:
        import torch

        if mask is None:  # plain causal, no padding
            q_pos = torch.arange(s - t, s, device=device).expand(b, t)
            return q_pos, None, torch.full((b,), s, dtype=torch.int64, device=device)
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise NotImplementedError(f"consistent attention: mask of shape {tuple(mask.shape)}")
        visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        visible = visible.expand(b, t, s)
        key_real = visible.any(1)
        kv_lens = key_real.sum(-1)
        q_pos = visible.sum(-1) - 1
        order = torch.sort((~key_real).to(torch.uint8), dim=-1, stable=True).indices
        identity = bool((order == torch.arange(s, device=device)).all())
        compact = visible if identity else visible.gather(-1, order[:, None, :].expand(b, t, s))
        if not torch.equal(compact, torch.arange(s, device=device) <= q_pos[..., None]):
            raise NotImplementedError(
                "consistent attention: the mask is not a causal prefix per sequence (sliding window, packed sequences?)"
            )
        key_index = None if identity else order[:, : int(kv_lens.max())]
        return q_pos, key_index, kv_lens


def attention_function() -> Callable:
    from logdiff import kernels

    layouts = _MaskLayout()
    placed = _PlacedKeys()

    def consistent_attention(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        if dropout:
            raise NotImplementedError("consistent attention: dropout (call model.eval())")
        b, _, t, d = query.shape
        s = key.shape[2]
        window = int(sliding_window) if sliding_window else None
        positions = getattr(attention_mask, _POSITIONS_TAG, None)
        if positions is not None:  # the mask came from consistent_mask: keys go to their absolute positions
            q_pos, slots, kv_lens = placed.get(attention_mask, positions, window)
            key, value = _place_keys(key, slots, int(kv_lens.max())), _place_keys(value, slots, int(kv_lens.max()))
        else:
            if window:
                raise NotImplementedError("consistent attention: a sliding window needs the consistent mask")
            q_pos, key_index, kv_lens = layouts.get(attention_mask, b, t, s, query.device)
            if key_index is not None:
                index = key_index[:, None, :, None].expand(-1, key.shape[1], -1, d)
                v_index = key_index[:, None, :, None].expand(-1, value.shape[1], -1, value.shape[-1])
                key, value = key.gather(2, index), value.gather(2, v_index)
        scale = d**-0.5 if scaling is None else float(scaling)
        out = kernels.attention_batched(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), q_pos, scale, kv_lens,
            kwargs.get("softcap"), window, kwargs.get("s_aux"),
        )
        return out, None

    return consistent_attention


def consistent_mask(*args: Any, **kwargs: Any) -> Any:
    """HF's boolean sdpa mask, always materialised (never the ``None`` 'is_causal' shortcut), tagged with
    each query's and key's absolute position (:func:`_mask_positions`)."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    if mask is not None:
        bound = inspect.signature(sdpa_mask).bind(*args, **kwargs)
        bound.apply_defaults()
        setattr(mask, _POSITIONS_TAG, _mask_positions(**{k: bound.arguments[k] for k in _POSITION_ARGS}))
    return mask


_POSITION_ARGS = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "attention_mask")


def _mask_positions(
    batch_size: int, q_length: int, kv_length: int, q_offset: Any, kv_offset: int, attention_mask: Any
) -> tuple[Any, Any]:
    """``(query positions [B, T], key positions [B, S])``: the absolute position of each query and key of a
    mask call, -1 for padding. Columns of the 2-D padding mask are the cache's token slots (a sliding-window
    cache's keys start at ``kv_offset``); a token's position is the number of real tokens before it."""
    import torch

    total = int(kv_offset) + int(kv_length)
    if attention_mask is None:
        real = torch.ones(batch_size, total, dtype=torch.bool)
    else:
        real = attention_mask.bool().cpu()
        if real.shape[-1] < total:  # HF pads the 2-D mask with real tokens the same way (prepare_padding_mask)
            real = torch.nn.functional.pad(real, (0, total - real.shape[-1]), value=True)
        real = real[:, :total].expand(batch_size, total)
    slot_pos = torch.where(real, real.long().cumsum(-1) - 1, -1)
    q_slots = torch.arange(int(q_offset), int(q_offset) + int(q_length))
    return slot_pos[:, q_slots], slot_pos[:, int(kv_offset) : total]


def _place_keys(x: Any, slots: Any, length: int) -> Any:
    """Keys (or values) ``[B, H, S, D]`` moved to their absolute positions ``[B, H, length, D]``; slots no key
    fills (keys a sliding-window cache dropped) stay zero, and padding keys (slot ``length``) are dropped."""
    b, h, _, d = x.shape
    out = x.new_zeros(b, h, length + 1, d)
    out.scatter_(2, slots[:, None, :, None].expand(b, h, -1, d).to(x.device), x)
    return out[:, :, :length]


class _PlacedKeys:
    """Per mask (and window): query positions, each key's slot and ``kv_lens``, checked against the mask."""

    def __init__(self) -> None:
        self._last: list[tuple[Any, Any, tuple[Any, Any, Any]]] = []  # (mask, window, layout), newest last

    def get(self, mask: Any, positions: tuple[Any, Any], window: int | None) -> tuple[Any, Any, Any]:
        for held, held_window, layout in self._last:
            if held is mask and held_window == window:
                return layout
        layout = self._compute(mask, *positions, window)
        self._last = [*self._last[-3:], (mask, window, layout)]  # a hybrid model alternates two masks
        return layout

    @staticmethod
    def _compute(mask: Any, q_pos: Any, key_pos: Any, window: int | None) -> tuple[Any, Any, Any]:
        """Raises where the kernel would not see what the mask shows (another mask function, missing keys)."""
        import torch

        device = mask.device
        q_pos, key_pos = q_pos.to(device), key_pos.to(device)
        kv_lens = (key_pos.amax(-1) + 1).clamp(min=0)
        length = int(kv_lens.max())
        slots = torch.where(key_pos >= 0, key_pos, length)
        # what the kernel shows each real query, in the mask's own columns
        sees = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos[..., None])
        if window:
            sees &= key_pos[:, None, :] > q_pos[..., None] - window
        visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        real = (q_pos >= 0)[..., None]
        if not torch.equal(visible.expand_as(sees) & real, sees & real):
            raise NotImplementedError(
                "consistent attention: the mask is not causal per sequence (with the layer's window): packed sequences?"
            )
        # every key a real query sees must be in the cache (a sliding-window cache drops only older ones)
        present = torch.zeros(key_pos.shape[0], length + 1, dtype=torch.long, device=device)
        present.scatter_(1, slots, 1)
        needed = q_pos + 1 if not window else torch.minimum(q_pos + 1, torch.full_like(q_pos, window))
        have = present[:, :length].cumsum(-1)
        first = (q_pos - needed).clamp(min=-1)
        count = have.gather(1, q_pos.clamp(min=0)) - torch.where(first >= 0, have.gather(1, first.clamp(min=0)), 0)
        if bool(((count != needed) & (q_pos >= 0)).any()):
            raise NotImplementedError("consistent attention: a key in a query's window is missing from the cache")
        return q_pos, slots, kv_lens
