"""What each engine actually computes with: its effective contract and weight fingerprints.

The semantic preflight compares these before any numerics. Values are read
from the loaded modules, not from config files, because the module is what
runs: an ``hf_overrides`` eps shows up as the norm's ``variance_epsilon``, a
weight-sync bug as a different hash of the loaded tensor.

Where each value sits in an engine's module tree is the architecture
adapter's knowledge (``logdiff.probes.arch``: layers, attention, norms,
embeddings). Weight fingerprints use HF tensor names: vLLM's packed parameters
(weights and biases) are split back into their HF parts by the layer's
``output_sizes`` and FusedMoE's parameters renamed after the HF fused experts,
both as the adapter's ``packed`` and ``moe_params`` say, so a difference names
the logical tensor.

What vLLM's CPU build keeps depends on the ISA (logdiff/isa.py): a oneDNN or
SGL GEMM drops the plain weight, the torch fallback keeps it; the MoE kernels
prepack the experts in place. Every weight is read back through the layer's
own kernels (``vllm_weights``), so the fingerprints are the same on every
machine; a tensor that cannot be read back maps to ``None`` (unverified).
"""

from __future__ import annotations

import hashlib
from typing import Any

#: vLLM rotary-embedding class -> the HF ``rope_type`` it implements
VLLM_ROPE_TYPES = {
    "RotaryEmbedding": "default",
    "Llama3RotaryEmbedding": "llama3",
    "LinearScalingRotaryEmbedding": "linear",
    "DynamicNTKScalingRotaryEmbedding": "dynamic",
    "YaRNScalingRotaryEmbedding": "yarn",
}


def fingerprint(tensor: Any) -> str:
    """A short hash of a tensor's bytes (dtype-exact: a 1-ulp change alters it)."""
    import torch

    raw = tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


def _first(module: Any, cls_suffix: str) -> Any:
    return next((m for m in module.modules() if type(m).__name__.endswith(cls_suffix)), None)


def _eps(norm: Any) -> float | None:
    """A norm's eps (HF's Gemma norms call it ``eps``)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0))) if norm is not None else None


def hf_contract(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Effective settings of a transformers model."""
    from logdiff.probes.arch import adapter_of

    arch = adapter_of(model)
    cfg = model.config
    layer = arch.layers(model)[0]
    rope = getattr(cfg, "rope_parameters", None) or {}
    attn = arch.attention(layer)
    return {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(model.lm_head.weight.shape[0]),
        "rms_norm_eps": _eps(arch.input_norm(layer)),
        "qk_norm_eps": _eps(arch.qk_norm_module(attn)),
        "final_norm_eps": _eps(arch.final_norm(model)),
        "rope_theta": float(rope.get("rope_theta", getattr(cfg, "rope_theta", 0.0))),
        "rope_type": rope.get("rope_type", "default"),
        "rope_style": "neox",  # transformers' Llama/Qwen families rotate halves
        "attention_scale": float(attn.scaling),
        "sliding_window": arch.sliding_window(cfg),
        "tie_word_embeddings": model.lm_head.weight.data_ptr() == arch.embed(model).weight.data_ptr(),
        "num_experts_per_tok": getattr(cfg, "num_experts_per_tok", None),
        "norm_topk_prob": getattr(cfg, "norm_topk_prob", None),
        "temperature": float(options.get("temperature", 1.0)),  # logits / T before log_softmax
        "logprobs_mode": "processed_logprobs" if options.get("temperature", 1.0) != 1.0 else "raw_logprobs",
        # The distribution it samples from (hf-decode) or scores under (the trainer): full support.
        **sampler(options),
        **arch.contract_extras(model, "hf"),
    }


