"""The vLLM engine's contract reader and weight fingerprints (what the loaded vLLM model computes with).

Values are read from the live module reached through ``apply_model``; packed and prepacked
weights are recovered through the layers' own kernels (``weights``), so the fingerprints use
HF tensor names and are the same on every CPU. The keys only some architectures have are read
by this engine's ``contract_extras.EXTRAS`` (one reader per adapter name), which also holds
vLLM's RoPE class names. The shared pieces are in ``probes/contracts.py``, which also says which
value of each key means off (``OFF``: a backend without a window) and which means "not read"
(None: no attention backend, no rotary module where the adapter says it sits). Each layer is
read: its backend's window (``layer_keys``: which layers slide, and how far) and its own rotary
module (one value where all layers agree, else one per layer: ``per_layer``).
"""

from __future__ import annotations

from typing import Any

from logdiff.probes.contracts import ContractExtras, fingerprint, layer_keys, narrowest, norm_eps, per_layer, sampler
from logdiff.sources.vllm.contract_extras import EXTRAS, VLLM_ROPE_TYPES, layer_windows


def vllm_contract(model: Any, options: dict[str, Any], extras: ContractExtras = EXTRAS) -> dict[str, Any]:
    """Effective settings of a vLLM model module (reached through ``apply_model``; ``extras``: the
    per-architecture readers, a derived engine's extended registry)."""
    from logdiff.probes.arch import adapter_of
    from logdiff.sources.vllm.quantized import quantization_keys

    arch = adapter_of(model)
    layer = arch.layers(model)[0]
    attn = arch.attention(layer)
    core = getattr(attn, "attn", None)
    # each layer holds its own rotary module: read every layer's (a list where they differ: ``per_layer``)
    rotaries = [getattr(arch.attention(x), "rotary_emb", None) for x in arch.layers(model)]
    experts = _moe_experts(model)
    lm_head = arch.lm_head(model)
    embed = arch.embed(model)
    drawn = sampler(options)
    # Processed logprobs equal the raw ones unless a temperature or a truncation processes them.
    processed = options.get("logprobs_mode", "raw_logprobs").startswith("processed") and drawn != sampler({})
    return {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(getattr(model.config, "vocab_size", embed.weight.shape[0])),
        "rms_norm_eps": norm_eps(arch.input_norm(layer)),
        "qk_norm_eps": norm_eps(arch.qk_norm_module(attn)),
        "final_norm_eps": norm_eps(arch.final_norm(model)),
        "rope_theta": per_layer([_rope_theta(r) for r in rotaries]),
        "rope_type": per_layer([_rope_type(r) for r in rotaries]),
        "rope_style": per_layer([_rope_style(r) for r in rotaries]),
        "attention_scale": float(core.impl.scale) if core is not None and hasattr(core, "impl") else None,
        **layer_keys(layer_windows(arch, model)),  # each layer's backend window
        "tie_word_embeddings": lm_head is not None and lm_head.weight.data_ptr() == embed.weight.data_ptr(),
        "num_experts_per_tok": getattr(experts, "top_k", None),
        "norm_topk_prob": getattr(experts, "renormalize", None),
        # Raw logprobs are taken before the temperature; only processed ones see it.
        "temperature": drawn["sampling_temperature"] if processed else 1.0,
        "logprobs_mode": "processed_logprobs" if processed else "raw_logprobs",
        **drawn,
        **extras.read(arch, model),
        **quantization_keys(model, arch),  # each layer's scheme, the ignored layers, the KV cache (quantized.py)
        "attn_implementation": type(core.impl).__name__ if core is not None and hasattr(core, "impl") else None,
    }


def _rope_theta(rotary: Any) -> float | None:
    return float(getattr(rotary, "base", 0.0)) if rotary is not None else None


def _rope_type(rotary: Any) -> str | None:
    return VLLM_ROPE_TYPES.get(type(rotary).__name__, type(rotary).__name__) if rotary is not None else None


def _rope_style(rotary: Any) -> str | None:
    return ("neox" if getattr(rotary, "is_neox_style", True) else "gptj") if rotary is not None else None


