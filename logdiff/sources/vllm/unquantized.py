"""A running quantized vLLM engine computed unquantized, on the trainer's weights: the quantization lever, live.

A scan measures the share of a quantized inference side by rescanning with an engine built on the trainer's
bf16 checkpoint (``diagnosis/attribute.py``, the ``quantization`` lever). Inside an RL framework the engine is
the framework's (TRL's colocated vLLM on an INT8 checkpoint) and cannot be rebuilt; ``unquantized(model,
weights)`` takes the same action in place: while the block runs, each quantized linear's ``quant_method.apply``
(an instance attribute of the layer's own method, as consistent mode patches it:
``consistent_int8.py``) is ``torch.nn.functional.linear`` on the trainer's weight of that layer (a packed
``qkv_proj`` is ``q_proj``, ``k_proj`` and ``v_proj`` stacked), in the engine's dtype. Every other op of the
engine, and its other weights, stay as they are. So this removes the quantization, and only it, when the
engine's other weights are the trainer's. ``weights_problem`` checks that first, through the scheme: each
quantized weight the engine loaded (``quantized.loaded_fingerprints``) must equal the trainer's weight
quantized under the engine's scheme (``probes/quantization.fingerprint_through``). A sync loads every tensor
or none (``sync_vllm_weights``), so equal quantized weights mean a synced engine; a stale one (a skipped
sync) is refused, since the action would then change its stale weights as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def quantized_layers(model: Any) -> list[tuple[Any, list[str]]]:
    """Each quantized linear of the vLLM ``model`` with the checkpoint names of its weights (its HF parts)."""
    from logdiff.probes.arch import adapter_of
    from logdiff.sources.vllm.quantized import is_quantized

    arch = adapter_of(model)
    out = []
    for name, module in model.named_modules():
        if is_quantized(module):
            prefix, _, short = name.rpartition(".")
            parts = arch.packed.get(short, (short,))
            out.append((module, [arch.hf_name(f"{prefix}.{p}.weight" if prefix else f"{p}.weight") for p in parts]))
    return out


def weights_problem(model: Any, weights: dict[str, Any], scheme: str | None) -> str | None:
    """Why the engine's quantized weights cannot be said to be the trainer's ``weights`` quantized (one line), or None."""
    from logdiff.probes.quantization import fingerprint_through
    from logdiff.sources.vllm.quantized import loaded_fingerprints

    for module, names in quantized_layers(model):
        loaded = loaded_fingerprints(module)
        if loaded is None:
            return f"the engine's quantized {names[0]} was not recorded as loaded (synced outside a captured step?)"
        for name, engine_print in zip(names, loaded):
            if name not in weights:
                return f"the trainer has no {name}"
            trainer_print = fingerprint_through(weights[name], scheme)
            if trainer_print is None or engine_print is None:
                return f"{name}: no exact re-quantization under {scheme}"
            if trainer_print != engine_print:
                return f"the engine's {name} is not the trainer's quantized (a stale engine)"
    return None


@contextlib.contextmanager
def unquantized(model: Any, weights: dict[str, Any]) -> Iterator[None]:
    """While the block runs, the quantized linears of the vLLM ``model`` compute ``F.linear`` on the trainer's
    ``weights`` (checkpoint name -> tensor) in the engine's dtype."""
    import torch

    from logdiff.probes.patching import Patches

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and p.dim() == 2), torch.bfloat16)
    with Patches() as patches:
        for module, names in quantized_layers(model):
            weight = torch.cat([weights[n].detach() for n in names], dim=0).to(dtype)
            patches.set(module.quant_method, "apply", _plain_apply(weight))
        yield


def _plain_apply(weight: Any) -> Any:
    def apply(layer: Any, x: Any, bias: Any = None) -> Any:
        import torch

        return torch.nn.functional.linear(x, weight, bias)

    return apply
