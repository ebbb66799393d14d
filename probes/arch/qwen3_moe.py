"""Qwen3-MoE: Qwen3 attention with a routed top-k mixture of experts in the sparse layers.

HF: ``mlp.gate`` (a TopKRouter returning logits, weights, ids) and
``mlp.experts`` (3-D fused ``gate_up_proj``/``down_proj``; saved as one tensor
per expert). vLLM: a FusedMoE (or MoERunner holding ``routed_experts``) whose
``w13_weight``/``w2_weight`` map to the HF fused tensors; the router is read
from the ``gate`` child. ``mlp_only_layers``/``decoder_sparse_step`` choose
the sparse layers. The demo: 8 experts of 256, top-2, every layer sparse.
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

QWEN3_MOE = register(
    DecoderAdapter("Qwen3Moe", "qwen3-moe", qk_norm=True, moe=True),
    Demo(
        "qwen3-moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
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
        "Qwen3-MoE: 8 experts, top-2",
    ),
)
