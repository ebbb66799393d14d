"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and a MoE with shared experts.

V3 (``DeepseekV3Adapter``, below) differs only in its router (sigmoid grouped
top-k with a correction bias) and HF's RoPE layout (``rope_interleave``).

An MLA layer projects the token to a compressed latent plus one decoupled
RoPE key: ``kv_a_proj_with_mqa`` -> ``[compressed_kv | k_pe]``,
``kv_a_layernorm`` on ``compressed_kv``, ``kv_b_proj`` up-projects the
normed latent to per-head ``k_nope`` and ``v``. The query is ``q_proj`` (or
the low-rank ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), each head
split into a no-position part and a RoPE part. RoPE (interleaved pairs, the
GPT-J style) rotates only the RoPE parts: ``q_pe`` per head, ``k_pe`` once,
shared by every head. Attention runs on ``q = [q_nope | rope(q_pe)]``,
``k = [k_nope | rope(k_pe)]`` (head dim nope + rope), ``v`` (head dim
``v_head_dim``), then ``o_proj``. The MLP is dense in the first
``first_k_dense_replace`` layers, then a router over ``n_routed_experts``
plus ``shared_experts`` (a plain gated MLP on every token) added to the
routed sum.

The layer's boundaries, the replay of its latent attention and its consistent ``forward`` are the
MLA's own, not the adapter's: ``probes/arch/mla.py`` holds them, with how the engines expose each
boundary. This module holds the adapters (contracts, routing rules, weights, consistent-mode
refusals) and the demos.

vLLM resolves the attention's children through ``self_attn.mla_attn`` (the
wrapper calls them), so its taps (``logdiff/sources/vllm/taps.py``) accept both
paths. Contract: HF rotates
interleaved pairs (``rope_style`` ``gptj``, vLLM's ``is_neox_style=False``);
vLLM's attention scale sits on the MLA op (``mla_attn.mla_attn.impl.scale``);
``latent_norm_eps``/``q_latent_norm_eps`` are ``kv_a_layernorm``'s and
``q_a_layernorm``'s eps (HF builds both with the default 1e-6 whatever
``rms_norm_eps`` says, vLLM with ``rms_norm_eps``).

Routing rule (contract keys ``norm_topk_prob``, ``scoring_func``, ``n_group``,
``topk_group``, ``routed_scaling_factor``), each engine's as its code applies
it: HF's ``DeepseekV2TopkRouter`` ranks softmax scores over every expert under
``topk_method: greedy`` (``n_group`` unused) and within the best ``topk_group``
groups under ``group_limited_greedy``, never renormalizes, and scales by
``routed_scaling_factor``; vLLM's block always routes grouped on ``n_group`` and
``topk_group`` and renormalizes by ``norm_topk_prob``. So ``greedy`` with
``n_group > 1`` is a routing difference between the two (``moe_routing``);
groups that are all kept read as one (``expert_groups``). Routing keys a
preflight alone finds are blamed on the first MoE layer of the model's layout
(``configured``: ``first_k_dense_replace``, ``moe_layer_freq``).

