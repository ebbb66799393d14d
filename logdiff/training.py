"""True on-policy training: the trainer's switch and the weight sync into a running vLLM.

``consistent_training(model)`` is what a trainer wraps around its forward *and*
backward on a plain HF module (it lives in ``logdiff/engines/hf/training.py``,
where the ``hf`` engine's ``--set train.grad=true`` shares it; see there). The
name the issue asked for, ``logdiff.kernels.consistent_training``, cannot exist:
``logdiff.kernels`` imports nothing of logdiff. The switch is
``logdiff.consistent_training``.

``sync_vllm_weights(llm, model)`` pushes the trainer's new weights into
an in-process ``vllm.LLM`` through vLLM's own ``model.load_weights`` (called by
``llm.apply_model``), inside vLLM's layer-wise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) where vLLM
has it: on CPU, ``process_weights_after_loading`` packs each linear weight
into a oneDNN handle and empties ``layer.weight``, and the reload restores the
plain parameters, loads, and packs again. Derived state is refreshed: the
prefix cache is reset (its KV blocks were computed with the old weights), and
consistent mode on the engine must be *off* during the sync, since the reload
replaces the ``cpu_linear`` that ``consistent_vllm`` patched and its exit
would put back the stale handle. The next ``consistent_vllm(llm)`` block
recovers the new weights (``engines/vllm/weights.py`` keys its recovered copies by the
rebuilt ``cpu_linear``). MoE models are refused: on vLLM 0.32's CPU build the
fused experts gave wrong logprobs after the layer-wise reload (max |diff| 15
against HF on a tiny Qwen3-MoE, stock vLLM included), and the recovered-expert
cache is keyed by a storage pointer the reload keeps.
"""

from __future__ import annotations

from typing import Any

from logdiff.engines.hf.training import ConsistentTraining, active_dropout, consistent_training

__all__ = ["ConsistentTraining", "active_dropout", "checkpoint_tensors", "consistent_training", "sync_vllm_weights"]


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
    from logdiff.engines.vllm.consistent import engine_objects, is_active

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
    named = checkpoint_tensors(weights) if hasattr(weights, "state_dict") else weights
    tensors = [(name, t.detach()) for name, t in named]
    expected = {name for name, _ in model.named_parameters()}
    loaded: list[Any] = []

    def load(vllm_model: Any) -> None:
        try:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        except ImportError:  # an older vLLM, whose layers keep their plain weights
            loaded.append(vllm_model.load_weights(iter(tensors)))
            return
        initialize_layerwise_reload(vllm_model)
        loaded.append(vllm_model.load_weights(iter(tensors)))
        finalize_layerwise_reload(vllm_model, llm.llm_engine.model_config)

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
