"""Exit codes and the user-facing exceptions.

Only the CLI turns exceptions into exit codes. The exception classes are
defined in ``logdiff.probes.errors`` (the lowest layer that raises them) and
re-exported here; ``OutputError`` is raised only by ``logdiff`` itself (the
writers in ``logdiff.outputs``), so it lives here.
"""

from __future__ import annotations

import re
from pathlib import Path

from logdiff.probes.errors import EngineUnavailable, InputError, LogdiffError, WorkspaceError

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE_UNAVAILABLE = 3
EXIT_OUTPUT = 4
EXIT_INTERNAL = 101
assert WorkspaceError.exit_code == EXIT_OUTPUT  # probes/ cannot import this module's constant


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
