"""MoE routing rules: which experts one side sends a token to, and how near each decision was.

A ``Rule`` is what one engine's router does for this model's config, read from
the side's effective contract (``rule_of``). The contract readers read it from
each engine's router as its code applies it (the architecture adapters): HF's
DeepSeek-V2 routes greedily under ``topk_method: greedy`` whatever ``n_group``
says, while vLLM routes every DeepSeek model grouped. A rule makes up to two
decisions per token:

* the **group choice** (grouped rules): the ``topk_group`` best of ``n_group``
  contiguous groups of experts, a group scoring its best expert, or the sum of
  its best two where a correction bias steers the choice (vLLM's grouped top-k,
  HF's ``*TopkRouter``s, ``kernels.moe_route_grouped``);
* the **expert choice**: the ``top_k`` best experts inside the chosen groups.

A grouped rule that keeps every group is greedy top-k, so both read as one
group (``logdiff.probes.contracts.expert_groups``): two engines that choose
alike have equal rules, whatever their configs spell.

What the decisions rank: without a correction bias the router logits
themselves (softmax and sigmoid are monotone, and a group's best expert is its
best logit), so margins are in logits whatever the scoring or grouping; with a
bias the choice scores ``scores + bias``. A decision's margin is the gap
between its last chosen and its first unchosen candidate: the k-th and
(k+1)-th expert among the eligible ones, or the ``topk_group``-th and next group.

A flip (two sides' expert sets differ) is *certain* when an expert is surely
chosen on one side and surely not on the other, whichever way each engine
breaks an exact tie (of experts at the k-th place or of groups at the
``topk_group``-th). It is a flip **at the group choice** when one side chose
an expert whose group the other side's group choice surely excluded, and
**at the expert choice** otherwise; its margin is that decision's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from logdiff.probes.contracts import expert_groups


@dataclass(frozen=True)
class Rule:
    """One side's routing rule: how many experts, whether their weights are renormalized, and (grouped or
    sigmoid routing) the scoring, the groups and the scaling of the weights."""

    top_k: int
    renormalize: bool
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    @property
    def grouped(self) -> bool:
        """Whether a group choice restricts the expert choice (some group can be left out)."""
        return self.n_group > 1 and self.topk_group < self.n_group

    @property
    def plain(self) -> bool:
        """Softmax top-k over every expert (Qwen-MoE, Mixtral, DeepSeek-V2's ``greedy``)."""
        return self.scoring == "softmax" and not self.grouped

    def summary(self) -> dict[str, Any]:
        """The rule for result.json: top-k and renormalisation, plus the rest where it is not plain top-k."""
        out = vars(self).copy()
        return {"top_k": self.top_k, "renormalize": self.renormalize} if self.plain and self.scaling == 1.0 else out

    def describe(self) -> str:
        """One phrase: ``softmax top-2 within the best 1 of 2 expert groups``."""
        where = f"within the best {self.topk_group} of {self.n_group} expert groups" if self.grouped else "of all experts"
        out = f"{self.scoring} top-{self.top_k} {where}"
        out += ", renormalized" if self.renormalize else ""
        return out + (f", scaled by {self.scaling:g}" if self.scaling != 1.0 else "")


def rule_of(contract: Mapping[str, Any] | None, config: Mapping[str, Any], family_renormalizes: bool | None) -> Rule:
    """A side's rule from its contract (what the engine runs with), else the model config."""
    contract = contract or {}

    def read(key: str, default: Any) -> Any:
        value = contract.get(key)
        return config.get(key, default) if value is None else value

    k = contract.get("num_experts_per_tok") or config.get("num_experts_per_tok")
    renorm = contract.get("norm_topk_prob")
    if renorm is None:
        renorm = config.get("norm_topk_prob", family_renormalizes)
    n_group, topk_group = expert_groups(read("n_group", 1), read("topk_group", 1))
    return Rule(int(k), bool(renorm), str(read("scoring_func", "softmax")), n_group, topk_group,
                float(read("routed_scaling_factor", 1.0) or 1.0))  # fmt: skip


@dataclass(frozen=True)
class Decisions:
    """One side's routing of N tokens under its rule (float64 throughout)."""

    ids: np.ndarray  # [N, k] expert ids, best first (ties to the lower index)
    weights: np.ndarray  # [N, k]
    choice: np.ndarray  # [N, E] what the expert choice ranks, -inf outside the chosen groups
    margin: np.ndarray  # [N] the expert choice's margin (inf when every eligible expert is chosen)
    sure_in: np.ndarray  # [N, E] chosen whichever way an exact tie is broken
    sure_out: np.ndarray  # [N, E] left out whichever way an exact tie is broken
    group_out: np.ndarray  # [N, E] the expert's group is surely left out (all False for greedy rules)
    group_scores: np.ndarray | None = None  # [N, G] what the group choice ranks; None for greedy rules
    group_margin: np.ndarray | None = None  # [N] the group choice's margin


def decide(logits: np.ndarray, rule: Rule, bias: np.ndarray | None = None) -> Decisions:
    """Both decisions of ``rule`` on router logits ``[N, E]`` (``bias``: the side's correction bias, or None)."""
    x = logits.astype(np.float64)
    if rule.scoring == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-x))
    else:
        scores = np.exp(x - x.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    ranked = x if bias is None else scores + bias.astype(np.float64)
    n, e = ranked.shape
    group_scores = group_margin = None
    choice, group_in, group_out = ranked, np.ones((n, e), bool), np.zeros((n, e), bool)
    if rule.grouped:
        size = e // rule.n_group
        per_group = ranked.reshape(n, rule.n_group, size)
        group_scores = -np.sort(-per_group, axis=-1)[..., : 2 if bias is not None else 1].sum(-1)
        order = np.argsort(-group_scores, axis=-1, kind="stable")
        kept = np.zeros((n, rule.n_group), bool)
        np.put_along_axis(kept, order[:, : rule.topk_group], True, -1)
        group_margin = _gap(group_scores, order, rule.topk_group)
        g_in, g_out = _sure(group_scores, rule.topk_group)
        group_in, group_out = np.repeat(g_in, size, -1), np.repeat(g_out, size, -1)
        choice = np.where(np.repeat(kept, size, -1), ranked, -np.inf)
    order = np.argsort(-choice, axis=-1, kind="stable")
    ids = order[:, : rule.top_k]
    weights = np.take_along_axis(scores, ids, -1)
    if rule.renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + (0.0 if rule.plain else 1e-20))
    e_in, e_out = _sure(choice, rule.top_k)
    return Decisions(ids, weights * rule.scaling, choice, _gap(choice, order, rule.top_k), group_in & e_in,
                     group_out | (group_in & e_out), group_out, group_scores, group_margin)  # fmt: skip


