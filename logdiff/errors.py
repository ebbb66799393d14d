"""Exit codes and the user-facing exceptions.

Only the CLI turns exceptions into exit codes. This module is a leaf: it imports nothing
of ours, so every stage, the probes and the records included, raises these classes, and
the CLI maps ``exit_code`` to the process exit status (docs/cli.md).
"""

from __future__ import annotations

import re
from pathlib import Path

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE_UNAVAILABLE = 3
EXIT_OUTPUT = 4
EXIT_INTERNAL = 101


class LogdiffError(Exception):
    """A problem the user can fix; carries its exit code."""

    exit_code = 2


class InputError(LogdiffError):
    """Bad input: a missing path, a corrupt file, a vocabulary mismatch."""

    exit_code = 2


class EngineUnavailable(LogdiffError):
    """A required engine (vLLM, ...) is not installed or cannot start here."""

    exit_code = EXIT_ENGINE_UNAVAILABLE


class WorkspaceError(LogdiffError):
    """logdiff's own scratch space cannot be written: the staged checkpoint under ``$TMPDIR``.

    A full disk or a quota while staging is not the user's input and not an
    internal error: one line naming the directory and the system's reason, and
    the exit code of an unwritable output (4, ``logdiff.errors.EXIT_OUTPUT``).
    """

    exit_code = EXIT_OUTPUT

    def __init__(self, path: object, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path}: {reason} (staging the checkpoint; set TMPDIR to a disk with room)")

    def __reduce__(self) -> tuple[type, tuple[object, str]]:
        return type(self), (self.path, self.reason)


class OutputError(LogdiffError):
    """An output cannot be written: result.json, report.html, a table, JUnit XML, a baseline.

    Raised for an output path that cannot take the file (a directory where a file
    is expected, a parent that is a file or cannot be created, no permission, a
    read-only file system) and for any OSError while writing (a full disk, a quota).
    ``path`` is the file (or directory) the user asked for, never a temporary name;
    ``reason`` is the system's words (``No space left on device``); ``what`` the
    option that named it (``--json``), when there is one.
    """

    exit_code = EXIT_OUTPUT

    def __init__(self, path: str | Path, reason: str, what: str | None = None) -> None:
        self.path = Path(path)
        self.reason = reason
        self.what = what
        where = f"{self.path} ({what})" if what else str(self.path)
        super().__init__(f"cannot write {where}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[Path, str, str | None]]:
        return type(self), (self.path, self.reason, self.what)

    @classmethod
    def from_os(cls, path: str | Path, e: OSError, what: str | None = None) -> OutputError:
        """The OutputError for ``e`` while writing ``path``: the system's reason, without its errno prefix."""
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return cls(path, e.strerror or re.sub(r"^\[Errno \d+\] ", "", text) or type(e).__name__, what)


__all__ = [
    "EXIT_ENGINE_UNAVAILABLE",
    "EXIT_GATE_FAILED",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_USAGE",
    "EngineUnavailable",
    "InputError",
    "LogdiffError",
    "OutputError",
    "WorkspaceError",
]
