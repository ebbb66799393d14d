"""Gemma 3 (text): Gemma 2's layer plus ``(1 + w)`` q/k norms and a RoPE base per layer type.

A Gemma 3 layer is Gemma 2's (``input_layernorm`` -> attention ->
``post_attention_layernorm`` -> residual add -> ``pre_feedforward_layernorm``
-> gelu-tanh gated MLP -> ``post_feedforward_layernorm`` -> residual add, all
norms ``(1 + w)`` in fp32, embeddings scaled by ``sqrt(hidden)``) with three
changes, all read from transformers' ``Gemma3TextConfig``:

* **q/k norms**: ``q_norm``/``k_norm`` are ``(1 + w)`` RMSNorms over each head,
  between the projections and RoPE (Qwen3's place, Gemma's formula). HF runs
  them on ``[B, heads, L, D]`` (after its transpose), so its taps
  (``logdiff/sources/hf/taps.py``) use the ``heads_first`` selection; vLLM runs
  them on ``[T, heads, D]``.
* **two RoPE bases**: ``layer_types`` says which layers are
  ``sliding_attention`` (local) and which ``full_attention`` (global);
  ``rope_parameters`` holds one entry per type (``rope_theta`` 10k local, 1M
  global on real checkpoints; older configs call the local one
  ``rope_local_base_freq``). HF has one rotary module computing cos/sin per
  type; vLLM gives each layer a ``RotaryEmbedding`` with its type's base.
  Contract keys: ``rope_theta`` (global), ``rope_local_base_freq`` (local) and
  ``layer_types``, each read from both engines' modules.
* **no soft caps** by default (``attn_logit_softcapping`` and
  ``final_logit_softcapping`` are None); when a config sets the final one,
  the logits are read from the model output as in Gemma 2, otherwise from
  ``lm_head`` (replayable). vLLM keeps an ``lm_head`` tied to the embeddings.

Sliding layers see the last ``sliding_window`` keys (the key at the query's own
position included), in HF's mask and vLLM's CPU kernel alike; consistent mode
masks the same window in its reference attention kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import FUNCTION_BOUNDARIES, model_boundaries
from logdiff.probes.arch.gemma2 import Gemma2Adapter, _layer_boundaries
from logdiff.probes.correspondence import Boundary, CorrespondenceMap

#: where Gemma 3's own contract keys are read first
_GEMMA3_KEYS = {
    "rope_local_base_freq": ("model.layers.0.self_attn.rope_q", "rope"),
}

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_type_keys(types: list[str], theta: dict[str, float], rope_type: dict[str, str]) -> dict[str, Any]:
    """The contract keys of Gemma 3's two layer types, from each engine's reading of them: the full layers'
    RoPE base and type, the sliding layers' base (``rope_local_base_freq``) and the per-layer types."""
    return {
        "rope_theta": theta.get(FULL),
        "rope_local_base_freq": theta.get(SLIDING),
        "rope_type": rope_type.get(FULL, rope_type.get(SLIDING)),
        "layer_types": ",".join("sliding" if t == SLIDING else "full" for t in types),
    }


def _with_qk_norms(boundaries: list[Boundary], n: int) -> list[Boundary]:
    """Gemma 2's layer with ``q_norm``/``k_norm`` between the projections and RoPE."""
    a = f"model.layers.{n}.self_attn"
    out: list[Boundary] = []
    for b in boundaries:
        if b.name == f"{a}.rope_q":
            out += [
                Boundary(f"{a}.q_norm", "norm", n, (f"{a}.q_proj",)),
                Boundary(f"{a}.k_norm", "norm", n, (f"{a}.k_proj",)),
            ]
            b = Boundary(b.name, b.kind, n, (f"{a}.q_norm",))
        elif b.name == f"{a}.rope_k":
            b = Boundary(b.name, b.kind, n, (f"{a}.k_norm",))
        out.append(b)
    return out


@dataclass(frozen=True)
class Gemma3Adapter(Gemma2Adapter):
    """``Gemma2Adapter`` with q/k norms, a RoPE base per layer type and a ``lm_head`` on both engines."""

    # transformers' Gemma3Attention stores the cap but never passes it to its attention function
    hf_dropped = MappingProxyType({
        "attn_logit_softcapping": "transformers' Gemma3Attention never passes attn_logit_softcapping to its "
        "attention function",
    })  # fmt: skip

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        n_layers = int(config["num_hidden_layers"])
        boundaries = model_boundaries(n_layers, lambda n: _with_qk_norms(_layer_boundaries(n), n))
        return CorrespondenceMap(
            self.architecture, boundaries, n_layers, config=config, functions=dict(FUNCTION_BOUNDARIES)
        )

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        return keys + [k for k, (_, k_kind) in _GEMMA3_KEYS.items() if k_kind == kind], weights

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        return {**super().key_boundary, **_GEMMA3_KEYS}



GEMMA3 = register(
    Gemma3Adapter("Gemma3", "gemma3", sliding_window_flag=None),
    Demo(
        "gemma3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            "intermediate_size": 768,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh",  # not read by Gemma 3; set so nothing mistakes it for SiLU
            "query_pre_attn_scalar": 64,
            "sliding_window": 8,  # shorter than a test's 16-token sequences: the window hides keys
            "sliding_window_pattern": 2,  # every second layer full: sliding, full, sliding, full (any depth)
            "tie_word_embeddings": True,
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
        },
        "Gemma 3 (text): (1 + w) q/k norms, a RoPE base per layer type, sliding window 8",
    ),
)
