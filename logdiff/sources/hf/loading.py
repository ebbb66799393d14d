"""Loading a transformers model as the HF engine computes with it: config overrides, attention, device."""

from __future__ import annotations

from typing import Any

from logdiff.errors import InputError
from logdiff.sources.base import EngineSpec, resolve_device


def load_model(spec: EngineSpec) -> Any:
    """``from_pretrained`` with this side's config overrides and attention implementation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(spec.model_dir, trust_remote_code=spec.trust_remote_code)
    for key, value in spec.overrides:
        apply_override(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(
        spec.model_dir,
        config=config,
        dtype=getattr(torch, spec.dtype),
        attn_implementation=spec.option("attn_implementation") or default_attention(config),
        trust_remote_code=spec.trust_remote_code,
    )
    return model.to(resolve_device(spec.device)).eval()


def default_attention(config: Any) -> str:
    """``sdpa``, unless the model sets a feature sdpa drops (Gemma 2's soft cap): then ``eager``.

    The default must compute the contracted function; ``train.attn_implementation=sdpa``
    still reproduces a trainer that runs sdpa, and the contract then says what it drops.
    """
    from logdiff.sources.hf.contract import HF_DROPS

    if not supports_sdpa(config):
        return "eager"
    return "eager" if any(getattr(config, k, None) is not None for k in HF_DROPS["sdpa"]) else "sdpa"


def supports_sdpa(config: Any) -> bool:
    """Whether transformers' model class for ``config`` runs sdpa attention (gpt-oss's sinks do not)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return True  # remote code or an unknown class: let from_pretrained decide
    return bool(getattr(cls, "_supports_sdpa", True))


def apply_override(config: Any, key: str, value: Any) -> None:
    """Set one config key; RoPE keys also live in ``rope_parameters`` in transformers 5.

    A structured value (a dict, a list) is copied: the config may change it in place,
    and the ``--set`` value it came from is the engine's key and the result's record.
    """
    import copy

    value = copy.deepcopy(value)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and key in rope:
        rope[key] = value
    elif not hasattr(config, key):
        raise InputError(f"--set: the model config has no key {key!r}")
    if hasattr(config, key):
        setattr(config, key, value)
