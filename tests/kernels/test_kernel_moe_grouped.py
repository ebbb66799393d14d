"""Grouped, bias-corrected routing (DeepSeek-V3, GLM-4.5): HF's rule, fixed ties, rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import moe_route_grouped, moe_route_grouped_reference

#: the fp32 routing weights against fp64 HF semantics (sigmoid, renormalised): a few ulps
BOUND = 1e-6
GLM = {"n_group": 4, "topk_group": 2, "scaling": 2.5}


def _case(gen: torch.Generator, t: int = 64, e: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(t, e, generator=gen) * 2, torch.randn(e, generator=gen) * 0.3


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_matches_hfs_grouped_router(gen, renormalize, scoring):
    logits, bias = _case(gen)
    bias = bias if scoring == "sigmoid" else None  # V2's softmax grouping has no bias
    w, ids = moe_route_grouped(logits, 4, renormalize, scoring=scoring, bias=bias, **GLM)
    ref_w, ref_ids = moe_route_grouped_reference(logits.double(), 4, renormalize, scoring=scoring, bias=bias, **GLM)
    order = ref_ids.sort(-1)
    assert torch.equal(ids.sort(-1).values, order.values)
    ref_by_id = ref_w.gather(1, order.indices)
    assert (w.gather(1, ids.sort(-1).indices).double() - ref_by_id).abs().max() <= BOUND * GLM["scaling"]
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_batch_size(gen, m, dtype):
    logits, bias = _case(gen)
    logits = logits.to(dtype)
    w, ids = moe_route_grouped(logits, 4, True, bias=bias, **GLM)
    wm, idm = moe_route_grouped(logits[-m:], 4, True, bias=bias, **GLM)
    assert torch.equal(wm, w[-m:]) and torch.equal(idm, ids[-m:])


def test_bias_chooses_the_experts_but_the_weights_are_unbiased_scores():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 has the worst score but the largest bias
    w, ids = moe_route_grouped(logits, 2, False, bias=bias)
    assert ids.tolist() == [[3, 0]]
    assert torch.equal(w, torch.sigmoid(logits)[:, [3, 0]])  # sigmoid(0) = 0.5 exactly, and sigmoid(3)
    unbiased = moe_route_grouped(logits, 2, False)[1]
    assert unbiased.tolist() == [[0, 1]]  # control: without the bias the best scores win


def test_only_the_best_groups_are_searched_and_ties_go_to_the_lower_index():
    logits = torch.full((1, 8), -4.0)
    logits[0, 5] = 4.0  # the single best expert, in group 2 of 4 (experts 4, 5)
    logits[0, [0, 1]] = 3.0  # group 0 has the best pair (sum of its top two)
    w, ids = moe_route_grouped(logits, 2, True, bias=torch.zeros(8), n_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]]  # expert 5's group loses on the top-two sum; tie 0/1 -> 0 first
    assert moe_route_grouped(logits, 2, True, bias=torch.zeros(8), n_group=4, topk_group=2)[1].tolist() == [[5, 0]]
    ties = moe_route_grouped(torch.zeros(2, 8), 3, True, bias=torch.zeros(8), n_group=2, topk_group=1)[1]
    assert ties.tolist() == [[0, 1, 2]] * 2  # equal groups -> group 0; equal experts -> the lowest ids


def test_scaling_multiplies_the_renormalised_weights():
    logits, bias = torch.randn(5, 8), torch.zeros(8)
    w1, _ = moe_route_grouped(logits, 2, True, bias=bias)
    w2, _ = moe_route_grouped(logits, 2, True, bias=bias, scaling=2.5)
    assert torch.equal(w2, w1 * 2.5)
    assert torch.allclose(w1.sum(-1), torch.ones(5))


def test_bad_rules_are_refused_in_one_line():
    with pytest.raises(ValueError, match="16 experts in 3 groups"):
        moe_route_grouped(torch.zeros(1, 16), 2, True, n_group=3)
    with pytest.raises(ValueError, match="top_k 5 exceeds"):
        moe_route_grouped(torch.zeros(1, 8), 5, True, n_group=4, topk_group=2)
    with pytest.raises(NotImplementedError, match="scoring 'sqrtsoftplus'"):
        moe_route_grouped(torch.zeros(1, 8), 2, True, scoring="sqrtsoftplus")


def test_backward_matches_autograd_of_the_reference(gen):
    logits, bias = _case(gen, t=6, e=8)
    logits = logits.double().float().requires_grad_(True)
    w, ids = moe_route_grouped(logits, 2, True, bias=bias, n_group=2, topk_group=1, scaling=1.5)
    d = torch.randn_like(w)
    (g,) = torch.autograd.grad(w, logits, d)
    ref = logits.detach().double().requires_grad_(True)
    rw = moe_route_grouped_reference(ref, 2, True, bias=bias, n_group=2, topk_group=1, scaling=1.5)[0]
    # the reference's sorted topk ranks like the kernel: no near ties in this draw
    (rg,) = torch.autograd.grad(rw, ref, d.double())
    assert (g.double() - rg).abs().max() < 1e-5


def test_negative_control_without_the_bias_the_reference_disagrees(gen):
    """The comparison above is sensitive to the rule: dropping the bias on one side changes the expert sets."""
    logits, bias = _case(gen)
    _, ids = moe_route_grouped(logits, 4, True, **GLM)
    _, ref_ids = moe_route_grouped_reference(logits.double(), 4, True, bias=bias, **GLM)
    assert not torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
