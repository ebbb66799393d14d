"""The effective contract of a megatron-core ``GPTModel``, read from its ``TransformerConfig`` and modules.

The same keys the HF engine's reader gives (``logdiff/sources/hf/contract.py``), so the comparison
checks a Megatron side against an HF or vLLM side key by key. Where Megatron has no such knob the
value is what its code computes: RoPE rotates halves (``neox``) unless ``rotary_interleaved``, the
attention scale is ``softmax_scale`` or ``1 / sqrt(kv_channels)``, top-k routing renormalizes its
weights unless the router applies softmax before top-k (``moe_router_pre_softmax``).
"""

from __future__ import annotations

import math
from typing import Any

from logdiff.probes.contracts import OFF, sampler


def megatron_contract(model: Any, vocab_size: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Effective settings of a ``GPTModel`` (``vocab_size``: the logical vocabulary, its output layer's rows across
    the tensor-parallel group)."""
    options = options or {}
    cfg = model.config
    eps = float(cfg.layernorm_epsilon)
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    scale = cfg.softmax_scale if getattr(cfg, "softmax_scale", None) else 1.0 / math.sqrt(head_dim)
    rope = getattr(model, "rotary_pos_emb", None)
    theta = getattr(model, "rotary_base", None) or _rope_base(rope)
    moe = bool(getattr(cfg, "num_moe_experts", None))
    window = getattr(cfg, "window_size", None)
    temperature = float(options.get("temperature", 1.0))
    return {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(vocab_size),
        "rms_norm_eps": eps,
        "qk_norm_eps": eps if getattr(cfg, "qk_layernorm", False) else None,
        "final_norm_eps": eps,
        "rope_theta": float(theta) if theta is not None else None,
        "rope_type": "default",
        "rope_style": "gptj" if getattr(cfg, "rotary_interleaved", False) else "neox",
        "attention_scale": float(scale),
        "sliding_window": OFF if window is None else int(window[0]) + 1,
        "tie_word_embeddings": bool(getattr(model, "share_embeddings_and_output_weights", False)),
        "num_experts_per_tok": int(cfg.moe_router_topk) if moe else None,
        "norm_topk_prob": (not bool(getattr(cfg, "moe_router_pre_softmax", False))) if moe else None,
        "temperature": temperature,
        "logprobs_mode": "processed_logprobs" if temperature != 1.0 else "raw_logprobs",
        **sampler(options),
        "attn_implementation": "megatron",
    }


def _rope_base(rope: Any) -> float | None:
    """RoPE's base from its inverse frequencies (``inv_freq[1] = base ** (-2 / dim)``)."""
    inv = getattr(rope, "inv_freq", None)
    if inv is None or inv.numel() < 2:
        return None
    dim = 2 * inv.numel()
    return float(inv[1].double() ** (-dim / 2.0))
