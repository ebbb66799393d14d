"""A live scan's window: which boundaries its stores and comparers see whole, and which by row sketches.

By default a scan stores every row of every boundary of its inference paths and
compares the training path against them whole. That is gigabytes of scratch at
a few hundred tokens of a 1.5B model, and grows with the tokens and the layers.
``scan --window N`` keeps, like a capture (``sketch.Window``), whole rows only
for the first ``N`` decoder layers and the records of no layer (embeddings,
final norm, logits, log-softmax): every other boundary reaches the row stores
and the comparers as its row sketch (``name#sketch``: ``sketch.SUFFIX``), made
once per pass and side by ``WindowedSinks``. Such a boundary is compared by
sketches (bitwise equality per row exactly, the size of a difference as a lower
bound, ``summary.PathComparer``) and its op is not replayed.

What a diagnosis needs whole beyond the window it fetches in a second, targeted
pass: ``FetchSink`` keeps whole rows of the boundaries asked for from one more
run of a side (the engine's replay of the scan's own tokens) and checks each
row against the sketch the scan kept of it, so a second pass that does not
reproduce the first is caught, not used (``ProbeSession.fetch``; conformance
and attribution's patched game ask: ``logdiff/diagnosis/beyond_window.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from logdiff.records.sketch import SUFFIX, Window, digest_of


def row_sketches(rows: Any) -> Any:
    """``[rows, sketch.WIDTH]`` float64 sketches of a torch tensor ``[rows, width]`` of logical rows, as a
    torch tensor on the host: numpy's on the host (three times faster there), torch's where the rows live on
    an accelerator (``sketch_device``; the same digest bit for bit)."""
    import torch

    columns = np.arange(rows.shape[1], dtype=np.int64)
    if rows.device.type != "cpu":
        from logdiff.records.sketch_device import sketch_rows

        return sketch_rows(rows, columns).cpu()
    from logdiff.records.bundle_writer import host_array
    from logdiff.records.sketch import sketch

    return torch.from_numpy(sketch(*host_array(rows), columns))


class WindowedSinks:
    """The recorder's sink for ``sinks`` under ``window``: a boundary inside it goes to them whole (with its
    replay spec where a sink wants one), any other as its row sketch, computed once for all of them."""

    def __init__(self, sinks: Sequence[Any], window: Window, cmap: Any):
        self.sinks, self.window, self.cmap = list(sinks), window, cmap
        self.wants_replay = any(getattr(s, "wants_replay", False) for s in self.sinks)

    def full(self, name: str) -> bool:
        boundary = self.cmap.get(name)
        return self.window.full(boundary.layer if boundary is not None else None)

    def emit(self, name: str, rows: Any, rmap: Any, replay_spec: Any = None) -> None:
        if self.full(name):
            for s in self.sinks:
                s.emit(name, rows, rmap, replay_spec if getattr(s, "wants_replay", False) else None)
            return
        sketches = row_sketches(rows)
        for s in self.sinks:
            s.emit(name + SUFFIX, sketches, rmap, None)


class FetchSink:
    """A second pass's sink: whole rows of ``names`` into ``store`` (a ``session.StoreSink``), each row checked
    against the first pass's sketch of it in ``sketched`` (a ``PathStore`` holding ``name#sketch``).
    ``mismatched``: boundary -> rows whose digest differs (the second pass did not reproduce the first there)."""

    wants_replay = False

    def __init__(self, store: Any, sketched: Any, names: Collection[str]):
        self.store, self.sketched, self.names = store, sketched, set(names)
        self.mismatched: dict[str, int] = {}
        self.checked = 0  # rows checked against the first pass's sketches

    def emit(self, name: str, rows: Any, rmap: Any, replay_spec: Any = None) -> None:
        if name not in self.names:
            return
        idx = np.nonzero(rmap.valid)[0]
        if not len(idx):
            return
        seq, pos = rmap.seq[idx], rmap.pos[idx]
        first = self.sketched.get(name + SUFFIX)
        if first is not None:
            here = first.has(seq, pos)
            if here.any():
                mine = row_sketches(rows[idx[here]]).numpy()
                theirs = first.read(seq[here], pos[here]).numpy()
                bad = int((digest_of(mine) != digest_of(theirs)).sum())
                self.checked += int(here.sum())
                if bad:
                    self.mismatched[name] = self.mismatched.get(name, 0) + bad
        self.store.emit(name, rows, rmap)


class Overlay:
    """A path's store with a second pass's whole rows over it: ``get(name)`` from ``fetched`` first; anything else
    (``sequences``, ``num_sequences``, ...) is the store's."""

    def __init__(self, fetched: Any, stored: Any):
        self.fetched, self.stored = fetched, stored

    def get(self, name: str) -> Any:
        got = self.fetched.get(name)
        return got if got is not None else self.stored.get(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stored, name)
