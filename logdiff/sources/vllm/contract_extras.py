"""The vLLM engine's readers of the contract keys only some architectures have: ``EXTRAS``, and vLLM's spellings.

``vllm_contract`` reads the keys every model has through the adapter's
engine-neutral helpers; this module reads the rest from vLLM's live modules
(reached through ``apply_model``), one reader per adapter ``name``
(``probes.contracts.ContractExtras``), each called with the adapter and the
loaded model. Its keys are merged over the generic ones (Gemma 2's
``tie_word_embeddings``, DeepSeek's MLA ``attention_scale`` correct them). An
adapter without an entry has no keys of its own; a derived engine running vLLM's
model code (vllm-ascend) reuses ``EXTRAS`` or ``EXTRAS.extended({...})``.

vLLM's own spellings live here too, shared with ``contract.py`` and
``consistent_ops.py``: ``VLLM_ROPE_TYPES`` (its rotary classes as HF
``rope_type`` names), ``vllm_routing_rule`` (a grouped router's settings on its
fused-MoE runner) and ``vllm_swiglu_constants`` (gpt-oss's fixed activation
constants). Family modules are imported inside the readers (they run after the
adapters are loaded), so importing this module never changes the adapters'
registration order; vLLM itself is imported only where a reader needs it.
"""

from __future__ import annotations

from typing import Any

from logdiff.probes.arch.decoder import ROUTING_KEYS
from logdiff.probes.contracts import OFF, ContractExtras, expert_groups, soft_cap, window_size

#: vLLM rotary-embedding class -> the HF ``rope_type`` it implements
VLLM_ROPE_TYPES = {
    "RotaryEmbedding": "default",
    "Llama3RotaryEmbedding": "llama3",
    "LinearScalingRotaryEmbedding": "linear",
    "DynamicNTKScalingRotaryEmbedding": "dynamic",
    "YaRNScalingRotaryEmbedding": "yarn",
    "DeepseekScalingRotaryEmbedding": "yarn",  # DeepSeek-V2/V3's yarn (rope_type deepseek_yarn inside vLLM)
}


def vllm_routing_rule(block: Any) -> dict[str, Any]:
    """``ROUTING_KEYS`` as vLLM applies them: read from the MoE block's runner (``block.experts``),
    whose router chooses and which scales the routed output (both scalings multiply)."""
    runner = block.experts
    router = getattr(runner, "router", None) or runner
    scale = float(getattr(router, "routed_scaling_factor", 1.0))
    if router is not runner:
        scale *= float(getattr(runner, "routed_scaling_factor", 1.0))
    groups, topk_groups = getattr(router, "num_expert_group", None), getattr(router, "topk_group", None)
    if not getattr(router, "use_grouped_topk", True):
        groups = topk_groups = 1  # a plain top-k router (its group settings unused)
    if groups is not None and topk_groups is not None:
        groups, topk_groups = expert_groups(groups, topk_groups)  # keeping every group is greedy top-k
    return {
        "scoring_func": _str_or_none(getattr(router, "scoring_func", None)),
        "n_group": None if groups is None else int(groups),
        "topk_group": None if topk_groups is None else int(topk_groups),
        "routed_scaling_factor": scale,
    }


def _str_or_none(value: Any) -> str | None:
    return str(value) if value is not None else None


def backend_window(impl: Any) -> int | str | None:
    """The window an attention backend masks (``OFF``: none; CPU: the window or -1, FlashAttention: a pair),
    or None where no backend holds one to read."""
    return window_size(impl.sliding_window) if hasattr(impl, "sliding_window") else None


def layer_windows(arch: Any, model: Any) -> list[int | str | None]:
    """The window each layer's attention backend masks: vLLM decides per model (Gemma's and gpt-oss's
    ``per_layer_sliding_window``; Qwen2/3 and Mistral take the cache config's window, set only where every
    layer type slides), so the backends are what runs."""
    return [backend_window(getattr(getattr(arch.attention(x), "attn", None), "impl", None)) for x in arch.layers(model)]


def _slides(layer_attention: Any) -> bool:
    """Whether a layer's attention backend masks a window."""
    return backend_window(layer_attention.attn.impl) != OFF


def vllm_swiglu_constants() -> tuple[float, float]:
    """(alpha, limit) of vLLM's ``swigluoai`` activation: ``SwigluOAIAndMul``'s defaults (not read from the config)."""
    import inspect

    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    params = inspect.signature(SwigluOAIAndMul.__init__).parameters
    return float(params["alpha"].default), float(params["limit"].default)