def route(logits: np.ndarray, rule: Rule, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids [N, k] best first, weights [N, k], expert-choice margin [N])`` from router logits ``[N, E]``."""
    d = decide(logits, rule, bias)
    return d.ids, d.weights, d.margin


def _gap(values: np.ndarray, order: np.ndarray, k: int) -> np.ndarray:
    """Per row, the k-th minus the (k+1)-th of ``values`` in ``order``; inf when there is no eligible (k+1)-th."""
    if k >= values.shape[-1]:
        return np.full(len(values), np.inf)
    ranked = np.take_along_axis(values, order[:, k - 1 : k + 1], -1)
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(ranked[:, 1]), np.inf, ranked[:, 0] - ranked[:, 1])


def _sure(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(surely in, surely out)`` of the top-k ``[N, C]``, whichever way an exact tie at the k-th place is broken."""
    if k >= values.shape[-1]:
        return np.ones(values.shape, bool), np.zeros(values.shape, bool)
    ranked = -np.sort(-values, axis=-1)
    return values > ranked[:, k : k + 1], values < ranked[:, k - 1 : k]


@dataclass(frozen=True)
class Flips:
    """Where two sides' expert sets differ, and at which decision."""

    differ: np.ndarray  # [N] the expert sets differ (as each side broke its ties)
    certain: np.ndarray  # [N] they differ whichever way each side breaks an exact tie
    at_group: np.ndarray  # [N] a certain flip at the group choice (else at the expert choice)
    margin: np.ndarray  # [N] the margin of the decision that flipped, the larger of the two sides'
    value: np.ndarray  # [N] the training side's last chosen candidate of that decision (where spacing is taken)


def compare(train: Decisions, infer: Decisions) -> Flips:
    """The flips between two sides' decisions on the same tokens."""
    same_k = train.ids.shape[1] == infer.ids.shape[1]
    if same_k:
        differ = ~(np.sort(train.ids, -1) == np.sort(infer.ids, -1)).all(-1)
    else:
        differ = np.ones(len(train.ids), bool)
    either = (train.sure_in & infer.sure_out) | (infer.sure_in & train.sure_out)
    certain = differ & either.any(-1) if same_k else differ
    at_group = certain & ((train.sure_in & infer.group_out) | (infer.sure_in & train.group_out)).any(-1)
    group_margin = _larger(train.group_margin, infer.group_margin, len(differ))
    margin = np.where(at_group, group_margin, np.maximum(train.margin, infer.margin))
    value = np.where(at_group, _last_group(train, infer), np.take_along_axis(train.choice, train.ids[:, -1:], -1)[:, 0])
    return Flips(differ, certain, at_group, margin, value)


def _larger(a: np.ndarray | None, b: np.ndarray | None, n: int) -> np.ndarray:
    """The larger group margin of the sides that make a group choice (a flip at it has at least one)."""
    present = [m for m in (a, b) if m is not None]
    return np.maximum.reduce(present) if present else np.full(n, np.nan)


def _last_group(train: Decisions, infer: Decisions) -> np.ndarray:
    """The last chosen group's score, of the training side when it chooses groups, else the inference side's."""
    side = train if train.group_scores is not None else infer
    if side.group_scores is None:
        return np.zeros(len(train.ids))
    kept = np.isfinite(side.choice).reshape(len(side.choice), side.group_scores.shape[1], -1).any(-1)
    return np.where(kept, side.group_scores, np.inf).min(-1)
