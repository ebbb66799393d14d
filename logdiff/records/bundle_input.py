"""A capture bundle is untrusted input: every fact it states is checked before it is used.

A bundle may come from another machine, a run that died, or a hand that edited it. Every file is read
through ``untrusted.InputRoot`` (inside the bundle, regular files only, bounded sizes), and what the files
say is checked here (``bundle.py`` calls these): ``bundle.json`` and each ``manifest.json`` must be JSON of
the documented types (a layout, a list of steps, each record's dtype, shape and placement); every file a
manifest names must lie inside its rank directory (no ``..``, no absolute path, no link out of it); every
step file's safetensors header is read when the bundle opens, before any model loads, and each record the
manifest lists must be there with the manifest's shape and dtype (``check_step_files``). A step file that
cannot be read, an array the manifest lists but the file lacks, an array whose shape or dtype is not the
manifest's, and a ``#rows`` index outside the step's rows are each one ``InputError`` naming the file and
what is wrong (exit 2), never a crash.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.records.layout import ParallelLayout, Placement
from logdiff.records.untrusted import InputRoot, brief, safetensors_header


def read_step_log(source: InputRoot, manifest: Path, name: Any) -> list[Any]:
    """The step entries an open writer's log holds (``bundle_writer.STEP_LOG``), one JSON value per line; a
    last line cut short (the writer stopped while appending it) is left out, any other bad line refused."""
    path = source.child(manifest.parent, name, f"{manifest}: step_log", within="its rank directory")
    try:
        lines = source.read_bytes(path).decode("utf-8").split("\n")
    except ValueError as e:
        raise InputError(f"{path}: not a readable step log ({type(e).__name__})") from None
    steps = []
    for i, line in enumerate(lines):
        try:
            steps.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:  # only the last, unterminated line may be cut short
                raise InputError(f"{path}: line {i + 1} is not a JSON step entry") from None
    return steps


#: the metadata the comparison reads, and the JSON type each must have where present
META_TYPES = {"config": dict, "prompt_lens": dict, "position_offsets": dict, "owners": dict, "contract": dict,
              "sequences": list, "weight_versions": list}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_head(path: Path, head: dict[str, Any], roles: tuple[str, ...]) -> None:
    if head.get("role") not in roles:
        raise InputError(f"{path}: role {_said(head.get('role'))} (expected one of {', '.join(roles)})")
    if not _int(head.get("world_size")) or head["world_size"] < 1:
        raise InputError(f"{path}: world_size {_said(head.get('world_size'))} is not a positive integer")


def _said(value: Any) -> str:
    """A value a file states, in a message: its JSON type where that is the fault, and never more than a line."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} (a string)" if isinstance(value, str) and value.strip("-").isdigit() else text


def check_version(path: Path, head: dict[str, Any], version: int) -> None:
    """The bundle format's version: the integer this logdiff reads, named as both sides write it."""
    found = head.get("version")
    if found != version or not _int(found):
        kind = "" if _int(found) else f" (a JSON {type(found).__name__ if found is not None else 'null'})"
        raise InputError(f"{path}: bundle version {_said(found) if _int(found) else repr(found)[:60]}{kind}; "
                         f"this logdiff reads version {version} (an integer)")


def check_ranks(root: Path, world_size: int, claimed: list[tuple[Path, int]]) -> None:
    """Each rank of ``world_size`` written by exactly one rank directory: none missing, none twice, none beyond.
    Counted against the directories on disk, so a stated world size of a billion costs nothing."""
    seen: dict[int, Path] = {}
    for manifest, rank in claimed:
        if not 0 <= rank < world_size:
            raise InputError(f"{manifest}: rank {rank:,} is outside the bundle's world size {world_size:,} "
                             f"({root / 'bundle.json'})")
        if rank in seen:
            raise InputError(f"{manifest} and {seen[rank]} both hold rank {rank} (a rank directory copied twice?)")
        seen[rank] = manifest
    if len(seen) < world_size:
        missing = (r for r in range(world_size) if r not in seen)
        raise InputError(f"{root}: world size {world_size:,} ({root / 'bundle.json'}), no records from ranks "
                         f"{brief(missing, total=world_size - len(seen))}")


