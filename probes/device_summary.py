"""A boundary's running comparison kept on the accelerator: no host sync per chunk.

``DiffSummary.update`` on the CPU reads each chunk's numbers back at once
(``float``, ``int``, ``torch.equal``): on an accelerator every such read waits
for the device. ``DeviceChunks`` instead reduces each chunk, on the device, to
one small float64 vector of statistics (``STATS``) and keeps the vectors there,
with the largest difference per position in a device tensor; ``settle`` reads
them all back with one transfer and folds them into the summary's fields, in
the order the chunks came, with the same rules as the host path (the first
worst row wins ties, the first non-finite row is the one reported, the first
unequal row is the one of smallest position, then sequence). The stored
side's rows move to the live side's device, never the other way.

``DiffSummary(on_device=True)`` takes this path on the CPU too, which is how the
tests prove both paths give the same summary.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: what each chunk's statistics vector holds, in order
STATS = ("unequal", "nonfinite", "sum_abs_diff", "rows_equal", "max_abs_ref", "nonfinite_ref", "nonfinite_other",
         "worst_value", "worst_row", "first_nonfinite_row", "max_ulp", "first_unequal_row", "neginf_ref",
         "neginf_other")


class DeviceChunks:
    """The statistics of the chunks folded since the last ``settle``, as device tensors."""

    def __init__(self, max_positions: int, device: Any):
        import torch

        self.per_position = torch.full((max_positions,), -math.inf, dtype=torch.float64, device=device)
        self.device = device
        self.stats: list[Any] = []  # one float64 vector (``STATS``) per chunk
        self.rows: list[tuple[np.ndarray, np.ndarray, int]] = []  # (seq, pos, elements) of each chunk, on the host

    def fold(self, ref: Any, other: Any, seq: np.ndarray, pos: np.ndarray, dtype: str | None, work: Any) -> None:
        """Reduce one chunk (``[rows, width]`` on both sides, ``other`` on ``self.device``) without a host sync."""
        import torch

        from logdiff.records.ulps import INT_OF, ulp_distance

        ref = ref.to(self.device, non_blocking=True)  # from the host without waiting on the device
        a, b = ref.detach().to(work), other.detach().to(work)
        finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
        diff = (a - b).abs_()
        diff = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(diff), diff)  # NaN on both: equal
        bad = ~torch.isfinite(diff)
        marked = torch.where(bad, torch.full_like(diff, math.inf), diff)
        row_max = marked.amax(dim=1)
        unequal = marked != 0
        odd_rows = (~finite_a | ~finite_b).reshape(a.shape[0], -1).any(dim=1)
        # each row's rank in (position, sequence) order, computed on the host: the first unequal row is the
        # unequal row of the smallest rank (meaningful where the chunk has an unequal element)
        rank = np.empty(len(seq), dtype=np.int64)
        rank[np.lexsort((seq, pos))] = np.arange(len(seq))
        rank_here = to_device(rank, self.device)
        first_unequal = torch.where(row_max != 0, rank_here, len(seq)).argmin()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        ulp = zero
        if dtype in INT_OF:
            ulp = torch.where(unequal, ulp_distance(ref, other, dtype), 0).amax().to(torch.float64)
        stats = [
            unequal.sum(), bad.sum(), torch.where(bad, torch.zeros_like(diff), diff).sum(dtype=torch.float64),
            (row_max == 0).sum(), torch.where(finite_a, a.abs(), torch.zeros_like(a)).amax(),
            (~finite_a).sum(), (~finite_b).sum(), row_max.amax(), row_max.argmax(),
            torch.where(odd_rows.any(), odd_rows.to(torch.int8).argmax(), -1), ulp, first_unequal,
            (a == -math.inf).sum(), (b == -math.inf).sum(),
        ]
        self.stats.append(torch.stack([s.to(torch.float64) for s in stats]))
        self.rows.append((seq, pos, diff.numel()))
        keep = pos < len(self.per_position)
        if keep.any():
            where, rows = (to_device(x, self.device) for x in (pos[keep], np.nonzero(keep)[0]))
            self.per_position.scatter_reduce_(0, where, row_max[rows].double(), "amax")

    def settle(self, summary: Any) -> None:
        """Fold every pending chunk into ``summary``'s fields (one read from the device), then forget them."""
        import torch

        if not self.stats:
            return
        table = torch.stack(self.stats).cpu().numpy()
        per_position = self.per_position.cpu().numpy()
        for row, (seq, pos, elements) in zip(table, self.rows):
            s = dict(zip(STATS, row))
            summary.elements += elements
            summary.equal_elements += elements - int(s["unequal"])
            summary.rows += len(seq)
            summary.rows_equal += int(s["rows_equal"])
            summary.nonfinite += int(s["nonfinite"])
            summary.nonfinite_ref += int(s["nonfinite_ref"])
            summary.nonfinite_other += int(s["nonfinite_other"])
            summary.neginf_ref += int(s["neginf_ref"])
            summary.neginf_other += int(s["neginf_other"])
            summary.sum_abs_diff += float(s["sum_abs_diff"])
            summary.max_abs_ref = max(summary.max_abs_ref, float(s["max_abs_ref"]))
            summary.max_ulp = max(summary.max_ulp, int(s["max_ulp"]))
            worst = int(s["worst_row"])
            if summary.worst_position is None or s["worst_value"] > summary.max_abs_diff:
                summary.max_abs_diff = float(s["worst_value"])
                summary.worst_sequence, summary.worst_position = int(seq[worst]), int(pos[worst])
            if s["unequal"] > 0:
                row = int(s["first_unequal_row"])
                summary.note_first_row(int(seq[row]), int(pos[row]))
            first = int(s["first_nonfinite_row"])
            if summary.nonfinite_at is None and first >= 0:
                summary.nonfinite_at = (int(seq[first]), int(pos[first]))
        seen = per_position > -math.inf
        summary.per_position[seen] = np.fmax(summary.per_position[seen], per_position[seen].astype(np.float32))
        self.stats, self.rows = [], []
        self.per_position.fill_(-math.inf)


def to_device(index: np.ndarray, device: Any) -> Any:
    """A host index array on ``device``, copied without waiting for the device (no host sync)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(device, non_blocking=True)
