"""True on-policy training: the trainer's switch and the weight sync into a running vLLM.

``consistent_training(model)`` is what a trainer wraps around its forward
*and* backward on a plain HF module. It refuses a model with active dropout
(a training step with dropout cannot equal the rollout), installs the
consistent kernels with ``consistent_hf`` (whose patched modules call the
differentiable kernels, so ``loss.backward()`` runs their fixed-order
backwards) and holds one ``kernel_caches()`` block for its whole life: a
prepared weight copy is keyed by the tensor's version counter, so an
``optimizer.step()`` that updates the weights in place inside the block is
seen by the next forward. It returns a handle that is both a context manager
and an installer (``handle.undo()``), for loops that cannot wrap a ``with``
block around their step.

The name the issue asked for, ``logdiff.kernels.consistent_training``, cannot
exist: ``logdiff.kernels`` imports nothing of logdiff, and installing kernels
into HF modules is ``probes/consistent_hf.py``'s job. The switch is
``logdiff.consistent_training`` (this module).

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
recovers the new weights (``vllm_weights`` keys its recovered copies by the
rebuilt ``cpu_linear``). MoE models are refused: on vLLM 0.32's CPU build the
fused experts gave wrong logprobs after the layer-wise reload (max |diff| 15
against HF on a tiny Qwen3-MoE, stock vLLM included), and the recovered-expert
cache is keyed by a storage pointer the reload keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from logdiff.probes.errors import InputError

#: config keys that are dropout probabilities but never act in a causal LM's forward
_NOT_FORWARD_DROPOUT = ("classifier_dropout", "summary_first_dropout")


def active_dropout(model: Any) -> list[str]:
    """Where ``model`` would drop activations in train mode: ``nn.Dropout`` modules and config keys with p > 0."""
    import torch.nn as nn

    found = [
        f"{name or 'model'} (p={m.p})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    config = getattr(model, "config", None)
    for key, value in sorted(vars(config).items() if config is not None else []):
        is_rate = ("dropout" in key or key.endswith("pdrop")) and key not in _NOT_FORWARD_DROPOUT
        if is_rate and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{key}={value}")
    return found


class ConsistentTraining:
    """The consistent kernels installed into one HF model; undo with ``undo()`` or by leaving the ``with`` block."""

    def __init__(self, model: Any):
        from logdiff import kernels
        from logdiff.probes.consistent_hf import consistent_hf

        dropout = active_dropout(model)
        if dropout:
            raise InputError(
                "consistent training needs dropout 0 (a step with dropout cannot equal the rollout): "
                + ", ".join(dropout)
            )
        self.model = model
        self._stack = contextlib.ExitStack()
        with self._stack:  # undone at once if installing fails
            self._stack.enter_context(kernels.kernel_caches())
            self.replaced = self._stack.enter_context(consistent_hf(model)).replaced
            self._stack = self._stack.pop_all()

    @property
    def active(self) -> bool:
        """Whether the kernels are still installed."""
        return self.model is not None

    def undo(self) -> None:
        """Put every original operator back and drop the kernels' caches (idempotent)."""
        if self.model is not None:
            self.model = None
            self._stack.close()

    def __enter__(self) -> ConsistentTraining:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def consistent_training(model: Any) -> ConsistentTraining:
    """Install the consistent (batch-invariant, differentiable) kernels into a plain HF ``model`` for training.

    Use it as ``with consistent_training(model): loss = ...; loss.backward(); opt.step()``
    or keep the handle and call ``handle.undo()``. Raises ``InputError`` for active
    dropout and ``NotImplementedError`` for a module no kernel covers.
    """
    return ConsistentTraining(model)


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
    from logdiff.probes.consistent_vllm import engine_objects, is_active

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
