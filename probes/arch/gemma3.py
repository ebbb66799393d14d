"""Gemma 3 (text): Gemma 2's layer plus ``(1 + w)`` q/k norms and a RoPE base per layer type.

A Gemma 3 layer is Gemma 2's (``input_layernorm`` -> attention ->
``post_attention_layernorm`` -> residual add -> ``pre_feedforward_layernorm``
-> gelu-tanh gated MLP -> ``post_feedforward_layernorm`` -> residual add, all
norms ``(1 + w)`` in fp32, embeddings scaled by ``sqrt(hidden)``) with three
changes, all read from transformers' ``Gemma3TextConfig``:

* **q/k norms**: ``q_norm``/``k_norm`` are ``(1 + w)`` RMSNorms over each head,
  between the projections and RoPE (Qwen3's place, Gemma's formula). HF runs
  them on ``[B, heads, L, D]`` (after its transpose), so its taps use the
  ``heads_first`` selection; vLLM runs them on ``[T, heads, D]``.
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
from logdiff.probes.arch.gemma2 import HF_TAPS as GEMMA2_HF_TAPS
from logdiff.probes.arch.gemma2 import VLLM_TAPS as GEMMA2_VLLM_TAPS
from logdiff.probes.arch.gemma2 import Gemma2Adapter, _layer_boundaries
from logdiff.probes.correspondence import Boundary, CorrespondenceMap, Tap

_L = r"model\.layers\.{N}"
_N = "model.layers.{N}"

_QK_NORM_TAPS = {
    family: tuple(
        Tap(_L + rf"\.self_attn\.{norm}", "output", select, (f"{_N}.self_attn.{norm}",))
        for norm in ("q_norm", "k_norm")
    )
    for family, select in (("hf", "heads_first"), ("vllm", "tensor"))
}
_HF_LOGITS_FROM_LM_HEAD = Tap(r"lm_head", "output", "tensor", ("logits",))

#: where Gemma 3's own contract keys are read first
_GEMMA3_KEYS = {
    "rope_local_base_freq": ("model.layers.0.self_attn.rope_q", "rope"),
    "layer_types": ("model.layers.0.self_attn.attn_core", "attn"),
}

SLIDING, FULL = "sliding_attention", "full_attention"


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


def _first_of_type(layer_types: list[str], kind: str) -> int | None:
    return next((i for i, t in enumerate(layer_types) if t == kind), None)


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
        hf_taps = list(GEMMA2_HF_TAPS) + list(_QK_NORM_TAPS["hf"])
        if not config.get("final_logit_softcapping"):  # no cap: the logits are lm_head's output (replayable)
            hf_taps = [t for t in hf_taps if t.select != "logits_field"] + [_HF_LOGITS_FROM_LM_HEAD]
        taps = {"hf": hf_taps, "vllm": list(GEMMA2_VLLM_TAPS) + list(_QK_NORM_TAPS["vllm"])}
        return CorrespondenceMap(self.architecture, boundaries, taps, n_layers, functions=dict(FUNCTION_BOUNDARIES))

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        return keys + [k for k, (_, k_kind) in _GEMMA3_KEYS.items() if k_kind == kind], weights

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        return {**super().key_boundary, **_GEMMA3_KEYS}

    def contract_extras(self, model: Any, family: str) -> dict[str, Any]:
        """Gemma 2's keys (soft caps, ``embed_scale``), both RoPE bases and the layer types, per engine."""
        extras = super().contract_extras(model, family)
        extras.pop("tie_word_embeddings", None)  # vLLM's Gemma 3 keeps a (tied) lm_head: the generic reading holds
        if family == "hf":
            cfg = model.config
            types = list(cfg.layer_types)
            params = cfg.rope_parameters
            theta = {t: float(params[t]["rope_theta"]) for t in (SLIDING, FULL) if t in params and t in types}
            rope_type = {t: params[t].get("rope_type", "default") for t in theta}
        else:
            from logdiff.probes.contracts import VLLM_ROPE_TYPES

            layers = self.layers(model)
            types = [SLIDING if self.attention(layer).attn.impl.sliding_window != -1 else FULL for layer in layers]
            firsts = {t: _first_of_type(types, t) for t in (SLIDING, FULL)}
            rotaries = {t: self.attention(layers[i]).rotary_emb for t, i in firsts.items() if i is not None}
            theta = {t: float(r.base) for t, r in rotaries.items()}
            rope_type = {t: VLLM_ROPE_TYPES.get(type(r).__name__, type(r).__name__) for t, r in rotaries.items()}
        return {
            **extras,
            "rope_theta": theta.get(FULL),
            "rope_local_base_freq": theta.get(SLIDING),
            "rope_type": rope_type.get(FULL, rope_type.get(SLIDING)),
            "layer_types": ",".join("sliding" if t == SLIDING else "full" for t in types),
        }


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
