"""Attribution's game measured on the recorded rows: the training forward moved to the inference side's ops.

The rescan game (``attribute.py``, ``--attribution rescan``) measures ``D(S)`` by
end-to-end rescans: the levers of ``S`` applied (a kernel lever: the reference
kernel of its family on both sides), both paths run again. This module measures
a *patched* game on the scan's own records instead, with no inference run and no
reference kernel (the default since it was measured against the rescans:
docs/causes.md):

    D_p(S) = mean |Δ logprob| between the inference path's recorded logprobs and
             ONE teacher-forced forward of the training model on the scan's
             tokens, in which every op of each kernel family in ``S`` computes
             "like the inference side": row by row, its live output gets the
             error the inference side's op introduced,
             ``out + (stored_out - op(stored_inputs))``, where ``op`` is the
             training op replayed on the inference side's recorded inputs.

A kernel lever makes a family's ops compute the same way on both sides, so the
family introduces no difference; moving the training side's ops to the
inference side's arithmetic does the same from the other end, and every family
outside ``S`` still computes its own way. ``D_p(∅)`` is the scan's own gap (the
training forward repeated: ``baseline_reproduced``). With every family patched,
every op's inputs agree by induction from the embedding, each patched output is
then exactly the stored one (``out == op(stored_inputs)``; the sum is taken in
fp32, where ``a + (b - a)`` of two 16-bit floats is ``b``), and the gap closes
wherever the recorded rows cover the path. One family per op: ``cause.FAMILY``
maps a boundary's kind to the family whose reference kernel neutralises it, the
same map that gives each cause its lever. One training forward (plus the replays
of the patched ops) per coalition, instead of a rescan of both paths with slow
reference kernels.

Why not replace the outputs outright (the issue's first sketch): an op's output
carries every difference upstream of it too. The residual adds belong to the
``rms_norm`` family (vLLM fuses the add into its norm), so a patched residual
stream hands the training side all of the inference side's upstream error: on
the demo Qwen3 against vLLM that game gave ``rms_norm`` 215% of the gap and the
other families negative shares. Transplanting the *introduced* error is the
lever's effect; the first-order assumption is that an op's introduced error
depends little on which side's inputs it sees (the same assumption ``locate``'s
replays make). Where the levers interact strongly the two games still differ:
a rescan moves both sides to a third (reference) kernel, this moves the training
side to the inference side's. ``attribute`` confirms with one end-to-end rescan,
every lever applied, and reports both closed fractions.

How a value is changed: the ``Patcher`` is a ``probes.record.Recorder`` (the row
maps, the taps, HF's wrapped RoPE, attention and log_softmax functions and the
``replay.ReplaySpec`` of each op are the recorder's and the engine's, unchanged)
whose ``emit`` writes instead of reading: the op's inputs are rebuilt from stored
rows as ``summary.PathComparer``'s replay rebuilds them (``Layout.to_rows``, the
stored rows over the live ones, ``Layout.from_rows``), the op re-run, and the
live tensor overwritten in place before the model reads it on. A residual add is
read at the next norm's input (a pre-hook), so the residual stream changes too.

When the game is usable (``PatchedGame.prepare``): the training path scored
in this process (not on ranks of its own), and every op of each player's family
that the training path emitted was replayed on stored rows during the scan
(``PathComparer.local``). A scan with a ``--window`` kept the ops beyond it as
row sketches and replayed none of them: ``prepare`` then fetches their whole
rows, and their inputs', in one more pass of the primary inference path on the
scan's tokens (``probes/windowed.py``), checked row by row against the sketches
the scan kept. Anything else falls back to rescans; ``attribute`` says which
game ran and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from logdiff.comparison.cause import FAMILY
from logdiff.diagnosis.settings import ATTRIBUTION_GAMES
from logdiff.probes.record import Recorder

#: attribution's games: end-to-end rescans, or the training forward patched with recorded outputs (the default)
RESCAN, PATCHED = ATTRIBUTION_GAMES


class _PatchedPass:
    """The one "sink" of a patched pass: it marks the pass as wanted, with replays (the engine builds each op's
    ``replay.ReplaySpec``); the patcher's own ``emit`` handles every value."""

    wants_replay = True


