"""Gemma 2: four norms per layer, ``(1 + w)`` RMSNorm, scaled embeddings and soft-capping.

A Gemma 2 layer is ``input_layernorm`` -> attention (q/k/v/o, RoPE, attention
logits soft-capped at ``attn_logit_softcapping``, sliding-window layers
alternating with global ones) -> ``post_attention_layernorm`` -> residual add
-> ``pre_feedforward_layernorm`` -> gelu-tanh gated MLP ->
``post_feedforward_layernorm`` -> residual add. Every norm is
``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32; the embeddings are scaled by
``sqrt(hidden)`` (the normalizer rounded to the model dtype) and the final
logits soft-capped at ``final_logit_softcapping``.

How the engines expose it (their taps: ``logdiff/sources/<engine>/taps.py``):

* **embeddings**: HF's ``Gemma2TextScaledWordEmbedding`` returns the scaled
  value; vLLM scales outside any module (``embed_input_ids``), so its
  ``model.embed_tokens`` boundary is read where the scaled value enters layer
  0's ``input_layernorm``.
* **norms**: vLLM fuses the attention residual add into
  ``pre_feedforward_layernorm`` and the MLP add into the next layer's
  ``input_layernorm`` (or ``model.norm``), each returning ``(normed, residual)``;
  the post-norms are plain. HF's adds are read from the input of
  ``pre_feedforward_layernorm`` and the decoder layer's output.
* **logits**: vLLM's logits processor soft-caps inside its call and HF does it
  in ``Gemma2ForCausalLM.forward`` after ``lm_head``, so the ``logits``
  boundary is the soft-capped value on both sides (HF: the model output's
  ``logits``). vLLM ties ``lm_head`` to the embeddings; the demo does too.

Contract keys of their own: ``attn_logit_softcapping`` (attention core),
``final_logit_softcapping`` (logits) and ``embed_scale`` (embeddings), read
from the loaded modules (each engine's ``contract_extras.py``). Consistent mode covers the
sliding-window layers only where the window spans the whole context (it then
never hides a key; the demo's window is its 2048-token context) and refuses a
shorter window, as real Gemma 2 checkpoints have (4096 of 8192).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import FUNCTION_BOUNDARIES, KEY_BOUNDARY, DecoderAdapter, model_boundaries
from logdiff.probes.correspondence import Boundary, CorrespondenceMap

#: where Gemma's own contract keys are read first
_GEMMA_KEYS = {
    "attn_logit_softcapping": ("model.layers.0.self_attn.attn_core", "attn"),
    "final_logit_softcapping": ("logits", "logits"),
    "embed_scale": ("model.embed_tokens", "embed"),
}


def _layer_boundaries(n: int) -> list[Boundary]:
    p, a = f"model.layers.{n}", f"model.layers.{n}.self_attn"
    res_in = "model.embed_tokens" if n == 0 else f"model.layers.{n - 1}.residual_mlp"
    ln = f"{p}.pre_feedforward_layernorm"
    return [
        Boundary(f"{p}.input_layernorm", "norm", n, (res_in,)),
        Boundary(f"{a}.q_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.k_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.v_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.rope_q", "rope", n, (f"{a}.q_proj",)),
        Boundary(f"{a}.rope_k", "rope", n, (f"{a}.k_proj",)),
        Boundary(f"{a}.attn_core", "attn", n, (f"{a}.rope_q", f"{a}.rope_k", f"{a}.v_proj"), causal=True),
        Boundary(f"{a}.o_proj", "linear", n, (f"{a}.attn_core",)),
        Boundary(f"{p}.post_attention_layernorm", "norm", n, (f"{a}.o_proj",)),
        Boundary(f"{p}.residual_attn", "add", n, (res_in, f"{p}.post_attention_layernorm")),
        Boundary(ln, "norm", n, (f"{p}.residual_attn",)),
        Boundary(f"{p}.mlp.gate_proj", "linear", n, (ln,)),
        Boundary(f"{p}.mlp.up_proj", "linear", n, (ln,)),
        Boundary(f"{p}.mlp.act_mul", "act", n, (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")),
        Boundary(f"{p}.mlp.down_proj", "linear", n, (f"{p}.mlp.act_mul",)),
        Boundary(f"{p}.post_feedforward_layernorm", "norm", n, (f"{p}.mlp.down_proj",)),
        Boundary(f"{p}.residual_mlp", "add", n, (f"{p}.residual_attn", f"{p}.post_feedforward_layernorm")),
    ]


@dataclass(frozen=True)
class Gemma2Adapter(DecoderAdapter):
    """``DecoderAdapter`` with Gemma 2's layer, embeddings and soft-capped logits."""

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        n_layers = int(config["num_hidden_layers"])
        boundaries = model_boundaries(n_layers, _layer_boundaries)
        return CorrespondenceMap(
            self.architecture, boundaries, n_layers, config=config, functions=dict(FUNCTION_BOUNDARIES)
        )

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        extra = [k for k, (_, k_kind) in _GEMMA_KEYS.items() if k_kind == kind]
        if kind == "logits":  # lm_head is the embedding matrix (tied)
            weights = ["model.embed_tokens.weight"]
        return keys + extra, weights

    def residual_norm(self, boundary: str) -> str:
        layer_prefix = boundary.rsplit(".", 1)[0]
        norm = "pre_feedforward_layernorm" if boundary.endswith("residual_attn") else "input_layernorm"
        return f"{layer_prefix}.{norm}"

    def fused_norm(self, boundary: str) -> str | None:
        """vLLM fuses the attention add into ``pre_feedforward_layernorm`` (the MLP add stays its own cause)."""
        if boundary.endswith("residual_attn"):
            return f"{boundary.rsplit('.', 1)[0]}.pre_feedforward_layernorm"
        return None

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        return {**KEY_BOUNDARY, **_GEMMA_KEYS}

    norm_offset = True

    def mlp_activation(self, config: Any) -> str:
        return str(config.hidden_activation)

    def final_softcap(self, config: Any) -> float | None:
        cap = getattr(config, "final_logit_softcapping", None)
        return float(cap) if cap else None



GEMMA2 = register(
    Gemma2Adapter("Gemma2", "gemma2", sliding_window_flag=None),
    Demo(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {
            "intermediate_size": 768,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh",  # not read by Gemma 2; set so nothing mistakes it for SiLU
            "query_pre_attn_scalar": 64,
            "sliding_window": 2048,  # the whole context (max_position_embeddings): the window never hides a key
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,  # vLLM's Gemma 2 always ties lm_head to the embeddings
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "Gemma 2: (1 + w) norms, soft-capping, sliding-window layers",
    ),
)
