"""A capture bundle's records into a probe session's sinks, and its token logprobs: one side of a comparison.

``logdiff compare`` (``offline.compare_bundles``) feeds both sides' bundles through here; a scan
(``pipeline``) feeds a path that ran elsewhere and was captured (a sharded training path on ranks of its
own) through the same code (``scores_of_capture``), so a captured path and a live one reach the same
sinks. Both import this module, which imports neither.

* ``feed_side``: one bundle, un-sharded record by record (``probes.feed.feed``), into a session's
  sinks for one role's path, and its token scores (``token_scores``: the trainer's own token logprobs
  where the bundle holds them, else its ``log_softmax`` or logits rows);
* ``replay``: one live pass of an engine in this process that only replays each op on the other side's
  inputs, where the live model reproduces the captured values;
* ``response_scores``: the logprobs (and top-1 tokens) of the response tokens, a ``PathScores``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from logdiff.comparison.pairing import TokenScores
from logdiff.records.bundle import Bundle
from logdiff.records.sequences import Sequence
from logdiff.sources.base import PathScores


def scores_of_capture(bundle: Bundle, seqs: list[Sequence], session: Any, role: str, path: str,
                      live: Any = None) -> PathScores:
    """A scan's path that ran elsewhere and was captured (a sharded training path on its own ranks): its
    records fed into the scan's ``session`` (None at ``--depth logprobs``) as ``role``'s path ``path``, and its
    logprobs of the scan's response tokens, read from its own ``log_softmax`` rows. ``live``: an engine of
    the same path in this process, whose ops are replayed where they reproduce the capture (``replay``)."""
    from logdiff.comparison.pairing import match_sequences

    ids = [s.ids for s in seqs]
    matching = match_sequences(bundle.sequence_table(), {((-1,), i): x for i, x in enumerate(ids)})
    scan_index = {c: key[1] for key, c in matching.infer.items()}
    if matching.unmatched["infer"] or any(len(matching.ids[c]) != len(ids[scan_index[c]]) for c in scan_index):
        raise RuntimeError(f"the capture of path {path} does not hold every sequence of the scan whole")
    common = {key: scan_index[c] for key, c in matching.train.items()}
    replays = session is not None and live is not None and role == "train"
    scores, misaligned = feed_side(bundle, common, ids, session, role, path,
                                   (session.keep_rows(path),) if replays else ())
    if misaligned:
        raise RuntimeError(f"the capture of path {path} fed {misaligned} rows another token id than the scan's")
    if replays:
        replay(live, session, path, seqs)
    missing = [i for i, s in enumerate(seqs) if not scores.has[i][len(s.prompt_ids):].all()]
    if missing:
        raise RuntimeError(f"the capture of path {path} has no logprobs for sequences {missing[:5]}")
    return response_scores(scores, seqs, path, "forward")


def response_scores(scores: Any, seqs: list[Sequence], path: str, mode: str) -> PathScores:
    """Path ``path``'s logprobs and top-1 tokens of each sequence's response tokens, from its ``TokenScores``
    (no top-1 tokens from the trainer's own token logprobs: none were given)."""
    top1 = None if isinstance(scores, GivenLogprobs) else [scores.top1[c][len(s.prompt_ids):]
                                                           for c, s in enumerate(seqs)]
    return PathScores(path, mode, [scores.logprobs[c][len(s.prompt_ids):] for c, s in enumerate(seqs)], top1)


def token_scores(bundle: Bundle, ids: list[list[int]]) -> Any:
    """The sink of a side's token logprobs: the trainer's own (``Capture.token_logprobs``: a fused head that
    never calls ``lm_head`` has no logits) where the bundle holds them, which the trainer's loss used; else its
    ``log_softmax`` rows, else its logits (``feed.score_source``)."""
    from logdiff.comparison.pairing import score_source
    from logdiff.probes.capture import TOKEN_LOGPROBS

    if any(TOKEN_LOGPROBS in step["records"] for part in bundle.ranks for step in part.steps):
        return GivenLogprobs(ids, TOKEN_LOGPROBS)
    return TokenScores(ids, score_source(bundle))


class GivenLogprobs(TokenScores):
    """A side's ``token_logprobs`` rows: one column, the logprob of the next token as the trainer computed it
    (no top-1 token: none was given)."""

    def emit(self, name: str, rows: Any, rmap: Any, replay: Any = None) -> None:
        import numpy as np

        if name != self.source:
            return
        values = rows.float().numpy()[:, 0]
        for j in np.nonzero(rmap.valid)[0]:
            s, n = int(rmap.seq[j]), int(rmap.pos[j]) + 1
            if n < len(self.ids[s]):
                self.logprobs[s][n], self.has[s][n] = values[j], True


def feed_side(bundle: Bundle, common: dict[Any, int], ids: list[list[int]], session: Any, role: str,
              path: str, extra: tuple[Any, ...] = (), sketch_also: Collection[str] = (),
              digest: str | None = None) -> tuple[Any, int]:
    """One side's bundle into the session's sinks for ``role``'s path ``path`` (none without a session) and
    ``extra`` sinks, with the sketches of the whole records ``sketch_also`` names (the other side kept only
    those, with their ``digest``): its token scores, and how many rows disagreed with their sequence's token ids."""
    from logdiff.comparison.pairing import feed, reductions

    scores = token_scores(bundle, ids)
    sinks = session.sinks(role, path, dict(bundle.meta.get("owners") or {})) if session is not None else []
    misaligned = feed(bundle, common, ids, [*sinks, *extra, scores], sketch_also, digest)
    if session is not None:
        session.reductions[role] = reductions(bundle, session.cmap)
    return scores, misaligned


def replay(engine: Any, session: Any, path: str, seqs: list[Sequence], rerun: Any = None) -> None:
    """One live pass of ``engine`` over the common sequences that only replays (``feed.ReplaySink``): each op
    re-run on the inference side's inputs where the live model reproduces the training bundle's values.

    The pass is ``engine.score`` (a batch of logdiff's own), or, with ``rerun`` (a ``CapturedCall``), the captured
    step's own call run again: the trainer's function on the arguments it was given, so each op runs as the
    captured step ran it (dtype, autocast, padding and positions, attention implementation, head), and each
    forward's rows are those of the bundle's step it repeats."""
    from logdiff.comparison.locate import named
    from logdiff.comparison.pairing import ReplaySink
    from logdiff.probes.record import Recorder

    kept = session.keep_rows(path)
    sinks = [ReplaySink(comparer, kept) for (train, _), comparer in session.comparers.items() if train == path]
    if rerun is None:
        with Recorder(engine, session.cmap, lambda _path: sinks, seqs, 0):
            engine.score(seqs)
    else:
        with Recorder(engine, session.cmap, lambda _path: sinks, seqs, 0, rows=rerun.rows) as rec:
            rec.begin_pass(path, list(range(len(seqs))))
            rerun.run()
        session.warnings.extend(rerun.warnings())
    unfaithful = list(dict.fromkeys(n for sink in sinks for n in sink.unfaithful))
    if unfaithful:
        how = "of the captured step's own call, run again," if rerun is not None else "in this process"
        session.warnings.append(f"the {path} ops {how} do not reproduce the captured {path} path at "
                                f"{len(unfaithful)} boundaries ({named(unfaithful, 4)}), so those were not replayed")


class CapturedCall:
    """A captured step's own call, to be run again for the replay (``replay``): ``run`` calls the trainer's function
    on the arguments it was captured with (an RL framework's integration holds them: TRL's
    ``_get_per_token_logps_and_entropies``), in the same grad and autocast state, so every forward repeats one step
    of the training bundle; ``rows`` is the recorder's row map of each forward, read from that step's row table
    (its token ids, positions from 0 and validity, the capture's sequence ids mapped to the comparison's).

    A forward whose token ids are not the next step's (a trainer whose call is not a pure function of its
    arguments) has no valid rows and is named in ``warnings``; so is a call that ran fewer forwards."""

    def __init__(self, call: Any, bundle: Bundle, common: dict[Any, int]):
        self.call = call
        self.bundle, self.common = bundle, common
        groups = bundle.groups()
        self.group = groups[0] if len(groups) == 1 else None  # one tp group: the ranks this process recorded
        self.step = 0
        self.misfed: list[int] = []  # forwards that fed other tokens than the step they repeat

    def run(self) -> Any:
        self.step, self.misfed = 0, []
        return self.call()

    def rows(self, args: tuple, kwargs: dict) -> Any:
        import numpy as np

        from logdiff.probes.align import RowMap

        ids = kwargs.get("input_ids", args[0] if args else None)
        flat = ids.detach().reshape(-1).cpu().numpy()
        forward, self.step = self.step, self.step + 1
        table = (self.bundle.part_of(self.group).table(forward)
                 if self.group is not None and forward < len(self.bundle.part_of(self.group).steps) else None)
        if table is None or not np.array_equal(table["tokens"], flat):
            self.misfed.append(forward)
            zero = np.zeros(len(flat), dtype=np.int64)
            return RowMap(zero, zero.copy(), np.zeros(len(flat), dtype=bool))
        known = {seq: c for (group, seq), c in self.common.items() if group == self.group}
        seq = np.array([known.get(int(s), -1) for s in table["sequences"]], dtype=np.int64)
        valid = table["valid"].astype(bool) & (seq >= 0)
        return RowMap(np.where(valid, seq, 0), table["positions"].astype(np.int64), valid)

    def warnings(self) -> list[str]:
        out = []
        if self.group is None:
            out.append(f"the captured step was not run again for the replay: its bundle holds {len(self.bundle.groups())} "
                       "tp groups, and this process ran one")
        elif self.misfed:
            out.append(f"the captured step's own call, run again, fed other tokens than its capture at forwards "
                       f"{self.misfed[:5]}: those were not replayed")
        elif self.step < len(self.bundle.part_of(self.group).steps):
            out.append(f"the captured step's own call, run again, ran {self.step} forwards where its capture has "
                       f"{len(self.bundle.part_of(self.group).steps)} steps: the others were not replayed")
        return out
