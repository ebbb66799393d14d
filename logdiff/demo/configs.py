"""Tiny transformers configs for the demo models, one per supported architecture.

The shapes follow each family's real layout (Qwen3: q/k RMSNorm and untied
embeddings; Llama: no q/k norm; Qwen3-MoE: Qwen3 attention with a routed
top-2 mixture of experts in every layer) at a size that trains and runs on
two CPU cores:

| arch      | hidden | layers | heads / kv | head_dim | MLP                               |
|-----------|--------|--------|------------|----------|-----------------------------------|
| qwen3     | 256    | 4      | 4 / 2      | 64       | dense, intermediate 768           |
| llama     | 256    | 4      | 4 / 2      | 64       | dense, intermediate 768           |
| qwen3-moe | 256    | 4      | 4 / 2      | 64       | 8 experts, top-2, expert size 256 |

Grouped-query attention (2 kv heads for 4 query heads) is kept on purpose:
it is where engines differ in how they lay out and repeat K/V.
"""

from __future__ import annotations

from typing import Any

from logdiff.errors import InputError

SUPPORTED_DEMO_ARCHS: tuple[str, ...] = ("qwen3", "llama", "qwen3-moe")

_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_cache": True,
}

_PER_ARCH: dict[str, dict[str, Any]] = {
    "qwen3": {
        "intermediate_size": 768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "llama": {
        "intermediate_size": 768,
        "mlp_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
    },
    "qwen3-moe": {
        "intermediate_size": 768,  # unused while every layer is sparse; kept for completeness
        "moe_intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.01,
        "output_router_logits": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
}


class UnsupportedArchError(InputError, ValueError):
    """An architecture the demo builder does not know (exit code 2 in the CLI)."""


def check_arch(arch: str) -> str:
    """Return ``arch`` if it is supported, else raise UnsupportedArchError naming the supported ones."""
    if arch not in SUPPORTED_DEMO_ARCHS:
        raise UnsupportedArchError(
            f"unsupported demo architecture {arch!r}; supported: {', '.join(SUPPORTED_DEMO_ARCHS)}"
        )
    return arch


def tiny_config(arch: str, vocab_size: int, **overrides: Any):
    """A tiny transformers config for ``arch`` with ``vocab_size`` tokens.

    ``overrides`` replace any config key (e.g. ``num_hidden_layers=2``,
    ``bos_token_id=1``). The result is an untrained-model recipe: pass it to
    ``AutoModelForCausalLM.from_config`` to get random weights.
    """
    check_arch(arch)
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    config_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3-moe": Qwen3MoeConfig}[arch]
    kwargs: dict[str, Any] = {**_COMMON, **_PER_ARCH[arch], "vocab_size": vocab_size}
    kwargs.update(overrides)
    return config_cls(**kwargs)
