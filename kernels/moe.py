"""Mixture-of-experts routing and combine with one fixed order.

:func:`moe_route` is softmax top-k routing (Qwen2/3-MoE, Mixtral):
fp32 softmax of the router logits (position-independent ``exp``, fixed-order
sum over experts), then the ``top_k`` largest probabilities, ties going to the
lower expert index (a stable descending sort, not ``torch.topk``, whose tie
order is unspecified), optionally renormalised by their sum added in rank order.
Returns fp32 weights ``[T, k]`` and int64 expert ids ``[T, k]``.

:func:`moe_combine` runs the experts and adds their outputs. Each expert sees
only the rows routed to it; the expert function must be row-invariant (built
from :func:`linear` and :func:`silu_and_mul`, it is), so which other tokens
share an expert call does not matter. The weighted sum is
``sum_r weights[t, r] * out[t, r]`` in fp32 in rank order ``r = 0..k-1``,
rounded once to ``x.dtype``. HF's sparse block instead scales in the model
dtype and ``index_add_``s in expert order, and vLLM's fused kernel has its own
order; routing both through this function gives one order.

:func:`moe_experts` is the expert MLP for weights stored as 3-D tensors
(HF ``Qwen3MoeExperts``, vLLM ``FusedMoE``): ``w13 [E, 2I, H]`` = cat(gate, up),
``w2 [E, H, I]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .activation import silu_and_mul
from .fixed_order import exp, halving_sum
from .matmul import linear


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], expert ids int64 [T, k])`` from router logits ``[T, E]``."""
    logits = router_logits.float().reshape(-1, router_logits.shape[-1])
    e = exp(logits - logits.amax(-1, keepdim=True))
    probs = e / halving_sum(e, -1).unsqueeze(-1)
    ranked, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ranked[:, :top_k].contiguous(), ids[:, :top_k].contiguous()
    if renormalize:
        total = weights[:, 0].clone()
        for r in range(1, top_k):
            total += weights[:, r]
        weights = weights / total.unsqueeze(-1)
    return weights, ids


def moe_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_r weights[:, r] * expert(ids[:, r], x)`` for x ``[T, H]``, in fp32 rank order, rounded once."""
    t, k = ids.shape
    rows = x.reshape(t, -1)
    outputs: torch.Tensor | None = None
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        slots = (flat_ids == e).nonzero(as_tuple=True)[0]  # slot = token * k + rank
        out_e = expert(int(e), rows[slots // k])
        if outputs is None:
            outputs = torch.zeros(t * k, out_e.shape[-1], dtype=out_e.dtype, device=x.device)
        outputs[slots] = out_e
    if outputs is None:  # no tokens
        return torch.zeros_like(rows).view(x.shape)
    outputs = outputs.view(t, k, -1).float()
    w = weights.float()
    total = outputs[:, 0] * w[:, :1]
    for r in range(1, k):
        total += outputs[:, r] * w[:, r : r + 1]
    return total.to(x.dtype).view(*x.shape[:-1], -1)


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Gated-SiLU experts with 3-D weights ``w13 [E, 2I, H]`` (gate; up), ``w2 [E, H, I]``, combined."""
    inter = w2.shape[-1]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = linear(rows, w13[e], output_sizes=(inter, inter))
        return linear(silu_and_mul(gate_up[:, :inter], gate_up[:, inter:]), w2[e])

    return moe_combine(x, weights, ids, expert)


def moe_route_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routing: ``softmax`` in fp32 (fp64 for fp64 input), ``torch.topk``, optional renormalisation."""
    dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(router_logits.to(dtype), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def moe_combine_reference(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Per token and rank, ``weight * expert(x_t)`` summed with ``torch.sum`` (fp32, fp64 for fp64 input)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.reshape(ids.shape[0], -1)
    outs = torch.stack(
        [
            torch.stack([expert(int(ids[t, r]), rows[t : t + 1])[0].to(dtype) for r in range(ids.shape[1])])
            for t in range(ids.shape[0])
        ]
    )
    return (outs * weights.to(dtype).unsqueeze(-1)).sum(1).to(x.dtype)
