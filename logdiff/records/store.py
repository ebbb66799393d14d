"""One path's boundary values on disk, addressed by (sequence, position).

The path that runs first in a scan is written here; the path that runs second
is compared against it on the spot (``summary.PathComparer``), so neither
path's values accumulate in memory. Each boundary is one flat file of
``num_sequences x max_len`` rows of ``width`` values in the engine's own dtype
(bfloat16 is stored as its raw 16-bit pattern), written and read with
``os.pwrite``/``os.pread`` at row offsets. Plain file I/O, not ``np.memmap``:
mapped pages would count towards the process's resident memory as the file
fills, page-cache pages do not.

A ``present`` mask per boundary records which rows were written (decode paths
never feed the last response token; vLLM computes logits only at sampled rows).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

_RAW = {"bfloat16": ("int16", 2), "float16": ("float16", 2), "float32": ("float32", 4), "float64": ("float64", 8)}


def _runs(seq: np.ndarray, pos: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """Group rows into runs of one sequence with consecutive positions: (seq, first pos, count, row ids)."""
    order = np.lexsort((pos, seq))
    s, p = seq[order], pos[order]
    breaks = np.flatnonzero((s[1:] != s[:-1]) | (p[1:] != p[:-1] + 1)) + 1
    starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [len(order)]))
    return [(int(s[a]), int(p[a]), int(b - a), order[a:b]) for a, b in zip(starts, ends) if b > a]


def is_run(idx: np.ndarray) -> bool:
    """Whether row ids are one ascending run (``a, a + 1, ...``): a slice, not a gather."""
    return len(idx) > 0 and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and bool((np.diff(idx) == 1).all())


def _rows(data: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``data[idx]`` as one C-contiguous block: a view where ``idx`` is a run of rows, else a copy."""
    return data[int(idx[0]) : int(idx[-1]) + 1] if is_run(idx) else np.ascontiguousarray(data[idx])


