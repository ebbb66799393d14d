"""Mixture-of-experts routing and combine with one fixed order.

:func:`moe_route` is softmax top-k routing (Qwen2/3-MoE, Mixtral):
fp32 softmax of the router logits (position-independent ``exp``, fixed-order
sum over experts), then the ``top_k`` largest probabilities, ties going to the
lower expert index (a stable descending sort, not ``torch.topk``, whose tie
order is unspecified), optionally renormalised by their sum added in rank order.
Returns fp32 weights ``[T, k]`` and int64 expert ids ``[T, k]``.

:func:`moe_route_grouped` is the routing of DeepSeek-V3 and GLM-4.5 (and,
with ``scoring="softmax"`` and no bias, DeepSeek-V2's group-limited greedy):
scores are ``sigmoid`` (or softmax) of the fp32 logits, position-independent
(:func:`fixed_order.exp`); experts are *chosen* on ``scores + bias`` (the
correction bias; none: the scores) within the ``topk_group`` best of
``n_group`` contiguous groups, a group scored by the rank-order sum of its
``group_top`` best choice scores (2 with a bias, as V3/GLM, else 1: the
maximum, as V2); ties in either ranking go to the lower index. The
*weights* are the unbiased scores at the chosen experts, renormalised by
their rank-order sum (``+ 1e-20``, as HF) when asked, times
``routed_scaling_factor`` (``scaling``), all in fp32. HF scales the weights,
vLLM the routed output; consistent mode runs both through this function.

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

from collections.abc import Callable, Iterable

import torch

from .activation import silu_and_mul
from .differentiable import needs_grad
from .fixed_order import exp, halving_sum
from .matmul import linear


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], expert ids int64 [T, k])`` from router logits ``[T, E]``.

    Differentiable in the logits (the ids are constants of the backward).
    """
    if needs_grad(router_logits):
        return _Route.apply(router_logits, top_k, renormalize)
    return _route(router_logits, top_k, renormalize)[:2]


def _rank_sum(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """``terms[0] + terms[1] + ...`` left to right, in rank order (terms made one at a time)."""
    it = iter(terms)
    total = next(it).clone()
    for term in it:
        total += term
    return total


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Position-independent fp32 ``sigmoid`` (``1 / (1 + exp(-x))``) or softmax of ``[T, E]`` logits."""
    if scoring == "sigmoid":
        return 1.0 / (1.0 + exp(-logits))
    e = exp(logits - logits.amax(-1, keepdim=True))
    return e / halving_sum(e, -1).unsqueeze(-1)


def _scores_grad(d_scores: torch.Tensor, scores: torch.Tensor, scoring: str) -> torch.Tensor:
    """The logits' gradient through :func:`_scores` (the softmax's row sum in the same halving order)."""
    if scoring == "sigmoid":
        return d_scores * (scores * (1.0 - scores))
    return scores * (d_scores - halving_sum(d_scores * scores, -1).unsqueeze(-1))


def _route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, ...]:
    """``(weights, ids, probs [T, E], top probabilities before renormalisation)``."""
    probs = _scores(router_logits.float().reshape(-1, router_logits.shape[-1]), "softmax")
    ranked, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = ranked[:, :top_k].contiguous(), ids[:, :top_k].contiguous()
    weights = top / _rank_sum(top.unbind(1)).unsqueeze(-1) if renormalize else top
    return weights, ids, probs, top


class _Route(torch.autograd.Function):
    """Row-local backward: through the renormalisation (rank-order sums), then the softmax (halving sum)."""

    @staticmethod
    def forward(ctx, router_logits, top_k, renormalize):  # noqa: ANN001, ANN205
        weights, ids, probs, top = _route(router_logits, top_k, renormalize)
        ctx.save_for_backward(ids, probs, top)
        ctx.renormalize, ctx.logits_dtype, ctx.logits_shape = renormalize, router_logits.dtype, router_logits.shape
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, d_weights, _d_ids):  # noqa: ANN001, ANN205
        ids, probs, top = ctx.saved_tensors
        d_top = d_weights.float()
        if ctx.renormalize:
            total = _rank_sum(top.unbind(1)).unsqueeze(-1)
            dot = _rank_sum((d_top * (top / total)).unbind(1)).unsqueeze(-1)
            d_top = (d_top - dot) / total
        d_logits = _scores_grad(torch.zeros_like(probs).scatter_(-1, ids, d_top), probs, "softmax")
        return d_logits.to(ctx.logits_dtype).view(ctx.logits_shape), None, None


def moe_route_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    scoring: str = "sigmoid",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_top: int | None = None,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], expert ids int64 [T, k])`` by grouped, bias-corrected top-k (module docstring).

    Differentiable in the logits (the ids and the bias are constants of the backward).
    """
    rule = _GroupedRule(top_k, renormalize, scoring, n_group, topk_group, group_top, float(scaling))
    rule.check(router_logits.shape[-1])
    if needs_grad(router_logits):
        return _GroupedRoute.apply(router_logits, bias, rule)
    return _route_grouped(router_logits, bias, rule)[:2]


