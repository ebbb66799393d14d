"""Qwen3 (dense): a Llama-like decoder with RMSNorm on q and k per head, untied embeddings.

vLLM 0.32 runs it as ``Qwen3ForCausalLM`` with the same module names; its
``q_norm``/``k_norm`` are plain (unfused) RMSNorms. The demo is 4 layers,
hidden 256, 4 query / 2 kv heads of 64, intermediate 768.
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

QWEN3 = register(
    DecoderAdapter("Qwen3", "qwen3", qk_norm=True),
    Demo(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {"intermediate_size": 768, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        "Qwen3 dense: q/k RMSNorm",
    ),
)