def _moe_experts(model: Any) -> Any:
    """The first module holding routed experts (``FusedMoE``, or ``MoERunner.routed_experts``)."""
    return next((m for m in model.modules() if hasattr(m, "w13_weight") and hasattr(m, "top_k")), None)


def vllm_fingerprints(model: Any, vocab_size: int) -> dict[str, str | None]:
    """Fingerprints under HF names, packed parameters split into their parts.

    Weights a CPU GEMM packed away are recovered bit-exactly by
    ``weights.dense_weight``, prepacked MoE experts by
    ``weights.moe_runner_weights``. A tensor that cannot be recovered
    maps to ``None``: unverified, never a guess.
    """
    from logdiff.probes.arch import adapter_of
    from logdiff.probes.quantization import SCALE_LEAVES
    from logdiff.sources.vllm.quantized import is_quantized, loaded_fingerprints
    from logdiff.sources.vllm.weights import dense_weight, dispatched_fingerprints, moe_runner_weights

    arch = adapter_of(model)
    packed, moe_params = arch.packed, arch.moe_params
    # the model dtype: vLLM keeps some tensors in fp32 (a MoE gate; on AMX hosts the bias of a
    # linear that its sgl GEMM packed), and ``narrowest`` hashes them at the width they were loaded
    dtype = arch.embed(model).weight.dtype
    out: dict[str, str | None] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        prefix, _, short = owner.rpartition(".")
        layer = modules[owner]
        if leaf in ("weight", *SCALE_LEAVES) and is_quantized(layer):
            # a quantized linear: its weight and scale as loaded, hashed together (quantized.py), one per part
            if leaf == "weight_scale":
                parts = packed.get(short, (short,))
                loaded = loaded_fingerprints(layer) or (None,) * len(parts)
                out.update({f"{prefix}.{part}.weight": p for part, p in zip(parts, loaded, strict=True)})
            continue
        if leaf in moe_params and hasattr(layer, "top_k"):
            # FusedMoE at the experts' HF position, or a MoERunner there holding routed_experts.
            runner_name = prefix if short == "routed_experts" else owner
            hf_name = f"{runner_name}.{moe_params[leaf]}"
            out[hf_name] = _recovered(
                lambda: arch.moe_to_hf(leaf, moe_runner_weights(modules[runner_name])[leaf == "w2_weight"])
            )
            continue
        if leaf == "weight" and param.numel() == 0 and hasattr(layer, "cpu_linear"):
            parts = packed.get(short, (short,))
            known = _known_at_dispatch(dispatched_fingerprints(layer), short in packed, dtype)
            if known is not None:
                out.update({f"{prefix}.{part}.weight": p for part, p in zip(parts, known, strict=True)})
                continue
            recovered = _recovered(lambda: dense_weight(layer, model.modules()), raw=True)  # AMX: MLA's kv_b_proj
            if recovered is None:
                out.update({f"{prefix}.{part}.weight": None for part in parts})
                continue
            param = recovered
        if short in packed and leaf in ("weight", "bias"):
            for part, chunk in zip(packed[short], param.split(list(layer.output_sizes), dim=0)):
                out[f"{prefix}.{part}.{leaf}"] = fingerprint(narrowest(chunk, dtype))
            continue
        if hasattr(layer, "num_embeddings_padded") and param.shape[0] > vocab_size:
            param = param[:vocab_size]  # vLLM pads the vocabulary dimension of its embedding and LM head
        out[name] = fingerprint(narrowest(param, dtype))
    return {arch.hf_name(k): v for k, v in out.items()}


def _known_at_dispatch(record: Any, packed: bool, dtype: Any) -> tuple[str, ...] | None:
    """A packed-away weight's fingerprints recorded by ``weights.fingerprint_at_dispatch``, per part where the
    layer is ``packed``, or None (no record, another dtype, or not split as asked): recover it then."""
    if record is None or record.dtype != dtype:
        return None
    if packed:
        return record.parts or None
    return (record.whole,) if record.whole is not None else None


def _recovered(read: Any, raw: bool = False) -> Any:
    """``read()``'s tensor (or its fingerprint), or None when the engine's layout defeats recovery."""
    try:
        tensor = read()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    return tensor if raw else fingerprint(tensor)
