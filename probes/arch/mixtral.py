"""Mixtral: Mistral attention with a routed top-2 mixture of experts in every layer.

HF holds the block as ``mlp`` (``gate``: a TopKRouter that always renormalizes
the top-k weights and has no ``norm_topk_prob``; ``experts``: fused 3-D
tensors), but its checkpoints and vLLM keep the legacy name
``block_sparse_moe`` (experts saved as ``experts.N.w1/w2/w3``; vLLM's
``MixtralMoE`` with a ``gate`` and a ``MoERunner``), so the vLLM taps and
weight names are renamed to the HF ones (``moe_block``). The demo: 8 experts
of 256, top-2, no sliding window.
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

MIXTRAL = register(
    DecoderAdapter(
        "Mixtral", "mixtral", moe=True, sliding_window_flag=None, moe_block="block_sparse_moe", router_renormalizes=True
    ),
    Demo(
        "mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        {
            "intermediate_size": 256,  # each expert's size
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.01,
            "output_router_logits": False,
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        "Mixtral: 8 experts, top-2",
    ),
)
