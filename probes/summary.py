"""Streaming summaries of how two paths' values differ at one boundary.

A comparison never keeps the tensors it compares: every aligned chunk of rows
(the rows one forward pass produced, matched to the other path's rows for the
same sequence and position) is reduced on the spot into a ``DiffSummary``:

* ``max_abs_diff`` and ``mean_abs_diff`` (over every element compared);
* ``max_ulp``: the largest distance in units in the last place of the output
  dtype (``ulp_distance``: both values' bit patterns mapped to an ordered
  integer line, so adjacent floats are 1 apart and +0 == -0);
* ``bitwise_equal_fraction`` of elements, and ``rows_equal`` (tokens whose whole
  row is bitwise equal);
* the worst element's sequence and position, and the first unequal row's: the smallest absolute
  position at which any sequence differs, and the smallest sequence that differs there
  (``first_position``, ``first_sequence``; a first divergence names where it *starts*, not
  where it is largest);
* ``per_position``: the largest difference at each absolute position, the
  small vector the boundary x position heatmap is made of.

Memory per summary is O(max positions) floats, independent of the hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from logdiff.records.store import is_run
from logdiff.records.ulps import INT_OF, coarser, dtype_name, ordered_bits, ulp_distance  # noqa: F401 - public here too

#: elements compared per chunk (float64 temporaries of a few MiB, whatever the batch or vocabulary)
CHUNK_ELEMENTS = 1 << 18


@dataclass
class DiffSummary:
    """Running comparison of one boundary between two paths."""

    max_positions: int
    dtype: str | None = None  # dtype the ulps are counted in
    elements: int = 0
    equal_elements: int = 0
    rows: int = 0
    rows_equal: int = 0
    sum_abs_diff: float = 0.0
    max_abs_diff: float = 0.0
    max_ulp: int = 0
    max_abs_ref: float = 0.0  # largest |value| on the reference side, for relative errors
    worst_sequence: int | None = None
    worst_position: int | None = None
    #: the first unequal row: smallest absolute position where any sequence differs, then the smallest such sequence
    first_sequence: int | None = None
    first_position: int | None = None
    nonfinite: int = 0  # elements whose difference is not finite (NaN on both sides counts as equal)
    nonfinite_ref: int = 0  # NaN/inf elements on each side, however they compare
    nonfinite_other: int = 0
    #: -inf elements on each side (of the NaN/inf above): at the sampler's boundaries a mask, not an overflow
    neginf_ref: int = 0
    neginf_other: int = 0
    nonfinite_at: tuple[int, int] | None = None  # (sequence, position) of the first row holding one
    #: compared by row sketches only: ``elements`` counts rows and ``max_abs_diff`` is a lower bound
    sketched: bool = False
    #: fold chunks without a host sync (``device_summary``); automatic for a live side on an accelerator
    on_device: bool = False
    per_position: np.ndarray = field(init=False)
    _pending: Any = field(default=None, init=False, repr=False)  # ``DeviceChunks`` not yet settled

    def __post_init__(self) -> None:
        self.per_position = np.full(self.max_positions, np.nan, dtype=np.float32)

    def settle(self) -> DiffSummary:
        """Fold what ``update`` left on the device into the fields (one transfer); returns self."""
        if self._pending is not None:
            self._pending.settle(self)
        return self

    def update(self, ref: Any, other: Any, seq: np.ndarray, pos: np.ndarray) -> None:
        """Fold in ``[rows, width]`` values of both paths for the given sequences/positions."""
        import torch

        if ref.shape != other.shape:
            raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(other.shape)}")
        if ref.numel() == 0:
            return
        dt = coarser(dtype_name(ref.dtype), dtype_name(other.dtype))
        self.dtype = dt if self.dtype is None else coarser(self.dtype, dt)
        if self.on_device or other.device.type != "cpu":  # a live side on an accelerator: stay there
            from logdiff.probes.device_summary import DeviceChunks

            if self._pending is None:
                self._pending = DeviceChunks(self.max_positions, other.device)
            work = torch.float32 if dt in ("bfloat16", "float16") and self._narrow(ref, other) else torch.float64
            self._pending.fold(ref, other, seq, pos, dt, work)
            return
        # the common case before a divergence, in two passes; a boundary already seen to differ skips the test
        # (the general path below gives an all-equal chunk the same numbers, one pass later)
        if self.equal_elements == self.elements and ref.dtype == other.dtype and torch.equal(ref, other):
            n, rows = ref.numel(), ref.shape[0]
            self.elements += n
            self.equal_elements += n
            self.rows += rows
            self.rows_equal += rows
            top = float(ref.abs().amax())
            if not math.isfinite(top):
                finite = ref[torch.isfinite(ref)]
                top = float(finite.abs().amax()) if finite.numel() else 0.0
                self._count_nonfinite(ref, other, seq, pos)
            self.max_abs_ref = max(self.max_abs_ref, top)
            if self.worst_position is None:
                self.worst_sequence, self.worst_position = int(seq[0]), int(pos[0])
            keep = pos < self.max_positions
            np.fmax.at(self.per_position, pos[keep], np.float32(0.0))
            return
        # differences of 16-bit floats are (all but exactly) representable in fp32; wider types use fp64
        work = torch.float32 if dt in ("bfloat16", "float16") and self._narrow(ref, other) else torch.float64
        a = ref.detach().to(work)
        diff = (a - other.detach().to(work)).abs_()
        row_max = diff.amax(dim=1)
        if bool(torch.isfinite(row_max).all()):
            lo, hi = torch.aminmax(a)
            ref_abs = max(-float(lo), float(hi))
            n_unequal = int(torch.count_nonzero(diff))  # for finite values the same as "bits differ" (+0 == -0)
            if n_unequal:
                if dt in INT_OF:  # equal elements are 0 ulps apart: no need to pick out the unequal ones
                    self.max_ulp = max(self.max_ulp, int(ulp_distance(ref, other, dt).amax()))
                self.sum_abs_diff += float(diff.sum(dtype=torch.float64))
        else:  # NaN/inf somewhere: NaN on both sides counts as equal, anything else as a divergence
            b = other.detach().to(work)
            self._count_nonfinite(a, b, seq, pos)
            both_nan = torch.isnan(a) & torch.isnan(b)
            diff = torch.where(both_nan, torch.zeros_like(diff), diff)
            bad = ~torch.isfinite(diff)
            self.nonfinite += int(bad.sum())
            diff = torch.where(bad, torch.full_like(diff, math.inf), diff)
            row_max = diff.amax(dim=1)
            ok = torch.isfinite(a)
            ref_abs = float(a[ok].abs().max()) if bool(ok.any()) else 0.0
            unequal = diff != 0
            n_unequal = int(unequal.sum())
            if n_unequal:
                if dt in INT_OF:
                    self.max_ulp = max(self.max_ulp, int(ulp_distance(ref[unequal], other[unequal], dt).max()))
                self.sum_abs_diff += float(torch.where(bad, torch.zeros_like(diff), diff).sum(dtype=torch.float64))
        self.rows_equal += int((row_max == 0).sum())
        self.elements += diff.numel()
        self.equal_elements += diff.numel() - n_unequal
        self.rows += diff.shape[0]
        self.max_abs_ref = max(self.max_abs_ref, ref_abs)
        row_max = row_max.to(torch.float64).cpu().numpy()
        self.note_first(row_max != 0, seq, pos)
        worst = int(np.argmax(row_max))
        if self.worst_position is None or row_max[worst] > self.max_abs_diff:
            self.max_abs_diff = float(row_max[worst])
            self.worst_sequence = int(seq[worst])
            self.worst_position = int(pos[worst])
        keep = pos < self.max_positions
        if keep.any():
            # fmax treats the NaN "never seen" marker as missing
            np.fmax.at(self.per_position, pos[keep], row_max[keep].astype(np.float32))

    def update_sketches(self, ref: np.ndarray, other: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> None:
        """Fold in ``[rows, sketch.WIDTH]`` sketches of both paths: a row is equal when its digests are."""
        from logdiff.records.sketch import digest_of, lower_bound

        equal = digest_of(ref) == digest_of(other)
        with np.errstate(invalid="ignore"):
            bound = np.where(equal, 0.0, lower_bound(ref, other))
        finite = np.isfinite(ref[:, 2]) & np.isfinite(other[:, 2])
        seen_unequal = self.rows_equal < self.rows  # before this batch
        self.rows += len(equal)
        self.rows_equal += int(equal.sum())
        self.elements += len(equal)
        self.equal_elements += int(equal.sum())
        self.nonfinite += int((~finite & ~equal).sum())
        self.nonfinite_ref += int((~np.isfinite(ref[:, 2])).sum())
        self.nonfinite_other += int((~np.isfinite(other[:, 2])).sum())
        if self.nonfinite_at is None and not finite.all():
            first = int(np.argmin(finite))
            self.nonfinite_at = (int(seq[first]), int(pos[first]))
        bound = np.where(np.isfinite(bound), bound, 0.0)
        self.sum_abs_diff += float(bound.sum())
        self.max_abs_ref = max(self.max_abs_ref, float(np.nanmax(np.where(np.isfinite(ref[:, 2]), ref[:, 2], 0.0))))
        keep = pos < self.max_positions
        np.fmax.at(self.per_position, pos[keep], bound[keep].astype(np.float32))
        self.note_first(~equal, seq, pos)
        if not equal.all():  # the worst row is an unequal one, even where its bound is 0
            worst = int(np.argmax(np.where(equal, -1.0, bound)))
            if not seen_unequal or bound[worst] > self.max_abs_diff:
                self.max_abs_diff = float(bound[worst])
                self.worst_sequence, self.worst_position = int(seq[worst]), int(pos[worst])
        elif self.worst_position is None:
            self.worst_sequence, self.worst_position = int(seq[0]), int(pos[0])

    def note_first(self, unequal: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> None:
        """Keep the earliest of the ``unequal`` rows (smallest position, then sequence) if it precedes the
        first unequal row seen so far."""
        rows = np.flatnonzero(unequal)
        if not len(rows):
            return
        row = rows[np.lexsort((seq[rows], pos[rows]))[0]]
        self.note_first_row(int(seq[row]), int(pos[row]))

    def note_first_row(self, seq: int, pos: int) -> None:
        """Keep the unequal row (``seq``, ``pos``) if it precedes the first unequal row seen so far."""
        if self.first_position is None or (pos, seq) < (self.first_position, self.first_sequence):
            self.first_sequence, self.first_position = seq, pos

    def _count_nonfinite(self, ref: Any, other: Any, seq: np.ndarray, pos: np.ndarray) -> None:
        import torch

        bad_ref, bad_other = ~torch.isfinite(ref), ~torch.isfinite(other)
        self.nonfinite_ref += int(bad_ref.sum())
        self.nonfinite_other += int(bad_other.sum())
        self.neginf_ref += int((ref == -math.inf).sum())
        self.neginf_other += int((other == -math.inf).sum())
        rows = (bad_ref | bad_other).reshape(ref.shape[0], -1).any(dim=1)
        if self.nonfinite_at is None and bool(rows.any()):
            first = int(rows.nonzero()[0, 0])
            self.nonfinite_at = (int(seq[first]), int(pos[first]))

    @staticmethod
    def _narrow(ref: Any, other: Any) -> bool:
        return all(dtype_name(t.dtype) in ("bfloat16", "float16") for t in (ref, other))

    @property
    def mean_abs_diff(self) -> float:
        return self.sum_abs_diff / self.elements if self.elements else 0.0

    @property
    def bitwise_equal_fraction(self) -> float:
        return self.equal_elements / self.elements if self.elements else 1.0

    @property
    def equal(self) -> bool:
        """True when every compared element was bitwise equal."""
        return self.elements > 0 and self.equal_elements == self.elements

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers (without the per-position vector)."""
        return {
            "elements": self.elements,
            "rows": self.rows,
            "max_abs_diff": self.max_abs_diff,
            "mean_abs_diff": self.mean_abs_diff,
            "max_ulp": self.max_ulp,
            "bitwise_equal_fraction": self.bitwise_equal_fraction,
            "rows_equal_fraction": self.rows_equal / self.rows if self.rows else 1.0,
            "max_abs_ref": self.max_abs_ref,
            "worst_sequence": self.worst_sequence,
            "worst_position": self.worst_position,
            "first_sequence": self.first_sequence,
            "first_position": self.first_position,
            "dtype": self.dtype,
            "nonfinite": self.nonfinite,
            "nonfinite_ref": self.nonfinite_ref,
            "nonfinite_other": self.nonfinite_other,
            **({"sketched": True} if self.sketched else {}),
        }


