"""Exceptions for problems the user can fix, raised anywhere below the CLI.

They live here, in the lowest layer that raises them, so that ``probes/`` stays
free of imports from ``logdiff/``; ``logdiff.errors`` re-exports them and the
CLI maps ``exit_code`` to the process exit status (see docs/cli.md).
"""

from __future__ import annotations


class LogdiffError(Exception):
    """A problem the user can fix; carries its exit code."""

    exit_code = 2


class InputError(LogdiffError):
    """Bad input: a missing path, a corrupt file, a vocabulary mismatch."""

    exit_code = 2


class EngineUnavailable(LogdiffError):
    """A required engine (vLLM, ...) is not installed or cannot start here."""

    exit_code = 3


class WorkspaceError(LogdiffError):
    """logdiff's own scratch space cannot be written: the staged checkpoint under ``$TMPDIR``.

    A full disk or a quota while staging is not the user's input and not an
    internal error: one line naming the directory and the system's reason, and
    the exit code of an unwritable output (4, ``logdiff.errors.EXIT_OUTPUT``).
    """

    exit_code = 4

    def __init__(self, path: object, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path}: {reason} (staging the checkpoint; set TMPDIR to a disk with room)")

    def __reduce__(self) -> tuple[type, tuple[object, str]]:
        return type(self), (self.path, self.reason)

