"""Capture bundles: records of one side of a run, from any number of ranks, on disk.

A bundle is a directory that any machine can read with numpy and safetensors
alone (no torch, vLLM, torch_npu or GPU)::

    BUNDLE/
      bundle.json                   {"format": "logdiff-capture", "version": 1, "role": "train", "world_size": 2}
      rank-00000/manifest.json      the rank's ParallelLayout, its metadata, and one entry per step
      rank-00000/step-000000.safetensors
      rank-00001/...

Each rank writes only its own directory, with no collective: a trainer rank or
an inference worker never waits for another to record. A step is one forward
pass; its file holds the pass's token ids and positions (``tokens``,
``positions``) and every record of the pass under its boundary name, as the
rank's *local* tensor. The manifest gives each record's dtype, local shape and
``Placement`` (``layout.py``), so ``unshard`` can rebuild the logical tensor. A record
outside the capture's full window holds only its row sketches (``sketch.py``;
``"sketch": true`` in the manifest), rebuilt across ranks by ``unshard_sketches``.
Steps are written as they finish (memory stays flat) and each written step's
manifest entry is appended to the rank's step log until the writer closes and
writes the manifest whole (``"step_log"`` in an open writer's manifest names the
log), so a run that dies leaves a readable bundle of the steps it completed
(``bundle_writer.py``, which writes a capture's steps in a thread of its own).
bfloat16 is stored as its raw 16-bit pattern (``int16``) with ``dtype: bfloat16``
in the manifest, since numpy has no bfloat16.

**Weight versions.** A rank whose weights change while it records (a rollout engine
that the trainer syncs new weights into) numbers them: each step entry in the manifest
carries the ``weight_version`` it ran with (0, the weights as loaded, where a bundle
has none), and the rank's metadata ``weight_versions`` lists each version's
``fingerprints`` (``fingerprints`` itself is the last version's, for readers that know
no versions). A capture of weights wider than bfloat16 also keeps them rounded:
``fingerprints_at`` (``{"bfloat16": {...}, "float16": {...}}``), since a bundle cannot
re-round. ``RankPart.fingerprints`` reads either, ``Bundle.versions_of`` says which
versions the steps of given sequences ran with.

**Untrusted input.** A bundle is read as untrusted input: every file through ``untrusted.InputRoot`` (inside
the bundle, links out refused, regular files only), its JSON type-checked on open, every step file's header
checked against its manifest entry before anything loads (``bundle_input.py``), the stated world size and
ranks against the rank directories on disk; anything wrong is one ``InputError`` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.records import bundle_input as checked
from logdiff.records.bundle_writer import FORMAT, RESERVED, ROLES, VERSION
from logdiff.records.layout import ParallelLayout, Placement
from logdiff.records.sketch import DIGESTS, LEGACY
from logdiff.records.unshard import Logical, unshard
from logdiff.records.untrusted import InputRoot


def _meta_ids(meta: dict[str, Any], seq: int) -> list[int] | None:
    """The whole ids the rank's metadata gives for its sequence ``seq``, if any."""
    listed = meta.get("sequences")
    if not isinstance(listed, list) or not 0 <= seq < len(listed) or not isinstance(listed[seq], dict):
        return None
    ids = listed[seq].get("ids")
    return [int(t) for t in ids] if isinstance(ids, list) else None


