"""Multi-head latent attention (DeepSeek-V2/V3 MLA) from the cached latent, on the consistent kernels.

MLA caches per token one normed latent ``c`` (``kv_lora_rank`` wide) and one
RoPE'd key ``k_pe`` shared by every head. Attention needs per head
``k = [k_nope | k_pe]`` (``qk_nope + qk_rope`` wide) and ``v`` (``v_head_dim``
wide), where ``[k_nope | v] = c @ W_kv_b.T`` per head. :func:`latent_attention`
computes exactly that, in one fixed way:

* the up-projection is :func:`matmul.linear` on the latent rows: every row's
  bits are those of its own 16-row GEMM tile, whatever else the call holds, so
  a decode step that up-projects the whole cache again gives every cached
  token the bits the prefill gave it;
* ``k`` is assembled by copies (``k_pe`` broadcast over heads: no arithmetic);
* softmax attention is :func:`attention.attention_batched`, whose value heads
  may differ in size from its q/k heads (192 vs 128 here).

No weight absorption: vLLM's decode folds ``W_kv_b`` into the query and the
output (``q W_UK`` against the latent, then ``W_UV``), another association of
the same products, whose bits differ from prefill's and HF's; here both are
the same explicit up-projection. HF's consistent mode runs the same steps
through its own modules (``expand_kv``: ``kv_b_proj`` on the ``linear`` kernel,
then the consistent attention function), so both engines compute the same bits.
"""

from __future__ import annotations

import torch

from .attention import attention_batched, attention_reference
from .matmul import linear


def latent_kv(
    latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values from the latent: latent ``[..., S, R]``, k_pe ``[..., S, P]``, kv_b_weight
    ``[H * (nope + v), R]`` -> k ``[..., S, H, nope + P]``, v ``[..., S, H, v]`` (in the latent's dtype)."""
    per_head = qk_nope_head_dim + v_head_dim
    if kv_b_weight.shape[0] % per_head:
        raise ValueError(f"latent_kv: kv_b_proj has {kv_b_weight.shape[0]} rows, not a multiple of {per_head}")
    heads = kv_b_weight.shape[0] // per_head
    kv = linear(latent, kv_b_weight).unflatten(-1, (heads, per_head))
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], heads, k_pe.shape[-1])], dim=-1)
    return k, v.contiguous()


def latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_lens: torch.Tensor,
    v_head_dim: int,
) -> torch.Tensor:
    """Padded batch: q ``[B, T, H, nope + P]`` (``[q_nope | rope(q_pe)]``), latent ``[B, S, R]``, k_pe
    ``[B, S, P]`` (RoPE'd), q_positions ``[B, T]`` (-1: no query), kv_lens ``[B]`` -> ``[B, T, H, v_head_dim]``.

    Query ``i`` of sequence ``b`` sees cached tokens ``0..q_positions[b, i]``; rows of the latent past
    ``kv_lens[b]`` are never read into a visible score (zeros are fine).
    """
    nope = q.shape[-1] - k_pe.shape[-1]
    k, v = latent_kv(latent, k_pe, kv_b_weight, nope, v_head_dim)
    return attention_batched(q, k, v, q_positions, scale, kv_lens)


def latent_attention_reference(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    kv_len: int,
    v_head_dim: int,
) -> torch.Tensor:
    """One sequence (q ``[T, H, nope + P]``, latent ``[S, R]``, k_pe ``[S, P]``), plain torch in fp32 (fp64 for
    fp64 input): ``F.linear`` up-projection, then :func:`attention.attention_reference`."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads = q.shape[-2]
    nope = q.shape[-1] - k_pe.shape[-1]
    kv = torch.nn.functional.linear(latent.to(dtype), kv_b_weight.to(dtype)).view(latent.shape[0], heads, -1)
    k = torch.cat([kv[..., :nope], k_pe.to(dtype)[:, None, :].expand(-1, heads, -1)], dim=-1)
    v = kv[..., nope : nope + v_head_dim]
    return attention_reference(q.to(dtype), k, v, q_positions, scale, kv_len).to(q.dtype)
