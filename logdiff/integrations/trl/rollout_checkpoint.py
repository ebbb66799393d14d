"""TRL's colocated vLLM on another checkpoint than the trainer's: a quantized rollout (``rollout_checkpoint``).

TRL builds its colocated engine from the trainer's model path (``LLM(model=model.name_or_path, ...)`` in
``trl.generation.vllm_generation``) and has no option for another one. A quantized rollout samples from an
engine on a quantized checkpoint of the same model (``logdiff quantize MODEL OUT --scheme int8-w8a8``) while
the trainer keeps bf16 weights::

    with logdiff_trl.eager_vllm(), logdiff_trl.rollout_checkpoint("qwen3-int8"):
        trainer = GRPOTrainer(model="qwen3", args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...), ...)
    logdiff_trl.layerwise_sync(trainer)

While the block runs, the engine TRL builds loads ``path`` instead (every other argument TRL's). Each weight
sync then quantizes the trainer's weights under the checkpoint's scheme (``logdiff.sync_vllm_weights``, through
``layerwise_sync``; ``logdiff/sources/vllm/quantized_sync.py``), so the engine holds what a fresh engine on a
checkpoint quantized from the trainer's new weights would hold. The checkpoint must be the trainer's model
quantized: its config (vocabulary, layers) is checked against the trainer's before the engine is built, in
one line (``ValueError``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from logdiff.probes.patching import Patches

#: config keys that must agree between the trainer's model and the rollout checkpoint
SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size")


@contextlib.contextmanager
def rollout_checkpoint(path: str | Path) -> Iterator[None]:
    """While the block runs, the vLLM engine TRL builds loads ``path`` (a quantized checkpoint of the trainer's model)
    instead of the trainer's model path."""
    import trl.generation.vllm_generation as generation

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"rollout_checkpoint: {path} has no config.json (a checkpoint directory, e.g. from "
                         "'logdiff quantize')")
    build = generation.LLM

    def build_on_checkpoint(*args: Any, model: str, **kwargs: Any) -> Any:
        _check_same_model(Path(model), path)
        return build(*args, model=str(path), **kwargs)

    with Patches() as patches:
        patches.set(generation, "LLM", build_on_checkpoint)
        yield


def _check_same_model(trainer_model: Path, checkpoint: Path) -> None:
    """``ValueError`` in one line when the checkpoint is not the trainer's model (its shapes differ)."""
    if not (trainer_model / "config.json").is_file():
        return  # a hub id: TRL resolved it, the engine's own load will say if the shapes differ
    mine, theirs = (json.loads((p / "config.json").read_text()) for p in (trainer_model, checkpoint))
    differ = [k for k in SHAPE_KEYS if mine.get(k) != theirs.get(k)]
    if differ:
        raise ValueError(f"rollout_checkpoint: {checkpoint} is not a checkpoint of the trainer's model {trainer_model} "
                         f"({differ[0]}: {theirs.get(differ[0])!r} against {mine.get(differ[0])!r})")