def gemma2_extras(arch: Any, model: Any) -> dict[str, Any]:
    """Soft caps from the attention backend and the logits processor (None or 0 there: no cap, ``OFF``; no
    backend or no logits processor: not read), the embedding ``normalizer``, and the tying (vLLM's Gemma 2
    holds no ``lm_head``: its logits use ``embed_tokens``' weight)."""
    impl = getattr(getattr(arch.attention(arch.layers(model)[0]), "attn", None), "impl", None)
    processor = getattr(model, "logits_processor", None)
    normalizer = getattr(model.model, "normalizer", None)
    return {
        "tie_word_embeddings": getattr(model, "lm_head", None) is None,  # logits from embed_tokens' weight
        "attn_logit_softcapping": soft_cap(impl.logits_soft_cap) if hasattr(impl, "logits_soft_cap") else None,
        "final_logit_softcapping": soft_cap(processor.soft_cap) if hasattr(processor, "soft_cap") else None,
        "embed_scale": float(normalizer.to(arch.embed(model).weight.dtype)) if normalizer is not None else None,
    }


def gemma3_extras(arch: Any, model: Any) -> dict[str, Any]:
    """Gemma 2's keys but the tying, the RoPE base of each layer type's first layer (each layer has its own
    rotary module; the sliding one ``OFF`` where no layer slides) and the layer types (from each layer's
    backend window)."""
    from logdiff.probes.arch.gemma3 import FULL, SLIDING, layer_type_keys

    extras = gemma2_extras(arch, model)
    extras.pop("tie_word_embeddings", None)  # vLLM's Gemma 3 keeps a (tied) lm_head: the generic reading holds
    layers = arch.layers(model)
    types = [SLIDING if _slides(arch.attention(layer)) else FULL for layer in layers]
    firsts = {t: next((i for i, kind in enumerate(types) if kind == t), None) for t in (SLIDING, FULL)}
    rotaries = {t: arch.attention(layers[i]).rotary_emb for t, i in firsts.items() if i is not None}
    theta = {t: float(r.base) for t, r in rotaries.items()}
    rope_type = {t: VLLM_ROPE_TYPES.get(type(r).__name__, type(r).__name__) for t, r in rotaries.items()}
    keys = layer_type_keys(types, theta, rope_type)
    return {**extras, **keys, **({} if SLIDING in types else {"rope_local_base_freq": OFF})}


def glm4_moe_extras(arch: Any, model: Any) -> dict[str, Any]:
    """The rotary width and the routing rule on the first MoE layer's fused-MoE runner."""
    out: dict[str, Any] = {"rotary_dim": arch.rotary_dim(model)}
    block = arch.first_moe_block(model)
    if block is None:
        return out | dict.fromkeys(ROUTING_KEYS)
    return out | vllm_routing_rule(block)


def gpt_oss_extras(arch: Any, model: Any) -> dict[str, Any]:
    """The layer types (from each layer's backend window: vLLM slides the even layers, whatever the config says)
    and the fixed SwiGLU constants."""
    from logdiff.probes.arch.gpt_oss import FULL, SLIDING

    types = [SLIDING if _slides(arch.attention(layer)) else FULL for layer in arch.layers(model)]
    alpha, limit = vllm_swiglu_constants()
    return {
        "layer_types": ",".join("sliding" if t == SLIDING else "full" for t in types),
        "swiglu_alpha": alpha,
        "swiglu_limit": limit,
    }


def deepseek_extras(arch: Any, model: Any) -> dict[str, Any]:
    """The attention scale on vLLM's MLA op, the latent norms' eps and the routing rule (V2 or V3)."""
    attn = arch.attention(arch.layers(model)[0])
    impl = getattr(getattr(getattr(attn, "mla_attn", None), "mla_attn", None), "impl", None)
    out = {"attention_scale": float(impl.scale) if impl is not None else None, **arch.latent_norm_eps(model)}
    block = arch.first_moe_block(model)
    if block is None:
        return out | dict.fromkeys(ROUTING_KEYS)
    return out | vllm_routing_rule(block)


#: the vLLM engine's readers, by adapter name
EXTRAS = ContractExtras({
    "gemma2": gemma2_extras,
    "gemma3": gemma3_extras,
    "glm4-moe": glm4_moe_extras,
    "gpt-oss": gpt_oss_extras,
    "deepseek-v2": deepseek_extras,
    "deepseek-v3": deepseek_extras,
})  # fmt: skip
