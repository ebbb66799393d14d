"""The files a run writes: probed before the scan, cleared of an earlier run's, written atomically.

* ``prepare`` runs before anything loads: every target (``--out`` directory,
  ``--json``, ``--junit``, a baseline to write) is created or probe-written, so
  an unwritable or invalid path is one line and exit 2 instead of a lost scan;
  then this run's output names in those places are removed, so a file left
  from an earlier run is never read as this run's.
* ``write_result`` renders result.json, report.html and the tables into a
  temporary directory beside them and renames them into place, result.json
  last; any failure or interrupt before that leaves nothing new behind.
* ``write_text`` does the same for one file (JUnit XML, a baseline).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from logdiff.errors import InputError

#: what a run writes into ``--out DIR`` (the tables are ``divergence_table*.parquet|csv``)
OUT_FILES = ("result.json", "report.html")
TABLE_GLOBS = ("divergence_table*.parquet", "divergence_table*.csv")


def dump_json(result: dict[str, Any], path: Path) -> None:
    """Strict JSON: non-finite floats (an infinite ratio, say) become null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(result), indent=2, allow_nan=False))


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _probe_dir(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and prove a file can be written there."""
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{what} {directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=".logdiff-probe-")
        try:
            os.write(fd, b"logdiff")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        raise InputError(f"{what} {directory}: cannot write there ({_why(e)})") from None


def probe_file(path: Path, what: str) -> None:
    """A file target: a regular file or nothing yet, in a directory we can write to."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} {path}: is a directory, expected a file path")
    if path.exists() and not path.is_file():
        raise InputError(f"{what} {path}: exists and is not a regular file")
    _probe_dir(path.parent, what)


def _ours_in(out: Path) -> list[Path]:
    found = [out / name for name in OUT_FILES if (out / name).is_file()]
    for pattern in TABLE_GLOBS:
        found += sorted(p for p in out.glob(pattern) if p.is_file())
    return found


def prepare(out: Path | None, json_path: Path | None, junit: Path | None = None,
            baseline: Path | None = None) -> None:  # fmt: skip
    """Probe every target, then remove this run's output names left from an earlier run."""
    if out is not None:
        _probe_dir(Path(out), "--out")
    for path, what in ((json_path, "--json"), (junit, "--junit"), (baseline, "--baseline")):
        if path is not None:
            probe_file(path, what)
    stale = _ours_in(Path(out)) if out is not None else []
    stale += [Path(p) for p in (json_path, junit) if p is not None and Path(p).is_file()]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _temp_beside(path: Path) -> Iterator[Path]:
    """A temporary file name in ``path``'s directory, removed unless renamed away.

    Only a name (the file is created by its writer, with the usual permissions).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _temp_beside(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def write_result(result: dict[str, Any], out: Path | None, json_path: Path | None,
                 tables: dict[str, Any] | None = None) -> None:  # fmt: skip
    """result.json, report.html and the tables into ``out``; the JSON alone to ``json_path``."""
    from logdiff.reports import write_html

    moves: list[tuple[Path, Path]] = []
    with contextlib.ExitStack() as stack:
        if out is not None:
            out = Path(out)
            out.mkdir(parents=True, exist_ok=True)
            tmp_dir = Path(tempfile.mkdtemp(dir=out, prefix=".logdiff-partial-"))
            stack.callback(shutil.rmtree, tmp_dir, ignore_errors=True)
            write_html(result, tmp_dir / "report.html")
            if tables:
                from logdiff.locate import write_tables

                write_tables(tables, tmp_dir)
            dump_json(result, tmp_dir / "result.json")
            files = sorted(tmp_dir.iterdir(), key=lambda p: p.name == "result.json")  # result.json last
            moves += [(p, out / p.name) for p in files]
        if json_path is not None:
            tmp = stack.enter_context(_temp_beside(Path(json_path)))
            dump_json(result, tmp)
            moves.insert(0, (tmp, Path(json_path)))
        for src, dst in moves:
            os.replace(src, dst)
