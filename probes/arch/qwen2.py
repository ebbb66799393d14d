"""Qwen2 / Qwen2.5: the Llama-like decoder with biases on q, k and v (not on o).

vLLM packs the three biases into ``qkv_proj.bias`` like the weights; the
fingerprints split them back into ``q_proj.bias``/``k_proj.bias``/
``v_proj.bias``, and the projections' contract reads them. The sliding window
is off unless ``use_sliding_window`` is set (not covered by consistent mode).
"""

from __future__ import annotations

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

QWEN2 = register(
    DecoderAdapter("Qwen2", "qwen2", qkv_bias=True),
    Demo(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"intermediate_size": 768, "use_sliding_window": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        "Qwen2/Qwen2.5: q/k/v biases",
    ),
)
