"""Writing one rank's part of a capture bundle, off the critical path of the step that records it.

The bundle format is ``bundle.py``'s (the reader's docstring describes it). A
capture records from inside the user's forward pass, so everything the writer
does there is time the training step waits for. ``BundleWriter`` therefore
splits a record in two:

* **in the hook** (``record``): nothing that waits for a device. On an
  accelerator a record outside the capture's window is sketched there
  (``sketch_device.sketch_rows``: five float64 values per row) and a whole record
  is copied there; on the host a whole record is copied (one contiguous copy:
  the engine may overwrite the tensor later, vLLM's fused residual add does so
  in place) and a sketched one is copied for the thread to sketch while the
  writer's host copies stay within ``hold_bytes``, else sketched in the hook
  (numpy's blocked sketch: no copy);
* **in the writer's thread** (``background=True``): the device-to-host copies,
  the host sketches, bfloat16's bit view, the step's safetensors file and the
  manifest. Steps are queued in order and written in order. The thread runs at
  the lowest CPU priority (``phases.lower_priority``): where the training fills
  every core, the steps after a capture lend it what they leave, and the step
  that recorded does not wait for it.

Memory stays bounded on two counts: at most ``pending`` steps wait, and the host
copies of the steps recorded but not written stay within ``hold_bytes`` (by
default ``HOLD_SHARE`` of the process's peak resident memory when the writer
starts: a capture left on in a loop costs a tenth more memory at most, beyond
one step's whole records); past either, ``end_step`` waits for the thread. On a
CPU the copies a thread would sketch buy little time for their memory, since a
step uses every core (docs/capture.md, "An FSDP2 trainer": a quarter gigabyte
of them cost 1.48x the uncaptured peak; within the share, 1.19x, at 1.14x the
time instead of 1.01x), so the share is small. Device copies are not counted.

The step's manifest entry is made at ``end_step`` in the caller's thread (so the
caller sees ``manifest["steps"]`` grow as before), but the bundle on disk lists
only steps whose file has been written: a run killed at any moment leaves a
readable bundle of its written steps (at most ``pending`` recorded steps lost).
While the writer is open, a written step's entry is appended to the rank's step
log (``STEP_LOG``, one JSON line each) and ``manifest.json`` holds the layout and
metadata with ``"step_log"`` naming the log, rewritten only when the metadata
changes; closing writes the manifest whole, its steps inline, and removes the log.
Rewriting the whole manifest after every step instead costs time quadratic in
the steps (a rollout engine records one step per decode step).
An error in the thread (a full disk) is raised by the next ``end_step``, by
``close`` or by ``wait``. ``close(wait=False)`` returns at once and lets the thread
finish the bundle while the step goes on (the interpreter's exit waits for it).
``background=False`` (a converter writing from files) writes each step in the
calling thread.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.phases import lower_priority, timed
from logdiff.records.layout import ParallelLayout, Placement
from logdiff.records.sketch import WIDTH

FORMAT = "logdiff-capture"
VERSION = 1
ROLES = ("train", "infer")
RESERVED = ("tokens", "positions", "sequences", "valid")
#: steps recorded but not yet written that a background writer holds before ``end_step`` waits: a rollout engine
#: records one per decode step, a few rows each (memory is bounded by ``hold_bytes`` all the same)
PENDING = 16
#: the share of the process's peak resident memory at its start a background writer may hold in host copies
HOLD_SHARE = 0.1
#: an open writer's log of its written steps' manifest entries (one JSON object per line), beside manifest.json
STEP_LOG = "steps.jsonl"


def _umask() -> int:
    """The process's umask, read without changing it where the kernel says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def file_mode() -> int:
    """The mode the user's umask gives a new file (``0o644`` under the usual ``022``): one mode for everything a
    capture writes, so a bundle copied to a shared place reads for a teammate as the user's other files do.
    safetensors writes its files ``0600`` whatever the umask; the writer sets this mode on each step file."""
    return 0o666 & ~_umask()


def usual_modes(directory: Path) -> None:
    """Give ``directory`` and the files in it the modes the user's umask gives new ones: a model or checkpoint
    written in a ``mkdtemp`` staging directory (``0700``) by writers that make ``0600`` files, then renamed into
    place, reads as the user's other files do."""
    mask = _umask()
    directory.chmod(0o777 & ~mask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~mask)


