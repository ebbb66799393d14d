"""gpt-oss (``GptOssForCausalLM``): attention sinks, alternating sliding/full layers, biased clamped-SwiGLU experts.

A gpt-oss layer is Llama's (``input_layernorm`` -> attention -> residual add
-> ``post_attention_layernorm`` -> MoE -> residual add) with four changes:

* **Attention sinks.** Each query head has a learned logit ``sinks[h]`` that
  joins the softmax's denominator and attends to nothing (HF's
  ``eager_attention_forward`` concatenates it as an extra column and drops it
  after the softmax; vLLM passes ``sinks=`` to its attention backend, whose CPU
  kernel adds it to the running sum). It is inside the ``attn_core`` boundary,
  and read there as a weight (``self_attn.sinks``): a stale sink is blamed on
  the attention core. HF's replay of the core reruns the function with the
  owning module, sinks included.
* **Alternating windows.** ``layer_types`` alternates ``sliding_attention``
  (even layers, window ``sliding_window``) and ``full_attention``; vLLM
  hard-codes "even layers slide" (``layer_idx % 2 == 0``) and ignores
  ``layer_types``. Both are read from the loaded modules and compared
  (``layer_types``, from each vLLM layer's backend window).
* **Biases everywhere.** q/k/v/o projections, the router (``mlp.router``: a
  linear with bias, top-k of the logits, softmax over the chosen: the same
  weights as softmax-then-renormalize) and both expert projections.
* **Clamped SwiGLU experts.** ``gate_up_proj`` holds gate and up in
  *interleaved* columns (``[E, hidden, 2I]``, HF's transposed layout);
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``,
  ``alpha`` 1.702, ``l`` 7.0. HF reads both from the config
  (``swiglu_alpha``/``swiglu_limit``); vLLM's fused MoE applies its
  ``swigluoai`` activation with fixed constants (``SwigluOAIAndMul``'s
  defaults): both are contract keys, so a checkpoint with other values is
  flagged, not silently mis-served.

vLLM names the modules differently (``model.embedding``, ``layers.N.attn``
with ``qkv_proj``/``rotary_emb``/``attn``/``o_proj``, ``mlp.router`` and
``mlp.experts``: a ``MoERunner`` over ``routed_experts`` with ``w13_weight
[E, 2I, H]`` and ``w13_bias``/``w2_bias``); its taps
(``logdiff/sources/vllm/taps.py``) and ``hf_name`` map them to HF's names.
vLLM's norms take eps 1e-5 whatever the config says (the demo uses 1e-5, as
the released checkpoints do). RoPE is YaRN (NeoX halves) on both
engines. transformers runs gpt-oss with eager attention only (no sdpa).

The demo: 4 layers (sliding, full, sliding, full; window 8), 8 experts of 128,
top-2, YaRN factor 8.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import (
    FUNCTION_BOUNDARIES,
    KEY_BOUNDARY,
    DecoderAdapter,
    _layer_boundaries,
    model_boundaries,
)
from logdiff.probes.correspondence import Boundary, CorrespondenceMap

SLIDING, FULL = "sliding_attention", "full_attention"
SWIGLU_KEYS = ("swiglu_alpha", "swiglu_limit")

#: vLLM parameter names -> HF's (after the packed q/k/v and the experts' weights are mapped)
_VLLM_RENAMES = (
    ("model.embedding.", "model.embed_tokens."),
    (".experts.routed_experts.w13_bias", ".experts.gate_up_proj_bias"),
    (".experts.routed_experts.w2_bias", ".experts.down_proj_bias"),
)


def _layer(n: int) -> list[Boundary]:
    """Llama's MoE layer with the router named ``mlp.router`` (HF's and vLLM's module)."""
    out = []
    for b in _layer_boundaries(n, qk_norm=False, moe=True):
        if b.kind == "router":
            b = Boundary(f"model.layers.{n}.mlp.router", "router", n, b.inputs)
        out.append(b)
    return out


