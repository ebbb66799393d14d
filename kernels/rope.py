"""Rotary position embedding computed once, at one precision, with one rounding.

``rope(x, positions, theta, style, rotary_dim)`` rotates the first
``rotary_dim`` features of every head of ``x`` by the angles
``positions * inv_freq``, ``inv_freq[i] = theta ** (-2i / rotary_dim)``.

Why it is invariant and engine-independent:

* **cos/sin come from one table.** The angles and their cos/sin are evaluated
  in fp64 and rounded once to fp32, for blocks of :data:`TABLE_BLOCK` positions
  at a time, every block with the same call shape (and under the serial
  threshold of every elementwise op), so the entry for position ``p`` has the
  same bits however many positions a call asks for, in prefill or in decode.
  Tables are cached per ``(theta, rotary_dim, device)`` and grown block by block,
  so a model with a base per layer type (Gemma 3: 10k on sliding layers, 1M on
  full ones) passes each layer's ``theta`` and reads that base's own table; the
  kernel keeps no per-model theta.
  HF computes cos/sin in fp32 then rounds them to the model dtype; vLLM keeps
  its own cache; with this table both sides read identical numbers.
* **The rotation is fp32 and rounded once.** ``o1 = x1*c - x2*s``,
  ``o2 = x2*c + x1*s`` as four multiplies and two adds (separate, correctly
  rounded ops: no fused multiply-add whose use could depend on the code path),
  then one rounding to ``x.dtype``.

``style="neox"`` pairs feature ``i`` with ``i + rotary_dim/2`` (HF
``rotate_half``; Llama, Qwen); ``style="gptj"`` pairs ``2i`` with ``2i+1``.
Features past ``rotary_dim`` pass through unchanged.
"""

from __future__ import annotations

import torch

from .caches import active
from .differentiable import needs_grad

TABLE_BLOCK_ELEMENTS = 1024
"""Upper bound on the elements of one table-block call (below every serial threshold)."""

def _block_positions(half: int) -> int:
    return max(1, TABLE_BLOCK_ELEMENTS // half)


def _table_block(block: int, theta: float, rotary_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    half = rotary_dim // 2
    rows = _block_positions(half)
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    pos = torch.arange(block * rows, (block + 1) * rows, dtype=torch.float64, device=device)
    angles = pos[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def _table(theta: float, rotary_dim: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (float(theta), int(rotary_dim), str(device))
    caches = active()
    tables = caches.rope_tables if caches is not None else {}
    cos, sin = tables.get(key, (None, None))
    have = 0 if cos is None else cos.shape[0]
    if have < length:
        rows = _block_positions(rotary_dim // 2)
        blocks = [_table_block(b, theta, rotary_dim, device) for b in range(have // rows, -(-length // rows))]
        new_cos = [c for c, _ in blocks]
        new_sin = [s for _, s in blocks]
        cos = torch.cat(([cos] if cos is not None else []) + new_cos)
        sin = torch.cat(([sin] if sin is not None else []) + new_sin)
        tables[key] = (cos, sin)
    return cos, sin


def rope_cos_sin(positions: torch.Tensor, theta: float, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[*positions.shape, rotary_dim // 2]`` from the shared table."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    positions = positions.long()
    length = int(positions.max()) + 1 if positions.numel() else 0
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("rope: negative position")
    cos, sin = _table(theta, rotary_dim, length, positions.device)
    return cos[positions], sin[positions]


def _pairs(x32: torch.Tensor, rotary_dim: int, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    if style == "neox":
        half = rotary_dim // 2
        return x32[..., :half], x32[..., half:rotary_dim]
    if style == "gptj":
        return x32[..., 0:rotary_dim:2], x32[..., 1:rotary_dim:2]
    raise ValueError(f"rope style must be 'neox' or 'gptj', got {style!r}")


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    """Rotate ``x`` (``[..., D]``) by fp32 ``cos``/``sin`` (``[..., rotary_dim/2]``, broadcastable).

    The rotation is fp32 and rounded once to ``x.dtype``. Differentiable in ``x``
    (cos/sin are constants: a table lookup); the gradient is the inverse rotation.
    """
    if needs_grad(x):
        if cos.requires_grad or sin.requires_grad:
            raise ValueError("rope_apply: cos/sin come from the table and take no gradient")
        return _RopeApply.apply(x, cos, sin, style)
    return _rope_apply(x, cos, sin, style)


def _rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    x32 = x.float()
    x1, x2 = _pairs(x32, rotary_dim, style)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if style == "neox":
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat([rotated, x32[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)


class _RopeApply(torch.autograd.Function):
    """The transpose of a rotation is the rotation by ``-angle``: ``dx = rope_apply(dy, cos, -sin)``."""

    @staticmethod
    def forward(ctx, x, cos, sin, style):  # noqa: ANN001, ANN205
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _rope_apply(x, cos, sin, style)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        cos, sin = ctx.saved_tensors
        return _rope_apply(dy, cos, -sin, ctx.style), None, None, None


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    style: str = "neox",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """RoPE on x ``[..., T, H, D]`` at absolute int positions ``[T]``."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = rope_cos_sin(positions, theta, rotary_dim)
    return rope_apply(x, cos.unsqueeze(-2), sin.unsqueeze(-2), style)


def rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    style: str = "neox",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """HF's ``rotate_half`` formula (or the interleaved one) in fp32, fp64 for fp64 input."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    xr, rest = x.to(dtype)[..., :rotary_dim], x.to(dtype)[..., rotary_dim:]
    if style == "neox":
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1).to(x.dtype)
