"""The architectures added through adapters, each run against the real CPU vLLM.

For every demo architecture beyond the first three (their scans are in
test_classify.py): a module-depth scan of HF against vLLM whose first
divergence is real (equal inputs, a replayable op) and whose causes are
classified with both engines' contracts and weights agreeing (the adapter
reads both sides right), and ``--consistent`` bitwise 0 between HF, HF decode
and vLLM, or, where consistent mode cannot cover the architecture yet, its
one clear error. Controls: a planted one-sided fault is found and blamed on
the op that reads it, so the agreeing contracts above are not vacuous.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import logdiff
from logdiff.errors import InputError

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}

# demo arch -> what consistent mode says about it (None: covered, bitwise 0 expected)
NEW = {
    "qwen2": None,
    "mistral": None,
    "llama3": None,
    "mixtral": None,
    "phi3": None,
    "gemma2": None,
    "glm4-moe": None,
    "gemma3": None,
    "deepseek-v2": None,
    "deepseek-v3": None,
    "gpt-oss": None,
}


def _first_divergence_is_real(r: dict[str, Any]) -> dict[str, Any]:
    first = r["first_divergence"]
    assert first is not None, r["warnings"]
    assert first["inputs_equal"] is True and first["input_max_abs_diff"] == 0.0
    intro = {op["boundary"]: op for op in r["introducing_ops"]}
    assert first["boundary"] in intro
    order = r["divergence_table"]["boundaries"]
    assert order.index(first["boundary"]) == min(order.index(b) for b in intro)
    return first


@pytest.mark.vllm
@pytest.mark.parametrize("arch", sorted(NEW))
def test_scan_against_vllm_finds_and_classifies(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None], arch: str
) -> None:
    model = demo_model(arch)
    r = logdiff.scan(model, infer=["vllm"], **SMALL)
    stock_varies(r["verdict"] == "consistent", f"stock HF and vLLM give bitwise-equal logprobs on {arch}")
    assert not [w for w in r["warnings"] if "probe failed" in w or "could not align" in w], r["warnings"]
    assert "no correspondence map" not in " ".join(r["warnings"])
    first = _first_divergence_is_real(r)
    assert first["layer"] is not None or first["boundary"] in ("logits", "log_softmax", "model.norm")
    # both engines read with the same contract and weights: every tensor verified or unverified, none differs
    assert r["contracts"]["differs"] == [], r["contracts"]
    assert r["contracts"]["weights"]["differs"] == []
    assert r["contracts"]["train"]["rope_type"] == r["contracts"]["infer"]["rope_type"]
    assert r["causes"], r["introducing_ops"]
    assert {c["class"] for c in r["causes"]} <= {"operator_path", "framework_difference"}
    assert all(c["kind"] and c["evidence"] and c["fix"] for c in r["causes"])
    assert r["verdict"] in ("operator_path", "framework_difference", "mixed")


@pytest.mark.vllm
@pytest.mark.parametrize("arch", sorted(NEW))
def test_consistent_is_bitwise_zero_or_a_clear_error(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None], arch: str
) -> None:
    model = demo_model(arch)
    fast = {**SMALL, "depth": "logprobs"}
    if NEW[arch] is not None:
        with pytest.raises(InputError, match=NEW[arch]):  # one line, exit 2: no kernel for it yet
            logdiff.scan(model, infer=["hf-decode", "vllm"], consistent=True, **fast)
        return
    stock = logdiff.scan(model, infer=["hf-decode", "vllm"], **fast)
    fixed = logdiff.scan(model, infer=["hf-decode", "vllm"], consistent=True, **fast)
    assert {"hf-decode", "vllm"} <= {p["infer"] for p in fixed["pairs"]}
    assert all(p["metrics"]["abs_diff_max"] == 0.0 for p in fixed["pairs"]), [p["metrics"] for p in fixed["pairs"]]
    assert fixed["verdict"] == "consistent"
    # control: the same comparison can fail (stock vLLM differs from HF on these models)
    stock_vllm = next(p for p in stock["pairs"] if p["infer"] == "vllm")
    stock_varies(stock_vllm["metrics"]["abs_diff_max"] == 0.0, f"stock vLLM matches HF bitwise on {arch}")


@pytest.mark.vllm
def test_qwen2_bias_fault_is_found_through_vllms_packed_bias(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """vLLM packs q/k/v biases into qkv_proj.bias; the adapter splits them, so a stale k bias is named."""
    from safetensors.torch import load_file, save_file

    model = demo_model("qwen2")
    name = "model.layers.1.self_attn.k_proj.bias"
    sd = load_file(str(model / "model.safetensors"))
    sd[name] = (sd[name].float() + 0.5).to(sd[name].dtype)
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=ckpt, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference"]
    assert [c["boundary"] for c in blamed] == ["model.layers.1.self_attn.k_proj"], blamed
    assert blamed[0]["kind"] == "weights" and blamed[0]["differs"] == [name]


@pytest.mark.vllm
def test_mixtral_router_fault_is_named_after_hfs_module(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """Checkpoint and vLLM call the block ``block_sparse_moe``, HF ``mlp``: the fault gets the HF name."""
    from safetensors.torch import load_file, save_file

    model = demo_model("mixtral")
    stored = "model.layers.1.block_sparse_moe.gate.weight"
    sd = load_file(str(model / "model.safetensors"))
    sd[stored] = (sd[stored].float() * 1.5).to(sd[stored].dtype)
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=ckpt, **SMALL)
    assert r["contracts"]["weights"]["differs"] == ["model.layers.1.mlp.gate.weight"]
    blamed = {c["boundary"]: c for c in r["causes"] if c["class"] == "framework_difference"}
    # the router reads the weight, and so does the MoE block that routes with it
    assert set(blamed) <= {"model.layers.1.mlp.gate", "model.layers.1.mlp"}, blamed
    router = blamed["model.layers.1.mlp.gate"]
    assert router["kind"] == "weights" and router["differs"] == ["model.layers.1.mlp.gate.weight"]


@pytest.mark.vllm
def test_phi3_fault_in_hfs_packed_qkv_is_localized_to_k(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """HF's own qkv_proj is split like vLLM's: stale k rows of the packed weight are blamed on k_proj alone."""
    from safetensors.torch import load_file, save_file

    model = demo_model("phi3")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    sd = load_file(str(model / "model.safetensors"))
    q_rows, kv_rows = 4 * 64, 2 * 64  # the demo's 4 query and 2 kv heads of 64
    w = sd[name].float()
    w[q_rows : q_rows + kv_rows] += 0.05
    sd[name] = w.to(sd[name].dtype)
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=ckpt, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference"]
    assert [c["boundary"] for c in blamed] == ["model.layers.1.self_attn.k_proj"], blamed
    assert blamed[0]["kind"] == "weights" and blamed[0]["differs"] == [name]


def test_phi3_adapter_reads_hfs_packed_weights_per_split_boundary() -> None:
    """Without vLLM: each split boundary reads its packed tensor, and the tensor is owned by the first part."""
    from logdiff.engines.hf.taps import TAPS as HF_TAPS
    from logdiff.probes.arch import adapter_for

    phi3, llama = adapter_for("Phi3ForCausalLM"), adapter_for("LlamaForCausalLM")
    k = "model.layers.2.self_attn.k_proj"
    assert phi3.contract_keys(k, "linear")[1] == ["model.layers.2.self_attn.qkv_proj.weight"]
    assert llama.contract_keys(k, "linear")[1] == [f"{k}.weight"]  # control: Llama's are separate
    assert phi3.contract_keys("model.layers.0.mlp.up_proj", "linear")[1] == ["model.layers.0.mlp.gate_up_proj.weight"]
    qkv = "model.layers.2.self_attn.qkv_proj.weight"
    assert phi3.weight_boundary(qkv) == ("model.layers.2.self_attn.q_proj", "linear")
    hf_taps = {t.pattern: t.select for t in HF_TAPS.taps(phi3.correspondence({"num_hidden_layers": 1}))}
    assert hf_taps[r"model\.layers\.{N}\.self_attn\.qkv_proj"] == "split_qkv"
    assert not any("q_proj" in p and "qkv" not in p for p in hf_taps)
