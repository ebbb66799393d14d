"""DeepSeek-V2 (MLA + shared experts) against the real CPU vLLM, and its adapter's own answers.

The scan and the consistent-mode refusal are the generic properties of
tests/test_architectures.py (``NEW``); here: planted one-sided faults in the
two places only this family has (the latent up-projection ``kv_b_proj``,
read inside vLLM's MLA op, and a shared expert), each blamed on the op that
reads it, and the adapter's map without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import logdiff
from logdiff.errors import InputError

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


def _stale(model: Path, tmp_path: Path, name: str, scale: float) -> Path:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(model / "model.safetensors"))
    sd[name] = (sd[name].float() * scale).to(sd[name].dtype)
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    return ckpt


@pytest.mark.vllm
def test_scan_locates_mla_and_shared_expert_boundaries(demo_model: Callable[[str], Path]) -> None:
    """Every MLA and shared-expert boundary is recorded on both engines, in HF's order, weights all verified."""
    r = logdiff.scan(demo_model("deepseek-v2"), infer=["vllm"], **SMALL)
    assert not [w for w in r["warnings"] if "probe failed" in w or "could not align" in w or "split" in w]
    table = r["divergence_table"]["boundaries"]
    for part in ("q_proj.nope", "q_proj.pe", "kv_a_proj_with_mqa.compressed_kv", "kv_a_proj_with_mqa.k_pe",
                 "kv_a_layernorm", "rope_q", "rope_k", "latent_attn", "o_proj"):
        assert f"model.layers.1.self_attn.{part}" in table, part
    for part in ("mlp.gate", "mlp.shared_experts.gate_proj", "mlp.shared_experts.act_mul", "mlp.shared_experts.down_proj", "mlp"):
        assert f"model.layers.1.{part}" in table, part
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    assert r["contracts"]["train"]["rope_style"] == r["contracts"]["infer"]["rope_style"] == "gptj"
    assert r["contracts"]["weights"].get("unverified", []) == []


@pytest.mark.vllm
def test_kv_b_proj_fault_is_blamed_on_the_latent_attention(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """vLLM absorbs kv_b_proj into its MLA op: a stale up-projection is found at the attention that reads it."""
    model = demo_model("deepseek-v2")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=_stale(model, tmp_path, name, 1.5), **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference" and c["kind"] == "weights"]
    assert [c["boundary"] for c in blamed] == ["model.layers.1.self_attn.latent_attn"], blamed
    assert blamed[0]["differs"] == [name]


@pytest.mark.vllm
def test_shared_expert_fault_is_blamed_on_its_projection(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """A stale shared-expert weight (vLLM packs gate/up) is named at the shared expert's own projection."""
    model = demo_model("deepseek-v2")
    name = "model.layers.2.mlp.shared_experts.up_proj.weight"
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=_stale(model, tmp_path, name, 1.5), **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference" and c["kind"] == "weights"]
    assert [c["boundary"] for c in blamed] == ["model.layers.2.mlp.shared_experts.up_proj"], blamed
    assert blamed[0]["differs"] == [name]


@pytest.mark.vllm
def test_consistent_refuses_mla_attention_in_one_line(demo_model: Callable[[str], Path]) -> None:
    with pytest.raises(InputError, match=r"--consistent: consistent_hf: MLA attention .*\(model\.layers\.0\.self_attn\)"):
        logdiff.scan(demo_model("deepseek-v2"), infer=["hf-decode", "vllm"], consistent=True, **{**SMALL, "depth": "logprobs"})


def test_adapter_maps_mla_weights_to_the_ops_that_read_them() -> None:
    """Without vLLM: split projections read their projection's weight; kv_b_proj belongs to the attention."""
    from logdiff.probes.arch import adapter_for

    ds = adapter_for("DeepseekV2ForCausalLM")
    a = "model.layers.1.self_attn"
    assert ds.contract_keys(f"{a}.q_proj.pe", "linear")[1] == [f"{a}.q_proj.weight"]
    assert ds.contract_keys(f"{a}.kv_a_proj_with_mqa.k_pe", "linear")[1] == [f"{a}.kv_a_proj_with_mqa.weight"]
    assert ds.contract_keys(f"{a}.latent_attn", "attn")[1] == [f"{a}.kv_b_proj.weight"]
    assert ds.weight_boundary(f"{a}.kv_b_proj.weight") == (f"{a}.latent_attn", "attn")
    assert ds.weight_boundary(f"{a}.q_b_proj.weight") == (f"{a}.q_b_proj.nope", "linear")
    # q-LoRA layout: q_a_proj -> q_a_layernorm -> q_b_proj, first layer dense, then MoE with shared experts
    cmap = ds.correspondence({"num_hidden_layers": 2, "q_lora_rank": 64, "first_k_dense_replace": 1, "n_routed_experts": 4})
    order = cmap.order
    assert order.index(f"{a}.q_a_proj") < order.index(f"{a}.q_a_layernorm") < order.index(f"{a}.q_b_proj.pe")
    assert "model.layers.0.mlp.gate" not in order and "model.layers.1.mlp.shared_experts.down_proj" in order
    assert cmap.rope_function == "apply_rotary_emb"
