"""rope with linear, yarn and llama3 scaling: HF's semantics, one table for HF and vLLM, cos/sin times yarn's factor."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
from logdiff.kernels import (
    RopeParams,
    kernel_caches,
    rope,
    rope_cos_sin,
    rope_inv_freq,
    rope_inv_freq_reference,
    rope_reference,
    rope_table_reference,
)
from logdiff.kernels.rope import inv_freq_matches, inv_freq_rtol, yarn_attention_factor, yarn_ramp_bounds

from logdiff.sources.hf.consistent import consistent_hf
from logdiff.sources.hf.consistent_rope import rope_params_of

# HF rope_parameters (and the HF config's max_position_embeddings: yarn's context after scaling) of each case
CASES = {
    "linear": (64, {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}, 512),
    "linear-llama": (128, {"rope_type": "linear", "rope_theta": 500_000.0, "factor": 8.0}, 512),
    # Qwen2.5's long-context setting: factor 4 over 32k
    "yarn-qwen2.5": (128, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                           "original_max_position_embeddings": 32768}, 131072),
    # DeepSeek-V3's numbers (factor 40 over 4k, mscale = mscale_all_dim = 1: attention factor 1)
    "yarn-deepseek": (64, {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                           "original_max_position_embeddings": 4096}, 163840),
    # DeepSeek yarn whose mscale and mscale_all_dim differ: cos/sin times mscale(40, 1) / mscale(40, 0.8)
    "yarn-deepseek-mscale": (64, {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "mscale": 1.0,
                                  "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 4096}, 163840),
    # the demo's: a short original context so that the ramp lies inside head_dim 64
    "yarn-demo": (64, {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                       "original_max_position_embeddings": 128}, 512),
    "yarn-untruncated": (64, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "truncate": False,
                              "original_max_position_embeddings": 1024}, 32768),
    # llama3: the demo's (probes/arch/llama3.py: its head_dim 64 frequencies fall in all three bands),
    # Llama 3.1 8B's, a factor-32 one (Llama 3.2 1B/3B) and an odd one with the medium band shifted
    **{name: (d, {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                  "high_freq_factor": high, "original_max_position_embeddings": orig}, 8 * orig)
       for name, (d, theta, factor, low, high, orig) in {
           "llama3-demo": (64, 500_000.0, 8.0, 1.0, 4.0, 256),
           "llama3.1": (128, 500_000.0, 8.0, 1.0, 4.0, 8192),
           "llama3-factor32": (64, 500_000.0, 32.0, 1.0, 4.0, 8192),
           "llama3-shifted": (96, 10_000.0, 4.0, 2.0, 8.0, 512),
       }.items()},
}


def _hf_rotary(name: str) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d, rope_parameters, max_pos = CASES[name]
    config = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=max_pos,
                         rope_parameters=dict(rope_parameters))
    return LlamaRotaryEmbedding(config)


def _params(name: str) -> RopeParams:
    """The RopeParams the HF installer reads from the case's rotary module."""
    return rope_params_of(_hf_rotary(name))[None]


def test_the_installer_reads_every_field():
    assert _params("yarn-qwen2.5") == RopeParams(1e6, 128, "yarn", factor=4.0, original_max_position_embeddings=32768,
                                                 attention_factor=yarn_attention_factor(4.0))
    assert _params("yarn-deepseek").attention_factor == 1.0 == yarn_attention_factor(40.0, 1.0, 1.0)
    assert _params("yarn-deepseek-mscale").attention_factor == yarn_attention_factor(40.0, 1.0, 0.8) > 1.05
    assert _params("yarn-untruncated").truncate is False
    assert _params("linear") == RopeParams(10_000.0, 64, "linear", factor=4.0)
    assert _params("llama3-demo") == RopeParams(500_000.0, 64, "llama3", 8.0, 1.0, 4.0, 256)
    assert _hf_rotary("llama3-demo").attention_scaling == 1.0


