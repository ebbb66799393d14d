"""logdiff's version, in a leaf module: what a bundle's writer records (``meta["logdiff"]``).

The captures (``engines/*/capture.py``) and foreign-dump readers (``msprobe/``) read it from here,
never from the ``logdiff`` package itself, whose ``__init__`` is the public API on top of the scan.
"""

from __future__ import annotations

__version__ = "0.1.0"