def write_json(path: Path, data: dict[str, Any] | str) -> None:
    """Write ``data`` (or its JSON text) to ``path`` atomically (ranks share bundle.json: each its own temporary)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data, indent=1))  # insertion order kept
    os.replace(tmp, path)


def host_array(tensor: Any) -> tuple[np.ndarray, str]:
    """A torch tensor (or numpy array) as a contiguous host numpy array and the dtype name it holds (bfloat16
    as its raw 16-bit pattern, ``int16``: numpy has no bfloat16)."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor), str(tensor.dtype)
    import torch

    t = tensor.detach()
    if hasattr(t, "to_local"):  # a DTensor: this rank's piece
        t = t.to_local()
    t = t.cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy(), dtype


@dataclass
class _Kept:
    """One record between ``record`` and its step's file: what is kept of it, and its manifest entry's facts."""

    value: Any  # the sketches, a private copy of the tensor, or (``columns`` set) a host copy still to sketch
    dtype: str
    placement: Placement
    sketched: bool
    shape: list[int]
    columns: np.ndarray | None = None  # the writer's thread sketches ``value`` over these logical columns
    nbytes: int = 0  # host bytes held until the step is written

    def stored(self) -> Any:
        if self.columns is None:
            return self.value
        from logdiff.records.sketch import sketch

        raw, dtype = host_array(self.value)
        return sketch(raw.reshape(raw.shape[0], -1), dtype, self.columns)


def _sketch_small_together(arrays: dict[str, Any]) -> None:
    """Sketch the step's small records still to sketch in one call per dtype and columns, in place: a decode step
    records hundreds of boundaries of a few rows each, and numpy's fixed cost per call, not the elements, is then
    what a sketch costs. Rows are sketched independently, so the values are each record's own; a record of at
    least ``sketch.BLOCK_ELEMENTS`` is sketched alone (no copy of it is made)."""
    from logdiff.records.sketch import BLOCK_ELEMENTS, sketch

    groups: dict[tuple[str, int], list[tuple[str, np.ndarray]]] = {}
    for name, kept in arrays.items():
        if isinstance(kept, _Kept) and kept.columns is not None and kept.value.numel() < BLOCK_ELEMENTS:
            raw = host_array(kept.value)[0]
            groups.setdefault((kept.dtype, id(kept.columns)), []).append((name, raw.reshape(raw.shape[0], -1)))
    for (dtype, _), members in groups.items():
        if len(members) < 2:
            continue
        columns = arrays[members[0][0]].columns
        together = sketch(np.concatenate([raw for _, raw in members]), dtype, columns)
        start = 0
        for name, raw in members:
            arrays[name] = together[start : start + raw.shape[0]]
            start += raw.shape[0]


