"""llama3 rope in both installers: HF's rotary module and vLLM's Llama3RotaryEmbedding read the same
RopeParams, so their cos/sin are one table; a module whose frequencies disagree, and any other scaled
rope class, are refused in one line."""

from __future__ import annotations

import pytest
import torch
from logdiff.kernels import RopeParams, rope_cos_sin

from logdiff.sources.hf.consistent import consistent_hf
from logdiff.sources.hf.consistent_rope import rope_params_of

# head_dim 16 (8 frequencies): with original context 64, wavelengths 6.3 (kept), 33 (interpolated), 169... (divided)
ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PARAMS = RopeParams(500_000.0, 16, "llama3", 8.0, 1.0, 4.0, 64)


def _llama3(build_model, dtype=torch.float32, **rope):
    return build_model("llama", dtype, rope_parameters={**ROPE, **rope})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_full_forward_equals_kv_decode(build_model, hf_paths, sequences, dtype):
    model = _llama3(build_model, dtype)
    prompts, responses = sequences
    with consistent_hf(model) as report:
        full = hf_paths.full(model, prompts, responses)
        decode = hf_paths.decode(model, prompts, responses)
    assert "model.rotary_emb" in report.replaced["rope"]
    assert hf_paths.equal(full, decode)


def test_hf_reads_the_rope_parameters_of_the_module(build_model):
    assert rope_params_of(_llama3(build_model).model.rotary_emb) == {None: PARAMS}


def test_hf_cos_sin_are_the_kernels_table(build_model):
    model = _llama3(build_model)
    pos = torch.arange(200)[None]
    x = torch.zeros(1, 200, 16)
    with consistent_hf(model, only={"rope"}):
        cos, sin = model.model.rotary_emb(x, pos)
    table_cos, table_sin = rope_cos_sin(pos, PARAMS)
    assert torch.equal(cos, torch.cat([table_cos, table_cos], -1)) and torch.equal(sin[..., :8], table_sin)
    # control: the llama3 table is not the default one of the same base
    assert not torch.equal(table_cos, rope_cos_sin(pos, 500_000.0, 16)[0])


def test_negative_control_a_config_that_disagrees_with_the_buffer_is_refused(build_model):
    model = _llama3(build_model)
    model.config.rope_parameters["low_freq_factor"] = 2.0  # the buffer was computed with 1.0
    with pytest.raises(NotImplementedError, match="inv_freq is not what its rope_parameters give"):
        with consistent_hf(model):
            pass
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_other_scaled_ropes_are_refused_naming_the_type(build_model):
    model = build_model("llama", torch.float32, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    match = r"^consistent_hf: rope_type 'dynamic' \(covered: default, llama3, linear, yarn\)$"
    with pytest.raises(NotImplementedError, match=match):
        with consistent_hf(model):
            pass


@pytest.fixture(scope="module")
def vllm_ropes():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_scaling_rope import (
        DynamicNTKScalingRotaryEmbedding,
    )
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        return {
            "llama3": Llama3RotaryEmbedding(16, 16, 512, 500_000.0, True, torch.bfloat16, 8.0, 1.0, 4.0, 64),
            "default": RotaryEmbedding(16, 16, 512, 500_000.0, True, torch.bfloat16),
            "dynamic": DynamicNTKScalingRotaryEmbedding(16, 16, 512, 256, 1e4, True, 2.0, torch.bfloat16),
        }


@pytest.mark.vllm
def test_vllm_reads_the_same_rope_parameters(vllm_ropes):
    from logdiff.sources.vllm.consistent_ops import rope_params_of as vllm_rope_params

    assert vllm_rope_params(vllm_ropes["llama3"]) == PARAMS
    assert vllm_rope_params(vllm_ropes["default"]) == RopeParams(500_000.0, 16)


@pytest.mark.vllm
def test_vllm_rotation_is_bitwise_hfs(build_model, vllm_ropes, gen):
    """The same q rotated through vLLM's replaced forward and HF's replaced rotary + apply_rotary_pos_emb."""
    import sys

    from logdiff.sources.vllm.consistent_ops import rope_forward

    model = _llama3(build_model, torch.bfloat16)
    modeling = sys.modules[type(model).__module__]
    q = torch.randn(1, 4, 150, 16, generator=gen).bfloat16()  # HF [B, H, T, D]
    pos = torch.arange(150)
    with consistent_hf(model, only={"rope"}):
        cos, sin = model.model.rotary_emb(q, pos[None])
        hf_q, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
    vllm_q, _ = rope_forward(vllm_ropes["llama3"])(pos, q[0].transpose(0, 1).reshape(150, 64))
    assert torch.equal(hf_q[0].transpose(0, 1).reshape(150, 64), vllm_q)


@pytest.mark.vllm
def test_vllm_refuses_other_scaled_classes_in_one_line(vllm_ropes):
    from logdiff.sources.vllm.consistent_ops import rope_params_of as vllm_rope_params

    match = r"^DynamicNTKScalingRotaryEmbedding: rope_type 'dynamic' has no consistent"
    with pytest.raises(NotImplementedError, match=match):
        vllm_rope_params(vllm_ropes["dynamic"])


@pytest.mark.vllm
def test_vllm_negative_control_parameters_that_disagree_with_the_module_are_refused(vllm_ropes, monkeypatch):
    from logdiff.sources.vllm.consistent_ops import rope_params_of as vllm_rope_params

    module = vllm_ropes["llama3"]
    monkeypatch.setattr(module, "low_freq_factor", 2.0)  # what the module reports, not what it computed with
    original = module._compute_inv_freq(module.base)
    monkeypatch.setattr(module, "low_freq_factor", 1.0)
    monkeypatch.setattr(module, "_compute_inv_freq", lambda base: original)
    with pytest.raises(NotImplementedError, match="inv_freq is not what its parameters give"):
        vllm_rope_params(module)
