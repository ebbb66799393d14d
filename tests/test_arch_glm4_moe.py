"""GLM-4.5 MoE: the adapter's layout, GLM's routing rule in the diagnostics, consistent mode, and faults on vLLM.

Without vLLM: layer 0 dense and the shared expert's boundaries; the routing
analysis recomputes each side's experts with sigmoid + correction bias +
groups + scaling (agreeing with ``kernels.moe_route_grouped``), so identical
router logits agree and a one-sided bias is a routing weights difference;
consistent HF covers the shared expert and the grouped router, and refuses
a gated shared expert in one line; partial rotary is the RoPE kernel's
``rotary_dim`` on both engines. Against the real CPU vLLM (the generic
scan and ``--consistent`` checks are in test_architectures.py): a planted
correction-bias fault is reported as a router weight difference with flipped
tokens, not as operator-path noise, and a fault in the shared expert's
``up_proj`` is found behind vLLM's packed ``gate_up_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from logdiff.probes.arch import adapter_for
from plants import stale_checkpoint

import logdiff
from logdiff.diagnosis import routing
from logdiff.sources.vllm.taps import TAPS as VLLM_TAPS

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}
GLM_RULE = routing.Rule(top_k=2, renormalize=True, scoring="sigmoid", n_group=2, topk_group=1, scaling=2.5)
CONFIG = {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_shared_experts": 1}


# ---------------------------------------------------------------------------- the adapter (no engine)


def test_layer_zero_is_dense_and_moe_layers_read_their_shared_expert() -> None:
    glm = adapter_for("Glm4MoeForCausalLM")
    cmap = glm.correspondence(CONFIG)
    names = [b.name for b in cmap.boundaries]
    assert "model.layers.0.mlp.gate_proj" in names and "model.layers.0.mlp.gate" not in names
    assert "model.layers.1.mlp.gate" in names and "model.layers.1.mlp.gate_proj" not in names
    shared = "model.layers.1.mlp.shared_experts"
    parts = ("gate_proj", "up_proj", "act_mul", "down_proj")
    assert [n for n in names if n.startswith(shared)] == [f"{shared}.{p}" for p in parts]
    block = cmap.get("model.layers.1.mlp")
    assert block.kind == "moe" and block.inputs == ("model.layers.1.post_attention_layernorm", f"{shared}.down_proj")
    # vLLM's runner calls the shared expert through its wrapper: both call names are tapped
    vllm = [t.regex() for t in VLLM_TAPS.taps(cmap) if "shared_experts" in t.pattern and "gate_up" in t.pattern]
    calls = (".shared_experts", ".experts._shared_experts._layer")
    assert vllm and all(rx.match(f"model.layers.1.mlp{c}.gate_up_proj") for rx in vllm for c in calls)


def test_the_correction_bias_is_a_router_weight_and_the_rule_is_contract() -> None:
    glm = adapter_for("Glm4MoeForCausalLM")
    keys, weights = glm.contract_keys("model.layers.2.mlp.gate", "router")
    assert {"scoring_func", "n_group", "topk_group", "routed_scaling_factor", "num_experts_per_tok"} <= set(keys)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in weights
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert glm.weight_boundary(bias) == ("model.layers.2.mlp.gate", "router")
    assert glm.weight_boundary("model.layers.1.mlp.shared_experts.up_proj.weight") == (
        "model.layers.1.mlp.shared_experts.up_proj", "linear")  # fmt: skip
    assert "rotary_dim" in glm.contract_keys("model.layers.0.self_attn.rope_q", "rope")[0]
    # the block's HF replay reruns the shared expert: it reads those weights too
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in glm.contract_keys("model.layers.1.mlp", "moe")[1]


# ---------------------------------------------------------------------------- GLM's routing rule in the diagnostics


def _logits(seed: int, n: int = 40, e: int = 8) -> routing.Any:
    rng = np.random.default_rng(seed)
    return rng.normal(0, 2, (1, n, e)).astype(np.float32)


def _rec(values: np.ndarray) -> routing.Any:
    from logdiff.probes.routing import RouterLogits

    return RouterLogits("model.layers.1.mlp.gate", 1, values, np.ones(values.shape[:2], bool), "float32")


def test_route_applies_glms_rule_like_the_kernel() -> None:
    from logdiff.kernels import moe_route_grouped

    logits, bias = _logits(0)[0], np.random.default_rng(1).normal(0, 0.3, 8).astype(np.float32)
    ids, weights, margin = routing.route(logits, GLM_RULE, bias)
    k_w, k_ids = moe_route_grouped(torch.from_numpy(logits), 2, True, bias=torch.from_numpy(bias), n_group=2,
                                   topk_group=1, scaling=2.5)  # fmt: skip
    assert np.array_equal(ids, k_ids.numpy())
    assert np.abs(weights - k_w.numpy()).max() < 1e-5
    assert (margin > 0).all()
    # the rule matters: without the bias and the groups (plain softmax top-k) other experts are chosen
    plain = routing.route(logits, routing.Rule(2, True))[0]
    assert not np.array_equal(np.sort(plain, -1), np.sort(ids, -1))


def test_identical_router_logits_route_alike_on_both_sides() -> None:
    values, bias = _logits(2), np.full(8, 0.1, np.float32)
    stats, forced = routing.compare_layer(_rec(values), _rec(values.copy()), GLM_RULE, GLM_RULE, (bias, bias.copy()))
    assert stats["flips"] == 0 and stats["tied_tokens"] == 0 and stats["weight_max_abs_diff"] == 0.0
    assert (forced < 0).all()


def test_a_one_sided_bias_is_a_router_weights_difference_not_operator_path() -> None:
    values, bias = _logits(3), np.zeros(8, np.float32)
    stale = bias.copy()
    stale[6] = 1.0  # the inference side's bias favours expert 6 (and its group)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    contracts = {"differs": [], "weights": {"differs": [name]}}
    section, forced = routing.analyze({"g": _rec(values)}, {"g": _rec(values.copy())}, GLM_RULE, GLM_RULE, contracts,
                                      [], {"train": {1: bias}, "infer": {1: stale}})  # fmt: skip
    layer = section["layers"][0]
    assert layer["flips"] > 0 and 6 in {e for f in layer["flipped"] for e in f["infer_experts"]}
    assert (layer["class"], layer["kind"]) == ("framework_difference", "weights")
    assert f"router weight differs: {name}" in layer["evidence"]
    # control: the softmax top-k rule without the biases (the analysis before GLM) sees no flip at all
    blind, _ = routing.analyze({"g": _rec(values)}, {"g": _rec(values.copy())}, routing.Rule(2, True),
                               routing.Rule(2, True), {}, [])  # fmt: skip
    assert blind["layers"][0]["flips"] == 0


def test_rule_of_reads_glms_routing_keys_from_the_contract() -> None:
    contract = {"num_experts_per_tok": 2, "norm_topk_prob": True, "scoring_func": "sigmoid", "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 2.5}  # fmt: skip
    assert routing.rule_of(contract, {}, None) == GLM_RULE
    assert routing.rule_of({"num_experts_per_tok": 2, "norm_topk_prob": True}, {}, None) == routing.Rule(2, True)


# ---------------------------------------------------------------------------- consistent HF (tiny random model)


@pytest.fixture(scope="module")
def tiny_glm() -> routing.Any:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from logdiff.demo.configs import tiny_config

    torch.manual_seed(0)
    config = tiny_config("glm4-moe", 256, num_hidden_layers=2, hidden_size=64, head_dim=16, intermediate_size=96,
                         initializer_range=0.2)  # fmt: skip
    assert isinstance(config, Glm4MoeConfig)
    model = Glm4MoeForCausalLM(config).to(torch.bfloat16).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)  # a bias that changes the choice
    return model


def test_consistent_hf_covers_the_shared_expert_and_the_grouped_router(tiny_glm: routing.Any) -> None:
    from logdiff.sources.hf.consistent import consistent_hf

    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), consistent_hf(tiny_glm) as report:
        full = tiny_glm(ids).logits
        rows = torch.cat([tiny_glm(ids[i : i + 1]).logits for i in range(3)])
    assert "model.layers.1.mlp.shared_experts" in report.replaced["silu_and_mul"]
    assert report.replaced["moe_route"] == ["model.layers.1.mlp.gate"]
    assert torch.equal(full, rows)  # a token's logits do not depend on its batch
    with torch.no_grad():
        stock = tiny_glm(ids).logits
    assert not torch.equal(stock, full)  # control: the stock model computes something else here


def test_partial_rotary_hf_and_vllm_calls_of_the_rope_kernel_agree() -> None:
    """GLM rotates half of each head: HF's call (cos/sin of rotary_dim) and vLLM's (``rotary_dim=``) give the
    same bits, and the other half passes through unchanged."""
    from logdiff import kernels

    x = torch.randn(7, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    positions = torch.arange(7)
    vllm_side = kernels.rope(x, positions, 1e6, rotary_dim=32)
    cos, sin = kernels.rope_cos_sin(positions, 1e6, 32)
    hf_side = kernels.rope_apply(x, cos[:, None], sin[:, None], "neox")
    assert torch.equal(vllm_side, hf_side)
    assert torch.equal(vllm_side[..., 32:], x[..., 32:]) and not torch.equal(vllm_side[..., :32], x[..., :32])
    ref = kernels.rope_reference(x.double(), positions, 1e6, rotary_dim=32)
    assert (vllm_side.double() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_a_gated_shared_expert_is_refused_in_one_line(tiny_glm: routing.Any) -> None:
    from logdiff.sources.hf.consistent import consistent_hf

    block = tiny_glm.model.layers[1].mlp
    block.shared_expert_gate = torch.nn.Linear(64, 1, bias=False)  # Qwen2-MoE's sigmoid gate on the shared expert
    assert adapter_for("Glm4MoeForCausalLM").shared_expert_gate == "shared_expert_gate"
    try:
        refusal = r"^consistent_hf: model\.layers\.1\.mlp has a shared expert that is not a plain gated MLP$"
        with pytest.raises(NotImplementedError, match=refusal), consistent_hf(tiny_glm):
            pass
    finally:
        del block.shared_expert_gate


# ---------------------------------------------------------------------------- planted faults on the real CPU vLLM


@pytest.mark.vllm
def test_vllm_bias_fault_is_a_routing_weights_difference(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """vLLM loads a stale correction bias for layer 2: its experts flip, and the routing names the bias."""
    model = demo_model("glm4-moe")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"

    def favour_expert_6(bias: torch.Tensor) -> torch.Tensor:
        bias[6] += 1.0
        return bias

    stale = stale_checkpoint(model, tmp_path, name, favour_expert_6)
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    layers = {s["layer"]: s for s in r["moe"]["layers"]}
    assert layers[2]["flips"] > 0, layers[2]
    assert (layers[2]["class"], layers[2]["kind"]) == ("framework_difference", "weights")
    assert layers[1]["flips"] == 0  # the layer before reads the same bias on both sides
    blamed = {c["boundary"]: c for c in r["causes"] if c["class"] == "framework_difference"}
    assert "model.layers.2.mlp" in blamed and blamed["model.layers.2.mlp"]["differs"] == [name], blamed
    assert not [c for c in r["causes"] if c["boundary"] == "model.layers.2.mlp" and c["class"] == "operator_path"]
    # routing replay forced vLLM's choice on HF with GLM's weights (sigmoid scores, renormalized, scaled)
    assert r["moe"]["replay"]["forced_tokens"] > 0 and r["moe"]["replay"]["share"] is not None


@pytest.mark.vllm
def test_consistent_vllm_patches_the_shared_expert_and_the_grouped_router(demo_model: Callable[[str], Path]) -> None:
    """The stock shared expert happens to agree with HF here, so bitwise 0 alone would not show it is covered."""
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire
    from logdiff.sources.vllm.consistent import consistent_vllm, engine_objects
    from logdiff.sources.vllm.consistent_ops import routing_rule

    spec = EngineSpec(model_dir=str(demo_model("glm4-moe")), dtype="bfloat16",
                      options=(("max_model_len", 256), ("max_num_seqs", 4)))  # fmt: skip
    llm = acquire("vllm", spec).llm
    model, _ = engine_objects(llm)
    rule = routing_rule(model.model.layers[1].mlp.experts)
    assert (rule["scoring"], rule["n_group"], rule["topk_group"], rule["scaling"]) == ("sigmoid", 2, 1, 2.5)
    assert rule["bias"] is not None and rule["bias"].dtype == torch.float32
    with consistent_vllm(llm) as summary:
        shared = "model.layers.1.mlp.shared_experts"
        assert {f"{shared}.gate_up_proj", f"{shared}.down_proj"} <= set(summary.replaced["linear"])
        assert f"{shared}.act_fn" in summary.replaced["silu_and_mul"]
        assert summary.replaced["moe"] == [f"model.layers.{n}.mlp.experts" for n in (1, 2, 3)]
        assert "model.layers.1.mlp.gate" in summary.replaced["linear"]  # the fp32 router GEMM


@pytest.mark.vllm
def test_vllm_shared_expert_fault_is_found_behind_the_packed_gate_up(
    demo_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = demo_model("glm4-moe")
    name = "model.layers.1.mlp.shared_experts.up_proj.weight"
    stale = stale_checkpoint(model, tmp_path, name, lambda w: w + 0.05)
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = {c["boundary"]: c for c in r["causes"] if c["class"] == "framework_difference"}
    # the shared expert's own op, and the block whose HF replay reruns it: both for this weight
    assert set(blamed) == {"model.layers.1.mlp.shared_experts.up_proj", "model.layers.1.mlp"}, blamed
    assert all(c["kind"] == "weights" and c["differs"] == [name] for c in blamed.values()), blamed


@pytest.mark.vllm
def test_consistent_training_step_equals_vllm_bitwise(demo_model: Callable[[str], Path]) -> None:
    """``train.grad=true``: HF runs a real step (train mode, backward) through the grouped router's, the
    experts' and the shared expert's kernels, and still equals vLLM bitwise."""
    small = {**SMALL, "depth": "logprobs", "train_set": {"grad": True}}
    r = logdiff.scan(demo_model("glm4-moe"), infer=["vllm"], consistent=True, **small)
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0
    assert next(p for p in r["paths"] if p["role"] == "train")["settings"]["grad"] is True