class _GroupedRule:
    """The settings of :func:`moe_route_grouped`, checked once."""

    def __init__(self, top_k: int, renormalize: bool, scoring: str, n_group: int, topk_group: int,
                 group_top: int | None, scaling: float) -> None:  # fmt: skip
        self.top_k, self.renormalize, self.scoring = int(top_k), bool(renormalize), scoring
        self.n_group, self.topk_group, self.group_top, self.scaling = int(n_group), int(topk_group), group_top, scaling

    def check(self, num_experts: int) -> None:
        if self.scoring not in ("sigmoid", "softmax"):
            raise NotImplementedError(f"moe_route_grouped: scoring {self.scoring!r} (sigmoid or softmax)")
        if self.n_group < 1 or num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"moe_route_grouped: {num_experts} experts in {self.n_group} groups, top {self.topk_group}")
        if self.top_k > self.topk_group * (num_experts // self.n_group):
            raise ValueError(f"moe_route_grouped: top_k {self.top_k} exceeds the experts of {self.topk_group} groups")


def _route_grouped(router_logits: torch.Tensor, bias: torch.Tensor | None, rule: _GroupedRule) -> tuple[torch.Tensor, ...]:
    """``(weights, ids, scores [T, E], top scores before renormalisation)``."""
    logits = router_logits.float().reshape(-1, router_logits.shape[-1])
    t, num_experts = logits.shape
    scores = _scores(logits, rule.scoring)
    choice = scores if bias is None else scores + bias.float().to(scores.device)
    if rule.n_group > 1 and rule.topk_group < rule.n_group:
        per_group = choice.view(t, rule.n_group, num_experts // rule.n_group)
        group_top = rule.group_top or (2 if bias is not None else 1)
        best = torch.sort(per_group, dim=-1, descending=True, stable=True).values[..., :group_top]
        group_scores = _rank_sum(best.unbind(-1))
        groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, : rule.topk_group]
        keep = torch.zeros(t, rule.n_group, dtype=torch.bool, device=logits.device).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(per_group).reshape(t, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : rule.top_k].contiguous()
    top = scores.gather(1, ids)
    weights = top / (_rank_sum(top.unbind(1)) + 1e-20).unsqueeze(-1) if rule.renormalize else top
    return weights * rule.scaling, ids, scores, top


class _GroupedRoute(torch.autograd.Function):
    """Row-local backward: scaling, the renormalisation (rank-order sums), then the sigmoid or softmax."""

    @staticmethod
    def forward(ctx, router_logits, bias, rule):  # noqa: ANN001, ANN205
        weights, ids, scores, top = _route_grouped(router_logits, bias, rule)
        ctx.save_for_backward(ids, scores, top)
        ctx.rule, ctx.logits_dtype, ctx.logits_shape = rule, router_logits.dtype, router_logits.shape
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, d_weights, _d_ids):  # noqa: ANN001, ANN205
        ids, scores, top = ctx.saved_tensors
        rule = ctx.rule
        d_top = d_weights.float() * rule.scaling
        if rule.renormalize:
            total = (_rank_sum(top.unbind(1)) + 1e-20).unsqueeze(-1)
            dot = _rank_sum((d_top * (top / total)).unbind(1)).unsqueeze(-1)
            d_top = (d_top - dot) / total
        d_logits = _scores_grad(torch.zeros_like(scores).scatter_(-1, ids, d_top), scores, rule.scoring)
        return d_logits.to(ctx.logits_dtype).view(ctx.logits_shape), None, None


