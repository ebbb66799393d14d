"""consistent_hf with sliding windows shorter than the sequences: Gemma 2 (every other layer) and Gemma 3.

HF builds a windowed mask for the sliding layers and, in a KV-cache decode, keeps
only the last ``window - 1`` keys of them (``DynamicSlidingWindowLayer``). The
consistent mask tags each query and key with its absolute position, the keys go
to their absolute slots, and the attention kernel masks the window: the full
forward and the decode then agree bitwise. Gemma 3 adds ``(1 + w)`` q/k norms and
one RoPE base per layer type. Controls: the window and the local base really act.
"""

from __future__ import annotations

import pytest
import torch

from logdiff.sources.hf.consistent import consistent_hf

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=128, initializer_range=0.2,
)
WINDOW = 4  # the fixture's sequences are 11 to 19 tokens long


def _gemma2(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma2Config(
        **{**TINY, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 5.0,
           "final_logit_softcapping": 3.0, **overrides}
    )
    return tf.Gemma2ForCausalLM(config).to(dtype).eval()


def _gemma3(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    config = tf.Gemma3TextConfig(
        **{**TINY, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "rope_parameters": rope,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"], **overrides}
    )
    return tf.Gemma3ForCausalLM(config).to(dtype).eval()



@pytest.mark.parametrize("build", [_gemma2, _gemma3], ids=["gemma2", "gemma3"])
def test_windowed_full_forward_equals_kv_decode(hf_paths, sequences, build):
    model = build()
    prompts, responses = sequences
    with consistent_hf(model) as report:
        full = hf_paths.full(model, prompts, responses)
        decode = hf_paths.decode(model, prompts, responses)
    assert hf_paths.equal(full, decode)
    assert {"linear", "rms_norm", "rope", "attention", "silu_and_mul"} <= set(report.replaced)


@pytest.mark.parametrize("build", [_gemma2, _gemma3], ids=["gemma2", "gemma3"])
def test_windowed_kernels_compute_what_hf_computes(hf_paths, sequences, build):
    """In fp32 (where rounding is small) the consistent paths agree with HF's own windowed attention.

    HF's eager attention: its sdpa path drops Gemma 2's attention soft cap (0.9 apart on this model).
    """
    model = build(torch.float32)
    model.config._attn_implementation = "eager"
    prompts, responses = sequences
    stock_full, stock_decode = hf_paths.full(model, prompts, responses), hf_paths.decode(model, prompts, responses)
    with consistent_hf(model):
        full, decode = hf_paths.full(model, prompts, responses), hf_paths.decode(model, prompts, responses)
    assert max(float((a - b).abs().max()) for a, b in zip(full, stock_full)) < 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(decode, stock_decode)) < 1e-3


def test_gemma3_qk_norms_are_gemma_norms_and_each_layer_type_rotates_with_its_base(hf_paths, sequences):
    model = _gemma3()
    prompts, responses = sequences
    with consistent_hf(model) as report:
        base = hf_paths.full(model, prompts, responses)
    assert "model.layers.0.self_attn.q_norm" in report.replaced["rms_norm"]
    local = _gemma3(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
    with consistent_hf(local):  # control: the sliding layers' base is used (same weights, another base)
        assert not hf_paths.equal(hf_paths.full(local, prompts, responses), base)


@pytest.mark.parametrize("build", [_gemma2, _gemma3], ids=["gemma2", "gemma3"])
def test_negative_control_the_window_hides_keys(hf_paths, sequences, build):
    prompts, responses = sequences
    windowed, wide = build(), build(sliding_window=64)
    with consistent_hf(windowed), consistent_hf(wide):
        assert not hf_paths.equal(hf_paths.full(windowed, prompts, responses), hf_paths.full(wide, prompts, responses))


def test_a_mask_that_is_not_causal_is_refused(sequences):
    """Gemma 3 with bidirectional attention: the kernel would not see what the mask shows; one clear error."""
    model = _gemma3(use_bidirectional_attention=True)
    prompts, responses = sequences
    with consistent_hf(model), pytest.raises(NotImplementedError, match="not causal"):
        model(input_ids=torch.tensor([prompts[1] + responses[1]]))


def test_windowed_training_step_has_the_inference_bits():
    """Mistral with a window of 4 on 12 tokens (its SiLU MLP has a backward; Gemma's gelu-tanh kernel has none):
    a train-mode step with autograd gives the no-grad bits, and every parameter gets a gradient."""
    import transformers as tf

    from logdiff import consistent_training, kernels

    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(**TINY, sliding_window=WINDOW)).to(torch.bfloat16).train()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    handle = consistent_training(model)
    try:
        lp = kernels.token_log_probs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
        lp.sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        with torch.no_grad():
            assert torch.equal(lp.detach(), kernels.token_log_probs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:]))
    finally:
        handle.undo()
