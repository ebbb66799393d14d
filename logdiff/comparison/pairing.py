"""Two capture bundles on one set of token sequences, and each bundle's records fed into a scan's sinks.

A live scan records both sides while they run over sequences it chose; two
bundles were recorded apart, each over its own batches, with its own sequence
numbering per ``tp`` group (a data-parallel trainer's ranks each number their
own). ``match_sequences`` joins them by token ids: a training sequence and an
inference sequence are the same when one's ids are a prefix of the other's
(vLLM never feeds the last token it samples; a trainer scores the whole
sequence). Each matched pair becomes one *common* sequence, holding the longer
ids, and every record row is addressed by (common sequence, position) from then
on, as a scan's ``RowMap`` addresses its rows.

``feed`` then replays one bundle, step by step and record by record in the order
they were recorded, into the sinks a ``ProbeSession`` hands out for that side
(``session.sinks``): un-sharded into logical tensors (``Bundle.logical``), rows
of unmatched sequences dropped, rows whose token id is not the common
sequence's id at that position dropped and counted. From there the comparison
is the scan's own: stores, comparers, ``locate``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.probes.align import RowMap
from logdiff.records.bundle import Bundle

Key = tuple[tuple[int, ...], int]  # (tp group, sequence id in that group)


@dataclass
class Matching:
    """The common sequences of two bundles and where each side's sequences went."""

    ids: list[list[int]]  # per common sequence: its token ids (the longer side's)
    train: dict[Key, int]  # a training-bundle sequence -> its common sequence
    infer: dict[Key, int]
    unmatched: dict[str, int] = field(default_factory=dict)  # side -> sequences without a partner


def _known(ids: list[int]) -> list[int]:
    """The ids up to the first position no row fed."""
    return ids[: ids.index(-1)] if -1 in ids else ids


def match_sequences(train: dict[Key, list[int]], infer: dict[Key, list[int]]) -> Matching:
    """Pair each training sequence with an unused inference sequence whose ids agree with it on their common
    length (one a prefix of the other), longest agreement first; each sequence is used at most once."""
    by_head: dict[tuple[int, ...], list[Key]] = {}
    for key, ids in infer.items():
        by_head.setdefault(tuple(_known(ids)[:2]), []).append(key)
    used: set[Key] = set()
    out = Matching([], {}, {})
    for tkey, tids in train.items():
        t = _known(tids)
        best, best_len = None, 0
        for ikey in by_head.get(tuple(t[:2]), []):
            if ikey in used:
                continue
            i = _known(infer[ikey])
            n = min(len(t), len(i))
            if n > best_len and t[:n] == i[:n]:
                best, best_len = ikey, n
        if best is None:
            continue
        used.add(best)
        i = _known(infer[best])
        out.train[tkey] = out.infer[best] = len(out.ids)
        out.ids.append(t if len(t) >= len(i) else i)
    out.unmatched = {"train": len(train) - len(out.train), "infer": len(infer) - len(out.infer)}
    if not out.ids:
        raise InputError("the two bundles share no token sequence: they did not record the same tokens")
    return out