def _default_hold() -> int:
    """``HOLD_SHARE`` of the process's peak resident memory so far (nothing held where it cannot be read)."""
    from logdiff.phases import peak_rss_bytes

    return int(HOLD_SHARE * (peak_rss_bytes() or 0))


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` as ``bfloat16`` (a record's dtype name; once per dtype: the hooks run per record)."""
    return str(dtype).removeprefix("torch.")


def _snapshot(tensor: Any, placement: Placement, sketch_columns: np.ndarray | None, defer: int,
              private: bool = False) -> _Kept:
    """What a record keeps of ``tensor`` until the writer stores it, never waiting for a device: on an accelerator
    the row sketches or a private copy, on its device; on the host a private copy, sketched by the writer's
    thread when ``defer`` bytes (what the writer's ``hold_bytes`` leave) hold it, else sketched now."""
    sketched = sketch_columns is not None
    if isinstance(tensor, np.ndarray):
        array, dtype = host_array(tensor)
        if sketched:
            from logdiff.records.sketch import sketch

            array = sketch(array.reshape(array.shape[0], -1), dtype, sketch_columns)
        return _Kept(array, dtype, placement, sketched, list(array.shape))
    import torch

    t = tensor.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    dtype = _dtype_name(t.dtype)
    rows = t.reshape(t.shape[0], -1) if sketched else t
    host = t.is_cpu
    nbytes = t.numel() * t.element_size() if host else 0
    if sketched and host and nbytes > defer:  # sketched now, by numpy (on a CPU, faster than ``sketch_rows``)
        from logdiff.records.sketch import sketch

        with timed("sketches (in the hook)"):
            kept = sketch(host_array(rows)[0], dtype, sketch_columns)
        return _Kept(kept, dtype, placement, True, list(kept.shape), nbytes=kept.nbytes)
    if sketched and not host:
        from logdiff.records.sketch_device import sketch_rows

        with timed("sketches (on the device)"):
            kept = sketch_rows(rows, sketch_columns)
        return _Kept(kept, dtype, placement, True, list(kept.shape))
    if private and rows.is_contiguous():
        copy = rows  # the caller's own copy: nothing else writes it
    else:
        with timed("copies (in the hook)" if host else "copies (on the device)"):
            copy = rows.clone(memory_format=torch.contiguous_format)  # the engine may overwrite ``t`` later
    if sketched:
        return _Kept(copy, dtype, placement, True, [int(rows.shape[0]), WIDTH], sketch_columns, nbytes)
    return _Kept(copy, dtype, placement, False, list(copy.shape), nbytes=nbytes)


class BundleWriter:
    """Writes one rank's part of a bundle, step by step (``background``: in a thread of its own)."""

    def __init__(self, root: str | Path, role: str, layout: ParallelLayout, meta: dict[str, Any] | None = None,
                 background: bool = False, pending: int = PENDING, hold_bytes: int | None = None):
        if role not in ROLES:
            raise ValueError(f"role {role!r} (expected one of {', '.join(ROLES)})")
        self.root = Path(root)
        self.layout = layout
        self.dir = self.root / f"rank-{layout.rank:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / STEP_LOG).unlink(missing_ok=True)  # a killed earlier run's, in a reused directory
        write_json(self.root / "bundle.json", {"format": FORMAT, "version": VERSION, "role": role,
                                               "world_size": layout.world_size})
        from logdiff.records.sketch import DIGEST

        self.manifest: dict[str, Any] = {"layout": layout.to_json(), "meta": {**(meta or {}), "sketch_digest": DIGEST},
                                         "steps": []}
        self._records: dict[str, _Kept] = {}
        self._index: dict[str, np.ndarray] = {}
        self._tokens: dict[str, np.ndarray] | None = None
        self._fields: dict[str, Any] = {}
        self._lock = threading.Lock()  # the manifest: the caller edits it, the thread dumps it
        self._freed = threading.Condition(self._lock)  # the thread wrote a step: its host copies are gone
        self._written = 0  # steps whose file is on disk (the manifest or the step log lists these)
        self._meta_changed = True  # the manifest on disk lacks the metadata as it is now
        self._queue: queue.Queue | None = queue.Queue(maxsize=pending) if background else None
        self._hold_bytes = (_default_hold() if hold_bytes is None else hold_bytes) if background else 0
        self._held = 0  # host bytes the queued steps hold (the thread frees them as it writes)
        self._step_bytes = 0  # host bytes the step being recorded holds
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # the thread's first failure: nothing is written after it
        self._reported = False
        self._closing = False  # the thread was told to finish

    def begin_step(self, token_ids: Any, positions: Any, sequences: Any = None, valid: Any = None,
                   fields: dict[str, Any] | None = None) -> None:
        """The rows this rank's forward pass sees: token ids, positions and, from a capture, each row's
        sequence id and whether it holds a real token (the attention mask), all of one flat length. ``fields``:
        step-level facts for the step's manifest entry (``{"weight_version": k}``)."""
        if self._tokens is not None:
            self.end_step()
        self._fields = dict(fields or {})
        table = {"tokens": token_ids, "positions": positions, "sequences": sequences, "valid": valid}
        self._tokens = {k: host_array(v)[0].reshape(-1).astype(np.int64) for k, v in table.items() if v is not None}

    def record(self, name: str, tensor: Any, placement: Placement, rows: Any = None,
               sketch_columns: np.ndarray | None = None, private: bool = False) -> None:
        """One record of the step; ``rows`` gives the index into the step's rows of each of its rows. With
        ``sketch_columns`` (each local column's logical column) only its row sketches are kept (``sketch.py``).
        ``private``: ``tensor`` is the caller's own copy, which nothing else writes (a gather of rows): kept as it
        is, not copied again."""
        if self._tokens is None:
            raise RuntimeError("record() outside a step: call begin_step() first")
        if name in RESERVED or "#" in name or name in self._records:
            raise ValueError(f"record {name!r} twice in one step, or under a reserved name")
        kept = _snapshot(tensor, placement, sketch_columns, self._hold_bytes - self._held - self._step_bytes, private)
        self._records[name] = kept
        self._step_bytes += kept.nbytes
        if rows is not None:
            self._index[name] = np.asarray(rows, dtype=np.int64)

    def meta_update(self, meta: dict[str, Any]) -> None:
        with self._lock:
            self.manifest["meta"].update(meta)
            self._meta_changed = True

    def end_step(self) -> None:
        """Close the step: its manifest entry now, its file now or (``background``) in the writer's thread."""
        self._raise_error()
        if self._tokens is None or self._error is not None:
            self._tokens = None
            return
        index = len(self.manifest["steps"])
        file = f"step-{index:06d}.safetensors"
        entry = {"file": file,
                 "records": {name: {"dtype": k.dtype, "shape": k.shape, "placement": k.placement.to_json(),
                                    **({"sketch": True} if k.sketched else {})}
                             for name, k in self._records.items()},
                 **self._fields}
        arrays: dict[str, Any] = dict(self._tokens)
        arrays.update(self._records)
        arrays.update({f"{name}#rows": rows for name, rows in self._index.items()})
        with self._lock:
            self.manifest["steps"].append(entry)
        held, self._step_bytes = self._step_bytes, 0
        self._records, self._index, self._tokens = {}, {}, None
        if self._queue is None:
            self._write(file, arrays, 0)
            return
        with timed("writer waits (in the step)"), self._freed:  # the queued steps' and this one's copies within
            while self._held and self._held + held > self._hold_bytes and self._error is None:  # ``hold_bytes``,
                self._freed.wait()  # or nothing else queued
            self._held += held
        if self._closing:
            raise RuntimeError(f"{self.dir}: a step recorded after the bundle writer was closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name=f"logdiff-writer-{self.dir.name}", daemon=True)
            self._thread.start()
        with timed("writer waits (in the step)"):
            self._queue.put((file, arrays, held))

    def close(self, wait: bool = True) -> None:
        """Write every step left, then the last manifest; raise what the writer's thread failed with. ``wait=False``
        (a background writer): return at once, the thread finishing on its own (``wait`` joins it later; the
        interpreter's exit does, and a failure nobody waits for is logged)."""
        self.end_step()
        if self._thread is None:
            self._raise_error()
            self._finish_manifest()
            return
        if not self._closing:
            self._closing = True
            self._queue.put(None)
        if wait:
            self.wait()
        else:
            atexit.register(self._thread.join)  # daemon threads die at exit: finish the bundle first

    @property
    def done(self) -> bool:
        """Whether nothing is left to write (a closed background writer's thread has finished)."""
        return self._thread is None or (self._closing and not self._thread.is_alive())

    def wait(self) -> None:
        """Block until a closed background writer has written everything; raise what it failed with."""
        if self._thread is not None:
            self._thread.join()
        self._raise_error()

    # ---- the writing ---------------------------------------------------------------------------

    def _write(self, file: str, arrays: dict[str, Any], held: int) -> None:
        from safetensors.numpy import save_file

        tmp = self.dir / f".{file}.tmp"
        try:
            with timed("writer: sketches"):
                _sketch_small_together(arrays)
                stored = {name: a.stored() if isinstance(a, _Kept) else a for name, a in arrays.items()}
            with timed("writer: device-to-host and files"):
                save_file({name: host_array(a)[0] for name, a in stored.items()}, str(tmp))
            os.chmod(tmp, file_mode())  # the user's umask, as the manifest's (safetensors writes 0600)
            os.replace(tmp, self.dir / file)
        finally:
            arrays.clear()
            self._release(held)
        with self._lock:
            entry = json.dumps(self.manifest["steps"][self._written])
            header = self._header() if self._meta_changed else None
            self._meta_changed = False
        if header is not None:
            write_json(self.dir / "manifest.json", header)
        with open(self.dir / STEP_LOG, "a") as log:
            log.write(entry + "\n")
        self._written += 1

    def _header(self) -> str:
        """The open writer's manifest (under the lock): layout and metadata, its steps in the step log."""
        return json.dumps({**self.manifest, "steps": [], "step_log": STEP_LOG}, indent=1)

    def _finish_manifest(self) -> None:
        """The manifest whole, every written step inline; then the step log is not needed."""
        with self._lock:
            text = json.dumps({**self.manifest, "steps": self.manifest["steps"][: self._written]}, indent=1)
        write_json(self.dir / "manifest.json", text)
        (self.dir / STEP_LOG).unlink(missing_ok=True)

    def _release(self, held: int) -> None:
        with self._freed:
            self._held -= held
            self._freed.notify_all()

    def _drain(self) -> None:
        lower_priority()  # the step's own threads get the cores first
        with timed("writer thread (its CPU; wall: its life)"):
            self._drain_all()

    def _drain_all(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:  # after a failure the rest are dropped (the caller hears of the first once)
                self._release(item[2])
                continue
            try:
                self._write(*item)
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by end_step or wait
                with self._freed:
                    self._error = e
                    self._freed.notify_all()
                logging.getLogger("logdiff").warning("logdiff: %s: the bundle writer failed (%s: %s)", self.dir,
                                                     type(e).__name__, e)
        if self._error is None:
            self._finish_manifest()  # with the metadata the capture added after its last step

    def _raise_error(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            error = self._error
            raise RuntimeError(f"{self.dir}: the bundle writer failed ({type(error).__name__}: {error}); the "
                               f"bundle holds the {self._written} steps written before") from error