def vllm_contract(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Effective settings of a vLLM model module (reached through ``apply_model``)."""
    from logdiff.probes.arch import adapter_of

    arch = adapter_of(model)
    layer = arch.layers(model)[0]
    attn = arch.attention(layer)
    rotary = getattr(attn, "rotary_emb", None)
    core = getattr(attn, "attn", None)
    experts = _moe_experts(model)
    lm_head = getattr(model, "lm_head", None)
    embed = arch.embed(model)
    drawn = sampler(options)
    # Processed logprobs equal the raw ones unless a temperature or a truncation processes them.
    processed = options.get("logprobs_mode", "raw_logprobs").startswith("processed") and drawn != sampler({})
    return {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(getattr(model.config, "vocab_size", embed.weight.shape[0])),
        "rms_norm_eps": _eps(arch.input_norm(layer)),
        "qk_norm_eps": _eps(arch.qk_norm_module(attn)),
        "final_norm_eps": _eps(arch.final_norm(model)),
        "rope_theta": float(getattr(rotary, "base", 0.0)) if rotary is not None else None,
        "rope_type": VLLM_ROPE_TYPES.get(type(rotary).__name__, type(rotary).__name__),
        "rope_style": "neox" if getattr(rotary, "is_neox_style", True) else "gptj",
        "attention_scale": float(core.impl.scale) if core is not None and hasattr(core, "impl") else None,
        "sliding_window": _window(getattr(getattr(core, "impl", None), "sliding_window", None)),
        "tie_word_embeddings": lm_head is not None and lm_head.weight.data_ptr() == embed.weight.data_ptr(),
        "num_experts_per_tok": getattr(experts, "top_k", None),
        "norm_topk_prob": getattr(experts, "renormalize", None),
        # Raw logprobs are taken before the temperature; only processed ones see it.
        "temperature": drawn["sampling_temperature"] if processed else 1.0,
        "logprobs_mode": "processed_logprobs" if processed else "raw_logprobs",
        **drawn,
        **arch.contract_extras(model, "vllm"),
    }


def sampler(options: dict[str, Any]) -> dict[str, Any]:
    """The sampler's settings: temperature, top-k (0: off) and top-p (1.0: off), whatever the logprobs mode.

    In RL these define the behaviour policy (the distribution the tokens were
    drawn from); the trainer's ratio is right only if it scores under the same one.
    """
    top_k = int(options.get("top_k", 0))
    return {
        "sampling_temperature": float(options.get("temperature", 1.0)),
        "sampling_top_k": top_k if top_k > 0 else 0,  # vLLM spells "off" as 0 or -1
        "sampling_top_p": float(options.get("top_p", 1.0)),
    }


def _window(value: Any) -> int | None:
    """vLLM spells "no sliding window" as None, -1 or (-1, -1)."""
    if value is None or value == -1 or value == (-1, -1):
        return None
    return int(value[0] if isinstance(value, (tuple, list)) else value)


def hf_fingerprints(model: Any) -> dict[str, str]:
    dtype = next(model.parameters()).dtype
    return {name: fingerprint(narrowest(p, dtype)) for name, p in model.state_dict().items()}


def narrowest(tensor: Any, dtype: Any) -> Any:
    """``tensor`` in the model's ``dtype`` when it is wider and holds values of that dtype exactly.

    Engines keep some tensors in fp32 whatever the model dtype (vLLM's fp32 MoE gate,
    HF's fp32 ``e_score_correction_bias``), each its own choice: the same bf16 values
    read from the checkpoint then hash alike on both sides, while a value the model
    dtype cannot hold keeps its width and its difference.
    """
    if not tensor.is_floating_point() or tensor.dtype == dtype or tensor.element_size() <= dtype.itemsize:
        return tensor
    narrow = tensor.detach().to(dtype)
    return narrow if narrow.to(tensor.dtype).equal(tensor.detach()) else tensor


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
    from logdiff.probes.arch import adapter_of
    from logdiff.probes.vllm_weights import dense_weight, moe_runner_weights

    arch = adapter_of(model)
    packed, moe_params = arch.packed, arch.moe_params
    dtype = arch.embed(model).weight.dtype  # the model dtype (vLLM keeps some tensors in fp32)
    out: dict[str, str | None] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        prefix, _, short = owner.rpartition(".")
        layer = modules[owner]
        if leaf in moe_params and hasattr(layer, "top_k"):
            # FusedMoE at the experts' HF position, or a MoERunner there holding routed_experts.
            runner_name = prefix if short == "routed_experts" else owner
            hf_name = f"{runner_name}.{moe_params[leaf]}"
            out[hf_name] = _recovered(lambda: moe_runner_weights(modules[runner_name])[leaf == "w2_weight"])
            continue
        if leaf == "weight" and param.numel() == 0 and hasattr(layer, "cpu_linear"):
            recovered = _recovered(lambda: dense_weight(layer), raw=True)
            if recovered is None:
                parts = packed.get(short, (short,))
                out.update({f"{prefix}.{part}.weight": None for part in parts})
                continue
            param = recovered
        if short in packed and leaf in ("weight", "bias"):
            for part, chunk in zip(packed[short], param.split(list(layer.output_sizes), dim=0)):
                out[f"{prefix}.{part}.{leaf}"] = fingerprint(chunk)
            continue
        if hasattr(layer, "num_embeddings_padded") and param.shape[0] > vocab_size:
            param = param[:vocab_size]  # vLLM pads the vocabulary dimension of its embedding and LM head
        out[name] = fingerprint(narrowest(param, dtype))
    return {arch.hf_name(k): v for k, v in out.items()}


def _recovered(read: Any, raw: bool = False) -> Any:
    """``read()``'s tensor (or its fingerprint), or None when the engine's layout defeats recovery."""
    try:
        tensor = read()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    return tensor if raw else fingerprint(tensor)
