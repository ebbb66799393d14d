"""The one reader of untrusted input: every file logdiff reads from a bundle, a dump or a user's file goes here.

A capture bundle, an msprobe dump or a ``--sequences`` file may come from another machine, a run that died,
a copy that went wrong or a hand that edited it. Whatever it says, reading it must not
- leave the directory the user named: every file and directory read under an ``InputRoot`` is resolved
  (links followed) and refused unless it stays inside the root as the user named it (``..``, an absolute
  name, a link to ``/etc/passwd`` or a rank directory that links to another bundle are all one line);
- block or read a device: only regular files are opened (a FIFO, a socket or a device is refused before
  ``open``, so nothing waits on a pipe nobody writes);
- allocate what is not there: a count a file states (``world_size``, ranks, steps, rows, a safetensors
  header's length and offsets) is checked against what is on disk before it sizes anything
  (``safetensors_header``; ``bundle_input.check_ranks`` for the ranks);
- print a wall: a message names at most a few items and how many more (``brief``).

Each refusal is an ``InputError`` (exit 2) naming the file the user can look at. The rules are the same for
every reader (``records/bundle.py``, ``sources/msprobe/``, ``records/sequences.py``, ``records/processing.py``
for the sampling records a manifest holds), so a new reader states
what it reads through this module and inherits them.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError

#: the most a safetensors header may take (the format's own readers refuse beyond 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: the most a JSON file logdiff reads from a bundle or a dump may take (manifests of long runs are a few MB)
MAX_JSON_BYTES = 512 * 1024 * 1024
#: how many items a message names before it says how many more
BRIEF = 5


def brief(items: Iterable[Any], total: int | None = None, limit: int = BRIEF) -> str:
    """``a, b, c, d, e and 999,995 more``: the first ``limit`` items, then how many more (``total`` where the
    items are not all listed, as for a range too long to build)."""
    shown: list[str] = []
    seen = 0
    for item in items:
        if len(shown) < limit:
            shown.append(repr(item) if isinstance(item, str) else str(item))
        seen += 1
        if total is not None and seen >= limit:
            break
    total = seen if total is None else total
    more = total - len(shown)
    return ", ".join(shown) + (f" and {more:,} more" if more > 0 else "")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    kind = f" (a JSON {_json_type(value)})" if not isinstance(value, (int, float)) or isinstance(value, bool) else ""
    return (text if len(text) <= limit else text[: limit - 3] + "...") + kind


def _json_type(value: Any) -> str:
    return {str: "string", bool: "boolean", type(None): "null", list: "array", dict: "object",
            float: "number", int: "number"}.get(type(value), type(value).__name__)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


class InputRoot:
    """A directory the user named as input; what is read under it stays under it.

    ``given`` is the path as the user wrote it (messages name paths under it); the root itself may be a link
    (the user's own choice), and every path below it is resolved and must stay inside the root's real path.
    """

    def __init__(self, path: str | Path, what: str):
        self.given = Path(path)
        self.what = what
        try:
            st = os.stat(self.given)
        except OSError as e:
            raise InputError(f"{self.given} is not a {what} ({e.strerror or type(e).__name__})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise InputError(f"{self.given} is not a {what} (it is {_kind(st.st_mode)}, not a directory)")
        self.real = Path(os.path.realpath(self.given))

    def __truediv__(self, name: str) -> Path:
        return self.given / name

    def contains(self, path: str | Path) -> bool:
        real = Path(os.path.realpath(path))
        return real == self.real or self.real in real.parents

    def resolve(self, path: str | Path, kind: str = "file") -> Path:
        """``path`` (under ``given``) checked: inside the root once resolved, and a regular file (``kind``
        ``"file"``) or a directory (``"dir"``). Returns the real path, which is what must be opened."""
        path = Path(path)
        real = Path(os.path.realpath(path))
        if not (real == self.real or self.real in real.parents):
            raise InputError(f"{path}: leads outside the {self.what} {self.given} (to {real}); "
                             "a link out of it is refused")
        try:
            st = os.stat(real)
        except OSError as e:
            raise InputError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
        if kind == "dir" and not stat.S_ISDIR(st.st_mode):
            raise InputError(f"{path}: expected a directory, found {_kind(st.st_mode)}")
        if kind == "file" and not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: expected a regular file, found {_kind(st.st_mode)}")
        return real

    def file(self, *parts: str) -> Path:
        return self.resolve(self.given.joinpath(*parts))

    def dir(self, *parts: str) -> Path:
        return self.resolve(self.given.joinpath(*parts), "dir")

    def child(self, directory: str | Path, name: Any, where: object, kind: str = "file",
              within: str = "its directory") -> Path:
        """``directory / name`` for a ``name`` a file states: a relative name, resolving inside ``directory``
        (itself under the root) and inside the root."""
        if not isinstance(name, str) or not name or Path(name).is_absolute() or "\x00" in name:
            raise InputError(f"{where}: file {_short(name)} is not a file name inside {within} {directory}")
        directory = Path(directory)
        real_dir = Path(os.path.realpath(directory))
        path = directory / name
        real = Path(os.path.realpath(path))
        if real_dir not in real.parents:
            raise InputError(f"{where}: file {name!r} lies outside {within} {directory}")
        self.resolve(path, kind)
        return real

    def glob(self, pattern: str, kind: str = "file") -> list[Path]:
        """The paths under the root matching ``pattern``, each checked (``resolve``) and given as found."""
        found = sorted(self.given.glob(pattern))
        for path in found:
            self.resolve(path, kind)
        return found

    def read_bytes(self, path: str | Path, limit: int = MAX_JSON_BYTES) -> bytes:
        real = self.resolve(path)
        size = os.stat(real).st_size
        if size > limit:
            raise InputError(f"{path}: {size:,} bytes, more than the {limit:,} logdiff reads of such a file")
        try:
            with open(real, "rb") as f:
                return f.read(limit + 1)
        except OSError as e:
            raise InputError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None

    def read_json(self, path: str | Path, what: str) -> Any:
        """``path``'s JSON value; unreadable text, bad JSON or a non-finite number is one line naming it."""
        data = self.read_bytes(path)
        try:
            return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise InputError(f"{path}: not a readable {what} ({type(e).__name__})") from None

    def read_object(self, path: str | Path, what: str) -> dict[str, Any]:
        data = self.read_json(path, what)
        if not isinstance(data, dict):
            raise InputError(f"{path}: not a {what} (a JSON {_json_type(data)}, expected an object)")
        return data


def regular_file(path: str | Path, what: str) -> Path:
    """A single input file the user named (``--sequences``, ``--prompts``): it must exist and be a regular file
    (a FIFO would block the read, a directory or device is no such file); one line naming it otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise InputError(f"{what} not found: {path} ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path}: expected a regular file, found {_kind(st.st_mode)}")
    return path


def model_files(model: str | Path, what: str = "model directory (--model)") -> list[Path]:
    """The files a model directory given to ``compare`` holds that a loader reads (config, weights, tokenizer:
    ``*.json``, ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.model``, ``*.txt``), each checked to lie inside it
    and be a regular file before anything loads."""
    root = InputRoot(model, what)
    found = []
    for pattern in ("*.json", "*.safetensors", "*.bin", "*.pt", "*.model", "*.txt"):
        found += root.glob(pattern)
    return found


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: safetensors' dtype names -> numpy's (bfloat16 is stored as its 16-bit pattern: numpy has none)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
                      "U16": "uint16", "U8": "uint8", "BOOL": "bool"}


def safetensors_header(real: Path, shown: str | Path) -> dict[str, tuple[str, list[int]]]:
    """Each array's (dtype name, shape) in the safetensors file ``real`` (already resolved), read from its header
    alone and checked against the file's size: a header longer than the file, an offset past its end or a shape
    whose bytes are not its offsets' is one line naming ``shown``. Nothing is allocated from a stated count."""
    try:
        size = os.stat(real).st_size
        with open(real, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{shown}: not a safetensors step file ({size} bytes, cut short)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise InputError(f"{shown}: not a safetensors step file (a header of {n:,} bytes in a file of "
                                 f"{size:,}: cut short or not safetensors)")
            header = json.loads(f.read(n).decode("utf-8"))
    except InputError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"{shown}: not a readable safetensors step file ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise InputError(f"{shown}: not a safetensors step file (its header is not an object)")
    data = size - 8 - n
    out: dict[str, tuple[str, list[int]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_DTYPES
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        if not (ok and isinstance(shape, list) and all(_natural(d) for d in shape) and isinstance(offsets, list)
                and len(offsets) == 2 and all(_natural(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise InputError(f"{shown}: not a readable safetensors step file (array {name!r}: its header entry is "
                             "not a dtype, a shape and data offsets)")
        if offsets[1] > data:
            raise InputError(f"{shown}: not a readable safetensors step file (array {name!r} lies past the end of "
                             f"its {size:,} bytes: cut short?)")
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        width = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        elements = 1
        for d in shape:
            elements *= d
        if elements * width != offsets[1] - offsets[0]:
            raise InputError(f"{shown}: not a readable safetensors step file (array {name!r} of shape {shape} "
                             f"does not fill its {offsets[1] - offsets[0]:,} bytes)")
        out[name] = (dtype, list(shape))
    return out


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
