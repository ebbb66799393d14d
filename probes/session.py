"""One scan's probes: where each path's boundary records go, and the pairs ``locate`` reads.

``ProbeSession`` owns a temporary directory for the scan. Every inference
path's passes are stored there (``StoreSink``, a ``store.PathStore``); the
training path's passes go to a ``summary.PathComparer`` per stored path, which
compares them as they arrive. ``record(engine, role)`` attaches a
``record.Recorder`` with those sinks for the length of a ``with`` block, and
``pairs()`` gives ``locate`` one ``PairRecord`` per (train path, infer path).
MoE router rows also go to a ``routing.RouterSink`` per (role, path).

With a ``window`` (``scan --window``) the stores and comparers see the
boundaries outside it as row sketches (``windowed.py``), and ``fetch`` runs a
second, targeted pass for whole rows a diagnosis needs there.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from logdiff.probes.align import RowMap
from logdiff.probes.correspondence import CorrespondenceMap, build, fallback
from logdiff.probes.ops import OpTracer
from logdiff.probes.record import Recorder
from logdiff.probes.routing import RouterSink, router_boundaries
from logdiff.probes.summary import PathComparer
from logdiff.probes.windowed import FetchSink, WindowedSinks

from logdiff.records.sketch import Window
from logdiff.records.store import PathStore, is_run

#: sequences whose training-path rows a session keeps for the diagnosis's conformance check when one follows
#: (``conformance_sequences``: a scan that diagnoses, a comparison of bundles with the training model; docs/causes.md)
CONFORMANCE_SEQUENCES = 2


class StoreSink(PathStore):
    """A ``PathStore`` that takes the recorder's ``emit`` calls (of the first ``sequences`` sequences only, if set)."""

    wants_replay = False

    def __init__(self, root: Path, path: str, num_sequences: int, max_len: int, sequences: int | None = None):
        super().__init__(root, path, num_sequences, max_len)
        self.sequences = sequences

    def emit(self, name: str, rows: Any, rmap: RowMap, replay_spec: Any = None) -> None:  # type: ignore[override]
        valid = rmap.valid if self.sequences is None else rmap.valid & (rmap.seq < self.sequences)
        idx = np.nonzero(valid)[0]
        if len(idx):
            kept = rows[int(idx[0]) : int(idx[-1]) + 1] if is_run(idx) else rows[idx]  # a run: a view, no copy
            super().emit(name, kept, rmap.seq[idx], rmap.pos[idx])



@dataclass
class PairRecord:
    """What ``locate`` needs for one (train path, infer path) pair."""

    train: str
    infer: str
    cmap: CorrespondenceMap
    comparer: PathComparer
    store: PathStore
    owners_train: dict[str, str]
    owners_infer: dict[str, str]
    tracer_train: OpTracer | None
    tracer_infer: OpTracer | None
    warnings: list[str] = field(default_factory=list)
    seqs: list[Any] = field(default_factory=list)
    #: the training path's own rows (the first ``conformance_sequences`` sequences), for conformance
    train_store: PathStore | None = None
    #: per side, the boundaries it summed across ranks and over how many (``feed.reductions``; bundles only)
    reductions: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per side, the model position each sequence's first token was fed at, where not 0 (a left-padded row
    #: without ``position_ids``; bundles only): what its RoPE rotated by
    position_offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    #: the boundaries kept whole (``scan --window``); the others were compared by row sketches
    window: Window = field(default_factory=lambda: Window(None))
    #: ``fetch(engine, path, run, names, role, sequences)``: whole rows of ``names`` from a second pass of a side
    #: (``ProbeSession.fetch``), None where the pair was not recorded live
    fetch: Any = None


