"""Llama (2 and 3): the plain Llama-like decoder, no q/k norm, no biases.

Llama 3's ``rope_type: llama3`` frequency scaling is a config of this same
architecture; its demo config lives in llama3.py.
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

LLAMA = register(
    DecoderAdapter("Llama", "llama"),
    Demo(
        "llama",
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "intermediate_size": 768,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
        },
        "Llama: the plain decoder",
    ),
)