def test_the_yarn_cases_have_a_ramp_inside_the_head():
    """Otherwise the mix would be all interpolation or all extrapolation and the tests would not see it."""
    for name in ("yarn-qwen2.5", "yarn-deepseek", "yarn-deepseek-mscale", "yarn-demo", "yarn-untruncated"):
        p = _params(name)
        low, high = yarn_ramp_bounds(p)
        ramp = ((torch.arange(p.rotary_dim // 2) - low) / (high - low)).clamp(0, 1)
        assert ((ramp > 0) & (ramp < 1)).any() and (ramp == 1).any(), (name, low, high)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_is_bitwise_hfs_formula_in_fp64(name):
    p = _params(name)
    assert torch.equal(rope_inv_freq(p), rope_inv_freq_reference(p, torch.float64))


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_in_fp32_is_hfs_own_inv_freq_buffer(name):
    module = _hf_rotary(name)
    assert torch.equal(rope_inv_freq_reference(_params(name), torch.float32), module.inv_freq)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_is_hfs_buffer_within_the_fp32_bound(name):
    p, buffer = _params(name), _hf_rotary(name).inv_freq
    rel = ((rope_inv_freq(p) - buffer.double()).abs() / buffer.double()).max().item()
    assert rel <= inv_freq_rtol(p), (rel, inv_freq_rtol(p))
    assert inv_freq_matches(p, buffer)


@pytest.mark.parametrize(
    "name, field, value",
    [("linear", "factor", 2.0), ("yarn-demo", "factor", 2.0), ("yarn-demo", "beta_slow", 2.0),
     ("yarn-demo", "original_max_position_embeddings", 256), ("yarn-untruncated", "truncate", True),
     ("llama3-demo", "low_freq_factor", 2.0), ("llama3-demo", "high_freq_factor", 3.0), ("llama3-demo", "factor", 4.0),
     ("llama3-demo", "original_max_position_embeddings", 512)],
)
def test_negative_control_a_wrong_scaling_field_is_refused_and_changes_the_bits(name, field, value):
    p = _params(name)
    wrong = dataclasses.replace(p, **{field: value})
    assert not inv_freq_matches(wrong, _hf_rotary(name).inv_freq)
    pos = torch.arange(300)
    assert not torch.equal(rope_cos_sin(pos, wrong)[0], rope_cos_sin(pos, p)[0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_table_is_bitwise_the_unblocked_reference(name):
    p = _params(name)
    pos = torch.arange(3000)
    with kernel_caches():
        cos, sin = rope_cos_sin(pos, p)
    ref_cos, ref_sin = rope_table_reference(pos, p)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)


def test_yarns_attention_factor_scales_cos_and_sin():
    p = _params("yarn-demo")
    assert p.attention_factor > 1.1
    pos = torch.arange(200)
    cos, sin = rope_cos_sin(pos, p)
    # the same angles at factor 1, scaled in fp64 and rounded once: the table's cos/sin are exactly that
    unscaled = dataclasses.replace(p, attention_factor=1.0)
    angles = pos.double()[:, None] * rope_inv_freq(unscaled)[None]
    assert torch.equal(cos, (angles.cos() * p.attention_factor).float())
    assert torch.equal(sin, (angles.sin() * p.attention_factor).float())
    assert float((cos.double() ** 2 + sin.double() ** 2).sqrt().max()) > 1.1


@pytest.mark.parametrize("name", sorted(CASES))
def test_error_against_fp64_is_within_the_stated_bound(gen, name):
    from logdiff.kernels import KERNELS

    p = _params(name)
    x = torch.randn(300, 2, p.rotary_dim, generator=gen)
    pos = torch.arange(0, 30000, 100)
    ref = rope_reference(x.double(), pos, p)
    bound = {k.name: k.bound for k in KERNELS}["rope"]
    assert (rope(x, pos, p).double() - ref).abs().max() / ref.abs().max() <= bound


# ----------------------------------------------------------------------------- HF and vLLM modules


def _hf_model(build_model, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    rope_parameters = dict(CASES[name][1])
    if rope_parameters["rope_type"] == "yarn":  # the tiny model's head_dim 16: a ramp inside 8 frequencies
        rope_parameters["original_max_position_embeddings"] = 32
    return build_model("llama", dtype, rope_parameters=rope_parameters,
                       max_position_embeddings=32 * int(rope_parameters["factor"]))


@pytest.mark.parametrize("name", ["linear", "yarn-demo"])
def test_hf_full_forward_equals_kv_decode(build_model, hf_paths, sequences, name):
    model = _hf_model(build_model, name)
    prompts, responses = sequences
    with consistent_hf(model) as report:
        full = hf_paths.full(model, prompts, responses)
        decode = hf_paths.decode(model, prompts, responses)
    assert "model.rotary_emb" in report.replaced["rope"]
    assert hf_paths.equal(full, decode)


def _vllm_rope(p: RopeParams) -> torch.nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope_parameters = {"rope_type": p.rope_type, "rope_theta": p.theta, "factor": p.factor}
    if p.rope_type == "yarn":
        rope_parameters.update(original_max_position_embeddings=p.original_max_position_embeddings,
                               beta_fast=p.beta_fast, beta_slow=p.beta_slow, truncate=p.truncate)
    with set_current_vllm_config(VllmConfig()):
        return get_rope(p.rotary_dim, max_position=32 * int(p.factor), is_neox_style=True,
                        rope_parameters=rope_parameters, dtype=torch.bfloat16)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["linear", "yarn-demo"])
def test_vllm_reads_the_same_rope_and_rotates_bitwise_as_hf(build_model, gen, name):
    pytest.importorskip("vllm")
    from logdiff.sources.vllm import consistent_ops

    model = _hf_model(build_model, name)
    hf_params = rope_params_of(model.model.rotary_emb)[None]
    module = _vllm_rope(hf_params)
    assert type(module).__name__ == {"linear": "LinearScalingRotaryEmbedding", "yarn": "YaRNScalingRotaryEmbedding"}[
        hf_params.rope_type]
    assert consistent_ops.rope_params_of(module) == hf_params
    modeling = sys.modules[type(model).__module__]
    q = torch.randn(1, 4, 150, 16, generator=gen).bfloat16()  # HF [B, H, T, D]
    pos = torch.arange(150)
    with consistent_hf(model, only={"rope"}):
        cos, sin = model.model.rotary_emb(q, pos[None])
        hf_q, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
    vllm_q, _ = consistent_ops.rope_forward(module)(pos, q[0].transpose(0, 1).reshape(150, 64))
    assert torch.equal(hf_q[0].transpose(0, 1).reshape(150, 64), vllm_q)


@pytest.mark.vllm
def test_vllm_negative_control_a_module_whose_frequencies_disagree_is_refused(monkeypatch):
    pytest.importorskip("vllm")
    from logdiff.sources.vllm.consistent_ops import rope_params_of

    module = _vllm_rope(_params("yarn-demo"))
    built_with = module._compute_inv_freq(module.scaling_factor)  # the frequencies of its cos/sin cache
    monkeypatch.setattr(module, "beta_slow", 2)  # reports another ramp than the one its cache was built with
    monkeypatch.setattr(module, "_compute_inv_freq", lambda factor: built_with)
    with pytest.raises(NotImplementedError, match="inv_freq is not what its parameters give"):
        rope_params_of(module)


# ----------------------------------------------------------------------------- DeepSeek-V2/V3's yarn

#: a DeepSeek yarn over the MLA rope width 64, mscale != mscale_all_dim (both factors differ from 1)
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def _hf_deepseek_rotary(arch: str, rope_parameters: dict) -> torch.nn.Module:
    """HF's own DeepSeek-V2/V3 rotary module (V2 returns cos/sin as a complex ``freqs_cis``) on the MLA shape."""
    import transformers
    from logdiff.probes.arch.deepseek_v2 import MLA_SHAPE

    cls = {"v2": "DeepseekV2", "v3": "DeepseekV3"}[arch]
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        q_lora_rank=None, first_k_dense_replace=1, max_position_embeddings=2048, rope_parameters=dict(rope_parameters),
        **MLA_SHAPE)  # fmt: skip
    modeling = importlib.import_module(f"transformers.models.deepseek_{arch}.modeling_deepseek_{arch}")
    return getattr(modeling, f"{cls}RotaryEmbedding")(config)


def _vllm_deepseek_rope(rope_parameters: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """vLLM's DeepseekScalingRotaryEmbedding as its deepseek_v2.py builds it (``rope_type`` renamed deepseek_yarn)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=2048, is_neox_style=False,
                        rope_parameters={**rope_parameters, "rope_type": "deepseek_yarn"}, dtype=dtype)


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_deepseek_yarn_is_the_kernels_yarn_with_the_mscale_ratio(arch):
    """HF's DeepSeek rotary module: yarn frequencies (its buffer is the fp32 reference bitwise) and cos/sin times
    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim), which the installer reads."""
    modeling = importlib.import_module(f"transformers.models.deepseek_{arch}.modeling_deepseek_{arch}")
    module = _hf_deepseek_rotary(arch, DEEPSEEK_YARN)
    p = rope_params_of(module)[None]
    ratio = modeling.yarn_get_mscale(4.0, 1.0) / modeling.yarn_get_mscale(4.0, 0.8)
    assert p == RopeParams(10_000.0, 64, "yarn", factor=4.0, original_max_position_embeddings=512,
                           attention_factor=ratio)
    assert p.attention_factor == module.attention_scaling == yarn_attention_factor(4.0, 1.0, 0.8) > 1.02
    assert torch.equal(rope_inv_freq_reference(p, torch.float32), module.inv_freq)
    assert torch.equal(rope_inv_freq(p), rope_inv_freq_reference(p, torch.float64))
    pos = torch.arange(3000)
    with kernel_caches():
        cos, sin = rope_cos_sin(pos, p)
    ref_cos, ref_sin = rope_table_reference(pos, p)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


@pytest.mark.parametrize(
    "field, value", [("mscale", 0.8), ("mscale_all_dim", 1.0), ("beta_fast", 16), ("beta_slow", 2)]
)
def test_deepseek_yarn_negative_control_a_wrong_field_gives_other_bits(field, value):
    """A wrong mscale (or mscale_all_dim) changes the cos/sin factor; a wrong beta, the frequencies (refused
    against the module's buffer): either way other bits."""
    p = rope_params_of(_hf_deepseek_rotary("v2", DEEPSEEK_YARN))[None]
    wrong = rope_params_of(_hf_deepseek_rotary("v2", {**DEEPSEEK_YARN, field: value}))[None]
    assert wrong != p
    if field.startswith("beta"):
        assert not inv_freq_matches(wrong, _hf_deepseek_rotary("v2", DEEPSEEK_YARN).inv_freq)
    pos = torch.arange(300)
    assert not torch.equal(rope_cos_sin(pos, wrong)[0], rope_cos_sin(pos, p)[0])


@pytest.mark.vllm
def test_vllm_deepseek_scaling_rope_is_read_as_hfs_yarn():
    """vLLM's DeepseekScalingRotaryEmbedding: its ``_compute_inv_freq`` is HF's buffer bitwise, its ``mscale`` HF's
    ``attention_scaling``, the installer reads HF's RopeParams from it, and its fp32 cos/sin cache is the kernel's
    table within fp32 angle rounding (a cache without the mscale ratio is 100x farther)."""
    pytest.importorskip("vllm")
    from logdiff.sources.vllm import consistent_ops

    hf = _hf_deepseek_rotary("v2", DEEPSEEK_YARN)
    p = rope_params_of(hf)[None]
    module = _vllm_deepseek_rope(DEEPSEEK_YARN)
    assert type(module).__name__ == "DeepseekScalingRotaryEmbedding"
    assert module.mscale == hf.attention_scaling
    assert torch.equal(module._compute_inv_freq(module.scaling_factor), hf.inv_freq)
    assert consistent_ops.rope_params_of(module) == p
    cache = module.cos_sin_cache
    pos = torch.arange(cache.shape[0])
    cos, sin = rope_cos_sin(pos, p)
    assert (cache[:, :32] - cos).abs().max() < 2e-4 and (cache[:, 32:] - sin).abs().max() < 2e-4
    unscaled, _ = rope_cos_sin(pos, dataclasses.replace(p, attention_factor=1.0))
    assert (cache[:, :32] - unscaled).abs().max() > 2e-2


@pytest.mark.vllm
def test_vllm_deepseek_negative_control_other_parameters_are_refused(monkeypatch):
    """A DeepseekScalingRotaryEmbedding whose cache was built with other frequencies than it reports is refused."""
    pytest.importorskip("vllm")
    from logdiff.sources.vllm.consistent_ops import rope_params_of as vllm_rope_params_of

    module = _vllm_deepseek_rope(DEEPSEEK_YARN)
    built_with = module._compute_inv_freq(module.scaling_factor)
    monkeypatch.setattr(module, "beta_fast", 16)
    monkeypatch.setattr(module, "_compute_inv_freq", lambda factor: built_with)
    with pytest.raises(NotImplementedError, match="DeepseekScalingRotaryEmbedding: its inv_freq is not what"):
        vllm_rope_params_of(module)
