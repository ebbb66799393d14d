"""Where a vLLM layer's output lives across its tensor-parallel group, read from the layer's type.

vLLM's parallel layers state their parallelism by what they are, not by a
DTensor placement, so a capture inside a vLLM worker maps the module that
produced a record to a ``Placement`` (``logdiff/records/layout.py``) with this table:

* ``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ColumnParallelLinear``:
  each rank holds a slice of the output columns, ``shard(-1)``. A packed output
  recorded whole (``[q_i, k_i, v_i]``, ``[gate_i, up_i]``) carries its local
  ``parts``; a part the adapter split off (the ``q_proj`` of ``qkv_proj``) is a
  plain shard. With ``gather_output`` the output is whole: replicated. K/V heads
  replicated over several ranks (more ranks than KV heads) are neither: refused.
* ``RowParallelLinear``: replicated after its all-reduce (``reduce_results``),
  a partial sum without it.
* ``VocabParallelEmbedding``: replicated (each rank's partial lookup is all-reduced).
* ``LogitsProcessor``: replicated; vLLM gathers the vocabulary-parallel logits and
  trims them to the real vocabulary before they leave it. Platforms that gather
  to the first rank only (``use_all_gather`` False) leave the other ranks none,
  and the capture records logits on the first rank alone.
* A layer with ``tp_size == 1`` (TP off, or ``disable_tp``) and ``ReplicatedLinear``:
  replicated.

Anything else (norms, RoPE, attention, the activation) returns None: the caller
places it like its first input, as ``probes/capture.py`` does.
"""

from __future__ import annotations

from typing import Any

from logdiff.records.layout import REPLICATE, Placement, shard


def vllm_placement(module: Any, name: str, width: int) -> Placement | None:
    """The placement of record ``name`` (``width`` wide, local) produced by vLLM layer ``module``; None when its
    type says nothing (the record follows its inputs)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    if isinstance(module, (ReplicatedLinear, LogitsProcessor)):
        return REPLICATE
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
        return REPLICATE
    if isinstance(module, RowParallelLinear):
        return REPLICATE if module.reduce_results or module.tp_size == 1 else Placement("partial")
    if not isinstance(module, ColumnParallelLinear):
        return None
    if module.tp_size == 1 or module.gather_output:
        return REPLICATE
    if isinstance(module, QKVParallelLinear):
        parts = (module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                 module.num_kv_heads * module.v_head_size)  # fmt: skip
        if module.num_kv_head_replicas > 1 and (width == sum(parts) or not _is_q(name)):
            raise NotImplementedError(f"{name}: K/V heads replicated over {module.num_kv_head_replicas} ranks "
                                      "(more ranks than KV heads) are not un-sharded yet")
        return shard(-1, parts=parts) if width == sum(parts) else shard(-1)
    if isinstance(module, MergedColumnParallelLinear):
        parts = tuple(size // module.tp_size for size in module.output_sizes)
        return shard(-1, parts=parts) if width == sum(parts) and len(parts) > 1 else shard(-1)
    return shard(-1)


def _is_q(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("q")
