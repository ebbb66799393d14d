"""What each engine actually computes with: its effective contract and weight fingerprints.

The semantic preflight compares these before any numerics. Values are read
from the loaded modules, not from config files, because the module is what
runs: an ``hf_overrides`` eps shows up as the norm's ``variance_epsilon``, a
weight-sync bug as a different hash of the loaded tensor.

Weight fingerprints use HF tensor names. vLLM's packed parameters are split
back into their HF parts first (``qkv_proj`` -> ``q_proj``/``k_proj``/``v_proj``
by the layer's ``output_sizes``, ``gate_up_proj`` -> ``gate_proj``/``up_proj``,
FusedMoE's ``w13_weight``/``w2_weight`` -> the experts' ``gate_up_proj``/
``down_proj``), so a difference names the logical tensor.

What vLLM's CPU build keeps depends on the ISA (logdiff/isa.py): a oneDNN or
SGL GEMM drops the plain weight, the torch fallback keeps it; the MoE kernels
prepack the experts in place. Every weight is read back through the layer's
own kernels (``vllm_weights``), so the fingerprints are the same on every
machine; a tensor that cannot be read back maps to ``None`` (unverified).
"""

from __future__ import annotations

import hashlib
from typing import Any

# vLLM packed parameter -> HF parts (split along dim 0 by the layer's output_sizes).
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vLLM FusedMoE parameters -> HF fused-expert parameters (vLLM's CPU build prepacks them).
MOE_PARAMS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def fingerprint(tensor: Any) -> str:
    """A short hash of a tensor's bytes (dtype-exact: a 1-ulp change alters it)."""
    import torch

    raw = tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


def _first(module: Any, cls_suffix: str) -> Any:
    return next((m for m in module.modules() if type(m).__name__.endswith(cls_suffix)), None)


def hf_contract(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Effective settings of a transformers model."""
    cfg = model.config
    layer = model.model.layers[0]
    rope = getattr(cfg, "rope_parameters", None) or {}
    attn = layer.self_attn
    return {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(model.lm_head.weight.shape[0]),
        "rms_norm_eps": float(layer.input_layernorm.variance_epsilon),
        "qk_norm_eps": float(attn.q_norm.variance_epsilon) if hasattr(attn, "q_norm") else None,
        "final_norm_eps": float(model.model.norm.variance_epsilon),
        "rope_theta": float(rope.get("rope_theta", getattr(cfg, "rope_theta", 0.0))),
        "rope_type": rope.get("rope_type", "default"),
        "rope_style": "neox",  # transformers' Llama/Qwen families rotate halves
        "attention_scale": float(attn.scaling),
        "sliding_window": getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", False) else None,
        "tie_word_embeddings": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
        "num_experts_per_tok": getattr(cfg, "num_experts_per_tok", None),
        "norm_topk_prob": getattr(cfg, "norm_topk_prob", None),
        "temperature": float(options.get("temperature", 1.0)),  # logits / T before log_softmax
        "logprobs_mode": "processed_logprobs" if options.get("temperature", 1.0) != 1.0 else "raw_logprobs",
    }


def vllm_contract(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Effective settings of a vLLM model module (reached through ``apply_model``)."""
    layer = model.model.layers[0]
    attn = layer.self_attn
    rotary = getattr(attn, "rotary_emb", None)
    core = getattr(attn, "attn", None)
    experts = _moe_experts(model)
    lm_head = getattr(model, "lm_head", None)
    embed = model.model.embed_tokens
    mode = options.get("logprobs_mode", "raw_logprobs")
    processed = mode.startswith("processed")
    return {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(getattr(model.config, "vocab_size", embed.weight.shape[0])),
        "rms_norm_eps": float(layer.input_layernorm.variance_epsilon),
        "qk_norm_eps": float(attn.q_norm.variance_epsilon) if hasattr(attn, "q_norm") else None,
        "final_norm_eps": float(model.model.norm.variance_epsilon),
        "rope_theta": float(getattr(rotary, "base", 0.0)) if rotary is not None else None,
        "rope_type": "default" if type(rotary).__name__ == "RotaryEmbedding" else type(rotary).__name__,
        "rope_style": "neox" if getattr(rotary, "is_neox_style", True) else "gptj",
        "attention_scale": float(core.impl.scale) if core is not None and hasattr(core, "impl") else None,
        "sliding_window": _window(getattr(getattr(core, "impl", None), "sliding_window", None)),
        "tie_word_embeddings": lm_head is not None and lm_head.weight.data_ptr() == embed.weight.data_ptr(),
        "num_experts_per_tok": getattr(experts, "top_k", None),
        "norm_topk_prob": getattr(experts, "renormalize", None),
        # Raw logprobs are taken before the temperature; only processed ones see it.
        "temperature": float(options.get("temperature", 1.0)) if processed else 1.0,
        "logprobs_mode": mode,
    }


def _window(value: Any) -> int | None:
    """vLLM spells "no sliding window" as None, -1 or (-1, -1)."""
    if value is None or value == -1 or value == (-1, -1):
        return None
    return int(value[0] if isinstance(value, (tuple, list)) else value)


def hf_fingerprints(model: Any) -> dict[str, str]:
    return {name: fingerprint(p) for name, p in model.state_dict().items()}


def _moe_experts(model: Any) -> Any:
    """The first module holding routed experts (``FusedMoE``, or ``MoERunner.routed_experts``)."""
    return next((m for m in model.modules() if hasattr(m, "w13_weight") and hasattr(m, "top_k")), None)


def vllm_fingerprints(model: Any, vocab_size: int) -> dict[str, str | None]:
    """Fingerprints under HF names, packed parameters split into their parts.

    Weights a CPU GEMM packed away are recovered bit-exactly by
    ``vllm_weights.dense_weight``, prepacked MoE experts by
    ``vllm_weights.moe_runner_weights``. A tensor that cannot be recovered
    maps to ``None``: unverified, never a guess.
    """
    from logdiff.probes.vllm_weights import dense_weight, moe_runner_weights

    out: dict[str, str | None] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        prefix, _, short = owner.rpartition(".")
        layer = modules[owner]
        if leaf in MOE_PARAMS and hasattr(layer, "top_k"):
            # FusedMoE at mlp.experts, or MoERunner at mlp.experts holding routed_experts.
            runner_name = prefix if short == "routed_experts" else owner
            hf_name = f"{runner_name}.{MOE_PARAMS[leaf]}"
            out[hf_name] = _recovered(lambda: moe_runner_weights(modules[runner_name])[leaf == "w2_weight"])
            continue
        if leaf == "weight" and param.numel() == 0 and hasattr(layer, "cpu_linear"):
            recovered = _recovered(lambda: dense_weight(layer), raw=True)
            if recovered is None:
                parts = PACKED.get(short, (short,))
                out.update({f"{prefix}.{part}.weight": None for part in parts})
                continue
            param = recovered
        if short in PACKED and leaf == "weight":
            for part, chunk in zip(PACKED[short], param.split(list(layer.output_sizes), dim=0)):
                out[f"{prefix}.{part}.weight"] = fingerprint(chunk)
            continue
        if name in ("lm_head.weight", "model.embed_tokens.weight") and param.shape[0] > vocab_size:
            param = param[:vocab_size]  # vLLM pads the vocabulary dimension
        out[name] = fingerprint(param)
    return out


def _recovered(read: Any, raw: bool = False) -> Any:
    """``read()``'s tensor (or its fingerprint), or None when the engine's layout defeats recovery."""
    try:
        tensor = read()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    return tensor if raw else fingerprint(tensor)
