"""One way to patch and unpatch: every monkeypatch logdiff makes goes through ``Patches``.

Consistent mode swaps kernels into a loaded engine, probes wrap its functions;
both must leave the engine exactly as they found it, also when an exception
or a KeyboardInterrupt ends the block, and in reverse order when patches stack
(consistent mode inside a recording, say). ``Patches`` is a thin layer over
``contextlib.ExitStack`` and ``unittest.mock.patch.object``: the stack undoes
newest first, and ``patch.object`` knows whether an attribute was the
object's own (restore it) or inherited from its class (delete the override).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock


class Patches(contextlib.ExitStack):
    """``with Patches() as p: p.set(obj, "forward", fn)``: every change undone on exit, newest first."""

    def set(self, obj: Any, name: str, value: Any) -> None:
        """Replace ``obj.name`` with ``value`` until the block ends."""
        self.enter_context(mock.patch.object(obj, name, value, create=True))

    def on_exit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` when the block ends, in stack order with the patches."""
        self.callback(fn)
