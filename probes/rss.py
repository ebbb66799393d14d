"""The process's peak resident memory, for the scan's cost line (``logdiff.phases``) and the capture's writer,
whose host copies are bounded by a share of it (``bundle_writer.HOLD_SHARE``).

``getrusage(RUSAGE_SELF).ru_maxrss`` is in KiB on Linux and in bytes on macOS.
"""

from __future__ import annotations

import sys


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes; None where ``resource`` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
