"""The exact function of a routed MoE block (logdiff/diagnosis/exact_moe.py) against HF's own blocks.

For every MoE family, HF's bf16 block, fed random rows, must lie within the
rounding bound of the exact function its own contract names, on its own
router logits; a side that computes another function (another scoring, another
group rule, another scaling, a stale expert) must lie outside. No CPU's kernel
choice enters: the exact side is fp64 and the bound is derived, not measured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from logdiff.probes.arch import adapter_of

from logdiff.diagnosis import exact_moe
from logdiff.diagnosis.exact import error_units
from logdiff.diagnosis.routing_rules import rule_of
from logdiff.diagnosis.spacing import eps
from logdiff.sources.hf.contract import hf_contract

#: (demo arch, config overrides) of one small MoE model per family
FAMILIES = {
    "qwen3-moe": {"moe_intermediate_size": 48},
    "mixtral": {"intermediate_size": 48},
    "glm4-moe": {"intermediate_size": 96, "moe_intermediate_size": 48, "first_k_dense_replace": 1},
    "deepseek-v3": {"intermediate_size": 96, "moe_intermediate_size": 48, "first_k_dense_replace": 1},
    "deepseek-v2": {"intermediate_size": 96, "moe_intermediate_size": 48, "first_k_dense_replace": 1},
    "gpt-oss": {"intermediate_size": 32},
}
BF16 = eps("bfloat16")


def _model(arch: str) -> Any:
    from transformers import AutoModelForCausalLM

    from logdiff.demo.configs import tiny_config

    torch.manual_seed(0)
    config = tiny_config(arch, 256, num_hidden_layers=2, hidden_size=64, initializer_range=0.2, **FAMILIES[arch])
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    layer = model.model.layers[1]
    bias = adapter_of(model).router_bias(layer)
    if bias is not None:
        bias.data.normal_(0, 0.2)  # a correction bias that changes the choice
    if arch == "gpt-oss":
        layer.mlp.experts.gate_up_proj_bias.data.normal_(0, 4.0)  # past the clamp limit: the clamps matter
    return model


def _keep_logits(seen: dict[str, Any]) -> Any:
    """A forward hook keeping a router's logits (its first output) without replacing its output."""

    def hook(module: Any, args: Any, out: Any) -> None:
        seen.setdefault("logits", out[0] if isinstance(out, tuple) else out)

    return hook


