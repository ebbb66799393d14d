"""Each side's routing rule, where the routing keys are labelled, and the decision a flip happened at.

* **Greedy vs grouped (DeepSeek-V2).** HF's router under ``topk_method: greedy``
  ranks every expert whatever ``n_group`` says; vLLM routes DeepSeek-V2
  grouped. The rule each contract reader reports is checked against the
  engine's own routing code on random router logits (HF's
  ``DeepseekV2TopkRouter``, vLLM's CPU router), and a rule that differs is a
  ``moe_routing`` framework difference. Controls: a rule both sides share
  (``group_limited_greedy`` on both, or groups that are all kept) is no cause.
* **The first MoE layer.** Routing keys a preflight alone finds are blamed on
  the first router of the model's own layout (``first_k_dense_replace``,
  ``moe_layer_freq``), a boundary that exists; the default layout stays at layer 1.
* **Which decision flipped.** A flip where the group choice flipped is measured
  on the group scores' gap, one where only the expert choice flipped on the
  experts' gap; a tie of groups broken differently is no flip.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from logdiff.probes.arch import adapter_for
from logdiff.probes.routing import RouterLogits

import logdiff
from logdiff.diagnosis import classify, routing
from logdiff.diagnosis.diagnose import scan_adapter
from logdiff.diagnosis.preflight import compare_contracts

ROUTER = "model.layers.1.mlp.gate"
SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


def _rec(rows: Any, dtype: str = "float32", boundary: str = ROUTER) -> RouterLogits:
    values = np.asarray(rows, np.float32).reshape(1, -1, np.shape(rows)[-1])
    return RouterLogits(boundary, 1, values, np.ones(values.shape[:2], bool), dtype)


# ---------------------------------------------------------------------------- greedy vs grouped: each side's rule


def _tiny_deepseek_v2(topk_method: str, n_group: int, topk_group: int) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, topk_method=topk_method, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=True, routed_scaling_factor=1.0, initializer_range=0.5,
    )  # fmt: skip
    return DeepseekV2ForCausalLM(config).eval()


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_hf_deepseek_v2_contract_reads_the_rule_its_router_applies(method: str) -> None:
    """The HF contract's rule routes random router logits exactly as HF's own router does."""
    from logdiff.sources.hf.contract import hf_contract

    model = _tiny_deepseek_v2(method, n_group=2, topk_group=1)
    contract = hf_contract(model, {})
    rule = routing.rule_of(contract, {}, False)
    grouped = method == "group_limited_greedy"
    assert (rule.n_group, rule.topk_group) == ((2, 1) if grouped else (1, 1))
    assert rule.renormalize is False  # HF's V2 router drops norm_topk_prob (the config says True)
    hidden = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, ids = model.model.layers[1].mlp.gate(hidden)
    ours, our_weights, _ = routing.route(logits.numpy(), rule)
    assert np.array_equal(np.sort(ours, -1), np.sort(ids.numpy(), -1))
    order = np.argsort(ids.numpy(), -1)
    assert np.allclose(np.take_along_axis(our_weights, np.argsort(ours, -1), -1),
                       np.take_along_axis(weights.numpy(), order, -1), rtol=1e-5)  # fmt: skip
    # the other rule routes some of these tokens elsewhere: the difference is real, not a label
    other = routing.Rule(2, False, n_group=1 if grouped else 2, topk_group=1)
    assert not np.array_equal(np.sort(routing.route(logits.numpy(), other)[0], -1), np.sort(ours, -1))


@pytest.mark.vllm
@pytest.mark.parametrize("groups", [(2, 1), (4, 2), (2, 2)])
def test_vllm_router_applies_the_rule_its_contract_reader_reports(groups: tuple[int, int]) -> None:
    """vLLM's CPU router, built as its DeepSeek-V2 block builds it (always grouped), against the rule read from it."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from logdiff.sources.vllm.contract_extras import vllm_routing_rule

    router = CPURouter(top_k=2, global_num_experts=8, use_grouped_topk=True, num_expert_group=groups[0],
                       topk_group=groups[1], renormalize=False, scoring_func="softmax")  # fmt: skip
    read = vllm_routing_rule(SimpleNamespace(experts=SimpleNamespace(router=router, routed_scaling_factor=1.0)))
    contract = {"num_experts_per_tok": router.top_k, "norm_topk_prob": router.renormalize, **read}
    rule = routing.rule_of(contract, {}, None)
    assert (rule.n_group, rule.topk_group) == ((1, 1) if groups[1] >= groups[0] else groups)
    logits = torch.randn(200, 8, generator=torch.Generator().manual_seed(2))
    weights, ids = router._compute_routing(None, logits, None)
    ours, our_weights, _ = routing.route(logits.numpy(), rule)
    assert np.array_equal(np.sort(ours, -1), np.sort(ids.numpy().astype(np.int64), -1))
    assert np.allclose(np.sort(our_weights, -1), np.sort(weights.numpy(), -1), rtol=1e-5)


