"""The Llama-like decoder layout, shared by every adapter registered today.

A Llama-like model is ``model.embed_tokens``, ``model.layers.N`` (RMSNorm ->
attention with q/k/v/o projections and RoPE -> residual add -> RMSNorm ->
gated SiLU MLP or a routed MoE -> residual add), ``model.norm`` and
``lm_head``, in HF and in vLLM alike, so one ``DecoderAdapter`` describes the
whole family; a family module sets only what differs (q/k norms, MoE, which
config key switches the sliding window on) and its demo config.

The adapter describes the boundaries once (``correspondence``: their semantic
order and inputs, the MoE and dense layers, q/k norms, and the map's
``functions``: RoPE and the attention core, which HF computes in plain functions
the recorder wraps). Where each engine's modules expose them (its taps: HF's residual adds
read from a norm's input, vLLM's packed ``qkv_proj``/``gate_up_proj`` split and
its fused add + RMSNorm pairs) lives in that engine's folder
(``logdiff/sources/<engine>/taps.py``), whose default builder covers every
``DecoderAdapter`` from its engine-neutral attributes (``moe_block``); a new
engine maps these boundaries without touching this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from logdiff.probes.arch.base import ArchAdapter, first_router_layer
from logdiff.probes.correspondence import Boundary, CorrespondenceMap

#: boundaries HF computes in plain functions the recorder wraps (apply_rotary_pos_emb, the attention function)
FUNCTION_BOUNDARIES = {
    "rope_q": "model.layers.{N}.self_attn.rope_q",
    "rope_k": "model.layers.{N}.self_attn.rope_k",
    "attn_core": "model.layers.{N}.self_attn.attn_core",
}

#: where a contract key is read first, for a difference no introducing op accounts for
KEY_BOUNDARY = {
    "rms_norm_eps": ("model.layers.0.input_layernorm", "norm"),
    "qk_norm_eps": ("model.layers.0.self_attn.q_norm", "norm"),
    "final_norm_eps": ("model.norm", "norm"),
    "rope_theta": ("model.layers.0.self_attn.rope_q", "rope"),
    "rope_type": ("model.layers.0.self_attn.rope_q", "rope"),
    "rope_style": ("model.layers.0.self_attn.rope_q", "rope"),
    "attention_scale": ("model.layers.0.self_attn.attn_core", "attn"),
    "sliding_window": ("model.layers.0.self_attn.attn_core", "attn"),
    "layer_types": ("model.layers.0.self_attn.attn_core", "attn"),
    "tie_word_embeddings": ("logits", "logits"),
    "temperature": ("log_softmax", "log_softmax"),
    "logprobs_mode": ("log_softmax", "log_softmax"),
    "vocab_size": ("log_softmax", "log_softmax"),
    "num_experts_per_tok": ("model.layers.0.mlp.gate", "router"),
    "norm_topk_prob": ("model.layers.0.mlp.gate", "router"),
}

#: vLLM packed parameter -> HF parts (split along dim 0 by the layer's output_sizes)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: vLLM FusedMoE parameters -> HF fused-expert parameters (vLLM's CPU build prepacks them)
MOE_PARAMS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}

#: a grouped router's contract keys besides top-k and renormalisation (GLM-4.5, DeepSeek-V2/V3)
ROUTING_KEYS = ("scoring_func", "n_group", "topk_group", "routed_scaling_factor")


def _layer_boundaries(n: int, qk_norm: bool, moe: bool) -> list[Boundary]:
    p = f"model.layers.{n}"
    res_in = "model.embed_tokens" if n == 0 else f"model.layers.{n - 1}.residual_mlp"
    a = f"{p}.self_attn"
    out = [
        Boundary(f"{p}.input_layernorm", "norm", n, (res_in,)),
        Boundary(f"{a}.q_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.k_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.v_proj", "linear", n, (f"{p}.input_layernorm",)),
    ]
    q_in, k_in = f"{a}.q_proj", f"{a}.k_proj"
    if qk_norm:
        out += [Boundary(f"{a}.q_norm", "norm", n, (q_in,)), Boundary(f"{a}.k_norm", "norm", n, (k_in,))]
        q_in, k_in = f"{a}.q_norm", f"{a}.k_norm"
    out += [
        Boundary(f"{a}.rope_q", "rope", n, (q_in,)),
        Boundary(f"{a}.rope_k", "rope", n, (k_in,)),
        Boundary(f"{a}.attn_core", "attn", n, (f"{a}.rope_q", f"{a}.rope_k", f"{a}.v_proj"), causal=True),
        Boundary(f"{a}.o_proj", "linear", n, (f"{a}.attn_core",)),
        Boundary(f"{p}.residual_attn", "add", n, (res_in, f"{a}.o_proj")),
        Boundary(f"{p}.post_attention_layernorm", "norm", n, (f"{p}.residual_attn",)),
    ]
    ln = f"{p}.post_attention_layernorm"
    if moe:
        out += [Boundary(f"{p}.mlp.gate", "router", n, (ln,)), Boundary(f"{p}.mlp", "moe", n, (ln,))]
        mlp_out = f"{p}.mlp"
    else:
        out += [
            Boundary(f"{p}.mlp.gate_proj", "linear", n, (ln,)),
            Boundary(f"{p}.mlp.up_proj", "linear", n, (ln,)),
            Boundary(f"{p}.mlp.act_mul", "act", n, (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")),
            Boundary(f"{p}.mlp.down_proj", "linear", n, (f"{p}.mlp.act_mul",)),
        ]
        mlp_out = f"{p}.mlp.down_proj"
    out.append(Boundary(f"{p}.residual_mlp", "add", n, (f"{p}.residual_attn", mlp_out)))
    return out


def model_boundaries(n_layers: int, layer: Callable[[int], list[Boundary]]) -> list[Boundary]:
    """A decoder's boundaries in semantic order: the embeddings, ``layer(n)`` for each layer, the final norm,
    the logits and the log-softmax (every family's frame; only the layers differ)."""
    boundaries = [Boundary("model.embed_tokens", "embed", None)]
    for n in range(n_layers):
        boundaries += layer(n)
    return boundaries + [
        Boundary("model.norm", "norm", None, (f"model.layers.{n_layers - 1}.residual_mlp",)),
        Boundary("logits", "logits", None, ("model.norm",)),
        Boundary("log_softmax", "log_softmax", None, ("logits",)),
    ]


@dataclass(frozen=True)
class DecoderAdapter(ArchAdapter):
    """A Llama-like decoder family. ``hf_prefix`` names its transformers classes (``Qwen3`` ->
    ``Qwen3ForCausalLM``, ``Qwen3Config``, ``Qwen3RMSNorm``)."""

    hf_prefix: str
    name: str
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    moe: bool = False  # routed experts (mlp.gate + mlp.experts) in the sparse layers
    qkv_bias: bool = False  # biases on q/k/v (Qwen2); vLLM packs them like the weights
    sliding_window_flag: str | None = "use_sliding_window"  # None: config.sliding_window alone switches it on
    moe_block: str = "mlp"  # the MoE block's name in checkpoints and in vLLM (HF's module is always ``mlp``)
    router_renormalizes: bool | None = None  # HF router without ``norm_topk_prob``: whether it renormalizes
    first_moe_layer: int = 0  # where routing keys are read first (``configured``: mlp_only_layers, sparse step)

    # ---- identity -----------------------------------------------------------------------------

    @property
    def architecture(self) -> str:  # type: ignore[override]
        return f"{self.hf_prefix}ForCausalLM"

    @property
    def config_class(self) -> str:
        return f"{self.hf_prefix}Config"

    # ---- correspondence ---------------------------------------------------------------------

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        n_layers = int(config["num_hidden_layers"])
        dense_layers = set(config.get("mlp_only_layers") or []) if self.moe else set()
        step = int(config.get("decoder_sparse_step", 1) or 1) if self.moe else 1
        boundaries = model_boundaries(
            n_layers,
            lambda n: _layer_boundaries(n, self.qk_norm, self.moe and n not in dense_layers and (n + 1) % step == 0),
        )
        return CorrespondenceMap(
            self.architecture, boundaries, n_layers, config=config, functions=dict(FUNCTION_BOUNDARIES)
        )

    # ---- classification ----------------------------------------------------------------------

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys: list[str] = []
        weights: list[str] = []
        if kind == "norm":
            if boundary.endswith(("q_norm", "k_norm")):
                keys.append("qk_norm_eps")
            elif boundary == "model.norm":
                keys.append("final_norm_eps")
            else:
                keys.append("rms_norm_eps")
            weights.append(f"{boundary}.weight")
        elif kind == "add":
            keys.append("rms_norm_eps")
            weights.append(f"{self.residual_norm(boundary)}.weight")
        elif kind == "linear":
            weights.append(f"{boundary}.weight")
            if self.qkv_bias and boundary.endswith(("q_proj", "k_proj", "v_proj")):
                weights.append(f"{boundary}.bias")
        elif kind == "logits":
            keys.append("tie_word_embeddings")
            weights.append("lm_head.weight")
        elif kind == "embed":
            weights.append("model.embed_tokens.weight")
        elif kind == "rope":
            keys += ["rope_theta", "rope_type", "rope_style"]
        elif kind == "attn":
            keys += ["attention_scale", "sliding_window", "layer_types"]  # the window, and the layers it acts on
        elif kind == "log_softmax":
            keys += ["temperature", "logprobs_mode", "vocab_size"]
        elif kind in ("router", "moe"):
            keys += ["num_experts_per_tok", "norm_topk_prob"]
            prefix = boundary if kind == "moe" else boundary.rsplit(".", 1)[0]
            weights += [f"{prefix}.gate.weight", f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]
        return keys, weights

    def residual_norm(self, boundary: str) -> str:
        """The norm whose eps and weight a residual-add boundary is judged with (same layer)."""
        layer_prefix = boundary.rsplit(".", 1)[0]
        norm = "post_attention_layernorm" if boundary.endswith("residual_attn") else "input_layernorm"
        return f"{layer_prefix}.{norm}"

    def fused_norm(self, boundary: str) -> str | None:
        """The norm a residual add is merged into as one cause (vLLM's add + RMSNorm kernel), or None.

        Only the attention add is merged: it fuses into the same layer's norm. The MLP add
        fuses into the next layer's norm in vLLM and stays a cause of its own.
        """
        if boundary.endswith("residual_attn"):
            return f"{boundary.rsplit('.', 1)[0]}.post_attention_layernorm"
        return None

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        keys = dict(KEY_BOUNDARY)
        router = (f"model.layers.{self.first_moe_layer}.mlp.gate", "router")
        return {k: router if kind == "router" else (b, kind) for k, (b, kind) in keys.items()}

    def configured(self, config: Any) -> DecoderAdapter:
        if not self.moe:
            return self
        return replace(self, first_moe_layer=first_router_layer(self, config, self.first_moe_layer))

    def weight_boundary(self, name: str) -> tuple[str, str]:
        """(boundary, kind) of the op that reads weight ``name``."""
        if ".experts." in name:
            return name.split(".experts.")[0], "moe"
        if name == "lm_head.weight":
            return "logits", "logits"
        if name == "model.embed_tokens.weight":
            return "model.embed_tokens", "embed"
        owner = name.rsplit(".", 1)[0]
        kind = "norm" if owner.endswith("norm") else "router" if owner.endswith("mlp.gate") else "linear"
        return owner, kind

    # ---- contract readers (the same attribute paths in HF and vLLM modules) ------------------

    def layers(self, model: Any) -> Any:
        return model.model.layers

    def attention(self, layer: Any) -> Any:
        return layer.self_attn

    def input_norm(self, layer: Any) -> Any:
        return layer.input_layernorm

    def qk_norm_module(self, attention: Any) -> Any:
        return getattr(attention, "q_norm", None)

    def final_norm(self, model: Any) -> Any:
        return model.model.norm

    def embed(self, model: Any) -> Any:
        return model.model.embed_tokens

    def lm_head(self, model: Any) -> Any:
        """The output projection, or None where the engine holds none (vLLM ties it to the embeddings)."""
        return getattr(model, "lm_head", None)

    def first_moe_block(self, model: Any) -> Any | None:
        """The first decoder layer's ``mlp`` holding a router ``gate`` (an MoE block), on either engine, or None."""
        return next((layer.mlp for layer in self.layers(model) if hasattr(layer.mlp, "gate")), None)

    def sliding_window(self, config: Any) -> int | None:
        """The HF model's active sliding window, or None: the window a family without per-layer types masks on
        every layer (the HF contract reads the window each layer's module holds first: ``hf_layer_windows``)."""
        window = getattr(config, "sliding_window", None)
        if self.sliding_window_flag is not None and not getattr(config, self.sliding_window_flag, False):
            return None
        return window

    # ---- weights --------------------------------------------------------------------------------

    @property
    def packed(self) -> dict[str, tuple[str, ...]]:
        return dict(PACKED)

    @property
    def moe_params(self) -> dict[str, str]:
        return dict(MOE_PARAMS)

    def moe_to_hf(self, param: str, tensor: Any) -> Any:
        """vLLM's plain expert tensor ``param`` (``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``) in HF's
        in-memory layout; the same here (gpt-oss keeps its experts transposed)."""
        return tensor

    def hf_name(self, name: str) -> str:
        """The HF in-memory name of a checkpoint or vLLM parameter name (the MoE block renamed)."""
        if self.moe_block == "mlp":
            return name
        return name.replace(f".{self.moe_block}.", ".mlp.")

    def per_expert_stored(self, fused: str, stored: Mapping[str, Any]) -> bool:
        """Is the in-memory tensor ``fused`` in the checkpoint under another layout or name?

        transformers 5 fuses experts in memory but saves one tensor per expert, and
        some families save their MoE block under its legacy name (``moe_block``).
        """
        if self.moe_block != "mlp" and fused.replace(".mlp.", f".{self.moe_block}.") in stored:
            return True
        prefix, sep, _ = fused.rpartition(".experts.")
        stored_prefix = prefix.replace(".mlp", f".{self.moe_block}") if sep else prefix
        return bool(sep) and any(k.startswith((f"{prefix}.experts.0.", f"{stored_prefix}.experts.0.")) for k in stored)

    # ---- consistent mode (HF) --------------------------------------------------------------------

    @property
    def hf_norm_classes(self) -> frozenset[str]:
        return frozenset({f"{self.hf_prefix}RMSNorm"})

    #: RMSNorm scales by ``(1 + w)`` (Gemma) rather than ``w``
    norm_offset = False
    #: contracted features transformers' modeling code for this family never applies, and why
    #: (the HF contract reports them as dropped: ``probes.contracts.effective``)
    hf_dropped = MappingProxyType({})

    def mlp_activation(self, config: Any) -> str:
        """The gated MLP's activation name in the HF config."""
        return str(config.hidden_act)

    def final_softcap(self, config: Any) -> float | None:
        """The soft cap HF applies to the logits after ``lm_head``, or None."""
        return None

    #: attribute names of a gated MLP module: gate, up, down, activation (three: packed gate_up, down, activation)
    mlp_parts = ("gate_proj", "up_proj", "down_proj", "act_fn")
    #: attribute names of a fused-experts module: gate_up, down
    experts_parts = ("gate_up_proj", "down_proj")
    #: the experts' activation: ``silu`` (gated SiLU, ``moe_experts``) or ``swiglu_oai`` (gpt-oss, ``moe_experts_oai``)
    experts_activation = "silu"
    #: attribute of an MoE block holding a shared expert (consistent mode covers a plain gated MLP there)
    shared_expert = "shared_expert"
    #: attribute of an MoE block gating its shared expert (Qwen2-MoE's sigmoid gate: not covered)
    shared_expert_gate = "shared_expert_gate"

    def router(self, layer: Any) -> Any | None:
        """The HF MoE router of a decoder layer (a TopKRouter returning logits, weights, ids), or None."""
        return getattr(getattr(layer, "mlp", None), "gate", None) if self.moe else None

    def router_renormalizes_of(self, router: Any) -> bool:
        """Whether an HF router renormalizes its top-k weights (``norm_topk_prob``, else the family's rule)."""
        return bool(getattr(router, "norm_topk_prob", self.router_renormalizes))

    def router_bias(self, layer: Any) -> Any | None:
        """A decoder layer's expert-choice correction bias, on HF's or vLLM's layer (both on the block's ``gate``)."""
        block = getattr(layer, "mlp", None) or getattr(layer, self.moe_block, None)
        return self.correction_bias(getattr(block, "gate", None))

    def correction_bias(self, router: Any) -> Any | None:
        """An HF or vLLM router's ``e_score_correction_bias`` (DeepSeek-V3, GLM-4.5), or None."""
        return getattr(router, "e_score_correction_bias", None)

    def routing_rule_of(self, router: Any) -> dict[str, Any] | None:
        """An HF router's grouped, bias-corrected rule as ``kernels.moe_route_grouped`` keywords, or None.

        None: plain softmax top-k (``kernels.moe_route``). A router holding an
        ``e_score_correction_bias`` (DeepSeek-V3, GLM-4.5) scores with a sigmoid and
        chooses within groups (``n_group``, or GLM's ``num_group``, and ``topk_group``);
        its weights are scaled by ``routed_scaling_factor``.
        """
        if self.correction_bias(router) is None:
            return None
        return {
            "scoring": "sigmoid",
            "n_group": int(getattr(router, "n_group", getattr(router, "num_group", 1))),
            "topk_group": int(getattr(router, "topk_group", 1)),
            "scaling": float(getattr(router, "routed_scaling_factor", 1.0)),
        }

    def consistent_refusal(self, module: Any) -> str | None:
        """What consistent mode has no kernel for in this HF module (one line naming the op), or None."""
        return None

    def is_attention(self, module: Any) -> bool:
        """An attention module (its modeling module holds ``apply_rotary_pos_emb``)."""
        return hasattr(module, "q_proj") and hasattr(module, "o_proj")

    def latent_attention(self, module: Any) -> bool:
        """An MLA attention module (DeepSeek), whose ``forward`` consistent mode replaces, RoPE included."""
        return False

    def consistent_attention_forward(self, module: Any, style: str, consistent_rope: Callable[[Any], bool]) -> Callable:
        """The ``forward`` consistent mode gives a ``latent_attention`` module (RoPE in ``style`` on the kernel's
        tables, ``consistent_rope(cos)`` telling them apart); only latent-attention adapters have one."""
        raise NotImplementedError(f"{self.name}: no consistent forward for {type(module).__name__}")
