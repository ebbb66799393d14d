"""Quantization schemes: the compressed-tensors configs logdiff writes, how a loaded one reads, and weights through them.

A quantized rollout engine (an INT8 W8A8 or FP8 checkpoint in vLLM) computes with
other weights than the bf16 trainer: its own quantization of them. Three things
need one shared description of the scheme, and this module is it:

* **writing** (``logdiff quantize``, ``logdiff/commands/quantize.py``): ``SCHEMES`` names each scheme
  logdiff writes and ``quantization_config`` gives the ``config.json`` block
  llm-compressor writes for it (``quant_method: compressed-tensors``; the INT8 one is
  llm-compressor's ``W8A8`` preset: weights int8 symmetric per output channel, static;
  input activations int8 symmetric per token, dynamic; ``lm_head`` ignored);
* **reading** (the contracts): ``describe`` turns a loaded ``quantization_config`` into one
  line per scheme (bits, type, granularity, static or dynamic), so that the two sides'
  contracts compare as values and a cause can name the scheme;
* **weights through the scheme** (the weight check): ``quantized_fingerprint`` hashes a
  quantized weight as the engine holds it (its int8 values and its scales), and
  ``fingerprint_through`` hashes a trainer's weight after quantizing it under the same
  scheme (``kernels/int8.py``: the one definition of the INT8 scheme's rounding), so a
  clean quantized engine matches its trainer and a stale weight inside it does not.
  Schemes without an exact re-quantization here (FP8) hash to None: unverified, never
  a guess.
"""

from __future__ import annotations

import re

from typing import Any

from logdiff.probes.contracts import OFF, fingerprint

#: the schemes ``logdiff quantize --scheme`` writes
SCHEMES = ("int8-w8a8", "fp8-block", "fp8-tensor")
#: FP8 block size (llm-compressor's FP8_BLOCK preset: 128 x 128 weight blocks, activations in groups of 128)
FP8_BLOCK = 128
#: the largest finite float8_e4m3fn value (the FP8 scale's divisor)
FP8_MAX = 448.0
#: the contract keys of a side's quantization (``describe``; a vLLM engine adds ``quantized_linears`` per layer)
QUANTIZATION_KEYS = ("quantization", "quantized_linears", "quantization_ignored", "kv_cache_quantization")
#: the tensors a quantized linear stores beside its ``weight`` (folded into the weight's fingerprint)
SCALE_LEAVES = ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point", "azp_adj", "weight_scale_inv")


def _args(kind: str, strategy: str, dynamic: bool, **extra: Any) -> dict[str, Any]:
    """One compressed-tensors ``QuantizationArgs`` block, with every field llm-compressor writes."""
    return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "actorder": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}, **extra}


#: what a mixture-of-experts model leaves unquantized beside the head: its router (``re:.*mlp.gate$``, as
#: llm-compressor's MoE examples do) and its routed experts (vLLM's CPU build has no INT8 fused-MoE kernel
#: but AMD's zentorch one), so that only its attention and dense linears are quantized
MOE_IGNORE = ("re:.*mlp\\.gate$", "re:.*mlp\\.experts.*")