@dataclass
class RankPart:
    layout: ParallelLayout
    meta: dict[str, Any]
    steps: list[dict[str, Any]]
    dir: Path
    source: InputRoot
    #: each step file's arrays and their shapes, from its header (``bundle_input.check_step_files``)
    shapes: list[dict[str, list[int]]] = field(default_factory=list, repr=False)
    _rows: dict[int, int] = field(default_factory=dict, repr=False)
    _files: dict[int, Path] = field(default_factory=dict, repr=False)  # each step's file, resolved once
    _open: dict[int, checked.StepFile] = field(default_factory=dict, repr=False)  # the steps ``reading`` holds open

    def file(self, step: int) -> Path:
        """Step ``step``'s file, inside the rank directory and the bundle (``untrusted.InputRoot.child``; resolved
        once per step: every record of the step names it)."""
        if step not in self._files:
            self._files[step] = self.source.child(self.dir, self.steps[step]["file"],
                                                  f"{self.dir / 'manifest.json'}: step {step}",
                                                  within="its rank directory")
        return self._files[step]

    def load(self, step: int, names: list[str]) -> dict[str, np.ndarray]:
        """Arrays ``names`` of step ``step``, each checked against the manifest (``bundle_input.read_step``), from
        the step's open file while ``reading(step)`` holds it."""
        held = self._open.get(step)
        if held is not None:
            return held.read(names, self.steps[step]["records"])
        return checked.read_step(self.file(step), names, self.steps[step]["records"])

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[None]:
        """While the block runs, step ``step``'s file stays open and each ``load`` of it reads only its arrays (its
        header parsed once: a reader of every record of a step would otherwise open the file per record)."""
        if step in self._open:
            yield
            return
        self._open[step] = checked.StepFile(self.file(step))
        try:
            yield
        finally:
            self._open.pop(step).close()

    def names(self, step: int) -> set[str]:
        """Every array in the step's file (from its header, read when the bundle opened)."""
        return set(self.shapes[step])

    def table(self, step: int) -> dict[str, np.ndarray]:
        """The step's row table: ``tokens``, ``positions`` and, from a capture, ``sequences`` and ``valid``
        (each one row per step row)."""
        names = [n for n in RESERVED if n in self.names(step)]
        if "tokens" not in names or "positions" not in names:
            raise InputError(f"{self.file(step)}: no tokens and positions arrays (not a capture's step file)")
        table = self.load(step, names)
        if len({a.shape for a in table.values()}) > 1 or table["tokens"].ndim != 1:
            raise InputError(f"{self.file(step)}: its row arrays ({', '.join(names)}) are not one row each")
        return table

    def weight_version(self, step: int) -> int:
        """The weight version step ``step`` ran with (0 where the bundle numbers none)."""
        return int(self.steps[step].get("weight_version", 0))

    def fingerprints(self, version: int = 0, at: str | None = None) -> dict[str, Any] | None:
        """The rank's weight fingerprints of ``version`` (``weight_versions``; a bundle without them has version 0
        only, ``fingerprints``), those rounded to ``at`` where the capture kept them (``fingerprints_at``), else
        its own dtype's; None where the rank hashed none of that version."""
        versions = self.meta.get("weight_versions")
        if isinstance(versions, list) and versions:
            entry = versions[version] if 0 <= version < len(versions) else None
        else:
            entry = self.meta if version == 0 else None
        if not isinstance(entry, dict):
            return None
        rounded = (entry.get("fingerprints_at") or {}).get(at) if at else None
        found = rounded if rounded is not None else entry.get("fingerprints")
        return dict(found) if isinstance(found, dict) else None


