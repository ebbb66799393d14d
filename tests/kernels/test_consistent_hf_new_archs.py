"""consistent_hf on Gemma 2 and Phi-3: HF full forward and KV-cache decode bitwise equal, and what is refused.

Gemma 2 exercises the kernels of its own ops ((1 + w) norms, gelu-tanh MLP,
soft-capped attention and logits) with its sliding-window layers spanning the
whole context (windows shorter than the sequences: test_consistent_hf_window.py).
Phi-3 exercises HF's packed qkv_proj/gate_up_proj. Controls: the soft caps
really act (switching one off changes the logits).
"""

from __future__ import annotations

import pytest
import torch

from logdiff.sources.hf.consistent import consistent_hf

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=128, initializer_range=0.2,
)


def _gemma2(**overrides: object) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma2Config(
        **{**TINY, "query_pre_attn_scalar": 16, "sliding_window": 128, "attn_logit_softcapping": 5.0,
           "final_logit_softcapping": 3.0, **overrides}
    )
    return tf.Gemma2ForCausalLM(config).to(torch.bfloat16).eval()


def _phi3() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    return tf.Phi3ForCausalLM(tf.Phi3Config(**TINY, pad_token_id=0)).to(torch.bfloat16).eval()



@pytest.mark.parametrize("build", [_gemma2, _phi3], ids=["gemma2", "phi3"])
def test_full_forward_equals_kv_decode(hf_paths, sequences, build):
    model = build()
    prompts, responses = sequences
    with consistent_hf(model) as report:
        full = hf_paths.full(model, prompts, responses)
        decode = hf_paths.decode(model, prompts, responses)
    assert hf_paths.equal(full, decode)
    assert {"linear", "rms_norm", "rope", "attention", "silu_and_mul"} <= set(report.replaced)


@torch.no_grad()
def test_gemma2_soft_caps_are_applied_by_the_kernels(hf_paths, sequences):
    model = _gemma2()
    prompts, responses = sequences
    ids = torch.tensor([prompts[0] + responses[0]])
    with consistent_hf(model):
        capped = model(input_ids=ids).logits
    assert model.config.final_logit_softcapping == 3.0  # restored on exit
    assert capped.abs().max() <= 3.0
    model.config.final_logit_softcapping = None  # control: without the cap the logits differ
    with consistent_hf(model):
        assert not torch.equal(model(input_ids=ids).logits, capped)
    attn_uncapped = _gemma2(attn_logit_softcapping=None)  # control: the attention cap acts too
    with consistent_hf(attn_uncapped):
        assert not torch.equal(attn_uncapped(input_ids=ids).logits, capped)