def _contract(n_group: int, topk_group: int) -> dict[str, Any]:
    return {"num_experts_per_tok": 2, "norm_topk_prob": False, "scoring_func": "softmax", "n_group": n_group,
            "topk_group": topk_group, "routed_scaling_factor": 1.0}  # fmt: skip


def test_greedy_against_grouped_is_a_moe_routing_framework_difference() -> None:
    """HF greedy (one group) against vLLM grouped (best 1 of 2): the contracts, the op's cause and the routers."""
    contracts = compare_contracts(_contract(1, 1), _contract(2, 1))
    assert contracts["differs"] == ["n_group"]
    ds = adapter_for("DeepseekV2ForCausalLM")
    ev = classify.OpEvidence(ROUTER, "router", 1, 0.1, None, None)
    assert classify.classify_op(ev, contracts, False, ds).kind == "moe_routing"
    assert [c.kind for c in classify.preflight_only_causes(contracts, [], ds)] == ["moe_routing"]
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (64, 8)).astype(np.float32)
    rules = [routing.rule_of(contracts[side], {}, False) for side in ("train", "infer")]
    section, _ = routing.analyze({ROUTER: _rec(logits)}, {ROUTER: _rec(logits.copy())}, *rules, contracts, [])
    layer = section["layers"][0]
    assert layer["flips"] > 0  # the same logits, routed by two rules
    assert (layer["class"], layer["kind"]) == ("framework_difference", "moe_routing")
    assert ("the routing rules differ: train routes softmax top-2 of all experts; infer routes softmax top-2 "
            "within the best 1 of 2 expert groups") in layer["evidence"]  # fmt: skip


@pytest.mark.parametrize("train, infer", [((2, 1), (2, 1)), ((1, 1), (2, 2)), ((4, 4), (1, 1))])
def test_a_rule_both_sides_share_is_no_cause(train: tuple[int, int], infer: tuple[int, int]) -> None:
    """Negative control: both grouped alike, or one greedy and the other keeping every group."""
    from logdiff.probes.contracts import expert_groups

    ct, ci = (_contract(*expert_groups(*g)) for g in (train, infer))
    contracts = compare_contracts(ct, ci)
    assert contracts["differs"] == []
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (64, 8)).astype(np.float32)
    rules = [routing.rule_of(c, {}, False) for c in (ct, ci)]
    assert rules[0] == rules[1]
    section, forced = routing.analyze({ROUTER: _rec(logits)}, {ROUTER: _rec(logits.copy())}, *rules, contracts, [])
    assert section["class"] is None and section["layers"][0]["flips"] == 0 and forced == {}
    assert classify.preflight_only_causes(contracts, [], adapter_for("DeepseekV2ForCausalLM")) == []


def test_keeping_every_group_routes_as_greedy() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (64, 8)).astype(np.float32)
    greedy = routing.route(logits, routing.Rule(2, True))[0]
    assert np.array_equal(routing.route(logits, routing.rule_of(_contract(2, 2), {}, True))[0], greedy)
    assert not np.array_equal(routing.route(logits, routing.rule_of(_contract(2, 1), {}, True))[0], greedy)


@pytest.mark.vllm
def test_deepseek_v2_greedy_with_groups_against_vllm_is_a_moe_routing_difference(
    demo_model: Callable[[str], Path],
) -> None:
    """The demo with ``n_group: 2, topk_group: 1`` on both sides: HF routes greedily, vLLM grouped.

    Control: ``topk_method: group_limited_greedy`` makes HF group too; then no routing setting differs.
    """
    model = demo_model("deepseek-v2")
    groups = {"n_group": 2, "topk_group": 1}
    r = logdiff.scan(model, infer=["vllm"], train_set=groups, infer_set=groups, **SMALL)
    assert "n_group" in r["contracts"]["differs"]
    assert (r["contracts"]["train"]["n_group"], r["contracts"]["infer"]["n_group"]) == (1, 2)
    moe = r["moe"]
    assert moe["rules"]["infer"]["n_group"] == 2 and "n_group" not in moe["rules"]["train"]
    assert all((x["class"], x["kind"]) == ("framework_difference", "moe_routing") for x in moe["layers"])
    assert any(x["flips"] for x in moe["layers"])
    gates = [c for c in r["causes"] if c["boundary"].endswith("mlp.gate")]
    assert gates and all((c["class"], c["kind"]) == ("framework_difference", "moe_routing") for c in gates)

    same = {**groups, "topk_method": "group_limited_greedy"}
    control = logdiff.scan(model, infer=["vllm"], train_set=same, infer_set=same, **SMALL)
    assert control["contracts"]["train"]["n_group"] == control["contracts"]["infer"]["n_group"] == 2
    assert not set(routing.ROUTER_KEYS) & set(control["contracts"]["differs"])
    assert control["moe"]["rules"]["train"] == control["moe"]["rules"]["infer"]
    assert all(x["kind"] != "moe_routing" for x in control["moe"]["layers"])
    assert all(c["kind"] != "moe_routing" for c in control["causes"])