def as_torch(array: np.ndarray, dtype: str) -> Any:
    """A bundle array as the torch tensor it was (bfloat16 arrives as its raw 16-bit pattern)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def sketched(bundle: Bundle) -> set[str]:
    """The records ``bundle`` kept only as row sketches (outside its capture's full window)."""
    return {name for part in bundle.ranks for step in part.steps for name, entry in step["records"].items()
            if entry.get("sketch")}


def feed(bundle: Bundle, common: dict[Key, int], ids: list[list[int]], sinks: Iterable[Any],
         sketch_also: Collection[str] = (), digest: str | None = None) -> int:
    """Replay every record of ``bundle`` into ``sinks`` as rows of the common sequences; returns how many
    rows were dropped because their token id is not the common sequence's at that position.

    A sketched record goes to the sinks as ``name#sketch`` (``sketch.SUFFIX``); a whole record as ``name``
    and, when ``sketch_also`` names it (the other side only sketched it), its sketch as well, with ``digest``
    (the other side's, ``Bundle.sketch_digest``; this one's by default)."""
    sinks = list(sinks)
    width = max(len(s) for s in ids)
    known = np.full((len(ids), width), -1, dtype=np.int64)
    for c, s in enumerate(ids):
        known[c, : len(s)] = s
    misaligned = 0
    for group in bundle.groups():
        part = bundle.part_of(group)
        for step in range(len(part.steps)):
            with bundle.reading(step, group):  # the step's file opened once for all its records
                misaligned += _feed_step(bundle, group, step, common, known, sinks, sketch_also, digest)
    return misaligned


def _feed_step(bundle: Bundle, group: tuple[int, ...], step: int, common: dict[Key, int], known: np.ndarray,
               sinks: list[Any], sketch_also: Collection[str], digest: str | None) -> int:
    """``feed`` of one step of ``group``: its records into ``sinks``; how many of its rows were misaligned."""
    import torch

    from logdiff.records.sketch import SUFFIX, sketch

    part = bundle.part_of(group)
    table = part.table(step)
    rmap, misaligned = _row_map(table, group, common, known)
    for name, entry in part.steps[step]["records"].items():
        index = bundle.record_rows(step, name, group)
        rows_map = rmap.take(index) if index is not None else rmap
        if not rows_map.valid.any():
            continue
        value = bundle.logical(step, name, group)[group].value.reshape(len(rows_map), -1)
        out = [(name + SUFFIX, torch.from_numpy(np.ascontiguousarray(value)))] if entry.get("sketch") else [
            (name, as_torch(value, entry["dtype"]))]
        if name in sketch_also and not entry.get("sketch"):
            columns = np.arange(value.shape[1], dtype=np.int64)
            kept = sketch(value, entry["dtype"], columns, digest or bundle.sketch_digest)
            out.append((name + SUFFIX, torch.from_numpy(kept)))
        for record, rows in out:
            for sink in sinks:
                sink.emit(record, rows, rows_map)
    return misaligned


def _row_map(table: dict[str, np.ndarray], group: tuple[int, ...], common: dict[Key, int],
             known: np.ndarray) -> tuple[RowMap, int]:
    """The step's rows as (common sequence, position), and how many real rows disagree on their token id."""
    seq_ids = table["sequences"]
    seq = np.asarray([common.get((group, int(s)), -1) for s in seq_ids], dtype=np.int64)
    pos = table["positions"].astype(np.int64)
    valid = table["valid"].astype(bool) if "valid" in table else np.ones(len(seq), bool)
    valid &= (seq >= 0) & (pos >= 0) & (pos < known.shape[1])
    v = np.nonzero(valid)[0]
    expected = known[seq[v], pos[v]]
    wrong = v[(expected >= 0) & (expected != table["tokens"][v])]
    valid[wrong] = False
    return RowMap(seq, pos, valid), len(wrong)


class TokenScores:
    """A sink of one side's ``log_softmax`` (or ``logits``) rows: the logprob and the top-1 token of each common
    sequence's next token, from the row before it (float32 ``log_softmax`` of logits)."""

    wants_replay = False

    def __init__(self, ids: list[list[int]], source: str):
        self.ids, self.source = ids, source
        self.logprobs = [np.zeros(len(s), np.float32) for s in ids]  # [c][p]: logprob of ids[c][p]
        self.top1 = [np.full(len(s), -1, np.int64) for s in ids]
        self.has = [np.zeros(len(s), bool) for s in ids]

    def emit(self, name: str, rows: Any, rmap: RowMap, replay: Any = None) -> None:
        if name != self.source:
            return
        import torch

        idx = np.nonzero(rmap.valid)[0]
        seq, nxt = rmap.seq[idx], rmap.pos[idx] + 1
        inside = np.asarray([n < len(self.ids[s]) for s, n in zip(seq, nxt)], dtype=bool)
        idx, seq, nxt = idx[inside], seq[inside], nxt[inside]
        if not len(idx):
            return
        x = rows[torch.as_tensor(idx)].float()
        lp = torch.log_softmax(x, dim=-1) if name == "logits" else x
        tokens = torch.as_tensor([self.ids[s][n] for s, n in zip(seq, nxt)])
        picked = lp.gather(1, tokens[:, None])[:, 0].numpy()
        best = lp.argmax(dim=-1).numpy()
        for j, (s, n) in enumerate(zip(seq, nxt)):
            self.logprobs[s][n], self.top1[s][n], self.has[s][n] = picked[j], best[j], True


def score_source(bundle: Bundle) -> str:
    """The boundary a side's token logprobs come from: its own ``log_softmax`` if it recorded one, else its logits."""
    names = {n for part in bundle.ranks for step in part.steps for n in step["records"]}
    for name in ("log_softmax", "logits"):
        if name in names:
            return name
    raise InputError(f"{bundle.root}: no logits or log_softmax record, so no token logprobs can be read")


def reductions(bundle: Bundle, cmap: Any) -> dict[str, int]:
    """The records this side summed across the ranks of a ``tp`` group, with the group's size: a replicated
    output of an op whose first input the ranks held in slices along its last (reduced) dimension. That is
    a row-parallel layer: each rank multiplies its slice, an all-reduce adds the partial sums."""
    from logdiff.records.layout import Placement

    out: dict[str, int] = {}
    for group in bundle.groups():
        part = bundle.part_of(group)
        if len(group) < 2 or not part.steps:
            continue
        records = part.steps[0]["records"]  # one step's placements stand for every step's
        for name, entry in records.items():
            boundary = cmap.get(name)
            source = records.get(boundary.inputs[0]) if boundary is not None and boundary.inputs else None
            if source is None:
                continue
            into, out_of = Placement.from_json(source["placement"]), Placement.from_json(entry["placement"])
            # replicated after the all-reduce, or each rank's summand (an msprobe dump's DTensor ``Partial``), or
            # each rank's rows of the sum (sequence parallel's reduce-scatter: Megatron's ``shard(-2)`` records)
            rows = out_of.kind == "shard" and out_of.dim in (-2, len(entry["shape"]) - 2)
            if into.kind == "shard" and into.dim in (-1, len(source["shape"]) - 1) and (
                    rows or out_of.kind in ("replicate", "partial")):
                out[name] = max(out.get(name, 1), len(group))
    return out


class ReplaySink:
    """A live pass that only replays: each op the live model runs is re-run on the stored (inference) side's
    inputs, and that local error goes to ``comparer`` as a scan's replay does; the live values themselves are
    not compared (the training side's values come from its bundle).

    A live op stands in for the training side's op only where it reproduces it: re-run first on the training
    bundle's own inputs (``train``, a store of its rows), it must give the bundle's output bit for bit. Where
    it does not (another device, kernel or sharding computed the bundle: a row-parallel sum, say), that
    boundary is not replayed, and ``unfaithful`` names it.
    """

    wants_replay = True

    def __init__(self, comparer: Any, train: Any):
        from logdiff.probes.summary import PathComparer

        self.comparer = comparer
        self.check = PathComparer(train, comparer.max_len)  # the live op against the bundle, on its inputs
        self.unfaithful: list[str] = []  # boundaries where the live op did not reproduce the bundle

    def emit(self, name: str, rows: Any, rmap: RowMap, replay: Any = None) -> None:
        stored, own = self.comparer.store.get(name), self.check.store.get(name)
        if replay is None or stored is None or own is None or name in self.unfaithful:
            return
        self.check._replay(name, own, rows, rmap, replay)
        reproduced = self.check.local.get(name)
        if reproduced is None:  # no row with all its inputs in the bundle: nothing shows the op is the same
            return
        if not reproduced.equal:
            self.unfaithful.append(name)
            self.comparer.local.pop(name, None)  # what earlier batches replayed stands on nothing either
            return
        self.comparer._replay(name, stored, rows, rmap, replay)
