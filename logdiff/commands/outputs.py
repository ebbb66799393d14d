"""The files a run writes: probed before the scan, swapped in whole when it succeeds, never lost when it fails.

* ``prepared`` (``prepare``, the probe) runs before anything loads: every target
  (``--out`` directory, ``--json``, ``--junit``, a baseline to write) is created
  or probe-written, so an unwritable or invalid path is one line and exit 4
  instead of a lost scan. Nothing an earlier run wrote is touched: a run that
  fails (bad input, an engine that will not start, an interrupt) leaves the
  earlier results exactly as they were, and removes the directories its probe
  created.
* ``write_result`` renders result.json, report.html and the tables, writes them
  to temporary files on the targets' file system (a hidden ``.logdiff-partial-*``
  directory inside ``--out``, a hidden ``.NAME.*.tmp`` beside the ``--json``
  file) and only then swaps them in (``_swap``): the earlier run's files of
  those names, and its tables this run does not write, are moved aside, the new
  files renamed into place (result.json last), and only then the earlier ones
  deleted. A failure or an interrupt before the end puts the earlier files back
  and removes the new ones, so the directory holds one run's set, never a new
  result.json beside an older report.html, and never fewer files than before.
* ``write_text`` does the same for one file (JUnit XML, a baseline, ``report``'s HTML):
  a rename over the target, atomic on one file system.

Every OSError while probing or writing (a full disk, no permission, a read-only
file system, a directory where a file belongs, a parent that cannot be created)
becomes an ``OutputError`` naming the file the user asked for, never a temporary
name: one line and exit 4 in the CLI (docs/cli.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from logdiff.errors import LogdiffError, OutputError

#: what a run writes into ``--out DIR`` (the tables are ``divergence_table*.parquet|csv``)
OUT_FILES = ("result.json", "report.html")
TABLE_GLOBS = ("divergence_table*.parquet", "divergence_table*.csv")
#: the prefixes of the temporaries beside a target (removed on failure; see ``_temp_beside``)
TEMP_PREFIXES = (".logdiff-probe-", ".logdiff-partial-")


def json_text(result: dict[str, Any]) -> str:
    """Strict JSON: non-finite floats (an infinite ratio, say) become null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(result), indent=2, allow_nan=False)


def dump_json(result: dict[str, Any], path: Path) -> None:
    """``result`` as strict JSON at ``path``, written atomically (parents created)."""
    write_text(path, json_text(result))


@contextlib.contextmanager
def writing(path: Path, what: str | None = None) -> Iterator[None]:
    """Turn an OSError in the block into an OutputError naming ``path``."""
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        raise OutputError.from_os(path, e, what) from e


def _mkdir(directory: Path, target: Path, what: str | None = None) -> None:
    """Create ``directory`` (and its parents) for ``target``, or say why it cannot be."""
    which = "" if directory == target else f"{directory} "
    if directory.exists() and not directory.is_dir():
        raise OutputError(target, f"{which}exists and is not a directory", what)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = OutputError.from_os(directory, e).reason
        raise OutputError(target, f"cannot create the directory {which}({reason})", what) from e


def _probe_dir(directory: Path, what: str | None, target: Path | None = None) -> None:
    """Create ``directory`` if needed and prove a file can be written there."""
    target = directory if target is None else target
    _mkdir(directory, target, what)
    with writing(target, what):
        fd, name = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIXES[0])
        try:
            os.write(fd, b"logdiff")
            os.fsync(fd)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name)


def probe_file(path: Path, what: str | None) -> None:
    """A file target: a regular file or nothing yet, in a directory we can write to."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(path, "is a directory, expected a file path", what)
    if path.exists() and not path.is_file():
        raise OutputError(path, "exists and is not a regular file", what)
    _probe_dir(path.parent, what, path)


#: what ``--out`` meant for ``report`` before it named a directory, as for every command: a file, told by its suffix
OLD_REPORT_OUT = (".html", ".htm")


def report_target(result_json: Path, out: Path | None, html: Path | None) -> tuple[Path, str | None, str | None]:
    """Where ``report`` writes the HTML, the option that named it (None: beside RESULT) and a deprecation note.

    ``--out DIR`` is a directory for every command (DIR/report.html here), ``--html FILE`` the file. An ``--out``
    ending in .html keeps its old meaning, a file, with a note saying to use ``--html``. Probed here, before
    anything is rendered.
    """
    from logdiff.errors import InputError

    if out is not None and html is not None:
        raise InputError("report: give --out DIR or --html FILE, not both")
    note = None
    if html is not None:
        path, what = Path(html), "--html"
    elif out is not None and Path(out).suffix.lower() in OLD_REPORT_OUT:
        path, what = Path(out), "--out"
        note = (f"report --out {out}: --out FILE.html is deprecated (--out names a directory for every command); "
                f"use --html {out}")
    elif out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise OutputError(out, "exists and is not a directory", "--out")
        path, what = out / "report.html", "--out"
    else:
        path, what = Path(result_json).parent / "report.html", None  # beside RESULT, named by no option
    probe_file(path, what)
    return path, what, note


def probe_demo_target(path: Path) -> list[Path]:
    """``demo-model PATH``: a directory (or nothing yet) whose parent can be written, checked before training;
    returns the parent directories it created (``removed_on_failure``)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(path, "exists and is not a directory")
    created = _missing([path.parent])
    _probe_dir(path.parent, None, path)
    return created


