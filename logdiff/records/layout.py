"""Where a recorded tensor lives: the writer's rank in its parallel groups, and the tensor's placement.

A sharded run records, on every rank, that rank's *local* tensor. To compare it
with anything, the logical tensor has to be rebuilt (``unshard``), and for that
each record carries two facts, written beside it in a capture bundle:

* ``ParallelLayout``: the writer's global rank and world size, and the ranks of
  each of its groups (``tp``, ``dp``, ``ep``, ``pp``), as lists of global ranks in
  group order. The records of one ``tp`` group are pieces of one logical
  tensor; different ``tp`` groups (the model's data-parallel replicas, or its
  pipeline stages) hold different sequences or layers.
* ``Placement`` across the ``tp`` group, the three kinds DTensor knows:

  - ``replicate``: every rank holds the whole tensor (after an all-reduce or an
    all-gather: a row-parallel output, the embedding, gathered logits);
  - ``shard``: rank ``i`` holds the ``i``-th slice along ``dim`` (a column-parallel
    output, vocabulary-parallel logits). ``parts`` describes a packed output
    whose slice is itself several parts side by side (vLLM's ``qkv_proj`` holds
    ``[q_i, k_i, v_i]``, ``gate_up_proj`` ``[gate_i, up_i]``): each part is
    gathered on its own, then the parts are put side by side. ``size`` trims
    padding (a vocabulary padded to a multiple of the world size);
  - ``partial``: each rank holds a summand (a row-parallel output read before its
    all-reduce); the logical tensor is their sum, taken here in one fixed order.

Placements are read from where the run states them: a DTensor's ``placements``
(``placement_of``), or a declared table for modules whose parallelism is their
type (an engine's column/row/vocabulary-parallel layers map their own types to a
``Placement``; this module names none). Nothing here imports torch at module level.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("replicate", "shard", "partial")
GROUPS = ("tp", "dp", "ep", "pp")


@dataclass(frozen=True)
class Placement:
    """How one record's tensor is split across its ``tp`` group."""

    kind: str = "replicate"
    dim: int | None = None  # shard: the split dimension (negative counts from the end)
    parts: tuple[int, ...] | None = None  # shard of a packed output: each part's local width, in order
    size: int | None = None  # shard: the logical length along ``dim`` (trims padding)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"placement kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if (self.kind == "shard") != (self.dim is not None):
            raise ValueError("a shard placement needs its dim, and only a shard has one")

    def to_json(self) -> dict[str, Any]:
        # made once per placement (a frozen value): a capture's writer asks for every record of every step, and
        # ``asdict`` cost a tenth of the demo's hooks (bench/bench_trl_step.py's breakdown)
        made = _JSON.get(self)
        if made is None:
            made = _JSON[self] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                                  if v is not None}
        return {k: (list(v) if isinstance(v, list) else v) for k, v in made.items()}  # the caller's own

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Placement:
        parts = data.get("parts")
        return cls(data.get("kind", "replicate"), data.get("dim"), tuple(parts) if parts else None, data.get("size"))


#: ``Placement.to_json``'s, per placement
_JSON: dict[Placement, dict[str, Any]] = {}

REPLICATE = Placement()


def shard(dim: int, parts: tuple[int, ...] | None = None, size: int | None = None) -> Placement:
    return Placement("shard", dim, parts, size)


@dataclass(frozen=True)
class ParallelLayout:
    """One writer's place in the run: its global rank, the world, and each group's global ranks."""

    rank: int = 0
    world_size: int = 1
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, ranks in self.groups.items():
            if self.rank not in ranks:
                raise ValueError(f"rank {self.rank} is not in its own {name} group {list(ranks)}")

    def group(self, name: str) -> tuple[int, ...]:
        """The global ranks of this rank's ``name`` group; a group the run does not have is this rank alone."""
        return tuple(self.groups.get(name, (self.rank,)))

    def index_in(self, name: str) -> int:
        return self.group(name).index(self.rank)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size,
                "groups": {k: list(v) for k, v in sorted(self.groups.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParallelLayout:
        return cls(int(data["rank"]), int(data["world_size"]),
                   {k: tuple(int(r) for r in v) for k, v in data.get("groups", {}).items()})


def placement_of(tensor: Any, mesh_dim: int = 0) -> Placement:
    """A DTensor's placement along one mesh dimension (its ``tp`` dimension); a plain tensor is replicated."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return REPLICATE
    p = placements[mesh_dim]
    return _from_dtensor(p, tensor.shape[p.dim] if p.is_shard() else None)


def placement_of_style(style: Any) -> Placement:
    """The placement of a module's output under a tensor-parallel plan's style (``ColwiseParallel``:
    sharded on the last dim; ``RowwiseParallel``: replicated), read from the style's ``output_layouts``.

    With ``use_local_output`` (the default) the module returns a plain local tensor, so its
    placement is known only from the plan, not from the tensor.
    """
    layouts = getattr(style, "output_layouts", None)
    if not layouts:
        raise ValueError(f"{type(style).__name__} states no output layout")
    return _from_dtensor(layouts[0], None)


def _from_dtensor(p: Any, size: int | None) -> Placement:
    """``Shard(d)`` and ``Replicate()`` map one to one; a ``Partial`` only when it sums (what ``unshard`` rebuilds)."""
    if p.is_shard():
        return shard(p.dim, size=size)
    if p.is_replicate():
        return REPLICATE
    if p.is_partial() and getattr(p, "reduce_op", "sum") == "sum":
        return Placement("partial")
    raise ValueError(f"cannot rebuild a tensor placed as {p}")


def layout_of_mesh(mesh: Any, names: dict[str, int] | None = None) -> ParallelLayout:
    """This rank's ``ParallelLayout`` from a ``DeviceMesh``: ``names`` maps group names to mesh dimensions
    (default: a 1-D mesh is the ``tp`` group)."""
    import torch.distributed as dist

    names = names if names is not None else {"tp": 0}
    groups = {}
    for name, dim in names.items():
        group = mesh.get_group(dim)
        groups[name] = tuple(dist.get_process_group_ranks(group))
    return ParallelLayout(dist.get_rank(), dist.get_world_size(), groups)
