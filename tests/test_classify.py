"""Planted faults: each must be localized to its exact boundary, class and kind.

Faults are planted through the real user-facing levers (``--infer-ckpt``,
``--set``) or, for a pure reduction-order change, by swapping one module's
forward on the inference engine. Controls: identical paths are consistent,
and every operator-path cause vanishes under ``--consistent``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plants import assert_closes, split_k

import logdiff
from logdiff.sources import base, checkpoint, pool

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


def perturbed(model: Path, tmp: Path, name: str, scale: float = 1.05) -> Path:
    """A copy of MODEL's weights with one tensor scaled: a stale / mis-synced weight."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(model / "model.safetensors"))
    assert name in sd, sorted(sd)[:8]
    sd[name] = (sd[name].float() * scale).to(sd[name].dtype)
    out = tmp / f"{name}.safetensors"
    save_file(sd, str(out))
    return out


def cause_at(result: dict[str, Any], boundary: str) -> dict[str, Any]:
    found = [c for c in result["causes"] if c["boundary"] == boundary]
    assert found, (boundary, [(c["boundary"], c["class"], c["kind"]) for c in result["causes"]])
    return found[0]


def framework_causes(result: dict[str, Any]) -> list[str]:
    return [c["boundary"] for c in result["causes"] if c["class"] == "framework_difference"]


# --- weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "infer", "tensor", "boundary"),
    [
        ("qwen3", "hf-decode", "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj"),
        ("llama", "hf-decode", "model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj"),
        pytest.param(
            "qwen3", "vllm", "model.layers.2.mlp.down_proj.weight", "model.layers.2.mlp.down_proj",
            marks=pytest.mark.vllm,
        ),
    ],
)  # fmt: skip
def test_weight_fault_is_localized_to_the_op_that_reads_it(
    demo_model: Callable[[str], Path], tmp_path: Path, arch: str, infer: str, tensor: str, boundary: str
) -> None:
    model = demo_model(arch)
    r = logdiff.scan(model, infer=[infer], infer_ckpt=perturbed(model, tmp_path, tensor), **SMALL)
    c = cause_at(r, boundary)
    assert (c["class"], c["kind"]) == ("framework_difference", "weights")
    assert framework_causes(r) == [boundary]  # nothing else is blamed on the weights
    assert r["contracts"]["weights"]["differs"] == [tensor]
    intro = {op["boundary"]: op for op in r["introducing_ops"]}
    assert intro[boundary]["local_max_abs_diff"] > 0


def test_moe_router_weight_fault(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    model = demo_model("qwen3-moe")
    r = logdiff.scan(model, infer=["hf-decode"], infer_ckpt=perturbed(model, tmp_path, "model.layers.1.mlp.gate.weight", 1.5), **SMALL)
    c = cause_at(r, "model.layers.1.mlp.gate")
    assert (c["class"], c["kind"]) == ("framework_difference", "weights")


# --- config contracts and sampling semantics -------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "infer", "override", "boundary", "kind", "first"),
    [
        ("qwen3", "hf-decode", {"rms_norm_eps": 0.01}, "model.layers.0.input_layernorm", "config_contract", True),
        ("llama", "hf-decode", {"rms_norm_eps": 0.01}, "model.layers.0.input_layernorm", "config_contract", True),
        ("qwen3", "hf-decode", {"rope_theta": 10000.0}, "model.layers.0.self_attn.rope_q", "config_contract", True),
        # Downstream of attention's own operator-path difference: found, though not first.
        ("qwen3", "hf-decode", {"temperature": 0.7}, "log_softmax", "sampling_semantics", False),
        pytest.param(
            "qwen3", "vllm", {"rms_norm_eps": 0.01}, "model.layers.0.input_layernorm", "config_contract", True,
            marks=pytest.mark.vllm,
        ),
    ],
)  # fmt: skip
def test_one_sided_setting_is_a_framework_difference(
    demo_model: Callable[[str], Path], arch: str, infer: str, override: dict, boundary: str, kind: str, first: bool
) -> None:
    r = logdiff.scan(demo_model(arch), infer=[infer], infer_set=override, **SMALL)
    if first:
        assert r["first_divergence"]["boundary"] == boundary
    c = cause_at(r, boundary)
    assert (c["class"], c["kind"]) == ("framework_difference", kind)
    assert r["verdict"] in ("framework_difference", "mixed")


def test_framework_difference_hiding_behind_numeric_noise(qwen3: Path) -> None:
    """An eps change too small to stand out from reordering noise is still caught by the contract."""
    r = logdiff.scan(qwen3, infer=["hf-decode"], infer_set={"rms_norm_eps": 1.5e-6}, **SMALL)
    c = cause_at(r, "model.layers.0.input_layernorm")
    assert (c["class"], c["kind"]) == ("framework_difference", "config_contract")
    # Where stock attention adds its own operator-path noise (the CPUs seen so far), the verdict is mixed.
    noise = any(c2["class"] == "operator_path" for c2 in r["causes"])
    assert r["verdict"] == ("mixed" if noise else "framework_difference")


# --- pure numerics ----------------------------------------------------------------------------


