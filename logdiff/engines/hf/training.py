"""The trainer's switch: the consistent kernels installed into a plain HF model for training.

``consistent_training(model)`` is what a trainer wraps around its forward
*and* backward on a plain HF module. It refuses a model with active dropout
(a training step with dropout cannot equal the rollout), installs the
consistent kernels with ``consistent_hf`` (whose patched modules call the
differentiable kernels, so ``loss.backward()`` runs their fixed-order
backwards) and holds one ``kernel_caches()`` block for its whole life: a
prepared weight copy is keyed by the tensor's version counter, and the block
drops the copies of whatever an optimizer steps (a fused AdamW, HF Trainer's
default, leaves the counter: ``kernels/caches.py``), so an ``optimizer.step()``
that updates the weights in place inside the block is seen by the next
forward. It returns a handle that is both a context manager and an installer (``handle.undo()``), for loops that cannot wrap a ``with``
block around their step.

The name the issue asked for, ``logdiff.kernels.consistent_training``, cannot
exist: ``logdiff.kernels`` imports nothing of logdiff, and installing kernels
into HF modules is ``logdiff/engines/hf/consistent.py``'s job. The switch is
``logdiff.consistent_training`` (this module, re-exported by ``logdiff/training.py``).

It lives in the ``hf`` engine's folder beside ``consistent`` (the installer), so
that the engine's ``--set train.grad=true`` path and ``logdiff.consistent_training``
share it.
"""

from __future__ import annotations

import contextlib
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
        from logdiff.engines.hf.consistent import consistent_hf

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