class RowStore:
    """``[num_sequences, max_len, width]`` values of one boundary, on disk."""

    #: rows held back to write together (per boundary: a few hundred boundaries stay within ~100 MB)
    BUFFER_BYTES = 256 * 1024

    def __init__(self, path: Path, num_sequences: int, max_len: int, width: int, dtype: str):
        if dtype not in _RAW:
            raise ValueError(f"cannot store dtype {dtype}")
        self.path = Path(path)
        self.num_sequences, self.max_len, self.width, self.dtype = num_sequences, max_len, width, dtype
        self._np_dtype, self._itemsize = _RAW[dtype]
        self.present = np.zeros((num_sequences, max_len), dtype=bool)
        self._prefix: np.ndarray | None = None  # cached running AND of ``present`` along positions
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (seq, pos, rows) not yet in the file
        self._pending_bytes = 0
        self.written_bytes = 0  # bytes written to the file so far (the scan's scratch: ``ScanResult.scratch_bytes``)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, num_sequences * max_len * width * self._itemsize)

    def _offset(self, seq: int, pos: int) -> int:
        return (seq * self.max_len + pos) * self.width * self._itemsize

    def _to_numpy(self, rows: Any) -> np.ndarray:
        import torch

        t = rows.detach().to(getattr(torch, self.dtype)).contiguous()
        if self.dtype == "bfloat16":
            t = t.view(torch.int16)
        return t.cpu().numpy()

    def _to_torch(self, arr: np.ndarray) -> Any:
        import torch

        t = torch.from_numpy(arr)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t

    def in_range(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return (seq >= 0) & (seq < self.num_sequences) & (pos >= 0) & (pos < self.max_len)

    def write(self, seq: np.ndarray, pos: np.ndarray, rows: Any) -> None:
        """Store ``rows[i]`` at ``(seq[i], pos[i])``; rows out of range are dropped.

        Small writes (a decode step's few rows) wait in a buffer of at most ``BUFFER_BYTES`` and reach the
        file together, as long runs of positions (one ``pwrite`` per run, not per step); ``read`` and
        ``close`` write what waits first. ``has`` answers at once.
        """
        keep = self.in_range(seq, pos)
        if not keep.any():
            return
        seq, pos = seq[keep], pos[keep]
        data = self._to_numpy(rows[np.nonzero(keep)[0]] if not keep.all() else rows)
        if data.shape[1] != self.width:
            raise ValueError(f"{self.path.name}: width {data.shape[1]} != {self.width}")
        self.present[seq, pos] = True
        self._prefix = None
        if data.nbytes >= self.BUFFER_BYTES:
            self._flush()
            self._write(seq, pos, data)
            return
        self._pending.append((seq, pos, data.copy()))  # a copy: the rows may view an engine buffer it reuses
        self._pending_bytes += data.nbytes
        if self._pending_bytes >= self.BUFFER_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        parts, self._pending, self._pending_bytes = self._pending, [], 0
        if len(parts) == 1:
            self._write(*parts[0])
            return
        self._write(*(np.concatenate(x) for x in zip(*parts)))  # later rows of a position after earlier ones

    def _write(self, seq: np.ndarray, pos: np.ndarray, data: np.ndarray) -> None:
        for s, p, _n, idx in _runs(seq, pos):
            self.written_bytes += os.pwrite(self._fd, _rows(data, idx), self._offset(s, p))  # the array's own buffer

    def read(self, seq: np.ndarray, pos: np.ndarray) -> Any:
        """Rows at ``(seq[i], pos[i])`` as a torch tensor ``[n, width]`` (unwritten rows are zeros)."""
        self._flush()
        out = np.empty((len(seq), self.width), dtype=self._np_dtype)
        row_bytes = self.width * self._itemsize
        for s, p, n, idx in _runs(seq, pos):
            if is_run(idx):  # straight into the output's rows
                os.preadv(self._fd, [memoryview(out[int(idx[0]) : int(idx[0]) + n]).cast("B")], self._offset(s, p))
                continue
            buf = os.pread(self._fd, n * row_bytes, self._offset(s, p))
            out[idx] = np.frombuffer(buf, dtype=self._np_dtype).reshape(n, self.width)
        return self._to_torch(out)

    def has(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Which of the rows were written."""
        ok = self.in_range(seq, pos)
        out = np.zeros(len(seq), dtype=bool)
        out[ok] = self.present[seq[ok], pos[ok]]
        return out

    def has_prefix(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Which rows have every position ``0..pos`` of their sequence written (causal inputs)."""
        ok = self.in_range(seq, pos)
        if self._prefix is None:
            self._prefix = np.logical_and.accumulate(self.present, axis=1)
        out = np.zeros(len(seq), dtype=bool)
        out[ok] = self._prefix[seq[ok], pos[ok]]
        return out

    def close(self) -> None:
        if self._fd >= 0:
            self._pending, self._pending_bytes = [], 0  # the files are deleted with the store: nothing to keep
            os.close(self._fd)
            self._fd = -1


class PathStore:
    """Every boundary of one path, one ``RowStore`` each, in a directory."""

    def __init__(self, root: Path, path: str, num_sequences: int, max_len: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.num_sequences, self.max_len = num_sequences, max_len
        self.boundaries: dict[str, RowStore] = {}
        self.order: list[str] = []  # first-seen order
        self.misaligned = 0

    def emit(self, name: str, rows: Any, seq: np.ndarray, pos: np.ndarray) -> None:
        store = self.boundaries.get(name)
        if store is None:
            from logdiff.records.ulps import dtype_name

            file = self.root / f"{len(self.order):04d}.bin"
            store = RowStore(file, self.num_sequences, self.max_len, int(rows.shape[1]), dtype_name(rows.dtype))
            self.boundaries[name] = store
            self.order.append(name)
        store.write(seq, pos, rows)

    def get(self, name: str) -> RowStore | None:
        return self.boundaries.get(name)

    @property
    def written_bytes(self) -> int:
        """Bytes written to this path's files so far."""
        return sum(s.written_bytes for s in self.boundaries.values())

    def close(self) -> None:
        """Close and delete the files."""
        for s in self.boundaries.values():
            s.close()
        shutil.rmtree(self.root, ignore_errors=True)