#: errors only a write gives (a full disk, a quota, a file too large, a read-only file system)
_WRITE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS") if hasattr(errno, n))


def _at_target(name: Any, path: Path) -> bool:
    """Whether the file ``name`` is ``path``, inside it, or in its staging directory (``.NAME.*`` beside it)."""
    if not isinstance(name, (str, os.PathLike)):
        return False
    target, found = Path(os.path.abspath(path)), Path(os.path.abspath(name))
    if found == target or target in found.parents:
        return True
    if target.parent not in found.parents:
        return False
    return found.relative_to(target.parent).parts[0].startswith(f".{target.name}.")


@contextlib.contextmanager
def writing_tree(path: Path) -> Iterator[None]:
    """For a writer logdiff does not control (``demo-model``'s build saving a model directory).

    An OSError that only a write gives, or one that names ``path``, a file in it or in
    its staging directory beside it, is an OutputError naming ``path``; any other
    OSError (reading the training corpus, say) propagates unchanged.
    """
    try:
        yield
    except LogdiffError:
        raise
    except OSError as e:
        if e.errno in _WRITE_ERRNOS or _at_target(e.filename, path) or _at_target(e.filename2, path):
            raise OutputError.from_os(path, e) from e
        raise
    except Exception as e:
        # safetensors (the weights) reports a failed write as its own error, not an OSError:
        # "Error while serializing: I/O error: No space left on device (os error 28)"
        found = re.search(r"I/O error: (.+?) \(os error \d+\)", str(e))
        if type(e).__name__ == "SafetensorError" and found:
            raise OutputError(path, found.group(1)) from e
        raise


def _ours_in(out: Path) -> list[Path]:
    found = [out / name for name in OUT_FILES if (out / name).is_file()]
    for pattern in TABLE_GLOBS:
        found += sorted(p for p in out.glob(pattern) if p.is_file())
    return found


def prepare(out: Path | None, json_path: Path | None, junit: Path | None = None,
            baseline: Path | None = None) -> list[Path]:  # fmt: skip
    """Probe every target (creating the directories it needs); returns the directories it created, outermost
    first. An earlier run's files are not touched: ``write_result`` replaces them when this run succeeds."""
    wanted = [Path(p).parent for p in (json_path, junit, baseline) if p is not None]
    created = _missing([*([Path(out)] if out is not None else []), *wanted])
    if out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise OutputError(out, "exists and is not a directory", "--out")
        _probe_dir(out, "--out")
        for name in OUT_FILES:
            if (out / name).is_dir():
                raise OutputError(out / name, "is a directory, expected a file path", "--out")
    for path, what in ((json_path, "--json"), (junit, "--junit"), (baseline, "--baseline")):
        if path is not None:
            probe_file(path, what)
    return created


def _missing(directories: list[Path]) -> list[Path]:
    """The directories (and their parents) that do not exist yet, outermost first."""
    out: list[Path] = []
    for d in directories:
        d = Path(os.path.abspath(d))
        chain = []
        while not os.path.lexists(d) and d != d.parent:
            chain.append(d)
            d = d.parent
        out += [c for c in reversed(chain) if c not in out]
    return out


@contextlib.contextmanager
def prepared(out: Path | None, json_path: Path | None, junit: Path | None = None,
             baseline: Path | None = None) -> Iterator[None]:  # fmt: skip
    """``prepare``, then the run: where the run fails, the directories the probe created are removed again
    (where still empty), so a failed run leaves nothing behind and the earlier results as they were."""
    with removed_on_failure(prepare(out, json_path, junit, baseline)):
        yield