@pytest.mark.isa_sensitive
def test_hf_vs_hf_decode_is_operator_path_in_attention(qwen3: Path, stock_varies: Callable) -> None:
    r = logdiff.scan(qwen3, infer=["hf-decode"], **{**SMALL, "attribute": True})
    # On CUDA, stock SDPA prefill and decode agreed bitwise at these sizes: nothing to find there.
    stock_varies(r["verdict"] == "consistent", "HF forward and KV-cache decode agree bitwise here")
    assert r["first_divergence"]["boundary"] == "model.layers.0.self_attn.attn_core"
    assert r["first_divergence"]["inputs_equal"] is True
    assert r["verdict"] == "operator_path"
    assert_closes(r)
    assert {(c["class"], c["kind"]) for c in r["causes"]} == {("operator_path", "online_softmax_block_size")}
    assert all(_within(c) for c in r["causes"])
    # The attention reference kernel alone closes the whole gap: its shares sum to 1, every cause necessary.
    assert r["attribution"]["closed"] == 1.0
    assert sum(c["share"] for c in r["causes"]) == pytest.approx(1.0)
    assert all(c["necessity"] is True for c in r["causes"])


def _within(cause: dict[str, Any]) -> bool:
    """Both sides checked and within their rounding bounds of the exact function (docs/causes.md)."""
    conf = cause.get("conformance") or {}
    return all(side in conf and conf[side]["error"] <= conf[side]["bound"] for side in ("train", "infer"))


@pytest.mark.vllm
@pytest.mark.isa_sensitive
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3-moe"])
def test_hf_vs_vllm_is_operator_path_and_vanishes_under_consistent(demo_model: Callable[[str], Path],
                                                                   shared_scan: Callable[..., dict], arch: str) -> None:
    model = demo_model(arch)
    r = shared_scan(model, infer=["vllm"], **SMALL)  # test_moe_routing.py reads the qwen3-moe one
    assert r["causes"] and r["verdict"] == "operator_path", [(c["boundary"], c["class"]) for c in r["causes"]]
    assert_closes(r)  # the stock kernels' gap is within what the ops up to the logits explain
    # each cause judged locally: both sides within their bounds (MoE blocks, with no exact function here,
    # by the reference rerun instead, which the evidence says)
    for c in r["causes"]:
        assert _within(c) or "vanishes with the reference kernel" in " ".join(c["evidence"]), c
    fixed = logdiff.scan(model, infer=["vllm"], consistent=True, **SMALL)
    assert fixed["logprobs"]["abs_diff_max"] == 0.0 and fixed["verdict"] == "consistent"




@pytest.mark.isa_sensitive
def test_planted_reduction_order_change_is_operator_path(qwen3: Path) -> None:
    engine = pool.acquire("hf-decode", base.EngineSpec(str(checkpoint.stage(qwen3).path)))  # the pooled engine
    target = "model.layers.2.self_attn.o_proj"
    with split_k(engine.model.get_submodule(target)):
        r = logdiff.scan(qwen3, infer=["hf-decode"], **SMALL)
    c = cause_at(r, target)
    assert (c["class"], c["kind"]) == ("operator_path", "reduction_order")
    assert _within(c)  # split-K with rounded partials is the same function: within the GEMM's bound
    assert_closes(r)


# --- controls -------------------------------------------------------------------------------


def test_identical_paths_are_consistent(qwen3: Path) -> None:
    r = logdiff.scan(qwen3, infer=["hf"], **SMALL)
    assert r["verdict"] == "consistent"
    assert r["causes"] == [] and r["first_divergence"] is None and r["introducing_ops"] == []
    assert r["closure"]["closure"] == 1.0 and r["closure"]["gap_max"] == 0.0  # nothing to explain


def test_every_operator_path_cause_vanishes_under_consistent(qwen3: Path) -> None:
    r = logdiff.scan(qwen3, infer=["hf-decode"], consistent=True, **SMALL)
    assert r["logprobs"]["abs_diff_max"] == 0.0 and r["verdict"] == "consistent" and r["causes"] == []


def test_dormant_weight_fault_is_still_found_by_the_preflight(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """A stale expert no probe token is routed to shows in no logprob, yet the engines differ."""
    model = demo_model("qwen3-moe")
    bad = perturbed(model, tmp_path, "model.layers.2.mlp.experts.0.down_proj.weight", 1.1)
    r = logdiff.scan(model, infer=["hf-decode"], infer_ckpt=bad, **SMALL)
    c = cause_at(r, "model.layers.2.mlp")
    assert (c["class"], c["kind"]) == ("framework_difference", "weights")
    assert c["differs"] == ["model.layers.2.mlp.experts.down_proj"]
    assert r["verdict"] == "mixed"


@pytest.mark.vllm
def test_vllm_rope_theta_override_reaches_the_model(qwen3: Path) -> None:
    r = logdiff.scan(qwen3, infer=["vllm"], infer_set={"rope_theta": 5e5}, **SMALL)
    assert r["contracts"]["infer"]["rope_theta"] == 5e5
    assert (cause_at(r, "model.layers.0.self_attn.rope_q")["class"]) == "framework_difference"