class Patcher(Recorder):
    """A recorder on the training engine whose named ops compute like the stored path's: each gets the error the
    stored path's op introduced (``_patch``)."""

    def __init__(self, engine: Any, cmap: Any, seqs: Sequence[Any], response_len: int, path: str,
                 store: Any, boundaries: set[str]):
        sink = [_PatchedPass()]
        super().__init__(engine, cmap, lambda p: sink if p == path else [], list(seqs), response_len)
        self.store = store
        self.boundaries = boundaries
        self.not_patched: dict[str, str] = {}

    def emit(self, name: str, tensor: Any, layout: Any, rmap: Any, spec: Any, owner: str | None = None) -> None:
        if rmap is None or self.pass_ is None or name not in self.boundaries:
            return
        stored = self.store.get(name)
        if stored is None or spec is None:
            self.not_patched[name] = "no stored rows" if stored is None else "the op cannot be replayed here"
            return
        self._paused = True  # the replay's own module calls are not values of this pass
        try:
            self._patch(name, tensor, layout, rmap, spec, stored)
        finally:
            self._paused = False

    def _patch(self, name: str, tensor: Any, layout: Any, rmap: Any, spec: Any, stored: Any) -> None:
        """``live + (stored output - live op on the stored inputs)`` at the rows the stored path has."""
        import torch

        from logdiff.probes.replay import row_index, stored_inputs

        n = len(rmap)
        rebuilt = stored_inputs(spec, self.store, rmap)  # the op's inputs rebuilt from stored rows, as a replay
        if isinstance(rebuilt, str):
            self.not_patched[name] = f"input {rebuilt} was not recorded on the stored path"
            return
        inputs, ok = rebuilt
        oidx = np.nonzero(ok & stored.has(rmap.seq, rmap.pos))[0]
        if not len(oidx):
            return
        with torch.no_grad():
            live = layout.to_rows(tensor.detach(), n).clone()
            at = row_index(oidx, live.device)
            if live.shape[1] != stored.width:
                raise ValueError(f"{name}: the stored rows are {stored.width} wide, the live ones {live.shape[1]}")
            replayed = spec.out_layout.to_rows(spec.run([i.tensor() for i in inputs]), n)[at].float()
            introduced = stored.read(rmap.seq[oidx], rmap.pos[oidx]).to(live.device, torch.float32) - replayed
            live[at] = (live[at].float() + introduced).to(live.dtype)
            tensor.copy_(layout.from_rows(live, like=tensor))


