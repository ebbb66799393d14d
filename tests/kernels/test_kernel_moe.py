"""MoE routing and combine: deterministic ties, fp32 weights, token results independent of grouping."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import KERNELS, moe_combine, moe_combine_reference, moe_experts, moe_route, moe_route_reference

BOUND_ROUTE = {k.name: k.bound for k in KERNELS}["moe_route"]
BOUND_COMBINE = {k.name: k.bound for k in KERNELS}["moe_combine"]


def test_route_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(3, 8)
    logits[0, [6, 2]] = 1.0
    logits[1, [7, 5, 1]] = 2.0
    weights, ids = moe_route(logits, 2, renormalize=False)
    assert ids.tolist()[:2] == [[2, 6], [1, 5]]
    assert ids[2].tolist() == [0, 1]  # all equal: lowest ids
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_route_rows_do_not_depend_on_batch_size(gen, dtype, m):
    logits = torch.randn(8, 16, generator=gen).to(dtype)
    w, ids = moe_route(logits, 4, True)
    wm, idm = moe_route(logits[-m:], 4, True)
    assert torch.equal(wm, w[-m:]) and torch.equal(idm, ids[-m:])


def test_route_matches_hf_routing(gen):
    logits = torch.randn(50, 16, generator=gen)
    for renormalize in (True, False):
        w, ids = moe_route(logits, 4, renormalize)
        ref_w, ref_ids = moe_route_reference(logits.double(), 4, renormalize)
        assert torch.equal(ids, ref_ids)
        assert (w.double() - ref_w).abs().max() <= BOUND_ROUTE


def _experts(gen, e=8, h=64, inter=32, dtype=torch.float32):
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) / 6).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_token_output_does_not_depend_on_which_tokens_share_an_expert(gen, dtype, m):
    x = torch.randn(8, 64, generator=gen).to(dtype)
    w13, w2 = _experts(gen, dtype=dtype)
    weights, ids = moe_route(torch.randn(8, 8, generator=gen), 2, True)
    full = moe_experts(x, weights, ids, w13, w2)
    assert torch.equal(moe_experts(x[-m:], weights[-m:], ids[-m:], w13, w2), full[-m:])


def test_combine_sums_in_rank_order_in_fp32_and_rounds_once(gen):
    x = torch.randn(5, 16, generator=gen).bfloat16()
    weights = torch.rand(5, 3, generator=gen)
    ids = torch.tensor([[0, 1, 2]] * 5)
    outs = {e: (torch.randn(5, 16, generator=gen)).bfloat16() for e in range(3)}
    got = moe_combine(x, weights, ids, lambda e, rows: outs[e][: len(rows)])
    want = outs[0].float() * weights[:, :1]
    want = want + outs[1].float() * weights[:, 1:2]
    want = want + outs[2].float() * weights[:, 2:3]
    assert torch.equal(got, want.bfloat16())


def test_combine_error_against_fp64_is_within_the_stated_bound(gen):
    x = torch.randn(12, 64, generator=gen)
    w13, w2 = _experts(gen)
    weights, ids = moe_route(torch.randn(12, 8, generator=gen), 2, True)

    def expert(e, rows):
        return moe_experts(
            rows,
            torch.ones(len(rows), 1, dtype=rows.dtype),
            torch.full((len(rows), 1), e),
            w13.to(rows.dtype),
            w2.to(rows.dtype),
        )

    ref = moe_combine_reference(x.double(), weights, ids, expert)
    assert (moe_combine(x, weights, ids, expert).double() - ref).abs().max() / ref.abs().max() <= BOUND_COMBINE


@pytest.mark.isa_sensitive
def test_negative_control_stock_hf_experts_depend_on_expert_group_size(gen, stock_varies):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg)
    w13, w2 = _experts(gen)
    experts.gate_up_proj.data.copy_(w13)
    experts.down_proj.data.copy_(w2)
    x = torch.randn(8, 64, generator=gen)
    ids = torch.tensor([[0, 1]] * 8)  # every token on the same two experts
    weights = torch.full((8, 2), 0.5)
    with torch.no_grad():
        alone, in_group = experts(x[:1], ids[:1], weights[:1]), experts(x, ids, weights)[:1]
    assert torch.equal(moe_experts(x[:1], weights[:1], ids[:1], w13, w2), moe_experts(x, weights, ids, w13, w2)[:1])
    stock_varies(torch.equal(alone, in_group), "stock HF experts are group-size invariant here")
