"""Rebuild logical tensors from the pieces the ranks of a sharded run recorded.

Input: one record per rank, each with the writer's ``ParallelLayout`` and the
record's ``Placement`` (``layout.py``), as numpy arrays. The records of one ``tp``
group are pieces of one logical tensor; each group is rebuilt on its own and
keyed by its ranks (different groups hold different sequences, which alignment
joins by token ids, not here):

* ``replicate``: the replicas are compared bit for bit and one is kept. Replicas
  that differ are not an error to hide: ``Logical.replicas_equal`` is False and
  ``replica_max_diff`` says by how much (a non-deterministic collective shows up
  exactly there).
* ``shard``: pieces are joined along ``dim`` in ``tp`` order; packed outputs part
  by part; then trimmed to the logical ``size``.
* ``partial``: the summands are added in ``tp`` order in float32, one fixed order
  whatever the world size, so the rebuilt value never depends on how ranks
  finished.

Arrays stay in the dtype they were written in; bfloat16 arrives as its raw
16-bit pattern (``int16``, as ``store.py`` keeps it) and ``to_float32`` widens it.
Joining and bitwise comparison work on the raw bits; only ``partial`` converts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from logdiff.errors import InputError
from logdiff.records.layout import ParallelLayout, Placement


@dataclass
class Logical:
    """One rebuilt tensor: its value, which ranks it came from, and what the replicas said."""

    value: np.ndarray
    ranks: tuple[int, ...]  # the tp group, in tp order
    replicas_equal: bool | None = None  # replicate only
    replica_max_diff: float = 0.0


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as float32; ``dtype`` names what it holds (``bfloat16`` arrives as raw int16 bits)."""
    if dtype == "bfloat16":
        return (array.astype(np.int32).astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def unshard(name: str, pieces: list[tuple[ParallelLayout, np.ndarray]], placement: Placement,
            dtype: str) -> dict[tuple[int, ...], Logical]:
    """The logical tensors of record ``name``, one per ``tp`` group, keyed by the group's ranks."""
    sets: dict[tuple[int, ...], list[tuple[ParallelLayout, np.ndarray]]] = {}
    for layout, array in pieces:
        sets.setdefault(layout.group("tp"), []).append((layout, array))
    return {key: _rebuild(name, members, placement, dtype) for key, members in sets.items()}


def _rebuild(name: str, members: list[tuple[ParallelLayout, np.ndarray]], placement: Placement,
             dtype: str) -> Logical:
    group = members[0][0].group("tp")
    by_index = {layout.index_in("tp"): array for layout, array in members}
    if len(by_index) != len(members) or sorted(by_index) != list(range(len(group))):
        have = sorted(members[0][0].group("tp")[i] for i in by_index)
        raise InputError(f"{name}: pieces from tp ranks {have}, expected all of {list(group)}")
    arrays = [by_index[i] for i in range(len(group))]
    if placement.kind == "replicate":
        return _replicated(arrays, group, dtype)
    if placement.kind == "partial":
        total = to_float32(arrays[0], dtype)
        for a in arrays[1:]:
            total = total + to_float32(a, dtype)
        return Logical(total, group)
    return Logical(_joined(name, arrays, placement), group)


def _replicated(arrays: list[np.ndarray], group: tuple[int, ...], dtype: str) -> Logical:
    first = arrays[0]
    equal = all(a.shape == first.shape and np.array_equal(a.view(np.uint8), first.view(np.uint8)) for a in arrays)
    diff = 0.0
    if not equal:
        ref = to_float32(first, dtype)
        diff = max(float(np.max(np.abs(to_float32(a, dtype) - ref))) if a.shape == first.shape else float("inf")
                   for a in arrays[1:])
    return Logical(first, group, equal, diff)


def _joined(name: str, arrays: list[np.ndarray], placement: Placement) -> np.ndarray:
    dim = placement.dim
    assert dim is not None
    if placement.parts:
        bounds = np.cumsum(placement.parts)[:-1]
        for a in arrays:
            if a.shape[dim] != sum(placement.parts):
                raise InputError(f"{name}: a piece of width {a.shape[dim]} along dim {dim}, "
                                 f"packed parts {list(placement.parts)}")
        split = [np.split(a, bounds, axis=dim) for a in arrays]
        joined = np.concatenate([np.concatenate([parts[i] for parts in split], axis=dim)
                                 for i in range(len(placement.parts))], axis=dim)
    else:
        joined = np.concatenate(arrays, axis=dim)
    if placement.size is not None:
        if placement.size > joined.shape[dim]:
            raise InputError(f"{name}: logical size {placement.size} along dim {dim}, pieces hold {joined.shape[dim]}")
        joined = np.take(joined, np.arange(placement.size), axis=dim)
    return joined
