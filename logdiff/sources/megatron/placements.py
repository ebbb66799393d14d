"""Where a Megatron rank's records and weights sit in the logical tensors, from Megatron's own metadata.

Megatron states its parallelism on the modules and parameters it builds, not in DTensors:

* ``parallel_state`` gives this rank's groups: tensor (``tp``), data (``dp``), pipeline (``pp``) and expert
  (``ep``) parallel, read into a ``ParallelLayout`` (``layout_of_megatron``);
* a ``ColumnParallelLinear`` (``linear_qkv``, ``linear_fc1``, ``output_layer``) without ``gather_output``
  returns its slice of the output columns: ``shard(-1)``; a ``RowParallelLinear`` (``linear_proj``,
  ``linear_fc2``) all-reduces its partial sums: ``replicate``; what follows a column-parallel layer per head
  (q/k norms, RoPE, the attention core, the activation) stays sharded. Each weight carries
  ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``, which ``weights.gather`` reads;
* under sequence parallel a ``RowParallelLinear`` reduce-scatters along the sequence instead, and the norms,
  residuals and embeddings between hold ``S / tp`` positions per rank: those records are ``shard(-2)`` (their
  rows: rank ``i``'s positions, in ``tp`` order), and each rank writes the row index of the whole.
"""

from __future__ import annotations

from typing import Any

from logdiff.records.layout import REPLICATE, ParallelLayout, Placement, shard

#: boundary suffixes by how a tensor-parallel rank holds them
SHARDED = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "rope_q", "rope_k", "attn_core", "gate_proj", "up_proj",
           "act_mul")
ROWS = -2  # the row dimension of a ``[rows, width]`` record: a sequence-parallel rank holds some rows


def record_placement(name: str, tp: int, sequence_split: bool, width: int = 0, vocab: int | None = None) -> Placement:
    """The placement of record ``name`` across a ``tp`` group (``sequence_split``: it holds this rank's positions
    only; ``width``, ``vocab``: the logits' local width and the logical vocabulary)."""
    if sequence_split:
        return shard(ROWS)
    if tp == 1:
        return REPLICATE
    if name == "logits":
        return REPLICATE if vocab is None or width == vocab else shard(-1, size=vocab)
    if name.rsplit(".", 1)[-1] in SHARDED:
        return shard(-1)
    return REPLICATE


def layout_of_megatron() -> ParallelLayout:
    """This rank's ``ParallelLayout`` from ``megatron.core.parallel_state`` (one rank where it is not initialized)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized()) or not ps.model_parallel_is_initialized():
        return ParallelLayout()
    getters = {"tp": ps.get_tensor_model_parallel_group, "dp": ps.get_data_parallel_group,
               "pp": ps.get_pipeline_model_parallel_group, "ep": ps.get_expert_model_parallel_group}
    groups = {}
    for name, get in getters.items():
        try:
            group = get()
        except (AssertionError, RuntimeError):
            continue
        if group is not None:
            groups[name] = tuple(dist.get_process_group_ranks(group))
    return ParallelLayout(dist.get_rank(), dist.get_world_size(), groups)


def tp_group() -> Any:
    """Megatron's tensor-parallel process group, or None outside a distributed run."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None


def ep_group() -> Any:
    """Megatron's expert-parallel process group, or None."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_group() if ps.model_parallel_is_initialized() else None


def expert_tp_group() -> Any:
    """Megatron's expert-tensor-parallel process group (the experts' own tensor-parallel slices), or None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_expert_tensor_parallel_group(check_initialized=False)
