"""The HF engine's readers of the contract keys only some architectures have: ``EXTRAS``.

``hf_contract`` reads the keys every model has through the adapter's
engine-neutral helpers; this module reads the rest from transformers' modules
and config, one reader per adapter ``name`` (``probes.contracts.ContractExtras``),
each called with the adapter and the loaded model. Its keys are merged over the
generic ones (DeepSeek's ``rope_style``, gpt-oss's ``norm_topk_prob`` correct
them). An adapter without an entry has no keys of its own. Where a family
derives from another (Gemma 3 from Gemma 2), its reader starts from the parent's.
Family modules are imported inside the readers (they run after the adapters are
loaded), so importing this module never changes the adapters' registration order.
"""

from __future__ import annotations

from typing import Any

from logdiff.probes.arch.decoder import ROUTING_KEYS
from logdiff.probes.contracts import OFF, ContractExtras, expert_groups, soft_cap


def gemma2_extras(arch: Any, model: Any) -> dict[str, Any]:
    """Soft caps (from the config the modules read: None there is no cap, ``OFF``) and the embedding scale as the
    embedding module holds it."""
    cfg = model.config
    scale = getattr(arch.embed(model), "embed_scale", None)
    return {
        "attn_logit_softcapping": soft_cap(cfg.attn_logit_softcapping),
        "final_logit_softcapping": soft_cap(cfg.final_logit_softcapping),
        "embed_scale": float(scale.to(arch.embed(model).weight.dtype)) if scale is not None else None,
    }


def gemma3_extras(arch: Any, model: Any) -> dict[str, Any]:
    """Gemma 2's keys, both RoPE bases (one rotary module per layer type; the sliding one ``OFF`` where no layer
    slides) and the layer types."""
    from logdiff.probes.arch.gemma3 import FULL, SLIDING, layer_type_keys

    extras = gemma2_extras(arch, model)
    cfg = model.config
    types = list(cfg.layer_types)
    params = cfg.rope_parameters
    theta = {t: float(params[t]["rope_theta"]) for t in (SLIDING, FULL) if t in params and t in types}
    rope_type = {t: params[t].get("rope_type", "default") for t in theta}
    keys = layer_type_keys(types, theta, rope_type)
    return {**extras, **keys, **({} if SLIDING in types else {"rope_local_base_freq": OFF})}


def glm4_moe_extras(arch: Any, model: Any) -> dict[str, Any]:
    """The rotary width and the routing rule as ``Glm4MoeTopkRouter`` applies it (first MoE layer's router)."""
    out: dict[str, Any] = {"rotary_dim": arch.rotary_dim(model)}
    block = arch.first_moe_block(model)
    if block is None:
        return out | dict.fromkeys(ROUTING_KEYS)
    gate = block.gate
    return out | {
        "scoring_func": "sigmoid",  # Glm4MoeTopkRouter: scores = router_logits.sigmoid()
        **dict(zip(("n_group", "topk_group"), expert_groups(gate.num_group, gate.topk_group))),
        "routed_scaling_factor": float(gate.routed_scaling_factor),
    }


def gpt_oss_extras(arch: Any, model: Any) -> dict[str, Any]:
    """The config's layer types, the experts' SwiGLU constants and the router's renormalisation."""
    from logdiff.probes.arch.gpt_oss import SLIDING

    experts = arch.layers(model)[0].mlp.experts
    types = list(model.config.layer_types)
    return {
        "layer_types": ",".join("sliding" if t == SLIDING else "full" for t in types),
        "swiglu_alpha": float(experts.alpha),
        "swiglu_limit": float(experts.limit),
        "norm_topk_prob": True,  # HF's router softmaxes over the chosen logits: the renormalized top-k weights
    }


def deepseek_extras(arch: Any, model: Any) -> dict[str, Any]:
    """The RoPE style of the modeling code's rotation, the latent norms' eps and the router's rule (V2 or V3)."""
    block = arch.first_moe_block(model)
    out = {"rope_style": arch.hf_rope_style(model.config), **arch.latent_norm_eps(model)}
    return out | (arch._hf_rule(block.gate) if block is not None else dict.fromkeys(ROUTING_KEYS))


#: the HF engine's readers, by adapter name
EXTRAS = ContractExtras({
    "gemma2": gemma2_extras,
    "gemma3": gemma3_extras,
    "glm4-moe": glm4_moe_extras,
    "gpt-oss": gpt_oss_extras,
    "deepseek-v2": deepseek_extras,
    "deepseek-v3": deepseek_extras,
})  # fmt: skip
