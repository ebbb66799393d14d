"""DeepSeek-V2/V3 (MLA + shared experts) against the real CPU vLLM, and the adapters' own answers.

The scan and the consistent-mode refusal are the generic properties of
tests/test_architectures.py (``NEW``); here: planted one-sided faults in the
two places only this family has (the latent up-projection ``kv_b_proj``,
read inside vLLM's MLA op, and a shared expert), each blamed on the op that
reads it, V3's one-sided correction bias blamed on the router, and the
adapters' maps without vLLM.
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
def test_scan_locates_mla_and_shared_expert_boundaries(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None]
) -> None:
    """Every MLA and shared-expert boundary is recorded on both engines, in HF's order, weights all verified."""
    r = logdiff.scan(demo_model("deepseek-v2"), infer=["vllm"], **SMALL)
    assert not [w for w in r["warnings"] if "probe failed" in w or "could not align" in w or "split" in w]
    table = r["divergence_table"]["boundaries"]
    for part in ("q_proj.nope", "q_proj.pe", "kv_a_proj_with_mqa.compressed_kv", "kv_a_proj_with_mqa.k_pe",
                 "kv_a_layernorm", "rope_q", "rope_k", "latent_attn", "o_proj"):
        assert f"model.layers.1.self_attn.{part}" in table, part
    for part in ("gate", "shared_experts.gate_proj", "shared_experts.act_mul", "shared_experts.down_proj"):
        assert f"model.layers.1.mlp.{part}" in table, part
    assert "model.layers.1.mlp" in table
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    assert r["contracts"]["train"]["rope_style"] == r["contracts"]["infer"]["rope_style"] == "gptj"
    assert r["contracts"]["weights"].get("unverified", []) == []
    # the MLA attention is replayed on vLLM's (q nope, RoPE'd q, latent, RoPE'd k): its own error is separated
    ops = {o["boundary"]: o for o in r["introducing_ops"]}
    latent = ops.get("model.layers.1.self_attn.latent_attn")
    assert not [w for w in r["warnings"] if "could not separate" in w], r["warnings"]
    stock_varies(latent is None, "stock MLA attention introduces no error against HF's here")
    assert latent["method"] == "replay", r["introducing_ops"]
    assert latent["local_max_abs_diff"] <= latent["propagated_max_abs_diff"]


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
def test_rms_norm_eps_set_on_both_sides_still_differs_in_the_latent_norm(demo_model: Callable[[str], Path]) -> None:
    """HF builds kv_a_layernorm with the default eps whatever rms_norm_eps says; vLLM uses rms_norm_eps.

    The same ``--set rms_norm_eps`` on both engines leaves their latent norms apart:
    the contract names it and the causes sit at the latent norms, not at the norms it was set for.
    """
    eps = {"rms_norm_eps": 1e-5}
    r = logdiff.scan(demo_model("deepseek-v2"), infer=["vllm"], train_set=eps, infer_set=eps, **SMALL)
    assert r["contracts"]["differs"] == ["latent_norm_eps"], r["contracts"]["differs"]
    assert (r["contracts"]["train"]["latent_norm_eps"], r["contracts"]["infer"]["latent_norm_eps"]) == (1e-6, 1e-5)
    blamed = [c for c in r["causes"] if "latent_norm_eps" in c.get("differs", [])]
    assert blamed and {c["boundary"] for c in blamed} <= {f"model.layers.{n}.self_attn.kv_a_layernorm" for n in range(4)}
    assert all(c["class"] == "framework_difference" for c in blamed), blamed


@pytest.mark.vllm
def test_v3_correction_bias_fault_is_a_router_weight(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """V3 routes on sigmoid + e_score_correction_bias: a one-sided bias is blamed on the router, as a weight."""
    from safetensors.torch import load_file, save_file

    model = demo_model("deepseek-v3")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    sd = load_file(str(model / "model.safetensors"))
    bias = sd[name].clone()
    bias[0] += 0.5  # trained as zeros: a scale would change nothing
    sd[name] = bias
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=ckpt, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    assert r["contracts"]["train"]["scoring_func"] == r["contracts"]["infer"]["scoring_func"] == "sigmoid"
    blamed = {c["boundary"]: c for c in r["causes"] if c["class"] == "framework_difference" and c["kind"] == "weights"}
    assert set(blamed) <= {"model.layers.2.mlp.gate", "model.layers.2.mlp"} and "model.layers.2.mlp.gate" in blamed, blamed
    assert blamed["model.layers.2.mlp.gate"]["differs"] == [name]


@pytest.mark.vllm
def test_consistent_refuses_mla_attention_in_one_line(demo_model: Callable[[str], Path]) -> None:
    with pytest.raises(InputError, match=r"--consistent: consistent_hf: MLA attention .*\(model\.layers\.0\.self_attn\)"):
        logdiff.scan(demo_model("deepseek-v2"), infer=["hf-decode", "vllm"], consistent=True, **{**SMALL, "depth": "logprobs"})


def test_hf_decode_scan_records_every_mla_boundary(demo_model: Callable[[str], Path]) -> None:
    """Without vLLM: HF's KV-cache decode (the cache holds the latent) against its full forward, q-LoRA included."""
    r = logdiff.scan(demo_model("deepseek-v3"), infer=["hf-decode"], **SMALL)
    assert r["warnings"] == []
    table = r["divergence_table"]["boundaries"]
    for part in ("q_a_proj", "q_a_layernorm", "q_b_proj.nope", "q_b_proj.pe", "kv_a_proj_with_mqa.compressed_kv",
                 "rope_q", "rope_k", "latent_attn"):
        assert f"model.layers.3.self_attn.{part}" in table, part
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    first = r["first_divergence"]
    assert first is None or first["inputs_equal"] is True


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
    # V3: HF's rope_interleave returns the pairs de-interleaved; vLLM's interleaved output is compared that way
    v3 = adapter_for("DeepseekV3ForCausalLM").correspondence({"num_hidden_layers": 1, "q_lora_rank": 64})
    assert v3.rope_function == "apply_rotary_pos_emb_interleave"
    assert [t.select for t in v3.taps["vllm"] if t.pattern.endswith("rotary_emb")] == ["pair_deinterleaved"]
    assert adapter_for("DeepseekV3ForCausalLM").contract_keys("model.layers.1.mlp.gate", "router")[1][-1] == (
        "model.layers.1.mlp.gate.e_score_correction_bias"
    )


def test_deinterleaved_vllm_rope_equals_hfs_interleave_layout() -> None:
    """vLLM's GPT-J rotation, de-interleaved, is bitwise HF's apply_rotary_pos_emb_interleave (fp32 math)."""
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from logdiff.probes.record import deinterleave

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 6, 64), torch.randn(1, 1, 6, 64)
    freqs = torch.arange(6)[:, None].float() * (1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.cat((freqs, freqs), dim=-1)
    hq, hk = hf.apply_rotary_pos_emb_interleave(q, k, emb.cos()[None], emb.sin()[None])

    def gptj(x: torch.Tensor) -> torch.Tensor:  # vLLM's forward_native with is_neox_style=False
        cos, sin, x1, x2 = freqs.cos(), freqs.sin(), x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    assert torch.equal(hq, deinterleave(gptj(q))) and torch.equal(hk, deinterleave(gptj(k)))
    assert not torch.equal(hq, gptj(q))  # control: compared as stored, the layouts differ
