"""How a tap pulls boundary tensors out of a module's input or output (``Tap.select``).

Engines fuse and pack differently: a module may return a tensor, a tuple
(vLLM's RMSNorm returns ``(normed, residual)``), a packed projection whose
parts are separate boundaries (``qkv_proj``, ``gate_up_proj``, MLA's latent
projections), or a model output object (Gemma's soft-capped ``logits``).
``select`` undoes that, given the module that called the tapped one (its
attributes size the parts). The selections are documented on ``correspondence.Tap``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def select(how: str, value: Any, caller: Any, warn: Callable[[str], None]) -> list[Any] | None:
    """The tensors selection ``how`` pulls out of ``value``; None where it holds none (``caller``: the module
    that called the tapped one; ``warn``: where a part that cannot be sized is reported)."""
    if how in ("tensor", "heads_first"):
        return [value] if _is_tensor(value) else None
    if how == "first":
        if _is_tensor(value):
            return [value]
        return [value[0]] if isinstance(value, (tuple, list)) and value and _is_tensor(value[0]) else None
    if how == "logits_field":  # a model output's soft-capped ``logits`` (Gemma)
        logits = getattr(value, "logits", None)
        return [logits] if _is_tensor(logits) else None
    if how in ("pair", "norm_pair"):
        if _is_tensor(value):
            return [value, None] if how == "norm_pair" else None
        return [value[0], value[1]] if isinstance(value, (tuple, list)) and len(value) >= 2 else None
    if how == "pair_deinterleaved":  # GPT-J RoPE output in HF's rope_interleave layout: even, then odd lanes
        if not (isinstance(value, (tuple, list)) and len(value) >= 2):
            return None
        return [deinterleave(value[0]), deinterleave(value[1])]
    out = value[0] if isinstance(value, (tuple, list)) else value
    if how == "split_qkv":
        q, kv = _qkv_sizes(caller)
        if q is None or kv is None:
            warn(f"{type(caller).__name__} has no q_size/kv_size or head counts; cannot split qkv_proj")
            return None
        return list(out.split([q, kv, kv], dim=-1))
    if how == "split_half":
        return list(out.chunk(2, dim=-1))
    if how.startswith(("split:", "split_heads:")):
        return _split_by_attributes(how, out, caller, warn)
    raise ValueError(f"unknown tap selection {how!r}")


def _split_by_attributes(how: str, out: Any, caller: Any, warn: Callable[[str], None]) -> list[Any] | None:
    """``split:a,b``: the last dim in parts of the calling module's attributes ``a``, ``b`` (MLA's
    ``kv_lora_rank``, ``qk_rope_head_dim``); ``split_heads:a,b``: each head's slice in such parts."""
    kind, _, attrs = how.partition(":")
    sizes = [getattr(caller, a, None) for a in attrs.split(",")]
    if any(not isinstance(n, int) for n in sizes):
        warn(f"{type(caller).__name__} has no {attrs}; cannot split its projection")
        return None
    if kind == "split_heads":
        out = out.reshape(*out.shape[:-1], -1, sum(sizes))
    return list(out.split(sizes, dim=-1))


def _qkv_sizes(attn: Any) -> tuple[int | None, int | None]:
    """(q, k/v) widths of a packed qkv output: vLLM's ``q_size``/``kv_size``, else HF's head counts (Phi-3)."""
    q, kv = getattr(attn, "q_size", None), getattr(attn, "kv_size", None)
    if q is None and hasattr(attn, "head_dim") and hasattr(attn, "num_key_value_heads"):
        config = getattr(attn, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if heads is not None:
            q, kv = heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
    return q, kv


def deinterleave(x: Any) -> Any:
    """``[x0, x1, x2, x3, ...]`` -> ``[x0, x2, ..., x1, x3, ...]`` along the last dim."""
    import torch

    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)
