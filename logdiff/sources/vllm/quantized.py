"""A quantized vLLM engine (a compressed-tensors checkpoint): its scheme per layer, and its weights as loaded.

**The contract.** Which linear layers run quantized is read from the live model, not the config:
each vLLM linear holds its ``quant_method``; a compressed-tensors one holds ``layer.scheme``
(``CompressedTensorsW8A8Int8``, ...). ``quantization_keys`` gives, per decoder layer, the scheme
line (``probes/quantization.describe``: bits, type, granularity, static or dynamic) where any of
its linears is quantized, the linears that are (under HF names), the layers the config leaves
unquantized (``lm_head``) and the KV cache's dtype where it is quantized (``kv_cache_dtype`` of the
attention layers: ``auto`` is the compute dtype, ``OFF``).

**The weights.** vLLM's kernels repack a quantized weight after loading (on CPU the oneDNN int8
GEMM takes it and the layer's ``weight`` becomes None), so, like ``weights.fingerprint_at_dispatch``
for bf16 weights, :func:`fingerprint_quantized_at_load` wraps the one entry every compressed-tensors
linear passes through, ``CompressedTensorsLinearMethod.process_weights_after_loading``, and hashes
each weight and its scale as loaded (``[out, in]`` quantized values, ``[out, 1]`` per-channel
scales), per part of a merged layer (``logical_widths``: q/k/v, gate/up), before the kernel takes
them. The record holds the processed scale parameter, so a reload (a weight sync) that processes the
layer again is recorded again, and a record whose layer was reloaded without it is not trusted.
vLLM's layer-wise reload processes a layer on fresh tensors and then copies their values into the
layer's original parameters, so the parameter object survives a reload: ``records_through_reload``
(around a weight sync) drops every record first, and afterwards moves each new record onto the
parameter that now holds its scale's values (after checking that they are equal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from logdiff.probes.contracts import OFF, per_layer
from logdiff.probes.quantization import describe, quantized_fingerprint

#: where the record of a loaded quantized weight is kept on its layer
RECORD = "_logdiff_quantized"


@dataclass(frozen=True)
class Loaded:
    """Fingerprints of a quantized layer's weight and scale as loaded, per logical part."""

    scale: Any  # the layer's weight_scale parameter after processing (identity: still this load)
    parts: tuple[str | None, ...]


@contextlib.contextmanager
def fingerprint_quantized_at_load() -> Iterator[None]:
    """While the block runs (an engine loading), record every compressed-tensors linear's weight fingerprints
    before its kernel repacks them (nothing where vLLM has no compressed-tensors support)."""
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsLinearMethod,
        )
    except ImportError:
        yield
        return
    from logdiff.probes.patching import Patches

    original = CompressedTensorsLinearMethod.process_weights_after_loading

    def process(self: Any, layer: Any) -> None:
        parts = _parts(layer)
        original(self, layer)
        if parts is not None:
            setattr(layer, RECORD, Loaded(getattr(layer, "weight_scale", None), parts))

    with Patches() as patches:
        patches.set(CompressedTensorsLinearMethod, "process_weights_after_loading", process)
        yield


def _parts(layer: Any) -> tuple[str | None, ...] | None:
    """Each logical part's ``quantized_fingerprint`` (None for a part whose scale is not per channel)."""
    weight, scale = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    if weight is None or scale is None or weight.dim() != 2 or weight.is_meta:
        return None
    widths = list(getattr(layer, "logical_widths", None) or [weight.shape[0]])
    if sum(widths) != weight.shape[0]:
        return None
    per_channel = scale.dim() == 2 and scale.shape == (weight.shape[0], 1)
    out = []
    for q, s in zip(weight.split(widths, dim=0), scale.split(widths, dim=0) if per_channel else [None] * len(widths)):
        out.append(quantized_fingerprint(q, s) if s is not None else None)
    return tuple(out)


