"""rope with Llama 3's frequency scaling: its bands, HF's rotation and every path alike.

The formula, HF-buffer, table and error-bound checks run over these cases in test_kernel_rope_scaled.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logdiff.kernels import (
    RopeParams,
    kernel_caches,
    rope,
    rope_cos_sin,
    rope_inv_freq,
    rope_table_reference,
)
from logdiff.kernels.rope import inv_freq_matches

# the llama3 demo's rope (probes/arch/llama3.py: its head_dim 64 frequencies fall in all three bands),
# Llama 3.1 8B's, a factor-32 one (Llama 3.2 1B/3B) and an odd one with the medium band shifted
LLAMA3 = {
    "demo": RopeParams(500_000.0, 64, "llama3", 8.0, 1.0, 4.0, 256),
    "llama3.1": RopeParams(500_000.0, 128, "llama3", 8.0, 1.0, 4.0, 8192),
    "factor32": RopeParams(500_000.0, 64, "llama3", 32.0, 1.0, 4.0, 8192),
    "shifted": RopeParams(10_000.0, 96, "llama3", 4.0, 2.0, 8.0, 512),
}


def _bands(p: RopeParams) -> tuple[int, int, int]:
    """How many frequencies are kept, interpolated and divided by the factor."""
    default = rope_inv_freq(dataclasses.replace(p, rope_type="default", factor=1.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=8192))
    scaled = rope_inv_freq(p)
    kept = int((scaled == default).sum())
    divided = int((scaled == default / p.factor).sum())
    return kept, scaled.numel() - kept - divided, divided


def _hf_rotary(p: RopeParams) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=4 * p.rotary_dim, num_attention_heads=4, head_dim=p.rotary_dim,
        max_position_embeddings=8 * p.original_max_position_embeddings,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": p.theta, "factor": p.factor, "low_freq_factor": p.low_freq_factor,
            "high_freq_factor": p.high_freq_factor,
            "original_max_position_embeddings": p.original_max_position_embeddings,
        },
    )
    return LlamaRotaryEmbedding(config)


def _hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``q * cos + rotate_half(q) * sin`` in fp32 on ``[T, H, D]``, rounded once to x's dtype."""
    x32 = x.float()
    cos, sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([sin, sin], dim=-1)[:, None]
    x1, x2 = x32[..., : x.shape[-1] // 2], x32[..., x.shape[-1] // 2 :]
    return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def test_the_demo_ropes_cover_every_band():
    """The tests below would be vacuous for a band no frequency falls in."""
    for name in ("demo", "llama3.1", "shifted"):
        assert all(n > 0 for n in _bands(LLAMA3[name])), (name, _bands(LLAMA3[name]))


def test_negative_control_default_rope_of_the_same_base_is_not_llama3():
    p = LLAMA3["demo"]
    assert not inv_freq_matches(RopeParams(p.theta, p.rotary_dim), _hf_rotary(p).inv_freq)
    assert inv_freq_matches(p, _hf_rotary(p).inv_freq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_rope_is_bitwise_hfs_rotation_of_the_reference_table(gen, name, dtype):
    p = LLAMA3[name]
    x = torch.randn(80, 4, p.rotary_dim, generator=gen).to(dtype)
    pos = torch.arange(1000, 1080)
    torch.testing.assert_close(rope(x, pos, p), _hf_rotate(x, *rope_table_reference(pos, p)), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_prefill_chunks_and_decode_steps_agree(gen, name):
    p = LLAMA3[name]
    x = torch.randn(40, 2, p.rotary_dim, generator=gen).bfloat16()
    pos = torch.arange(200, 240)
    full = rope(x, pos, p)
    steps = torch.cat([rope(x[i : i + 1], pos[i : i + 1], p) for i in range(40)])
    assert torch.equal(full, steps)


def test_llama3_and_default_tables_of_one_base_live_side_by_side(gen):
    """The table is cached per RopeParams: one base, two rope types, two tables, neither disturbs the other."""
    p = LLAMA3["demo"]
    default = RopeParams(p.theta, p.rotary_dim)
    x = torch.randn(500, 2, p.rotary_dim, generator=gen)
    pos = torch.arange(500)
    with kernel_caches() as caches:
        alone = rope(x, pos, p)
        plain = rope(x, pos, p.theta)  # a bare base is default RoPE
        assert torch.equal(rope(x, pos, p), alone) and torch.equal(rope(x, pos, default), plain)
        assert {k[0] for k in caches.rope_tables} == {p, default}
    assert not torch.equal(alone[1:], plain[1:])


def test_parameters_are_validated():
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        RopeParams(1e4, 64, "dynamic")
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        RopeParams(1e4, 64, "llama3", 8.0, 4.0, 4.0, 8192)
    with pytest.raises(ValueError, match="default RoPE takes none of factor"):
        RopeParams(1e4, 64, "default", factor=8.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_cos_sin(torch.arange(3), LLAMA3["demo"], 32)