def moe_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_r weights[:, r] * expert(ids[:, r], x)`` for x ``[T, H]``, in fp32 rank order, rounded once.

    Differentiable in ``x``, ``weights`` and whatever the expert's output depends on.
    """
    t, k = ids.shape
    rows = x.reshape(t, -1)
    slot_rows = _SlotRows.apply(rows, k) if needs_grad(rows) else None
    outputs: torch.Tensor | None = None
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        slots = (flat_ids == e).nonzero(as_tuple=True)[0]  # slot = token * k + rank
        out_e = expert(int(e), rows[slots // k] if slot_rows is None else slot_rows[slots])
        if outputs is None:
            outputs = torch.zeros(t * k, out_e.shape[-1], dtype=out_e.dtype, device=x.device)
        outputs[slots] = out_e
    if outputs is None:  # no tokens
        return torch.zeros_like(rows).view(x.shape)
    outputs = outputs.view(t, k, -1).float()
    w = weights.float()
    total = _WeightedSum.apply(outputs, w) if needs_grad(outputs, w) else _weighted_sum(outputs, w)
    return total.to(x.dtype).view(*x.shape[:-1], -1)


def _weighted_sum(outputs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_r w[:, r] * outputs[:, r]`` in rank order."""
    return _rank_sum(outputs[:, r] * w[:, r : r + 1] for r in range(w.shape[1]))


class _WeightedSum(torch.autograd.Function):
    """Backward: ``d_outputs[:, r] = dy * w[:, r]``; ``d_w[:, r] = halving_sum(dy * outputs[:, r])`` (per token)."""

    @staticmethod
    def forward(ctx, outputs, w):  # noqa: ANN001, ANN205
        ctx.save_for_backward(outputs, w)
        return _weighted_sum(outputs, w)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        outputs, w = ctx.saved_tensors
        d_outputs = dy.unsqueeze(1) * w.unsqueeze(-1) if ctx.needs_input_grad[0] else None
        d_w = halving_sum(dy.unsqueeze(1) * outputs, -1) if ctx.needs_input_grad[1] else None
        return d_outputs, d_w


class _SlotRows(torch.autograd.Function):
    """Each token's row once per rank (slot ``t * k + r``); backward adds a token's k slots in rank order."""

    @staticmethod
    def forward(ctx, rows, k):  # noqa: ANN001, ANN205
        ctx.k = k
        return rows.repeat_interleave(k, dim=0)

    @staticmethod
    def backward(ctx, d_slots):  # noqa: ANN001, ANN205
        per_rank = d_slots.view(-1, ctx.k, d_slots.shape[-1]).unbind(1)
        return _rank_sum(per_rank), None


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


def moe_route_grouped_reference(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    scoring: str = "sigmoid",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_top: int | None = None,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``Glm4MoeTopkRouter`` / ``DeepseekV3TopkRouter`` rule in plain torch (fp32, fp64 for fp64 input)."""
    dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    logits = router_logits.to(dtype)
    scores = logits.sigmoid() if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.to(dtype)
    t, num_experts = choice.shape
    per_group = choice.view(t, n_group, num_experts // n_group)
    group_scores = per_group.topk(group_top or (2 if bias is not None else 1), dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    choice = choice.masked_fill(~mask.unsqueeze(-1).expand_as(per_group).reshape(t, num_experts), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


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


def moe_experts_oai(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """gpt-oss's experts, combined: biased ``w13 [E, 2I, H]`` whose rows interleave gate and up (``b13 [E, 2I]``),
    the clamped SwiGLU (:func:`swiglu_oai_and_mul`), biased ``w2 [E, H, I]`` (``b2 [E, H]``).

    HF stores the transpose (``gate_up_proj [E, H, 2I]``); vLLM's ``w13_weight`` is this layout.
    """
    from .activation import swiglu_oai_and_mul

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = linear(rows, w13[e], b13[e])
        return linear(swiglu_oai_and_mul(gate_up[:, 0::2], gate_up[:, 1::2], alpha, limit), w2[e], b2[e])

    return moe_combine(x, weights, ids, expert)