class ProbeSession:
    """The probes of one scan: stores for inference paths, comparers for the training path.

    Use ``record(engine, "infer")`` around every inference engine call and then
    ``record(engine, "train")`` around the training path; ``pairs()`` gives one
    ``PairRecord`` per (train path, stored infer path).
    """

    def __init__(
        self,
        seqs: list[Any],
        response_len: int,
        architecture: str,
        config: dict[str, Any],
        *,
        ops: bool = False,
        drill: str | None = None,
        workdir: str | None = None,
        conformance_sequences: int = 0,
        window: Window | None = None,
    ):
        self.seqs = seqs
        self.response_len = response_len
        cmap = build(architecture, config)
        self.warnings: list[str] = []
        if cmap is None:
            cmap = fallback(architecture, config)
            self.warnings.append(
                f"no correspondence map for {architecture}: boundaries are matched by module name only, "
                "in observed execution order, without teacher-forced replay"
            )
        self.cmap = cmap
        self.ops = ops
        self.drill = drill
        self.window = window or Window(None)  # every boundary whole unless a scan says otherwise
        self.root = Path(tempfile.mkdtemp(prefix="logdiff-probe-", dir=workdir))
        self.stores: dict[str, StoreSink] = {}
        #: the training paths' own rows, kept for the diagnosis's conformance check (docs/causes.md)
        self.train_stores: dict[str, StoreSink] = {}
        self.conformance_sequences = min(conformance_sequences, len(seqs))
        self.comparers: dict[tuple[str, str], PathComparer] = {}
        self.owners: dict[str, dict[str, str]] = {}
        self.tracers: dict[tuple[str, str], OpTracer] = {}
        self.position_offsets: dict[str, dict[int, int]] = {}  # ``PairRecord.position_offsets``
        self._store_count = 0
        self._every_store: list[PathStore] = []  # closed or not: what they wrote is the scan's scratch
        self._recorders: list[Recorder] = []
        #: MoE router logits per (role, path), in memory (``routing.RouterSink``); empty for dense models
        self.routers: dict[tuple[str, str], RouterSink] = {}
        self._has_routers = bool(router_boundaries(cmap))
        #: per role, the boundaries a captured side summed across ranks (``feed.reductions``)
        self.reductions: dict[str, dict[str, int]] = {}
        #: every row of a training path, kept for an offline replay's check (``keep_rows``)
        self.kept: dict[str, StoreSink] = {}
        #: the stored paths whose comparers replay the training path's ops (None: every one). A scan replays
        #: against its primary path only, whose pair the diagnosis reads: each replay costs one more forward
        self.replay_paths: set[str] | None = None

    @property
    def max_len(self) -> int:
        return max(len(s.prompt_ids) + max(len(s.response_ids or []), self.response_len) for s in self.seqs)

    def _tracer_for(self, role: str, path: str) -> OpTracer | None:
        if not self.ops:
            return None
        if (role, path) not in self.tracers:
            drill = self.drill
            select = (lambda name: name == drill or name.startswith(drill + ".")) if drill else None
            self.tracers[(role, path)] = OpTracer(select)
        return self.tracers[(role, path)]

    @contextlib.contextmanager
    def record(self, engine: Any, role: str) -> Iterator[Recorder]:
        """Record ``engine``'s passes: ``infer`` stores them, ``train`` compares against the stores."""
        if role not in ("infer", "train"):
            raise ValueError(role)

        def sinks_for(path: str) -> list[Any]:
            sinks = self.sinks(role, path, rec.owners)
            rec.use_tracer(self._tracer_for(role, path))
            return sinks

        rec = Recorder(engine, self.cmap, sinks_for, self.seqs, self.response_len)
        self._recorders.append(rec)
        with rec:
            yield rec
        self._keep_warnings(rec)

    def _keep_warnings(self, rec: Recorder) -> None:
        """A finished recorder's warnings, each once, into the session's."""
        self.warnings += [w for w in dict.fromkeys(rec.warnings) if w not in self.warnings]

    def sinks(self, role: str, path: str, owners: dict[str, str]) -> list[Any]:
        """Where ``path``'s records on ``role``'s side go: ``infer`` to its store, ``train`` to a comparer per
        stored path (and its own store of the conformance sequences), MoE router rows to a router sink.

        ``owners`` (boundary -> producing module) is one run's: a later run of the same path (another
        recorder, another bundle) replaces the earlier one's records. A live recording (``record``) and a
        capture bundle (``feed.feed``) reach the comparison through here alike.
        """
        if role not in ("infer", "train"):
            raise ValueError(role)
        if role == "infer" and path in self.stores and self.owners.get(path) is not owners:
            # a later run of the same path replaces an earlier one: the pipeline reports
            # the last run's scores (an HF engine samples, then scores in a separate pass)
            self.stores.pop(path).close()
            self.tracers.pop((role, path), None)
            self.routers.pop((role, path), None)
        extra = [self._router_sink(role, path)] if self._has_routers else []
        if role == "infer":
            if path not in self.stores:
                self.stores[path] = self._new_store(path, self.max_len)
                self.owners[path] = owners
            return [*self._windowed([self.stores[path]]), *extra]
        sinks = []
        if self.conformance_sequences:
            if path in self.train_stores and self.owners.get(f"train:{path}") is not owners:
                self.train_stores.pop(path).close()  # a later run of the same path replaces it
            if path not in self.train_stores:
                self.train_stores[path] = self._new_store(path, self.max_len, self.conformance_sequences)
            sinks.append(self.train_stores[path])
        for infer_path, store in self.stores.items():
            key = (path, infer_path)
            if key not in self.comparers:
                replay = self.replay_paths is None or infer_path in self.replay_paths
                self.comparers[key] = PathComparer(store, self.max_len, replay)
            sinks.append(self.comparers[key])
        self.owners[f"train:{path}"] = owners
        return [*extra, *self._windowed(sinks)]

    def _windowed(self, sinks: list[Any]) -> list[Any]:
        """``sinks`` as the session's window has them see boundaries (router sinks never go through it)."""
        return sinks if self.window.layers is None or not sinks else [WindowedSinks(sinks, self.window, self.cmap)]

    def fetch(self, engine: Any, path: str, run: Any, names: set[str], role: str = "infer",
              sequences: int | None = None) -> tuple[StoreSink, FetchSink]:
        """Whole rows of boundaries ``names`` of ``role``'s path ``path`` (of its first ``sequences`` sequences),
        from a second pass: ``run(recording)`` (``engine`` replaying the scan's tokens inside ``with recording():``,
        after whatever it sets up first, as the scan did: consistent kernels) recorded into a new store, each row
        checked against the sketch the scan stored of it (``FetchSink.mismatched``; the training side's sketches
        are those of its conformance store). The store is the session's, deleted with it."""
        first = self.stores[path] if role == "infer" else self.train_stores[path]
        store = self._new_store(path, self.max_len, sequences)
        sink = FetchSink(store, first, names)

        @contextlib.contextmanager
        def recording() -> Iterator[Recorder]:
            with Recorder(engine, self.cmap, lambda p: [sink] if p == path else [], self.seqs,
                          self.response_len) as rec:
                yield rec
            self._keep_warnings(rec)

        run(recording)
        return store, sink

    def keep_rows(self, path: str) -> StoreSink:
        """A store of every row of training path ``path`` (an offline comparison checks its live replay model
        against it: ``feed.ReplaySink``); one per path, deleted with the session."""
        if path not in self.kept:
            self.kept[path] = self._new_store(path, self.max_len)
        return self.kept[path]

    def _new_store(self, path: str, max_len: int, sequences: int | None = None) -> StoreSink:
        """A store for ``path`` in the next numbered directory of the session (of its first ``sequences`` only)."""
        self._store_count += 1
        store = StoreSink(self.root / f"{self._store_count:02d}", path, len(self.seqs), max_len, sequences)
        self._every_store.append(store)
        return store

    @property
    def scratch_bytes(self) -> int:
        """Bytes this session's row stores have written to scratch files (every store, replaced ones too)."""
        return sum(s.written_bytes for s in self._every_store)

    def _router_sink(self, role: str, path: str) -> RouterSink:
        """The path's router sink (created on its first pass; dropped with its store when a path reruns)."""
        if (role, path) not in self.routers:
            self.routers[(role, path)] = RouterSink(self.cmap, len(self.seqs), self.max_len)
        return self.routers[(role, path)]

    def pairs(self) -> list[PairRecord]:
        out = []
        for (train, infer), comparer in self.comparers.items():
            out.append(
                PairRecord(
                    train,
                    infer,
                    self.cmap,
                    comparer,
                    self.stores[infer],
                    self.owners.get(f"train:{train}", {}),
                    self.owners.get(infer, {}),
                    self.tracers.get(("train", train)),
                    self.tracers.get(("infer", infer)),
                    list(self.warnings),
                    self.seqs,
                    self.train_stores.get(train),
                    dict(self.reductions),
                    {side: dict(o) for side, o in self.position_offsets.items()},
                    self.window,
                    self.fetch if self.window.layers is not None else None,
                )
            )
        return out

    def pair(self, train: str, infer: str) -> PairRecord | None:
        return next((p for p in self.pairs() if p.train == train and p.infer == infer), None)

    def close(self) -> None:
        for s in [*self.stores.values(), *self.train_stores.values(), *self.kept.values()]:
            s.close()
        shutil.rmtree(self.root, ignore_errors=True)
