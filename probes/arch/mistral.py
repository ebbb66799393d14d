"""Mistral: the Llama-like decoder whose ``sliding_window`` alone switches the window on.

Mistral 7B v0.1 attends within 4096 tokens; v0.2 and later set
``sliding_window: null``. The demo does the latter: a sliding window is not
covered by consistent mode (consistent_hf refuses it).
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

MISTRAL = register(
    DecoderAdapter("Mistral", "mistral", sliding_window_flag=None),
    Demo(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        {"intermediate_size": 768, "sliding_window": None,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        "Mistral: no sliding window (v0.2+)",
    ),
)
