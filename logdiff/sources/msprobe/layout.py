"""An msprobe dump on disk: its step and rank directories, each ``dump.json``, and its tensor files.

``DUMP/step{S}/{rank{R}|proc{PID}}/`` holds ``dump.json`` (``{"task", "level", "framework", "data"}``),
``construct.json`` (each entry's parent entry) and, in tensor mode, ``dump_tensor_data/{data_name}``: one
``torch.save`` per tensor. A tensor whose file is absent was not kept (statistics mode, a slimmed dump, an
empty tensor): ``load`` returns None for it, never an error.

A dump is untrusted input: ``dump.json`` and ``construct.json`` must be JSON of msprobe's types (each entry an
object, its ``input_args``/``output`` lists, its ``input_kwargs`` an object, each parent a name or null), a
``data_name`` must name a file inside ``dump_tensor_data/`` (no ``..``, no absolute path, no link out of it),
and what ``torch.load`` reads (``weights_only``) must be a tensor; a dump cut short (a rank directory with no
``dump.json``, a tensor dump with no ``dump_tensor_data/``) is refused rather than read in part; anything else
is one ``InputError`` naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.records.untrusted import InputRoot

#: a module entry: ``Module.{path}.{class}.forward.{call count}``
ENTRY = re.compile(r"^Module\.(?P<path>.+)\.(?P<cls>[A-Za-z0-9_]+)\.forward\.(?P<count>\d+)$")
_STEP = re.compile(r"^step(\d+)$")
_RANK_DIR = re.compile(r"^(rank|proc)\d+$")


def pick(entry: dict[str, Any], where: str, index: int) -> Any:
    """One tensor's description in a dump entry: ``output``'s, an ``input``'s (HF passes hidden_states by keyword,
    so a call with no positional inputs reads its keyword ones in order), or ``kwarg:NAME``'s."""
    if where.startswith("kwarg:"):
        return (entry.get("input_kwargs") or {}).get(where.split(":", 1)[1])
    seq = entry.get("output") if where == "output" else entry.get("input_args")
    if where == "input" and not seq and entry.get("input_kwargs"):
        seq = list(entry["input_kwargs"].values())
    seq = seq or []
    return seq[index] if index < len(seq) else None


def dump_files(root: Path) -> list[Path]:
    """The ``dump.json`` files of a dump directory (the dump root, a step directory or a rank directory), each
    a regular file inside it (``untrusted.InputRoot``: a rank directory or a dump.json that links out is refused)."""
    source = InputRoot(root, "msprobe dump")
    found = sorted({*source.given.glob("dump.json"), *source.given.glob("*/dump.json"),
                    *source.given.glob("step*/*/dump.json")})
    for f in found:
        source.resolve(f)
    return found


def is_dump(path: Path) -> bool:
    """Whether ``path`` is a directory with an msprobe ``dump.json`` under it (and no logdiff ``bundle.json``)."""
    path = Path(path)
    return path.is_dir() and not (path / "bundle.json").exists() and bool(dump_files(path))


@dataclass
class RankDump:
    """One step's dump of one rank: its entries, their parents, and where its tensors lie."""

    step: int
    dir: Path
    data: dict[str, Any]
    parents: dict[str, str | None] = field(default_factory=dict)

    def load(self, desc: Any) -> Any:
        """The tensor a description names (``data_name``), or None where no file was kept; a name that leads out
        of the rank directory, or to a FIFO, a device or a directory, is refused (``untrusted.InputRoot``)."""
        if not isinstance(desc, dict) or not desc.get("data_name"):
            return None
        source = InputRoot(self.dir, "msprobe rank directory")
        name = desc["data_name"]
        tensors = self.dir / "dump_tensor_data"
        if not isinstance(name, str) or not name or Path(name).is_absolute() or not source.contains(tensors / name) \
                or Path(os.path.realpath(tensors)) not in Path(os.path.realpath(tensors / name)).parents:
            raise InputError(f"{self.dir / 'dump.json'}: data_name {name!r} is not a file inside {tensors}")
        if not os.path.lexists(tensors / name):
            return None
        f = source.resolve(tensors / name)
        import torch

        try:
            t = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a file torch cannot read is the user's input
            raise InputError(f"{f}: not a tensor msprobe wrote ({type(e).__name__})") from None
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{f}: holds a {type(t).__name__}, not a tensor msprobe wrote")
        return t


