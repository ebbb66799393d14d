"""Llama 3: the Llama adapter with ``rope_type: llama3`` (frequency-dependent RoPE scaling).

Same architecture string as Llama (``LlamaForCausalLM``), so no adapter of its
own: only a demo config. vLLM runs it with ``Llama3RotaryEmbedding``, whose
type the contract reader reports as ``llama3`` like HF's ``rope_type``.
Consistent mode covers it: both installers read the llama3 scaling from their
rotary module into ``kernels.RopeParams`` and read one cos/sin table (see
docs/kernels.md, RoPE, and docs/architectures.md).
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register_demo

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small so the tiny model's head_dim 64 frequencies fall in all three bands
    "original_max_position_embeddings": 256,
}

LLAMA3 = register_demo(
    Demo(
        "llama3",
        "LlamaForCausalLM",
        "LlamaConfig",
        {"intermediate_size": 768, "mlp_bias": False, "rope_parameters": LLAMA3_ROPE},
        "Llama 3: llama3 RoPE scaling",
    )
)