@contextlib.contextmanager
def removed_on_failure(created: list[Path]) -> Iterator[None]:
    """Remove the directories a probe ``created`` (innermost first, where still empty) if the block fails."""
    try:
        yield
    except BaseException:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


@contextlib.contextmanager
def _temp_beside(path: Path) -> Iterator[Path]:
    """A temporary file name in ``path``'s directory, removed unless renamed away.

    Only a name (the file is created by its writer, with the usual permissions).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _write_file(tmp: Path, data: str, target: Path) -> None:
    """``data`` into the new file ``tmp``, flushed to disk; an OSError names ``target``."""
    with writing(target):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        try:
            view = memoryview(data.encode("utf-8"))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


def _sync(path: Path, target: Path) -> None:
    """Flush a file another library wrote to disk; an OSError names ``target``."""
    with writing(target):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap(moves: list[tuple[Path, Path]], remove: Sequence[Path] = ()) -> None:
    """Rename every (temporary, target) pair into place and take the ``remove`` targets away: all or none.

    The earlier files at the targets are first moved aside (beside themselves, ``.NAME.*.prev``), then the
    new ones renamed in, in order, then the earlier ones deleted. A failure (or an interrupt) partway removes
    what this call placed and puts the earlier files back, so the targets hold either the earlier set or the
    new one, never a mix and never less than before.
    """
    saved: list[tuple[Path, Path]] = []
    placed: list[Path] = []
    try:
        for dst in [dst for _, dst in moves] + list(remove):
            if os.path.lexists(dst):
                aside = dst.with_name(f".{dst.name}.{os.getpid()}.{secrets.token_hex(4)}.prev")
                with writing(dst):
                    os.replace(dst, aside)
                saved.append((aside, dst))
        for src, dst in moves:
            with writing(dst):
                os.replace(src, dst)
            placed.append(dst)
    except BaseException:
        for dst in placed:
            with contextlib.suppress(OSError):
                dst.unlink()
        for aside, dst in reversed(saved):
            with contextlib.suppress(OSError):
                os.replace(aside, dst)
        raise
    for aside, _ in saved:
        with contextlib.suppress(OSError):
            aside.unlink()


def write_text(path: Path, text: str, what: str | None = None) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file, then a rename)."""
    path = Path(path)
    _mkdir(path.parent, path, what)
    with _temp_beside(path) as tmp:
        try:
            _write_file(tmp, text, path)
            _swap([(tmp, path)])
        except OutputError as e:
            raise OutputError(e.path, e.reason, what) from e.__cause__


def write_result(result: dict[str, Any], out: Path | None, json_path: Path | None,
                 tables: dict[str, Any] | None = None) -> None:  # fmt: skip
    """result.json, report.html and the tables into ``out``; the JSON alone to ``json_path``.

    Everything is rendered first (a rendering error is not an output error), then
    written to temporaries, then swapped into place (``_swap``): the ``--json``
    file, report.html, the tables, and result.json last.
    """
    from logdiff.reports import render_html

    text = json_text(result)
    html = render_html(result) if out is not None else None
    moves: list[tuple[Path, Path]] = []
    stale: list[Path] = []
    with contextlib.ExitStack() as stack:
        if json_path is not None:
            json_path = Path(json_path)
            _mkdir(json_path.parent, json_path)
            tmp = stack.enter_context(_temp_beside(json_path))
            _write_file(tmp, text, json_path)
            moves.append((tmp, json_path))
        if out is not None:
            out = Path(out)
            _mkdir(out, out)
            with writing(out):
                staging = Path(tempfile.mkdtemp(dir=out, prefix=TEMP_PREFIXES[1]))
            stack.callback(shutil.rmtree, staging, ignore_errors=True)
            staged = [staging / "report.html"]
            _write_file(staged[0], html or "", out / "report.html")
            if tables:
                from logdiff.comparison.locate import write_tables

                try:
                    written = write_tables(tables, staging)
                except OutputError as e:  # name the table as the user will look for it
                    raise OutputError(out / e.path.name, e.reason) from e.__cause__
                for table in written:  # flushed to disk like the others before any rename
                    _sync(table, out / table.name)
                staged += written
            staged.append(staging / "result.json")
            _write_file(staged[-1], text, out / "result.json")
            moves += [(p, out / p.name) for p in staged]  # result.json last
            stale = [p for p in _ours_in(out) if p.name not in {dst.name for _, dst in moves}]
        _swap(moves, stale)