class PathComparer:
    """Compares a live path against a stored one as the live path runs.

    For every boundary the live path emits, the rows the stored path also
    produced (same sequence and position) are read back from disk and folded
    into ``summaries[name]``. When the live op comes with a ``ReplaySpec``, the
    op is re-run on the stored path's inputs and compared with the stored
    output: ``local[name]`` is the error the op introduces by itself.
    ``replay=False``: compare only (no ``local``; the recorder builds no replays for this sink).
    """

    #: run every replay, also where the stored inputs equal the live ones (a test's control)
    replay_equal_inputs = False

    def __init__(self, store: Any, max_len: int, replay: bool = True):
        self.store = store
        self.max_len = max_len
        self._summaries: dict[str, DiffSummary] = {}
        self._local: dict[str, DiffSummary] = {}
        self.order: list[str] = []  # first-seen order on the live path
        self._seen: set[str] = set()
        self.not_stored: set[str] = set()
        self.replay_skipped: dict[str, str] = {}
        self.wants_replay = replay
        self.replays = {"run": 0, "equal_inputs": 0}  # replays run, and those whose inputs were the live ones

    @property
    def summaries(self) -> dict[str, DiffSummary]:
        """Each boundary's comparison so far (settled: what stayed on the device is read back first)."""
        for summary in self._summaries.values():
            summary.settle()
        return self._summaries

    @property
    def local(self) -> dict[str, DiffSummary]:
        """Each replayed boundary's local error so far (settled like ``summaries``)."""
        for summary in self._local.values():
            summary.settle()
        return self._local

    def emit(self, name: str, rows: Any, rmap: Any, replay: Any = None) -> None:
        """Compare ``rows`` (``[len(rmap), width]``) with the stored path's rows."""
        from logdiff.records.sketch import SUFFIX

        if name.endswith(SUFFIX):
            self._fold_sketches(name[: -len(SUFFIX)], rows, rmap)
            return
        if name not in self._seen:
            self._seen.add(name)
            self.order.append(name)
        stored = self.store.get(name)
        if stored is None:
            self.not_stored.add(name)
            return
        idx = np.nonzero(rmap.valid)[0]
        seq, pos = rmap.seq[idx], rmap.pos[idx]
        here = stored.has(seq, pos)
        if not here.any():
            return
        summ = self._summaries.get(name)
        if summ is None:
            summ = self._summaries[name] = DiffSummary(self.max_len)
        self._fold(summ, stored, rows, idx[here], seq[here], pos[here])
        if replay is not None:
            self._replay(name, stored, rows, rmap, replay)

    def _fold_sketches(self, name: str, rows: Any, rmap: Any) -> None:
        """Compare boundary ``name`` by row sketches (``sketch.py``), where a side kept only those and no whole
        rows were compared: bitwise equality per row, differences as lower bounds."""
        from logdiff.records.sketch import SUFFIX

        summ = self._summaries.get(name)
        stored = self.store.get(name + SUFFIX)
        if stored is None or (summ is not None and not summ.sketched):
            return
        if name not in self._seen:
            self._seen.add(name)
            self.order.append(name)
        self.not_stored.discard(name)
        idx = np.nonzero(rmap.valid)[0]
        here = stored.has(rmap.seq[idx], rmap.pos[idx])
        idx = idx[here]
        if not len(idx):
            return
        if summ is None:
            summ = self._summaries[name] = DiffSummary(self.max_len, sketched=True)
        seq, pos = rmap.seq[idx], rmap.pos[idx]
        summ.update_sketches(stored.read(seq, pos).numpy(), rows[idx].numpy(), seq, pos)

    @staticmethod
    def _fold(summ: DiffSummary, stored: Any, live: Any, idx: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> None:
        """Compare in chunks of rows so the float64 temporaries stay small whatever the batch."""
        step = max(1, CHUNK_ELEMENTS // max(1, int(live.shape[1])))
        first = int(idx[0]) if len(idx) else 0
        contiguous = is_run(idx)  # a slice, not a gather
        on_host = live.device.type == "cpu"
        for a in range(0, len(idx), step):
            b = min(a + step, len(idx))
            if contiguous:
                rows = live[first + a : first + b]
            elif on_host:
                rows = live[idx[a:b]]
            else:  # a gather on an accelerator, its index sent there first (indexing by a host array syncs)
                from logdiff.probes.device_summary import to_device

                rows = live[to_device(idx[a:b], live.device)]
            summ.update(stored.read(seq[a:b], pos[a:b]), rows, seq[a:b], pos[a:b])

    def _replay(self, name: str, stored: Any, live_out: Any, rmap: Any, spec: Any) -> None:
        """Fold the live op's error on the stored inputs into ``local[name]``. Where every stored input row
        equals the live one, the replay would repeat the live call itself: its own output (``live_out``, the
        boundary's live rows) stands in and the op is not run again (on the host; ``replay_equal_inputs``
        forces the run)."""
        import torch
        from logdiff.probes.replay import row_index, stored_inputs

        rebuilt = stored_inputs(spec, self.store, rmap)
        if isinstance(rebuilt, str):
            self.replay_skipped[name] = f"input {rebuilt} was not recorded on the stored path"
            return
        inputs, ok = rebuilt
        ok &= stored.has(rmap.seq, rmap.pos)
        if not ok.any():
            return
        # on an accelerator the test would wait for the device (``device_summary``): there the replay runs
        same = not self.replay_equal_inputs and live_out.device.type == "cpu" and all(
            i.stored is None or torch.equal(i.stored, i.live[row_index(i.rows, i.live.device)]) for i in inputs
        )
        self.replays["equal_inputs" if same else "run"] += 1
        if same:
            out_rows = live_out
        else:
            with torch.no_grad():
                out = spec.run([i.tensor() for i in inputs])
            out_rows = spec.out_layout.to_rows(out, len(rmap))
        oidx = np.nonzero(ok)[0]
        local = self._local.get(name)
        if local is None:
            local = self._local[name] = DiffSummary(self.max_len)
        self._fold(local, stored, out_rows, oidx, rmap.seq[oidx], rmap.pos[oidx])