The CPU vLLM refuses MLA head sizes other than the real ones (``Head dimension
48 is not supported by MLA``), so the demo keeps ``kv_lora_rank`` 512,
``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, and
sets ``n_group``/``topk_group`` 1 (vLLM always routes grouped and asserts
they are set; one group is plain top-k, as HF's ``greedy``).

Consistent mode (docs/kernels.md, ``latent_attention``): both engines run
``kv_b_proj``'s up-projection of every cached latent on the ``linear`` kernel,
then the attention kernel with q/k heads of ``qk_nope + qk_rope`` and v heads
of ``v_head_dim``. HF: the attention module's ``forward`` (``latent_attention``
names it) is HF's own steps with RoPE on the kernel in ``hf_rope_style``
(interleaved pairs kept interleaved, as vLLM keeps them). vLLM: each
``MLAAttention.forward_impl`` reads the latent back from the paged cache, for
decode and prefill alike (no absorbed decode). A YaRN MLA (real checkpoints')
is covered: cos/sin carry the rotary module's factor (``mscale`` over
``mscale_all_dim``, the kernel's yarn ``attention_factor``) and the softmax
scale is each engine's own (``mscale_all_dim``'s mscale squared folded in);
any other scaled rope is refused (``consistent_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from logdiff.probes.arch.base import Demo, first_router_layer, register
from logdiff.probes.arch.decoder import (
    KEY_BOUNDARY,
    ROUTING_KEYS,
    DecoderAdapter,
    model_boundaries,
)
from logdiff.probes.arch.mla import (
    FUNCTION_BOUNDARIES,
    SPLIT_PARTS,
    consistent_mla_forward,
    latent_attention_replay,
    mla_layer_boundaries,
)
from logdiff.probes.contracts import expert_groups
from logdiff.probes.correspondence import Boundary, CorrespondenceMap

#: where DeepSeek's own contract keys are read first
_MLA_KEYS = {
    "latent_norm_eps": ("model.layers.0.self_attn.kv_a_layernorm", "norm"),
    "q_latent_norm_eps": ("model.layers.0.self_attn.q_a_layernorm", "norm"),
}


@dataclass(frozen=True)
class DeepseekV2Adapter(DecoderAdapter):
    """``DecoderAdapter`` with MLA attention and a shared-experts MoE after ``first_k_dense_replace`` layers."""

    #: the first MoE layer, where routing keys are read first (``key_boundary``): ``configured`` sets it from
    #: the model's ``first_k_dense_replace`` and ``moe_layer_freq`` (1 unconfigured: DeepSeek-V2's and the demos')
    first_moe_layer: int = 1

    def configured(self, config: Any) -> DeepseekV2Adapter:
        return replace(self, first_moe_layer=first_router_layer(self, config, self.first_moe_layer))

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        n_layers = int(config["num_hidden_layers"])
        q_lora = config.get("q_lora_rank") is not None
        dense = int(config.get("first_k_dense_replace", 0) or 0)
        freq = int(config.get("moe_layer_freq", 1) or 1)

        def layer(n: int) -> list[Boundary]:
            return mla_layer_boundaries(n, q_lora, bool(config.get("n_routed_experts")) and n >= dense and n % freq == 0)

        boundaries = model_boundaries(n_layers, layer)
        return CorrespondenceMap(
            self.architecture,
            boundaries,
            n_layers,
            config=config,
            functions=dict(FUNCTION_BOUNDARIES),
            rope_function="apply_rotary_emb",
            attention_replay=latent_attention_replay,
        )

    # ---- classification ----------------------------------------------------------------------

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        if boundary.endswith(SPLIT_PARTS):  # a part of a projection reads the projection's weight
            weights = [f"{boundary.rsplit('.', 1)[0]}.weight"]
        elif kind == "norm" and boundary.endswith(("kv_a_layernorm", "q_a_layernorm")):
            keys = ["latent_norm_eps" if boundary.endswith("kv_a_layernorm") else "q_latent_norm_eps"]
        elif kind == "attn":  # the latent's up-projection runs inside the attention op (vLLM absorbs it)
            weights = [f"{boundary.rsplit('.', 1)[0]}.kv_b_proj.weight"]
        elif kind in ("router", "moe"):
            keys = [*keys, *ROUTING_KEYS]
            prefix = boundary if kind == "moe" else boundary.rsplit(".", 1)[0]
            weights = [*weights, *self._router_extra_weights(prefix)]
        return keys, weights

    def _router_extra_weights(self, prefix: str) -> list[str]:
        """Router tensors besides ``gate.weight`` (V3: the correction bias)."""
        return []

    def weight_boundary(self, name: str) -> tuple[str, str]:
        owner = name.rsplit(".", 1)[0]
        short = owner.rsplit(".", 1)[-1]
        if short in ("q_proj", "q_b_proj"):
            return f"{owner}.nope", "linear"
        if short == "kv_a_proj_with_mqa":
            return f"{owner}.compressed_kv", "linear"
        if short == "kv_b_proj":
            return f"{owner.rsplit('.', 1)[0]}.latent_attn", "attn"
        return super().weight_boundary(name)

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        router = (f"model.layers.{self.first_moe_layer}.mlp.gate", "router")
        moe = {k: router for k in ("num_experts_per_tok", "norm_topk_prob", *ROUTING_KEYS)}
        return {**KEY_BOUNDARY, **_MLA_KEYS, **moe}

    # ---- contract readers -----------------------------------------------------------------------

    def latent_norm_eps(self, model: Any) -> dict[str, float | None]:
        """The eps of the first layer's latent norms (``kv_a_layernorm``, ``q_a_layernorm`` where q is compressed):
        HF builds both with the default eps, whatever ``rms_norm_eps`` says; vLLM uses it."""
        attn = self.attention(self.layers(model)[0])
        q_norm = getattr(attn, "q_a_layernorm", None)
        return {
            "latent_norm_eps": float(attn.kv_a_layernorm.variance_epsilon),
            "q_latent_norm_eps": float(q_norm.variance_epsilon) if q_norm is not None else None,
        }

    def hf_rope_style(self, config: Any) -> str:
        """V2's ``apply_rotary_emb`` rotates interleaved pairs (a complex multiply): GPT-J style."""
        return "gptj"

    def _hf_rule(self, gate: Any) -> dict[str, Any]:
        """V2's router as ``DeepseekV2TopkRouter.forward`` applies it: softmax scores; groups only under
        ``group_limited_greedy`` (``greedy`` ranks every expert, whatever ``n_group`` says); the top-k
        weights never renormalized (the router drops ``norm_topk_prob``), times ``routed_scaling_factor``."""
        grouped = getattr(gate, "topk_method", None) == "group_limited_greedy"
        n_group, topk_group = expert_groups(gate.num_group, gate.topk_group) if grouped else (1, 1)
        return {
            "norm_topk_prob": False,
            "scoring_func": "softmax",
            "n_group": n_group,
            "topk_group": topk_group,
            "routed_scaling_factor": float(gate.routed_scaling_factor),
        }

    # ---- weights, routing, consistent mode --------------------------------------------------------

    @property
    def packed(self) -> dict[str, tuple[str, ...]]:
        return {**super().packed, "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}

    def router(self, layer: Any) -> Any | None:
        return getattr(getattr(layer, "mlp", None), "gate", None)

    #: the MoE block's shared experts (a gated MLP)
    shared_expert = "shared_experts"

    def consistent_refusal(self, module: Any) -> str | None:
        """MLA is covered with default RoPE and with YaRN (real checkpoints'): its cos/sin factor is the rotary
        module's (the kernel's yarn ``attention_factor``), and its attention factor (``mscale_all_dim``'s mscale
        squared) is already in each engine's own softmax scale (HF ``module.scaling``, vLLM ``impl.scale``).
        Any other scaled rope is refused."""
        if self.latent_attention(module):
            rope = dict(getattr(module.config, "rope_parameters", None) or {})
            if rope.get("rope_type", "default") not in ("default", "yarn"):
                kind = rope["rope_type"]
                return f"MLA attention with rope_type {kind!r} has no consistent kernel (covered: default, yarn)"
        if hasattr(module, "topk_method") and self.correction_bias(module) is None:  # V2's softmax router
            rule = self._hf_rule(module)
            if rule["n_group"] != 1 or rule["routed_scaling_factor"] != 1.0:
                return (f"DeepSeek-V2 routing with {module.topk_method}, {rule['n_group']} groups and "
                        f"routed_scaling_factor {rule['routed_scaling_factor']} has no consistent kernel "
                        "(covered: greedy top-k, unscaled)")
        return None

    def is_attention(self, module: Any) -> bool:
        return hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "o_proj")

    def latent_attention(self, module: Any) -> bool:
        return self.is_attention(module) and hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv")

    def consistent_attention_forward(self, module: Any, style: str, consistent_rope: Callable[[Any], bool]) -> Callable:
        return consistent_mla_forward(module, style, consistent_rope)



#: the MLA shapes vLLM's CPU MLA accepts, on the demo's hidden 256 / 4 heads
MLA_SHAPE = {
    "num_key_value_heads": 4,  # MLA: every head gets its own k and v from the latent
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}

DEEPSEEK_V2 = register(
    DeepseekV2Adapter("DeepseekV2", "deepseek-v2", moe=True, sliding_window_flag=None, router_renormalizes=False),
    Demo(
        "deepseek-v2",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        {
            **MLA_SHAPE,
            "q_lora_rank": None,  # as DeepSeek-V2-Lite: q_proj straight from the hidden state
            "intermediate_size": 768,  # the dense first layer
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "topk_method": "greedy",
            "n_group": 1,  # vLLM always routes grouped and needs both set; one group is plain top-k
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "DeepSeek-V2: MLA (no q-LoRA), 8 routed + 1 shared expert, first layer dense",
    ),
)


@dataclass(frozen=True)
class DeepseekV3Adapter(DeepseekV2Adapter):
    """DeepSeek-V3: V2's MLA and MoE layout with sigmoid grouped routing and a correction bias.

    The router scores with a sigmoid, chooses the ``topk_group`` best of ``n_group``
    groups on ``scores + e_score_correction_bias`` (a router weight: a one-sided
    bias is a weights difference), weights from the unbiased scores, renormalized
    (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; vLLM needs
    ``scoring_func: sigmoid`` and ``topk_method: noaux_tc`` in the config (real V3
    checkpoints carry both; without them it routes with a softmax and no bias,
    which the contract's ``scoring_func`` shows). With ``rope_interleave`` (the
    default) HF rotates the interleaved pairs and returns them de-interleaved
    (``apply_rotary_pos_emb_interleave``: even lanes, then odd), while vLLM keeps
    them interleaved: vLLM's ``rope_q``/``rope_k`` are compared de-interleaved
    (``pair_deinterleaved``), the same values in HF's order.
    """

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        cmap = super().correspondence(config)
        if config.get("rope_interleave", True):  # vLLM's taps compare its pair de-interleaved (deepseek-v3 entry)
            cmap.rope_function = "apply_rotary_pos_emb_interleave"
        else:  # HF rotates halves of the checkpoint's interleaved lanes: a different rotation (rope_style neox)
            cmap.rope_function = "apply_rotary_pos_emb"
        return cmap

    def hf_rope_style(self, config: Any) -> str:
        return "gptj" if getattr(config, "rope_interleave", True) else "neox"

    def _hf_rule(self, gate: Any) -> dict[str, Any]:
        n_group, topk_group = expert_groups(gate.num_group, gate.topk_group)
        return {
            "scoring_func": "sigmoid",  # DeepseekV3TopkRouter: scores = router_logits.sigmoid()
            "n_group": n_group,
            "topk_group": topk_group,
            "routed_scaling_factor": float(gate.routed_scaling_factor),
        }

    def _router_extra_weights(self, prefix: str) -> list[str]:
        return [f"{prefix}.gate.e_score_correction_bias"]


DEEPSEEK_V3 = register(
    DeepseekV3Adapter("DeepseekV3", "deepseek-v3", moe=True, sliding_window_flag=None, router_renormalizes=True),
    Demo(
        "deepseek-v3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {
            **MLA_SHAPE,
            "q_lora_rank": 128,  # q_a_proj -> q_a_layernorm -> q_b_proj (vLLM fuses q_a with kv_a)
            "intermediate_size": 768,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",  # read by vLLM (HF's V3 router always uses a sigmoid)
            "topk_method": "noaux_tc",  # vLLM: the router holds e_score_correction_bias
            "rope_interleave": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "DeepSeek-V3: MLA with q-LoRA, sigmoid grouped routing with a correction bias, 8 routed + 1 shared expert",
    ),
)