def check_manifest(source: InputRoot, path: Path, m: dict[str, Any]) -> ParallelLayout:
    """The manifest's layout, once its every field the comparison reads has the documented type."""
    try:
        layout = ParallelLayout.from_json(m["layout"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: no valid layout ({type(e).__name__}: {e})") from None
    if not isinstance(m.get("meta", {}), dict) or not isinstance(m.get("steps"), list):
        raise InputError(f"{path}: meta must be an object and steps a list")
    meta = m.get("meta", {})
    for key, kind in META_TYPES.items():
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise InputError(f"{path}: meta {key} is not a JSON {'object' if kind is dict else 'list'}")
    for key in ("prompt_lens", "position_offsets"):
        if not all(_int(v) and v >= 0 for v in (meta.get(key) or {}).values()):
            raise InputError(f"{path}: meta {key} must map sequence ids to non-negative integers")
    for i, step in enumerate(m["steps"]):
        where = f"{path}: step {i}"
        if not isinstance(step, dict) or not isinstance(step.get("records"), dict):
            raise InputError(f"{where} is not an object with records")
        source.child(path.parent, step.get("file"), where, within="its rank directory")
        if "weight_version" in step and (not _int(step["weight_version"]) or step["weight_version"] < 0):
            raise InputError(f"{where}: weight_version {step['weight_version']!r} is not a non-negative integer")
        for name, e in step["records"].items():
            shape = e.get("shape") if isinstance(e, dict) else None
            if (not isinstance(shape, list) or not all(_int(n) and n >= 0 for n in shape)
                    or not isinstance(e.get("dtype"), str) or not isinstance(e.get("placement"), dict)):
                raise InputError(f"{where}: record {name!r} needs a dtype, a shape of sizes and a placement")
            try:
                Placement.from_json(e["placement"])
            except (TypeError, ValueError) as err:
                raise InputError(f"{where}: record {name!r}: {err}") from None
    return layout


def stored_as(dtype: str) -> str:
    """A stored array's dtype in the manifest's words: int16 is also how a bfloat16 record is stored."""
    return "int16 (a bfloat16 or int16 record's bits)" if dtype == "int16" else dtype


def _stored_dtype(name: str) -> np.dtype | None:
    """The numpy dtype a record of manifest dtype ``name`` is stored in (bfloat16 as its int16 bits)."""
    try:
        return np.dtype("int16" if name == "bfloat16" else name)
    except TypeError:
        return None


def read_step(file: Path, names: list[str], entries: dict[str, Any]) -> dict[str, np.ndarray]:
    """Arrays ``names`` of step file ``file``, each checked against its manifest entry in ``entries`` (records)
    and the step's rows (``#rows`` indices)."""
    with StepFile(file) as f:
        return f.read(names, entries)


class StepFile:
    """One step file open for many reads (``RankPart.reading``): its safetensors header is parsed once, not once per
    record (a step file holds every record of a pass, and opening it costs as much as its header is long); each
    ``read`` checks what it returns as ``read_step`` does."""

    def __init__(self, file: Path):
        from safetensors import safe_open

        self.file = file
        with self._input_errors():
            self._handle = safe_open(str(file), framework="numpy")
            self.keys = set(self._handle.keys())
            self.rows = self._handle.get_slice("tokens").get_shape()[0] if "tokens" in self.keys else None

    def __enter__(self) -> "StepFile":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        with self._input_errors():
            self._handle.__exit__(None, None, None)

    def read(self, names: list[str], entries: dict[str, Any]) -> dict[str, np.ndarray]:
        """Arrays ``names``, each checked against its manifest entry in ``entries`` and the step's rows."""
        absent = [n for n in names if n not in self.keys]
        if absent:
            raise InputError(f"{self.file}: no array {absent[0]!r} in the step file (its manifest lists it)")
        with self._input_errors():
            out = {n: self._handle.get_tensor(n) for n in names}
        for n, array in out.items():
            entry = entries.get(n)
            if entry is not None:
                want = _stored_dtype(entry["dtype"]) if not entry.get("sketch") else None
                if list(array.shape) != entry["shape"] or (want is not None and array.dtype != want):
                    raise InputError(f"{self.file}: array {n!r} is stored as {stored_as(str(array.dtype))}"
                                     f"{list(array.shape)}, its manifest says {entry['dtype']}{entry['shape']}")
            elif n.endswith("#rows") and self.rows is not None and not _within(array, self.rows):
                raise InputError(f"{self.file}: row index {n!r} points outside the step's {self.rows} rows")
        return out

    @contextlib.contextmanager
    def _input_errors(self) -> Iterator[None]:
        """safetensors' own errors (a truncated or corrupt file) are the input's: one ``InputError``."""
        try:
            yield
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever safetensors raises on a bad file
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise InputError(f"{self.file}: not a readable safetensors step file ({type(e).__name__}: {reason})"
                             ) from None


def _within(index: np.ndarray, rows: int) -> bool:
    """Whether ``index`` is a flat integer index into ``rows`` rows."""
    if index.ndim != 1 or index.dtype.kind not in "iu":
        return False
    return not index.size or (int(index.min()) >= 0 and int(index.max()) < rows)


def check_rows(file: Path, name: str, entry: dict[str, Any], rows: int) -> None:
    """A whole record must hold a whole number of values per row of its rows."""
    size = math.prod(entry["shape"])
    if (size % rows) if rows else size:
        raise InputError(f"{file}: record {name!r} of shape {entry['shape']} does not split into {rows} rows")


def check_step_files(source: InputRoot, manifest: Path, steps: list[dict[str, Any]], dir: Path) -> list[dict]:
    """Every step file of a rank, from its safetensors header alone, against the manifest: each record there with
    the manifest's shape and stored dtype, the row arrays one row each, each ``#rows`` index as long as its
    record's rows. Read when the bundle opens, before a model loads or an array is allocated; returns each step's
    header shapes (name -> shape)."""
    out = []
    for i, step in enumerate(steps):
        shown = dir / str(step["file"])
        real = source.child(dir, step["file"], f"{manifest}: step {i}", within="its rank directory")
        header = safetensors_header(real, shown)
        for name, entry in step["records"].items():
            if name not in header:
                raise InputError(f"{shown}: no array {name!r} in the step file (its manifest lists it)")
            dtype, shape = header[name]
            want = _stored_dtype(entry["dtype"])
            stored = "int16" if dtype == "bfloat16" else dtype  # logdiff stores bfloat16 as int16 bits
            if shape != entry["shape"] or (not entry.get("sketch") and (want is None or np.dtype(stored) != want)):
                raise InputError(f"{shown}: array {name!r} is stored as {stored_as(stored)}{shape}, its manifest "
                                 f"says {entry['dtype']}{entry['shape']}")
        rows = [header[n][1] for n in ("tokens", "positions", "sequences", "valid") if n in header]
        if len({tuple(r) for r in rows}) > 1 or any(len(r) != 1 for r in rows):
            raise InputError(f"{shown}: its row arrays (tokens, positions, ...) are not one row each")
        out.append({name: shape for name, (_, shape) in header.items()})
    return out


def row_width(file: Path, name: str, entry: dict[str, Any], tp: int, shapes: dict[str, list[int]]) -> int | None:
    """A whole record's logical values per row: its shape (a shard's split dimension whole), which must be the
    one stored in ``file`` (``shapes``, its header's), over its rows (its ``#rows`` index, else the step's). None
    for a sketch or a record of no rows."""
    shape = list(entry["shape"])
    if name not in shapes:
        raise InputError(f"{file}: no array {name!r} in the step file (its manifest lists it)")
    if shapes[name] != shape:
        raise InputError(f"{file}: array {name!r} is {shapes[name]}, its manifest says {entry['dtype']}{shape}")
    rows = (shapes.get(f"{name}#rows") or shapes.get("tokens") or [0])[0]
    if entry.get("sketch") or not shape:
        return None
    check_rows(file, name, entry, rows)
    p = entry["placement"]
    if p.get("kind") == "shard" and _int(p.get("dim")) and -len(shape) <= p["dim"] < len(shape):
        d = p["dim"] % len(shape)
        shape[d] = int(p.get("size") or shape[d] * tp)
    return math.prod(shape) // rows if rows else None