class Bundle:
    """A bundle on disk, read with numpy only."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        source = InputRoot(self.root, "capture bundle")
        head_path = self.root / "bundle.json"
        if not os.path.lexists(head_path):
            raise InputError(f"{self.root} is not a capture bundle (no bundle.json)")
        head = source.read_object(head_path, "bundle.json")
        if head.get("format") != FORMAT:
            raise InputError(f"{head_path}: format {str(head.get('format'))[:60]!r}, expected {FORMAT!r}")
        checked.check_version(head_path, head, VERSION)
        checked.check_head(head_path, head, ROLES)
        self.role: str = head["role"]
        self.world_size = int(head["world_size"])
        self.ranks: list[RankPart] = []
        for rank_dir in (p for p in sorted(self.root.glob("rank-*")) if p.is_dir() or p.is_symlink()):
            source.resolve(rank_dir, "dir")
            part = rank_dir / "manifest.json"
            if not os.path.lexists(part):
                raise InputError(f"{rank_dir}: a rank directory with no manifest.json (an interrupted capture or an "
                                 "incomplete copy)")
            m = source.read_object(part, "manifest.json")
            if "step_log" in m:  # a writer that has not closed (still running, or killed)
                m["steps"] = checked.read_step_log(source, part, m["step_log"])
            layout = checked.check_manifest(source, part, m)
            shapes = checked.check_step_files(source, part, m["steps"], rank_dir)
            self.ranks.append(RankPart(layout, m.get("meta", {}), m["steps"], rank_dir, source, shapes))
        if not self.ranks:
            raise InputError(f"{self.root}: a bundle with no rank's records")
        checked.check_ranks(self.root, self.world_size, [(p.dir / "manifest.json", p.layout.rank) for p in self.ranks])
        digests = {str(part.meta.get("sketch_digest", LEGACY)) for part in self.ranks}
        if len(digests) > 1 or not digests <= set(DIGESTS):
            raise InputError(f"{self.root}: row sketch digests {sorted(digests)} (this logdiff reads one of "
                             f"{', '.join(DIGESTS)}, the same on every rank)")
        #: the digest of the bundle's row sketches (``sketch.py``; ``LEGACY`` where the capture named none)
        self.sketch_digest: str = digests.pop()

    @property
    def num_steps(self) -> int:
        """The steps every rank has (data-parallel ranks may have more: ``sequences`` reads each rank's all)."""
        return min(len(r.steps) for r in self.ranks)

    def names(self, step: int) -> list[str]:
        return list(self.ranks[0].steps[step]["records"])

    def rows(self, step: int) -> dict[tuple[int, ...], dict[str, np.ndarray]]:
        """The step's row table (``tokens``, ``positions``, and from a capture ``sequences``, ``valid``),
        one per ``tp`` group (the ranks of a group see the same batch)."""
        out = {}
        for part in self.ranks:
            key = part.layout.group("tp")
            if key not in out:
                out[key] = part.table(step)
        return out

    @property
    def meta(self) -> dict[str, Any]:
        """The first rank's metadata (every rank of a capture writes the same model facts)."""
        return self.ranks[0].meta

    @contextlib.contextmanager
    def reading(self, step: int, group: tuple[int, ...]) -> Iterator[None]:
        """While the block runs, the step files of step ``step`` of every rank of ``group`` stay open
        (``RankPart.reading``): ``record_rows`` and ``logical`` of that step read from them."""
        with contextlib.ExitStack() as stack:
            for part in self.ranks:
                if part.layout.group("tp") == group and step < len(part.steps):
                    stack.enter_context(part.reading(step))
            yield

    def groups(self) -> list[tuple[int, ...]]:
        """The ``tp`` groups, in rank order: each holds its own sequences."""
        return list(dict.fromkeys(part.layout.group("tp") for part in self.ranks))

    def part_of(self, group: tuple[int, ...]) -> RankPart:
        """The first rank of ``group`` (its ranks see the same rows)."""
        return next(part for part in self.ranks if part.layout.group("tp") == group)

    def sequence_table(self) -> dict[tuple[tuple[int, ...], int], list[int]]:
        """Every captured sequence's token ids by position (-1 where no row fed one), keyed by its ``tp`` group
        and its sequence id there (ranks number their own sequences), groups in rank order, each in the
        order its steps first saw them. Where a rank's metadata lists a sequence's whole ids (``sequences[i].ids``:
        the vLLM plugin's, with the last sampled token that no step fed), those are taken."""
        out: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for group in self.groups():
            part = self.part_of(group)
            for step in range(len(part.steps)):  # data-parallel groups may run different numbers of steps
                table = part.table(step)
                if "sequences" not in table:
                    raise InputError(f"{self.root}: step {step} has no sequence ids (not written by a capture)")
                valid = table["valid"].astype(bool) if "valid" in table else np.ones(len(table["tokens"]), bool)
                seq, pos, tok = table["sequences"][valid], table["positions"][valid], table["tokens"][valid]
                for s in dict.fromkeys(seq.tolist()):
                    mine = seq == s
                    ids = out.setdefault((group, int(s)), [])
                    for p, t in zip(pos[mine].tolist(), tok[mine].tolist()):
                        ids.extend([-1] * (p + 1 - len(ids)))
                        ids[p] = t
            for (g, s), ids in out.items():  # ids a rank knows beyond what it fed (vLLM's last sampled token)
                known = _meta_ids(part.meta, s) if g == group else None
                if known and len(known) > len(ids) and all(a in (-1, b) for a, b in zip(ids, known)):
                    out[(g, s)] = known
        return out

    def position_offset(self, group: tuple[int, ...], seq: int) -> int:
        """The model position sequence ``seq`` of ``group`` was fed its first token at (0 unless the capture saw it
        shifted: a left-padded row without ``position_ids``; ``meta["position_offsets"]``, ``logdiff/records/batching.py``)."""
        return int((self.part_of(group).meta.get("position_offsets") or {}).get(str(seq), 0))

    def versions_of(self, keys: Any) -> dict[tuple[tuple[int, ...], int], list[int]]:
        """The weight versions the steps that fed sequences ``keys`` (``(group, sequence id)``, as
        ``sequence_table``'s) ran with: ``(group, version)`` -> those steps, in order."""
        wanted: dict[tuple[int, ...], set[int]] = {}
        for group, seq in keys:
            wanted.setdefault(tuple(group), set()).add(int(seq))
        out: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for group, seqs in wanted.items():
            part = self.part_of(group)
            numbered = any("weight_version" in step for step in part.steps)
            for step in range(len(part.steps)):
                if numbered:  # else every step is version 0: no row table needs reading
                    table = part.table(step)
                    valid = table["valid"].astype(bool) if "valid" in table else slice(None)
                    if not seqs.intersection(table["sequences"][valid].tolist()):
                        continue
                out.setdefault((group, part.weight_version(step)), []).append(step)
        return out

    def sequences(self) -> list[list[int]]:
        """Every captured sequence's token ids in position order (``sequence_table``'s, unfed positions left out)."""
        return [[t for t in ids if t >= 0] for ids in self.sequence_table().values()]

    def record_rows(self, step: int, name: str, group: tuple[int, ...] | None = None) -> np.ndarray | None:
        """The index into the step's rows of each row of record ``name`` (None: one row per step row)."""
        part = self.ranks[0] if group is None else self.part_of(group)
        key, entry = f"{name}#rows", part.steps[step]["records"].get(name)
        index = part.load(step, [key])[key] if key in part.names(step) else None
        if entry is not None and not entry.get("sketch"):
            if index is None and step not in part._rows:
                part._rows[step] = len(part.table(step)["tokens"])
            rows = len(index) if index is not None else part._rows[step]
            checked.check_rows(part.file(step), name, entry, rows)
        return index

    def logical(self, step: int, name: str, group: tuple[int, ...] | None = None) -> dict[tuple[int, ...], Logical]:
        """Record ``name`` of ``step`` rebuilt into logical tensors (``unshard``), one per ``tp`` group (only
        ``group``'s, if given: data-parallel groups may have run different numbers of steps)."""
        ranks = [part for part in self.ranks if group is None or part.layout.group("tp") == group]
        entries = [part.steps[step]["records"].get(name) if step < len(part.steps) else None for part in ranks]
        if any(e is None for e in entries):
            raise InputError(f"{self.root}: step {step} has no record {name!r} on every rank")
        if len(entries) > 1 and (len({json.dumps(e["placement"], sort_keys=True) for e in entries}) > 1
                                 or len({e["dtype"] for e in entries}) > 1):  # one rank agrees with itself
            raise InputError(f"{self.root}: ranks disagree on how {name!r} is placed or typed")
        pieces = [(part.layout, part.load(step, [name])[name]) for part in ranks]
        placement = Placement.from_json(entries[0]["placement"])
        try:
            if entries[0].get("sketch"):
                from logdiff.records.sketch import unshard_sketches

                return unshard_sketches(pieces, placement, self.sketch_digest)
            return unshard(name, pieces, placement, entries[0]["dtype"])
        except (ValueError, IndexError, KeyError) as e:
            raise InputError(f"{self.root}: step {step}, record {name!r}: the ranks' pieces do not make one "
                             f"tensor ({type(e).__name__}: {e})") from None

    def widths(self) -> dict[str, int]:
        """Each whole record's logical values per row (``bundle_input.row_width``), from the first step that has
        it (each step file's header read until every record's is known)."""
        out: dict[str, int] = {}
        for part in self.ranks:
            tp = len(part.layout.group("tp"))
            for step, entry in enumerate(part.steps):
                todo = [n for n in entry["records"] if n not in out]
                if not todo:
                    continue
                shapes = part.shapes[step]
                for name in todo:
                    width = checked.row_width(part.file(step), name, entry["records"][name], tp, shapes)
                    if width is not None:
                        out[name] = width
        return out