# ---------------------------------------------------------------------------- the first MoE layer


@pytest.mark.parametrize(
    "arch, layout, first",
    [
        ("DeepseekV2ForCausalLM", {"first_k_dense_replace": 3}, 3),
        ("DeepseekV2ForCausalLM", {"first_k_dense_replace": 1, "moe_layer_freq": 2}, 2),
        ("DeepseekV2ForCausalLM", {"first_k_dense_replace": 0}, 0),
        ("DeepseekV3ForCausalLM", {"first_k_dense_replace": 3}, 3),
        ("Glm4MoeForCausalLM", {"first_k_dense_replace": 2}, 2),
        ("Glm4MoeForCausalLM", {"first_k_dense_replace": 1}, 1),  # the default layout: unchanged
    ],
)
def test_routing_keys_are_blamed_on_the_first_router_of_the_layout(arch: str, layout: dict, first: int) -> None:
    config = {"num_hidden_layers": 6, "n_routed_experts": 8, **layout}
    adapter = adapter_for(arch)
    configured = adapter.configured(config)
    routers = [b for b in adapter.correspondence(config).boundaries if b.kind == "router"]
    assert routers[0].name == f"model.layers.{first}.mlp.gate"
    contracts = compare_contracts(_contract(1, 1), _contract(2, 1))
    causes = classify.preflight_only_causes(contracts, [], configured)
    assert [(c.boundary, c.kind) for c in causes] == [(routers[0].name, "moe_routing")]
    assert adapter.key_boundary["n_group"][0] == "model.layers.1.mlp.gate"  # the registered adapter is untouched


@pytest.mark.parametrize("layout, first", [({"mlp_only_layers": [0, 1]}, 2), ({"decoder_sparse_step": 2}, 1),
                                            ({}, 0)])  # the last: the default layout, unchanged
def test_qwen3_moe_routing_keys_follow_its_dense_layers(layout: dict, first: int) -> None:
    config = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, **layout}
    adapter = adapter_for("Qwen3MoeForCausalLM")
    routers = [b.name for b in adapter.correspondence(config).boundaries if b.kind == "router"]
    assert routers[0] == f"model.layers.{first}.mlp.gate"
    assert adapter.configured(config).key_boundary["num_experts_per_tok"] == (routers[0], "router")
    assert adapter.key_boundary["num_experts_per_tok"][0] == "model.layers.0.mlp.gate"  # registered one untouched


def test_the_scan_adapter_is_configured_by_the_training_models_config() -> None:
    train = SimpleNamespace(loaded_config=lambda: {"num_hidden_layers": 6, "n_routed_experts": 8,
                                                   "first_k_dense_replace": 3})  # fmt: skip
    assert scan_adapter("DeepseekV2ForCausalLM", train).key_boundary["n_group"][0] == "model.layers.3.mlp.gate"
    # an engine that cannot give its config keeps the adapter's default layout
    assert scan_adapter("DeepseekV2ForCausalLM", SimpleNamespace()).first_moe_layer == 1
    assert scan_adapter("NoSuchForCausalLM", train) is None


# ---------------------------------------------------------------------------- which decision flipped

GLM = routing.Rule(top_k=2, renormalize=True, scoring="sigmoid", n_group=2, topk_group=1, scaling=2.5)
ZERO = np.zeros(8, np.float32)
BIASES = {"train": {1: ZERO}, "infer": {1: ZERO.copy()}}
BELOW_ONE, ABOVE_ONE = np.float32(1.0 - 2**-24), np.float32(1.0 + 2**-23)  # fp32 neighbours of 1


def _glm(rows: list[list[float]]) -> dict[str, Any]:
    return {ROUTER: _rec(rows)}