def loaded_fingerprints(layer: Any) -> tuple[str | None, ...] | None:
    """The recorded parts of a quantized layer, while it still holds the scale processed then."""
    record = getattr(layer, RECORD, None)
    if record is None or record.scale is not getattr(layer, "weight_scale", None):
        return None
    return record.parts


def is_quantized(layer: Any) -> bool:
    """Whether a vLLM linear computes through a quantization method (a compressed-tensors scheme, or an online
    one: ``--set infer.quantization=fp8``), not the unquantized one."""
    from vllm.model_executor.layers.linear import LinearBase

    qm = getattr(layer, "quant_method", None)
    return isinstance(layer, LinearBase) and qm is not None and not type(qm).__name__.startswith("Unquantized")


def _method(model: Any) -> str | None:
    """The quantization method of the first quantized linear (an online one has no config to describe it)."""
    found = next((m for m in model.modules() if is_quantized(m)), None)
    return type(found.quant_method).__name__ if found is not None else None


def quantization_keys(model: Any, arch: Any) -> dict[str, Any]:
    """The quantization contract keys of a loaded vLLM model (every one ``OFF`` for an unquantized model)."""
    qcfg = getattr(model.config, "quantization_config", None)
    if qcfg is not None and not isinstance(qcfg, dict):
        qcfg = getattr(qcfg, "to_dict", lambda: None)()
    keys = describe(qcfg)
    if qcfg is None and _method(model) is not None:  # online quantization: the method's name is the scheme
        keys["quantization"] = f"online {_method(model)}"
    lines, linears = [], []
    for layer in arch.layers(model):
        names = [_hf_parts(arch, name) for name, m in layer.named_modules() if is_quantized(m)]
        lines.append(keys["quantization"] if names else OFF)
        linears.append(",".join(p for parts in names for p in parts) if names else OFF)
    if not any(v != OFF for v in lines):  # a quantization_config no linear applies: the function is unquantized
        keys["quantization"] = OFF
        keys["quantization_ignored"] = OFF
    else:
        keys["quantization"] = per_layer(lines)
    keys["quantized_linears"] = per_layer(linears) if linears else OFF
    keys["kv_cache_quantization"] = _kv_cache(model, keys["kv_cache_quantization"])
    return keys


def _hf_parts(arch: Any, name: str) -> list[str]:
    """A vLLM linear's HF names within its layer (``self_attn.qkv_proj`` -> q_proj, k_proj, v_proj)."""
    prefix, _, short = name.rpartition(".")
    parts = arch.packed.get(short, (short,))
    return [f"{prefix}.{p}" if prefix else p for p in parts]


def _kv_cache(model: Any, declared: Any) -> Any:
    """The KV cache's dtype where an attention layer stores it quantized (``auto``: the compute dtype: OFF)."""
    dtypes = {str(m.kv_cache_dtype) for m in model.modules() if hasattr(m, "kv_cache_dtype") and hasattr(m, "impl")}
    quantized = sorted(d for d in dtypes if d not in ("auto", "bfloat16", "float16", "float32"))
    return ",".join(quantized) if quantized else declared if declared != OFF else OFF


@contextlib.contextmanager
def records_through_reload(model: Any) -> Iterator[None]:
    """Around a layer-wise reload of ``model``: the records made before it are dropped (the reload changes the weights
    whether or not ``fingerprint_quantized_at_load`` is active), and each record made during it, which holds the fresh
    scale vLLM processed and then copied into the layer's own parameter, is moved onto that parameter when the two
    hold equal values (else it stays untrusted: ``loaded_fingerprints`` gives None)."""
    import torch

    for module in model.modules():
        if hasattr(module, RECORD):
            delattr(module, RECORD)
    yield
    for module in model.modules():
        record, live = getattr(module, RECORD, None), getattr(module, "weight_scale", None)
        if record is None or live is None or record.scale is live or record.scale is None:
            continue
        if record.scale.shape == live.shape and torch.equal(record.scale, live):
            setattr(module, RECORD, Loaded(live, record.parts))
