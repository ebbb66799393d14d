"""True on-policy training: the trainer's switch and the weight sync into a running vLLM.

``consistent_training(model)`` is what a trainer wraps around its forward *and*
backward on a plain HF module (it lives in ``logdiff/sources/hf/training.py``,
where the ``hf`` engine's ``--set train.grad=true`` shares it; see there). The
name the issue asked for, ``logdiff.kernels.consistent_training``, cannot exist:
``logdiff.kernels`` imports nothing of logdiff. The switch is
``logdiff.consistent_training``.

``sync_vllm_weights(llm, model)`` (``logdiff/sources/vllm/training.py``) pushes the
trainer's new weights into an in-process ``vllm.LLM`` through vLLM's own ``model.load_weights`` (called by
``llm.apply_model``), inside vLLM's layer-wise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) where vLLM
has it: on CPU, ``process_weights_after_loading`` packs each linear weight
into a oneDNN handle and empties ``layer.weight``, and the reload restores the
plain parameters, loads, and packs again. Derived state is refreshed: the
prefix cache is reset (its KV blocks were computed with the old weights), and
consistent mode on the engine must be *off* during the sync, since the reload
replaces the ``cpu_linear`` that ``consistent_vllm`` patched and its exit
would put back the stale handle. The next ``consistent_vllm(llm)`` block
recovers the new weights (``sources/vllm/weights.py`` keys its recovered copies by the
rebuilt ``cpu_linear``). MoE models are refused: on vLLM 0.32's CPU build the
fused experts gave wrong logprobs after the layer-wise reload (max |diff| 15
against HF on a tiny Qwen3-MoE, stock vLLM included), and the recovered-expert
cache is keyed by a storage pointer the reload keeps.
"""

from __future__ import annotations

from logdiff.sources.hf.training import ConsistentTraining, active_dropout, consistent_training
from logdiff.sources.vllm.training import checkpoint_tensors, sync_vllm_weights

__all__ = ["ConsistentTraining", "active_dropout", "checkpoint_tensors", "consistent_training", "sync_vllm_weights"]