def _layer(train: list[list[float]], infer: list[list[float]], rule: routing.Rule = GLM,
           biases: Any = BIASES) -> dict[str, Any]:  # fmt: skip
    return routing.analyze(_glm(train), _glm(infer), rule, rule, {}, [], biases)[0]["layers"][0]


def test_a_group_flip_is_measured_on_the_group_choice() -> None:
    """Group 0 and group 1 score alike up to one fp32 neighbour: the group choice flips, the experts within
    each group are far apart (sigmoid(1) - sigmoid(-3) = 0.68, the margin the expert choice would report)."""
    train = [[1.0, 1.0, -3, -3, 1.0, BELOW_ONE, -3, -3]]
    infer = [[1.0, 1.0, -3, -3, 1.0, ABOVE_ONE, -3, -3]]
    layer = _layer(train, infer)
    assert (layer["flips"], layer["group_flips"]) == (1, 1)
    flip = layer["flipped"][0]
    assert (flip["train_experts"], flip["infer_experts"], flip["decision"]) == ([0, 1], [4, 5], "group")
    assert flip["margin"] < 1e-7 and flip["margin_ulps"] <= 1.0
    assert (layer["class"], layer["kind"]) == ("operator_path", "near_tie_flip")
    assert "(1 at the group choice, 0 at the expert choice)" in layer["evidence"][-1]
    # what the expert choice alone would have said: a wide margin, millions of units of spacing
    assert routing.route(np.asarray(train, np.float32), GLM, ZERO)[2][0] > 0.6


def test_an_expert_flip_within_the_same_group_is_measured_on_the_expert_choice() -> None:
    """Negative control: group 0 wins by far on both sides; experts 1 and 2 swap across one fp32 neighbour."""
    train = [[2.0, 1.0, BELOW_ONE, -3, -3, -3, -3, -3]]
    infer = [[2.0, BELOW_ONE, 1.0, -3, -3, -3, -3, -3]]
    layer = _layer(train, infer)
    assert (layer["flips"], layer["group_flips"]) == (1, 0)
    flip = layer["flipped"][0]
    assert (flip["train_experts"], flip["infer_experts"], flip["decision"]) == ([0, 1], [0, 2], "expert")
    assert flip["margin"] < 1e-7 and flip["margin_ulps"] <= 1.0
    assert "all at the expert choice" in layer["evidence"][-1]


def test_identical_logits_and_an_exact_group_tie_flip_nothing() -> None:
    """Negative controls: identical logits; two groups tied exactly on one side (each engine breaks it its own way)."""
    same = [[1.0, 1.0, -3, -3, 1.0, BELOW_ONE, -3, -3]]
    assert _layer(same, [list(same[0])])["flips"] == 0
    tied = [[1.0, 1.0, -3, -3, 1.0, 1.0, -3, -3]]
    layer = _layer(tied, [[1.0, 1.0, -3, -3, 1.0, ABOVE_ONE, -3, -3]])
    assert (layer["flips"], layer["group_flips"], layer["tied_tokens"], layer["class"]) == (0, 0, 1, None)


def test_softmax_group_flips_are_measured_in_logits() -> None:
    """DeepSeek-V2's grouped rule (softmax, a group scores its best expert, no bias): the group gap in logits."""
    rule = routing.Rule(top_k=2, renormalize=False, n_group=2, topk_group=1)
    train = [[1.0, 0.0, -1, -2, BELOW_ONE, 0.0, -1, -2]]
    infer = [[BELOW_ONE, 0.0, -1, -2, 1.0, 0.0, -1, -2]]
    layer = _layer(train, infer, rule, None)
    flip = layer["flipped"][0]
    assert (flip["train_experts"], flip["infer_experts"], flip["decision"]) == ([0, 1], [4, 5], "group")
    assert flip["margin"] == 2**-24 and flip["margin_ulps"] == 0.5  # one fp32 step below 1, in units at 1


@pytest.mark.parametrize("settings, refused", [
    ({"topk_method": "greedy", "n_group": 2, "topk_group": 1}, False),  # greedy ignores the groups
    ({"topk_method": "greedy", "routed_scaling_factor": 16.0}, True),  # DeepSeek-V2's own setting
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, True),
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 2}, False),  # every group kept: greedy
])  # fmt: skip
def test_consistent_mode_refuses_a_v2_rule_its_kernel_does_not_compute(settings: dict, refused: bool) -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, **settings)
    refusal = adapter_for("DeepseekV2ForCausalLM").consistent_refusal(DeepseekV2TopkRouter(config))
    assert (refusal is not None) == refused, refusal
    if refused:
        assert "no consistent kernel" in refusal and config.topk_method in refusal
