"""The ranks of a multi-rank msprobe dump, grouped by the parallel sizes the user gives (``--tp N``).

msprobe writes ``DUMP/step{S}/rank{R}/`` per global rank and, of the parallel layout, only each collective's
group and (for a DTensor) its mesh: no TP/PP sizes. So the sizes come from the user: ``--tp N`` or
``--parallel tp=N`` (``parse_parallel``; only ``tp`` is un-sharded yet, any other size above one is one line,
exit 2). With them, the ranks of every step are checked (each step holds ranks ``0..W-1``, ``W`` a multiple
of ``N``, no ``proc{PID}`` directories) and grouped: the ``tp`` group of rank ``r`` is the ``N`` consecutive
ranks holding it (TP innermost, as Megatron and a ``(dp, tp)`` DeviceMesh number them; where the dump holds
DTensors their mesh is checked against it, ``placements.py``). ``W / N`` groups are data-parallel replicas:
each its own sequences.

``convert_parallel`` writes one bundle rank per dump rank (``convert.convert`` with a ``RankView``), each with
its ``ParallelLayout`` and the records' ``Placement``s (``placements.py``), so that ``logdiff/records/unshard.py``
rebuilds the logical tensors. A dump of one rank per step is one unsharded rank whatever ``--tp`` says (the
other side of a comparison may be the sharded one); several ranks per step without ``--tp`` are refused.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdiff.errors import InputError

_RANK = re.compile(r"^rank(\d+)$")
_STEP = re.compile(r"^step(\d+)$")
#: the parallel sizes ``--parallel`` names; only ``tp`` is un-sharded yet
SIZES = {"tp": "tensor", "pp": "pipeline", "dp": "data", "ep": "expert", "cp": "context", "sp": "sequence"}


@dataclass(frozen=True)
class Parallel:
    """The parallel sizes of the run a dump came from, as the user gave them."""

    tp: int = 1


def parse_parallel(spec: str | None, tp: int | None = None) -> Parallel | None:
    """``--parallel tp=2[,pp=1]`` and ``--tp 2`` as one ``Parallel`` (None: neither given); one line for anything
    else: an unknown key, a size that is not an integer >= 1, a size other than ``tp`` above one (not yet)."""
    if spec is None and tp is None:
        return None
    sizes: dict[str, int] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SIZES:
            raise InputError(f"--parallel {spec}: {item.strip()!r} is not KEY=SIZE with KEY one of {', '.join(SIZES)}")
        sizes[key] = _size(value.strip(), f"--parallel {key}")
    if tp is not None:
        given = _size(str(tp), "--tp")
        if sizes.get("tp", given) != given:
            raise InputError(f"--tp {tp} and --parallel tp={sizes['tp']} disagree")
        sizes["tp"] = given
    for key, size in sizes.items():
        if key != "tp" and size > 1:
            raise InputError(f"--parallel {key}={size}: {SIZES[key]}-parallel msprobe dumps are not supported yet "
                             "(only tp is un-sharded)")
    return Parallel(tp=sizes.get("tp", 1))


def _size(value: str, what: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise InputError(f"{what}={value}: must be an integer >= 1")
    return size


def rank_dirs(root: Path) -> dict[int, dict[str, Path]]:
    """Each step's rank directories of a dump (``{step: {"rank3": dir}}``), as ``layout.dump_files`` finds
    them (a step or rank directory given itself counts as one)."""
    from logdiff.sources.msprobe.layout import dump_files

    out: dict[int, dict[str, Path]] = {}
    for f in dump_files(Path(root)):
        m = _STEP.match(f.parent.parent.name)
        out.setdefault(int(m.group(1)) if m else 0, {})[f.parent.name] = f.parent
    return out


def check_ranks(root: Path, parallel: Parallel | None) -> dict[int, list[Path]] | None:
    """The dump's rank directories per global rank, each listing its steps' directories in step order, when
    it holds several ranks per step and ``parallel`` is given; None for a dump of one rank per step. Several
    ranks per step without ``parallel``, a ``proc{PID}`` directory among them, a missing rank, or a rank
    count that is not a multiple of ``tp``: one line."""
    steps = rank_dirs(root)
    if all(len(dirs) <= 1 for dirs in steps.values()):
        for dirs in steps.values():
            for d in dirs.values():
                _one_of_several(d)
        return None
    step, dirs = next((s, d) for s, d in sorted(steps.items()) if len(d) > 1)
    if parallel is None:
        raise InputError(f"{root}: step {step} holds {len(dirs)} ranks' dumps ({', '.join(sorted(dirs))}): a "
                         "tensor-parallel run's; give its size, --tp N (docs/msprobe.md)")
    ranks: dict[int, list[Path]] = {}
    for step, dirs in sorted(steps.items()):
        numbered = {}
        for name, d in dirs.items():
            m = _RANK.match(name)
            if not m:
                raise InputError(f"{d}: not a rank{{R}} directory; a multi-rank dump is read by its global ranks")
            numbered[int(m.group(1))] = d
        world = max(numbered) + 1
        absent = sorted(set(range(world)) - set(numbered))
        if absent:
            raise InputError(f"{root}: step {step} has no rank{absent[0]} directory (ranks {sorted(numbered)} of "
                             f"{world}): every rank's dump is needed to un-shard")
        if world % parallel.tp:
            raise InputError(f"{root}: step {step} holds {world} ranks, not a multiple of --tp {parallel.tp}")
        if ranks and world != len(ranks):
            raise InputError(f"{root}: step {step} holds {world} ranks, an earlier step {len(ranks)}")
        for r, d in numbered.items():
            ranks.setdefault(r, []).append(d)
    return ranks


def _one_of_several(rank_dir: Path) -> None:
    """One line where the only rank directory of a step holds DTensor pieces of a mesh of several ranks: the
    other ranks' dumps are missing (a dump of one TP rank cannot be un-sharded)."""
    from logdiff.records.untrusted import InputRoot

    try:
        text = InputRoot(rank_dir, "msprobe rank directory").read_bytes(rank_dir / "dump.json").decode("utf-8", "replace")
    except InputError:
        return  # read_dump says why
    found = re.search(r'"device_mesh":\s*\[([0-9,\s]+)\]', text)
    ranks = [int(r) for r in found.group(1).split(",") if r.strip()] if found else []
    if len(ranks) > 1:
        raise InputError(f"{rank_dir}: the only rank of its step, but its DTensors span ranks {ranks}: the other "
                         "ranks' directories are missing (every rank's dump is needed to un-shard)")