class PatchedGame:
    """``D_p(S)``: the primary pair's metrics with the training forward patched at the families of ``S``.

    ``train``: the scan's training engine; ``record``: the primary pair's probes
    (``probes.session.PairRecord``: the stored inference rows and the comparer
    that compared them); ``infer``: the primary inference path's recorded scores;
    ``fetch(names)``: whole rows of those boundaries from a second pass of the
    inference path (``PairRecord.fetch``'s store and sink), or None where it cannot.
    """

    def __init__(self, train: Any, record: Any, infer: Any, seqs: Sequence[Any], response_len: int, cfg: Any,
                 fetch: Callable[[set[str]], Any] | None = None):
        self.train, self.record, self.infer = train, record, infer
        self.seqs, self.response_len, self.cfg = list(seqs), response_len, cfg
        self.fetch = fetch
        self.store = record.store  # the rows patched ops read: the scan's, with any fetched ones over them
        self.fetched: dict[str, Any] = {}  # what a second pass fetched, for the report
        self.unfetched: str | None = None  # why the ops beyond the window stay unpatched, where a second pass failed
        kinds = {b.name: b.kind for b in record.cmap.boundaries}
        #: family -> the boundaries of that family the training path emitted
        self.boundaries: dict[str, list[str]] = {}
        for name in record.comparer.order:
            family = FAMILY.get(kinds.get(name) or "")
            if family is not None:
                self.boundaries.setdefault(family, []).append(name)
        self.forwards = 0
        self.warnings: list[str] = []  # what the patching recorder warned of (misaligned rows)
        self.not_patched: dict[str, str] = {}  # boundary -> why a patched forward left it as it was

    def prepare(self, families: set[str]) -> dict[str, str]:
        """Each family the stored rows cannot patch, with why (empty: the game is usable); ops a ``--window`` kept
        as sketches are fetched whole first (``_fetch_beyond_window``)."""
        if getattr(self.train, "tensor_parallel_size", 1) != 1 or getattr(self.train, "fsdp_size", 1) != 1:
            return {f: "the training path scored on ranks of its own, not in this process" for f in families}
        replayed = self.record.comparer.local  # the scan replayed these ops on the stored inputs
        unreplayed = {f: [n for n in self.boundaries.get(f, []) if n not in replayed or not replayed[n].elements]
                      for f in families}
        whole = self._fetch_beyond_window({n for names in unreplayed.values() for n in names})
        out = {}
        for f in sorted(families):
            names = self.boundaries.get(f, [])
            missing = [n for n in unreplayed[f] if n not in whole]
            if not names:
                out[f] = "the training path emitted no boundary of this family"
            elif missing and self.unfetched:
                out[f] = f"{len(missing)} of its {len(names)} ops were not replayed in the scan, and {self.unfetched}"
            elif missing:
                out[f] = (f"{len(missing)} of its {len(names)} ops were not replayed on stored inputs in the scan "
                          f"({missing[0]}{', ...' if len(missing) > 1 else ''})")
        return out

    def _fetch_beyond_window(self, names: set[str]) -> set[str]:
        """The ops among ``names`` now held whole, with their inputs, from a second pass: those whose rows or inputs'
        rows the scan's window kept as sketches (nothing when it kept every boundary whole, or no pass can run)."""
        from logdiff.diagnosis.beyond_window import sketched_ops, to_fetch

        beyond = sketched_ops(self.record, names)
        if not beyond or self.fetch is None:
            return set()
        wanted = to_fetch(self.record, beyond, self.record.store)
        store, sink = self.fetch(wanted)
        self.fetched = {"boundaries": len(wanted), "rows_checked": sink.checked,
                        **({"mismatched": dict(sorted(sink.mismatched.items()))} if sink.mismatched else {})}
        if sink.mismatched:  # the second pass computed other values than the scan: its rows cannot stand in
            rows = sum(sink.mismatched.values())
            self.unfetched = (f"the second pass that fetched them did not reproduce the scan ({rows} rows of "
                              f"{len(sink.mismatched)} boundaries differ from the scan's sketches)")
            return set()
        from logdiff.probes.windowed import Overlay

        self.store = Overlay(store, self.record.store)
        return {n for n in beyond if self.store.get(n) is not None
                and all(self.store.get(i) is not None for i in self.record.cmap.get(n).inputs)}

    def metrics(self, families: frozenset[str]) -> dict[str, Any]:
        """The primary pair's metrics (``compare.token_metrics``) with ``families`` patched: one training forward."""
        import contextlib

        from logdiff.comparison.metrics import token_metrics

        names = {n for f in families for n in self.boundaries.get(f, [])}
        patcher = Patcher(self.train, self.record.cmap, self.seqs, self.response_len, self.record.train,
                          self.store, names)
        with contextlib.ExitStack() as stack:
            if self.cfg.consistent:  # the scan's own kernels, as its training path ran
                stack.enter_context(self.train.consistent(self.cfg.consistent_kernels))
            stack.enter_context(patcher)
            scores = self.train.score_primary(self.seqs)
        self.warnings += [w for w in patcher.warnings if w not in self.warnings]
        self.not_patched.update(patcher.not_patched)
        self.forwards += 1
        masks = [s.response_mask for s in self.seqs]
        return token_metrics(scores.logprobs, self.infer.logprobs, scores.top1, self.infer.top1, masks,
                             self.cfg.is_threshold)


    def report(self) -> dict[str, Any]:
        """For the attribution summary: the training forwards run, and what they could not patch."""
        out: dict[str, Any] = {"forwards": self.forwards, **({"fetched": self.fetched} if self.fetched else {})}
        if self.not_patched:
            out["not_patched"] = dict(sorted(self.not_patched.items()))
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


def of_run(run: Any, result: Any, cfg: Any, record: Any) -> PatchedGame | None:
    """The patched game of a measured scan (``pipeline.PathRun`` and its result), or None without the primary
    pair's stored rows or scores."""
    if record is None:
        return None
    infer = next((p for p in run.infers if p.path == result.primary.infer), None)
    if infer is None or run.train.path != result.primary.train:
        return None
    from logdiff.diagnosis.beyond_window import can_replay, second_pass

    owner, fetch = run.engine_of(result.primary.infer), None
    if record.fetch is not None and can_replay(owner):

        def fetch(names: set[str]) -> Any:
            return record.fetch(owner, record.infer, second_pass(owner, cfg, run.sequences), names)

    return PatchedGame(run.train_engine, record, infer, run.sequences, cfg.response_len, cfg, fetch)
