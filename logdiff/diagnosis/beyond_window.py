"""What a diagnosis fetches beyond a scan's ``--window``: whole rows, from a second pass of a side.

A scan with ``--window N`` kept each boundary past its first N decoder layers as
row sketches (``probes/windowed.py``): exact per-row equality, no values. Two
steps of the diagnosis need values there:

* conformance judges the ops that introduce error against their exact functions
  on both sides' rows of the first ``CONFORMANCE_SEQUENCES`` sequences:
  ``for_conformance`` fetches those whose rows or inputs lie beyond the window
  from one more pass of each side. Past the first divergence every op beyond the
  window has inputs that differ and no replay: locate cannot separate what each
  introduces, and conformance does not fetch them all (it would be the whole
  record again, two more passes for every scan); a wider window judges them;
* attribution's patched game replays every op of its families: ``PatchedGame.prepare``
  fetches those from one more pass of the inference side (``second_pass``).

A second pass is the engine's replay of the scan's own tokens, as a rescan runs
it, under the scan's consistent kernels. ``ProbeSession.fetch`` checks every row
it keeps against the sketch the scan kept of it: a pass that does not reproduce
the scan is not used, and the diagnosis says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from logdiff.records.sketch import SUFFIX


def can_replay(engine: Any) -> bool:
    """Whether a second pass of ``engine`` can be recorded here: it scores in this process (not on ranks of its
    own) and replays given tokens as it sampled them."""
    in_process = getattr(engine, "tensor_parallel_size", 1) == 1 and getattr(engine, "fsdp_size", 1) == 1
    return in_process and engine.replays_as_sampled


def second_pass(engine: Any, cfg: Any, seqs: list[Any]) -> Callable[[Callable[[], Any]], Any]:
    """``engine``'s primary path on the scan's tokens, recorded inside ``recording()`` (``ProbeSession.fetch``),
    with the scan's consistent kernels installed first where it had them (as the scan installed them: the
    recorder wraps the functions they put in place)."""

    def run(recording: Callable[[], Any]) -> Any:
        with contextlib.ExitStack() as stack:
            if cfg.consistent:
                stack.enter_context(engine.consistent(cfg.consistent_kernels))
            stack.enter_context(recording())
            return engine.score_primary(seqs)

    return run


def _read_from(record: Any, name: str) -> tuple[str, ...]:
    """The boundaries a check or replay of ``name`` reads: itself, its inputs, and for an MoE block its layer's
    router (the routing each side made)."""
    from logdiff.diagnosis.conformance import layer_router

    b = record.cmap.get(name)
    router = layer_router(record.cmap, b.layer) if b.kind == "moe" else None
    return (name, *b.inputs, *((router,) if router else ()))


def only_sketched(stored: Any, name: str) -> bool:
    """Whether ``stored`` kept boundary ``name`` as row sketches only (beyond the scan's window)."""
    return stored.get(name) is None and stored.get(name + SUFFIX) is not None


def sketched_ops(record: Any, names: Iterable[str]) -> set[str]:
    """The ops among ``names`` whose rows, or whose inputs' rows, the scan kept as sketches only."""
    return {n for n in names if record.cmap.get(n) is not None
            and any(only_sketched(record.store, m) for m in _read_from(record, n))}


def to_fetch(record: Any, ops: set[str], stored: Any) -> set[str]:
    """What ``ops`` read (``_read_from``) that ``stored`` kept as sketches only."""
    return {m for n in ops for m in _read_from(record, n) if only_sketched(stored, m)}


def for_conformance(record: Any, names: Iterable[str], train: Any, infer: Any, cfg: Any,
                    warnings: list[str], progress: Callable[..., None]) -> Any:
    """``record`` with the rows of ``names`` beyond the window (and their inputs) fetched from one more pass of each
    side, over its stores, for conformance; ``record`` itself where nothing lies beyond or nothing can be fetched."""
    from logdiff.probes.windowed import Overlay

    far = sketched_ops(record, names)
    if not far or record.fetch is None or record.train_store is None:
        return record
    sides = {"infer": (infer, record.infer, record.store), "train": (train, record.train, record.train_store)}
    if not all(can_replay(engine) for engine, _, _ in sides.values()):
        warnings.append(f"{len(far)} ops beyond the window were not checked against their exact functions: "
                        "a side scores on ranks of its own or cannot replay the scan's tokens as it sampled them")
        return record
    kept = record.train_store.sequences
    progress(f"fetching the rows of {len(far)} ops beyond the window for conformance: one more pass of each side",
             phase="fetch")
    fetched, bad = {}, {}
    for role, (engine, path, stored) in sides.items():
        store, sink = record.fetch(engine, path, second_pass(engine, cfg, record.seqs),
                                   to_fetch(record, far, stored), role=role, sequences=kept)
        fetched[role] = Overlay(store, stored)
        bad.update({f"{role}:{n}": k for n, k in sink.mismatched.items()})
    if bad:
        warnings.append(f"{len(far)} ops beyond the window were not checked against their exact functions: "
                        f"the second pass did not reproduce the scan ({sum(bad.values())} rows differ from its "
                        f"sketches, first at {min(bad)})")
        return record
    return replace(record, store=fetched["infer"], train_store=fetched["train"])
