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
