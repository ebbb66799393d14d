"""consistent_hf: HF full forward and HF KV-cache decode give bitwise-equal logprobs, and stock does not."""

from __future__ import annotations

import sys

import pytest
import torch

from logdiff.sources.hf.consistent import ATTN_IMPLEMENTATION, consistent_hf

ARCHS = ["qwen3", "llama", "qwen3_moe"]
DTYPES = [torch.bfloat16, torch.float32]



@pytest.mark.isa_sensitive
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_full_forward_equals_kv_decode_inside_and_differs_outside(
    tiny_model, hf_paths, sequences, stock_varies, arch, dtype
):
    model = tiny_model(arch, dtype)
    prompts, responses = sequences
    with consistent_hf(model):
        full = hf_paths.full(model, prompts, responses)
        decode = hf_paths.decode(model, prompts, responses)
    assert hf_paths.equal(full, decode)
    assert torch.cat(full).mean() < -3.0  # peaked model: the random responses are unlikely
    # negative control: the stock paths disagree on the same tokens
    stock = hf_paths.equal(hf_paths.full(model, prompts, responses), hf_paths.decode(model, prompts, responses))
    stock_varies(stock, "stock HF full forward and KV-cache decode agree bitwise here")


def test_qwen2_with_qkv_biases(tiny_model, hf_paths, sequences):
    model = tiny_model("qwen2", torch.bfloat16)
    prompts, responses = sequences
    with consistent_hf(model):
        assert hf_paths.equal(hf_paths.full(model, prompts, responses), hf_paths.decode(model, prompts, responses))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_forward_equals_each_sequence_alone(tiny_model, hf_paths, sequences, arch):
    model = tiny_model(arch, torch.bfloat16)
    prompts, responses = sequences
    with consistent_hf(model):
        batched = hf_paths.full(model, prompts, responses)
        alone = [hf_paths.full(model, [p], [r])[0] for p, r in zip(prompts, responses, strict=True)]
    assert hf_paths.equal(batched, alone)


def _instance_forwards(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def _globals_snapshot(model: torch.nn.Module) -> dict:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    modeling = sys.modules[type(model).__module__]
    return {
        "attn": model.config._attn_implementation,
        "rope_fn": modeling.apply_rotary_pos_emb,
        "attn_registered": ATTN_IMPLEMENTATION in AttentionInterface._global_mapping,
        "mask_registered": ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping,
        "forwards": _instance_forwards(model),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_everything_is_restored_on_exit_and_on_exceptions(tiny_model, arch):
    model = tiny_model(arch, torch.float32)
    before = _globals_snapshot(model)
    assert before["forwards"] == [] and not before["attn_registered"]
    with consistent_hf(model) as report:
        inside = _globals_snapshot(model)
        assert inside["attn"] == ATTN_IMPLEMENTATION and inside["rope_fn"] is not before["rope_fn"]
        assert set(report.replaced) >= {"linear", "rms_norm", "rope", "attention"}
        assert len(inside["forwards"]) == sum(len(v) for k, v in report.replaced.items() if k != "attention") - 1
    assert _globals_snapshot(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with consistent_hf(model):
            raise RuntimeError("boom")
    assert _globals_snapshot(model) == before


def test_a_stock_model_is_untouched_while_another_is_consistent(build_model, hf_paths, sequences):
    stock, other = build_model("qwen3", torch.float32), build_model("qwen3", torch.float32)
    prompts, responses = sequences
    before = hf_paths.full(stock, prompts, responses)
    with consistent_hf(other):
        during = hf_paths.full(stock, prompts, responses)
        with consistent_hf(stock):  # nested: shared globals stay until the last holder leaves
            pass
        assert _globals_snapshot(other)["attn"] == ATTN_IMPLEMENTATION
        assert hf_paths.full(stock, prompts, responses)[0].dtype == torch.float32
    assert hf_paths.equal(before, during)
    assert _globals_snapshot(stock) == _globals_snapshot(other)


def test_unsupported_models_are_refused_before_anything_is_patched(build_model):
    model = build_model("qwen3", torch.float32)
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)
    with pytest.raises(NotImplementedError, match="LayerNorm"):
        with consistent_hf(model):
            pass
    assert _instance_forwards(model) == []
    scaled = build_model(
        "llama", torch.float32, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(NotImplementedError, match="rope_type"):
        with consistent_hf(scaled):
            pass