@dataclass(frozen=True)
class GptOssAdapter(DecoderAdapter):
    """``DecoderAdapter`` with sinks in the attention core, per-layer windows, biases and clamped-SwiGLU experts."""

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        n_layers = int(config["num_hidden_layers"])
        boundaries = model_boundaries(n_layers, _layer)
        return CorrespondenceMap(
            self.architecture, boundaries, n_layers, config=config, functions=dict(FUNCTION_BOUNDARIES)
        )

    # ---- classification ----------------------------------------------------------------------

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        if kind == "linear" and boundary.endswith("o_proj"):
            weights.append(f"{boundary}.bias")
        elif kind == "attn":
            weights.append(f"{boundary.rsplit('.', 1)[0]}.sinks")
        elif kind in ("router", "moe"):
            block = boundary if kind == "moe" else boundary.rsplit(".", 1)[0]
            weights = [f"{block}.router.weight", f"{block}.router.bias"]
            if kind == "moe":
                keys += list(SWIGLU_KEYS)
                weights += [f"{block}.experts.{p}" for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                             "down_proj_bias")]  # fmt: skip
        return keys, weights

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        router = ("model.layers.0.mlp.router", "router")
        return {
            **KEY_BOUNDARY,
            "num_experts_per_tok": router,
            "norm_topk_prob": router,
            **dict.fromkeys(SWIGLU_KEYS, ("model.layers.0.mlp", "moe")),
        }

    def weight_boundary(self, name: str) -> tuple[str, str]:
        if name.endswith(".self_attn.sinks"):
            return f"{name.rsplit('.', 1)[0]}.attn_core", "attn"
        if ".mlp.router." in name:
            return name.rsplit(".", 1)[0], "router"
        return super().weight_boundary(name)

    # ---- contract readers ----------------------------------------------------------------------

    def attention(self, layer: Any) -> Any:
        """HF's ``self_attn``; vLLM's ``attn`` (an ``OAIAttention`` holding ``rotary_emb`` and the core ``attn``)."""
        attn = getattr(layer, "self_attn", None)
        return attn if attn is not None else layer.attn

    def embed(self, model: Any) -> Any:
        embed = getattr(model.model, "embed_tokens", None)
        return embed if embed is not None else model.model.embedding

    def router(self, layer: Any) -> Any | None:
        return getattr(getattr(layer, "mlp", None), "router", None)

    # ---- weights --------------------------------------------------------------------------------

    def hf_name(self, name: str) -> str:
        for old, new in _VLLM_RENAMES:
            name = name.replace(old, new)
        head, sep, tail = name.partition(".attn.")  # vLLM's OAIAttention is HF's self_attn
        return f"{head}.self_attn.{tail}" if sep and head.startswith("model.layers.") else name

    def moe_to_hf(self, param: str, tensor: Any) -> Any:
        """vLLM's plain expert tensor (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) in HF's layout (``[E, H, 2I]``,
        ``[E, I, H]``): gpt-oss keeps its experts transposed, gate/up columns interleaved on both sides."""
        return tensor.transpose(1, 2)

    # ---- consistent mode (HF) --------------------------------------------------------------------

    experts_activation = "swiglu_oai"  # consistent mode runs the experts through ``moe_experts_oai``


GPT_OSS = register(
    GptOssAdapter("GptOss", "gpt-oss", moe=True, qkv_bias=True, sliding_window_flag=None, router_renormalizes=True),
    Demo(
        "gpt-oss",
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "intermediate_size": 128,  # each expert's size
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "attention_bias": True,
            "sliding_window": 8,  # shorter than a test's 16-token sequences: the window hides keys
            # layer_types: GptOssConfig's default, sliding, full, sliding, full (any depth: every second layer full)
            "rms_norm_eps": 1e-5,  # vLLM's gpt-oss norms use 1e-5 whatever the config says
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 150_000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 256,
            },  # fmt: skip
        },
        "gpt-oss: attention sinks, sliding/full layers (window 8), 8 biased clamped-SwiGLU experts, top-2",
    ),
)
