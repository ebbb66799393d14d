"""Exit codes and the user-facing exceptions.

Only the CLI turns exceptions into exit codes. The exception classes are
defined in ``logdiff.probes.errors`` (the lowest layer that raises them) and
re-exported here.
"""

from __future__ import annotations

from logdiff.probes.errors import EngineUnavailable, InputError, LogdiffError

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE_UNAVAILABLE = 3
EXIT_INTERNAL = 101

__all__ = [
    "EXIT_ENGINE_UNAVAILABLE",
    "EXIT_GATE_FAILED",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_USAGE",
    "EngineUnavailable",
    "InputError",
    "LogdiffError",
]