def _check_entries(path: Path, data: dict[str, Any]) -> None:
    """Each entry of a dump.json's ``data`` as msprobe writes it: an object of lists and objects."""
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise InputError(f"{path}: entry {name!r} is not an object (a JSON {type(entry).__name__})")
        for key, kind in (("input_args", list), ("output", list), ("input_kwargs", dict)):
            if entry.get(key) is not None and not isinstance(entry[key], kind):
                raise InputError(f"{path}: entry {name!r}: {key} is not a {kind.__name__} (a JSON "
                                 f"{type(entry[key]).__name__})")


def _read_json(path: Path) -> Any:
    source = InputRoot(path.parent, "msprobe dump")
    try:
        return source.read_json(path, "JSON")
    except InputError as e:  # the dump's words: "not readable JSON"
        raise InputError(str(e).replace("not a readable JSON", "not readable JSON")) from None


def _check_complete(root: Path) -> None:
    """One line for a rank directory (``rank{R}``, ``proc{PID}``) under ``root`` with no dump.json: its step would
    otherwise be left out without a word (an interrupted dump, an incomplete copy)."""
    dirs = [root] if _RANK_DIR.match(root.name) else []
    for d in (d for d in root.iterdir() if d.is_dir()):
        if _RANK_DIR.match(d.name):
            dirs.append(d)
        elif _STEP.match(d.name):
            dirs += [r for r in d.iterdir() if r.is_dir() and _RANK_DIR.match(r.name)]
    for d in sorted(dirs):
        if not (d / "dump.json").is_file():
            raise InputError(f"{d}: a rank directory with no dump.json (an interrupted dump or an incomplete copy); "
                             "remove it, or give the step directories that are whole")


def read_dump(root: Path, tasks: tuple[str, ...] = ("tensor",)) -> list[RankDump]:
    """Every step of a one-rank dump of one of ``tasks`` (tensor mode unless said), in step order; a one-line
    InputError for anything else."""
    root = Path(root)
    files = dump_files(root)
    if not files:
        raise InputError(f"{root}: not an msprobe dump (no dump.json under it)")
    _check_complete(root)
    steps: dict[int, list[Path]] = {}
    for f in files:
        m = _STEP.match(f.parent.parent.name)
        steps.setdefault(int(m.group(1)) if m else 0, []).append(f)
    out = []
    for step, found in sorted(steps.items()):
        if len(found) > 1:
            raise InputError(f"{root}: step {step} holds {len(found)} ranks' dumps; one rank is read (TP > 1 is not "
                             "supported yet)")
        f = found[0]
        head = _read_json(f)
        if not isinstance(head, dict) or not isinstance(head.get("data"), dict) or "task" not in head:
            raise InputError(f"{f}: not an msprobe dump.json (no task and data)")
        if head.get("framework", "pytorch") != "pytorch":
            raise InputError(f"{f}: a {head.get('framework')} dump; logdiff reads PyTorch dumps")
        if head["task"] not in tasks:
            raise InputError(f"{f}: a {head['task']!r} dump holds no tensors; dump with \"task\": \"tensor\" "
                             "(docs/msprobe.md)")
        _check_entries(f, head["data"])
        if head["task"] == "tensor" and head["data"] and not (f.parent / "dump_tensor_data").is_dir():
            raise InputError(f"{f.parent}: a tensor dump with no dump_tensor_data/ (its tensors): an interrupted dump "
                             "or an incomplete copy")
        construct = f.parent / "construct.json"
        parents = _read_json(construct) if os.path.lexists(construct) else {}
        if not isinstance(parents, dict) or not all(v is None or isinstance(v, str) for v in parents.values()):
            raise InputError(f"{construct}: not an msprobe construct.json (each entry's parent: a name or null)")
        out.append(RankDump(step, f.parent, head["data"], parents))
    return out