def tp_group(rank: int, tp: int) -> tuple[int, ...]:
    """The ``tp`` ranks holding ``rank``: ``tp`` consecutive global ranks (TP innermost)."""
    first = rank - rank % tp
    return tuple(range(first, first + tp))


@dataclass
class RankView:
    """What ``convert.convert`` needs to write one rank of a multi-rank dump (see its ``rank`` argument)."""

    layout: Any  # ParallelLayout
    steps: list[Any]  # this rank's RankDump per step
    placer: Any  # placements.Placer
    split_config: dict[str, Any]  # the config a rank's packed tensors split by (its local heads)
    fingerprints: tuple[dict, dict] = ({}, {})  # the whole weights' (fingerprints, fingerprints_at), over the ranks


def convert_parallel(dump_dir: Path, out_dir: Path, role: str, config: dict[str, Any], model: str | None,
                     parallel: Parallel | None) -> Path:
    """The bundle of a multi-rank dump: one bundle rank per dump rank, placed for un-sharding. One rank's dump
    is converted as ``convert.convert`` converts it."""
    from logdiff.records.layout import ParallelLayout
    from logdiff.sources.msprobe.convert import convert, engine_of
    from logdiff.sources.msprobe.layout import read_dump
    from logdiff.sources.msprobe.placements import gathered_parameters, placer_for
    from logdiff.sources.msprobe.weights import fingerprint_sets

    ranks = check_ranks(Path(dump_dir), parallel)
    if ranks is None or parallel is None:
        return convert(dump_dir, out_dir, role, config, model)
    steps = {r: [s for d in dirs for s in read_dump(d)] for r, dirs in sorted(ranks.items())}
    engine = engine_of(steps[0])
    world, tp = len(steps), parallel.tp
    fingerprints = fingerprint_sets(gathered_parameters(steps, tp)) if engine == "hf" else ({}, {})
    existed = Path(out_dir).exists()
    try:
        for r, mine in steps.items():
            group = tp_group(r, tp)
            layout = ParallelLayout(r, world, {"tp": group})
            placer = placer_for(engine, config, tp, group)
            placer.learn(mine)
            view = RankView(layout, mine, placer, placer.split_config(), fingerprints)
            convert(dump_dir, out_dir, role, config, model, rank=view)
    except BaseException:
        if not existed:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return Path(out_dir)