def quantization_config(scheme: str, moe: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` block of ``config.json`` for ``scheme`` (one of ``SCHEMES``); ``moe``: leave the
    router and the routed experts unquantized too (``MOE_IGNORE``)."""
    if scheme == "int8-w8a8":
        weights, acts, fmt = _args("int", "channel", False), _args("int", "token", True), "int-quantized"
    elif scheme == "fp8-block":
        weights = _args("float", "block", False, block_structure=[FP8_BLOCK, FP8_BLOCK])
        acts, fmt = _args("float", "group", True, group_size=FP8_BLOCK), "float-quantized"
    elif scheme == "fp8-tensor":
        weights, acts, fmt = _args("float", "tensor", False), _args("float", "token", True), "float-quantized"
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head", *(MOE_IGNORE if moe else ())],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def _granularity(args: dict[str, Any]) -> str:
    strategy = str(args.get("strategy") or "tensor")
    if strategy == "block" and args.get("block_structure"):
        return "block " + "x".join(str(int(b)) for b in args["block_structure"])
    if strategy == "group" and args.get("group_size"):
        return f"group {int(args['group_size'])}"
    return {"channel": "per-channel", "token": "per-token", "tensor": "per-tensor"}.get(strategy, strategy)


def _side(args: dict[str, Any] | None) -> str:
    if not args:
        return "none"
    kind = {"int": "int", "float": "fp"}.get(str(args.get("type")), str(args.get("type")))
    sym = "symmetric" if args.get("symmetric", True) else "asymmetric"
    when = "dynamic" if args.get("dynamic") else "static"
    return f"{kind}{int(args.get('num_bits', 8))} {sym} {_granularity(args)} {when}"


def ignores(ignore: list[str] | str | None, module: str) -> bool:
    """Whether compressed-tensors' ``ignore`` list (a list, or the contract's comma-joined string) leaves the linear
    ``module`` (``model.layers.0.mlp.down_proj``) unquantized: an entry is its name, its last parts
    (``lm_head``), or an ``re:`` pattern matched from the name's start, as vLLM's compressed-tensors reader does."""
    entries = ignore.split(",") if isinstance(ignore, str) else list(ignore or [])
    for entry in (e.strip() for e in entries):
        if not entry or entry == "off":
            continue
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False


def describe_group(group: dict[str, Any]) -> str:
    """One config group as a line: ``weights int8 symmetric per-channel static; activations int8 ... dynamic``."""
    return f"weights {_side(group.get('weights'))}; activations {_side(group.get('input_activations'))}"


def scheme_name(qcfg: dict[str, Any] | None) -> str | None:
    """Which of ``SCHEMES`` a ``quantization_config`` is (None: another one, or none)."""
    if not qcfg:
        return None
    groups = list((qcfg.get("config_groups") or {}).values())
    for name in SCHEMES:
        ours = quantization_config(name)["config_groups"]["group_0"]
        if len(groups) == 1 and all(_core(groups[0].get(k)) == _core(ours[k]) for k in ("weights", "input_activations")):
            return name
    return None


def _core(args: dict[str, Any] | None) -> tuple | None:
    """The fields that change the function (not the observer that chose the scales)."""
    if not args:
        return None
    return tuple(args.get(k) for k in ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size")) + (
        tuple(args.get("block_structure") or ()),)


def describe(qcfg: dict[str, Any] | None) -> dict[str, Any]:
    """The contract keys of a loaded ``quantization_config`` (``OFF`` where there is none).

    ``quantization``: the scheme (its name where it is one logdiff writes), then each config group's
    line; ``quantization_ignored``: the layers left unquantized (``lm_head``); ``kv_cache_quantization``:
    the KV cache's scheme (``OFF``: the cache holds the compute dtype)."""
    if not qcfg:
        return {"quantization": OFF, "quantized_linears": OFF, "quantization_ignored": OFF,
                "kv_cache_quantization": OFF}
    groups = qcfg.get("config_groups") or {}
    lines = [describe_group(g) for _, g in sorted(groups.items())]
    name = scheme_name(qcfg) or str(qcfg.get("quant_method") or "quantized")
    kv = qcfg.get("kv_cache_scheme")
    return {
        "quantization": f"{name}: {' | '.join(lines)}" if lines else name,
        "quantized_linears": "every Linear" if groups else OFF,
        "quantization_ignored": ",".join(str(x) for x in qcfg.get("ignore") or []) or OFF,
        "kv_cache_quantization": _side(kv) if kv else OFF,
    }


def quantized_fingerprint(q: Any, scale: Any) -> str:
    """A quantized weight as an engine holds it: its quantized values and its scales (``q:...;s:...``)."""
    import torch

    return f"q:{fingerprint(q)};s:{fingerprint(scale.detach().to(torch.float32))}"


def fingerprint_through(weight: Any, scheme: str | None) -> str | None:
    """``weight`` (the trainer's, as stored) quantized under ``scheme`` and hashed as the engine holds it, or
    None where logdiff has no exact re-quantization of that scheme (unverified)."""
    if scheme != "int8-w8a8":
        return None
    from logdiff.kernels.int8 import quantize_weight

    return quantized_fingerprint(*quantize_weight(weight))
