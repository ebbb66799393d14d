"""The HF engine's contract reader and weight fingerprints (what a transformers model computes with).

The values are read from the loaded module, not from config files; the architecture adapter
says where each sits. The keys only some architectures have are read by this engine's
``contract_extras.EXTRAS`` (one reader per adapter name). The shared pieces (``fingerprint``,
``sampler``, the ``ContractExtras`` type) are in ``probes/contracts.py``, which also says
which value of each key means off (``OFF``) and which means "not read" (None).
"""

from __future__ import annotations

from typing import Any

from logdiff.probes.contracts import (
    OFF,
    ContractExtras,
    effective,
    fingerprint,
    layer_keys,
    narrowest,
    norm_eps,
    off_if_none,
    sampler,
)
from logdiff.probes.quantization import QUANTIZATION_KEYS
from logdiff.sources.hf.contract_extras import EXTRAS


def hf_contract(model: Any, options: dict[str, Any], extras: ContractExtras = EXTRAS) -> dict[str, Any]:
    """Effective settings of a transformers model (``extras``: the per-architecture readers; a derived engine's
    extended registry)."""
    from logdiff.probes.arch import adapter_of

    arch = adapter_of(model)
    cfg = model.config
    layer = arch.layers(model)[0]
    rope = getattr(cfg, "rope_parameters", None) or {}
    attn = arch.attention(layer)
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    # a router without the config key renormalizes or not by its family (Mixtral's always does)
    renormalizes = getattr(arch, "router_renormalizes", None) if getattr(arch, "moe", False) else None
    contract = {
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "vocab_size": int(arch.lm_head(model).weight.shape[0]),
        "rms_norm_eps": norm_eps(arch.input_norm(layer)),
        "qk_norm_eps": norm_eps(arch.qk_norm_module(attn)),
        "final_norm_eps": norm_eps(arch.final_norm(model)),
        "rope_theta": _float_or_none(rope.get("rope_theta", getattr(cfg, "rope_theta", None))),
        "rope_type": rope.get("rope_type", "default"),
        "rope_style": "neox",  # transformers' Llama/Qwen families rotate halves
        "attention_scale": float(attn.scaling),
        **layer_keys(hf_layer_windows(arch, model)),  # the window each layer masks, not the config key
        "tie_word_embeddings": _shared(arch.lm_head(model).weight, arch.embed(model).weight),
        "num_experts_per_tok": getattr(cfg, "num_experts_per_tok", None),
        "norm_topk_prob": getattr(cfg, "norm_topk_prob", renormalizes),
        "temperature": float(options.get("temperature", 1.0)),  # logits / T before log_softmax
        "logprobs_mode": "processed_logprobs" if options.get("temperature", 1.0) != 1.0 else "raw_logprobs",
        # The distribution it samples from (hf-decode) or scores under (the trainer): full support.
        **sampler(options),
        **extras.read(arch, model),
        # the trainer computes with its weights as loaded: no quantization scheme, no quantized KV cache
        # (probes/quantization.py; a quantized inference side reads its own: sources/vllm/quantized.py)
        **dict.fromkeys(QUANTIZATION_KEYS, OFF),
        "attn_implementation": impl,
    }
    return effective(contract, {**HF_DROPS.get(impl, {}), **arch.hf_dropped})


def hf_layer_windows(arch: Any, model: Any) -> list[Any]:
    """The window each layer's attention masks (``OFF``: none).

    Families with per-layer types (Qwen2/3, Gemma 2/3, gpt-oss) build each attention module with its own
    ``sliding_window``, None on a ``full_attention`` layer, and choose each layer's mask by the same
    ``layer_types`` (transformers 5 derives Qwen2's from ``use_sliding_window``, ``sliding_window`` and
    ``max_window_layers``: a layer slides from ``max_window_layers`` on); a module without the attribute
    (Mistral, Mixtral, Phi-3) is masked by the config's window on every layer (the family's rule,
    ``arch.sliding_window``; Llama's never is).
    """
    everywhere = off_if_none(arch.sliding_window(model.config))
    out = []
    for layer in arch.layers(model):
        attn = arch.attention(layer)
        out.append(off_if_none(attn.sliding_window) if hasattr(attn, "sliding_window") else everywhere)
    return out


#: contracted features each HF attention implementation silently ignores when the model passes them
#: (transformers' ``sdpa_attention_forward`` swallows ``softcap`` in its ``**kwargs``)
HF_DROPS = {
    "sdpa": {
        "attn_logit_softcapping": "HF's sdpa attention ignores the soft cap it is passed "
        "(set train.attn_implementation=eager to apply it)",
    },
}


def _float_or_none(value: Any) -> float | None:
    return float(value) if value is not None else None


def _shared(a: Any, b: Any) -> bool:
    """Whether two weights are one tensor: the same parameter, or the same storage (a sharded weight's local
    shards compared: FSDP2's DTensors have no storage of their own)."""
    if a is b:
        return True
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    return a.numel() > 0 and a.data_ptr() == b.data_ptr()


def hf_fingerprints(model: Any, at: str | None = None) -> dict[str, str]:
    """The fingerprint of every weight under its HF name, of the logical tensor: a DTensor (FSDP2's shards, a
    tensor-parallel weight) is gathered whole first, one at a time; that is a collective every rank joins.
    ``at``: a narrower dtype name (the other side's) to round every wider floating tensor to first."""
    return hf_fingerprint_sets(model, (at,))[at]


def hf_fingerprint_sets(model: Any, ats: tuple[str | None, ...]) -> dict[str | None, dict[str, str]]:
    """``hf_fingerprints`` at each of ``ats`` (None: the model's own dtype) in one pass: each DTensor is gathered
    once and hashed at every dtype (a capture keeps an fp32 model's at bfloat16 and float16 too)."""
    import torch

    dtype = next(model.parameters()).dtype
    narrow = {at: getattr(torch, at) if at else None for at in ats}

    def hashed(t: Any, to: Any) -> str:
        if to is not None and t.is_floating_point() and t.element_size() > to.itemsize:
            return fingerprint(t.detach().to(to))
        return fingerprint(narrowest(t, dtype))

    out: dict[str | None, dict[str, str]] = {at: {} for at in ats}
    for name, t in model.state_dict().items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        for at, to in narrow.items():
            out[at][name] = hashed(t, to)
    return out