@pytest.fixture(scope="module", params=list(FAMILIES))
def block(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One family's layer-1 MoE block run by HF on random rows: its inputs, router logits and output."""
    model = _model(request.param)
    arch = adapter_of(model)
    layer = model.model.layers[1]
    router = arch.router(layer)
    seen: dict[str, Any] = {}
    router.register_forward_hook(_keep_logits(seen))
    torch.manual_seed(1)
    x = (torch.randn(1, 48, 64) * 2).to(torch.bfloat16)
    shared = getattr(layer.mlp, "shared_experts", None)
    with torch.no_grad():
        out = layer.mlp(x)
        out = out[0] if isinstance(out, tuple) else out
        shared_out = shared(x).reshape(48, 64) if shared is not None else None
    contract = hf_contract(model, {})
    return {
        "arch": arch, "model": model, "layer": layer, "x": x.reshape(48, 64), "out": out.reshape(48, 64),
        "logits": seen["logits"].reshape(48, -1), "shared": shared_out, "contract": contract,
        "rule": rule_of(contract, model.config.to_dict(), arch.router_renormalizes),
    }  # fmt: skip


def _experts(b: dict[str, Any]) -> exact_moe.Experts:
    return exact_moe.Experts.of(b["layer"].mlp.experts, b["arch"].experts_parts, b["arch"].experts_activation)


def _units(b: dict[str, Any], rule: Any = None, experts: Any = None, bias: Any = "own") -> tuple[float, float]:
    """(error units of HF's output against the exact function under ``rule``, the bound)."""
    if isinstance(bias, str):
        held = b["arch"].router_bias(b["layer"])
        bias = held.detach().double().numpy() if held is not None else None
    ex = exact_moe.routed(b["x"], b["logits"], experts or _experts(b), rule or b["rule"], bias, b["shared"])
    return error_units(b["out"], ex, BF16), ex.bound.units("bfloat16")


def test_hf_block_is_within_the_bound_of_its_own_rule(block: dict[str, Any]) -> None:
    error, bound = _units(block)
    assert error <= bound, f"{block['arch'].name}: {error:.3g} units against a bound of {bound:.3g}"


def test_another_scaling_or_renormalisation_is_outside(block: dict[str, Any]) -> None:
    rule = block["rule"]
    other = replace(rule, scaling=rule.scaling * 1.5)
    error, bound = _units(block, other)
    assert error > bound
    if rule.top_k > 1:
        flipped = replace(rule, renormalize=not rule.renormalize)
        error, bound = _units(block, flipped)
        assert error > bound


def test_another_scoring_is_outside(block: dict[str, Any]) -> None:
    rule = block["rule"]
    other = replace(rule, scoring="softmax" if rule.scoring == "sigmoid" else "sigmoid")
    error, bound = _units(block, other)
    assert error > bound


def test_a_stale_expert_is_outside(block: dict[str, Any]) -> None:
    experts = _experts(block)
    stale = experts.gate_up.detach().clone()
    chosen = int(np.bincount(_chosen(block).reshape(-1)).argmax())  # an expert some token chose
    stale[chosen] = stale[chosen] * 1.25
    error, bound = _units(block, experts=replace(experts, gate_up=stale))
    assert error > bound


def _chosen(b: dict[str, Any]) -> np.ndarray:
    from logdiff.diagnosis.routing_rules import decide

    held = b["arch"].router_bias(b["layer"])
    bias = held.detach().double().numpy() if held is not None else None
    return decide(b["logits"].double().numpy(), b["rule"], bias).ids


def test_a_grouped_rule_read_as_greedy_is_outside() -> None:
    """GLM-4.5 routes within the best ``topk_group`` of ``n_group`` groups: the exact function of a greedy
    rule on the same logits chooses experts the block never ran, for some token."""
    model = _model("glm4-moe")
    model.config.n_group, model.config.topk_group = 4, 1
    for layer in model.model.layers[1:]:
        layer.mlp.gate.num_group, layer.mlp.gate.topk_group = 4, 1
    b = _run(model)
    assert b["rule"].grouped
    error, bound = _units(b)
    assert error <= bound
    greedy = replace(b["rule"], n_group=1, topk_group=1)
    error, bound = _units(b, greedy)
    assert error > bound


def _run(model: Any) -> dict[str, Any]:
    arch = adapter_of(model)
    layer = model.model.layers[1]
    seen: dict[str, Any] = {}
    arch.router(layer).register_forward_hook(_keep_logits(seen))
    torch.manual_seed(1)
    x = (torch.randn(1, 48, 64) * 2).to(torch.bfloat16)
    with torch.no_grad():
        out = layer.mlp(x)
        shared = layer.mlp.shared_experts(x).reshape(48, 64)
    contract = hf_contract(model, {})
    rule = rule_of(contract, model.config.to_dict(), None)
    return {"arch": arch, "layer": layer, "x": x.reshape(48, 64), "out": out.reshape(48, 64), "shared": shared,
            "logits": seen["logits"].reshape(48, -1), "rule": rule}  # fmt: skip


def test_an_exact_tie_is_left_unjudged() -> None:
    """Two experts tied at the k-th place: either choice is the side's to make."""
    experts = exact_moe.Experts(torch.randn(4, 8, 6), torch.randn(4, 6, 4))
    logits = torch.tensor([[3.0, 1.0, 1.0, -2.0], [3.0, 2.0, 1.0, -2.0]])
    rule = rule_of({"num_experts_per_tok": 2, "norm_topk_prob": True}, {}, None)
    ex = exact_moe.routed(torch.randn(2, 6), logits, experts, rule)
    assert torch.isinf(ex.scale[0]).all() and torch.isfinite(ex.scale[1]).all()
    assert "1 tied tokens not judged" in ex.function
