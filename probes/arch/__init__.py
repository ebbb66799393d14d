"""Architecture adapters: one module per model family, looked up by the HF ``architectures`` string.

``adapter_for("Qwen3ForCausalLM")`` returns the family's adapter (base.py says
what an adapter holds); ``demos()`` lists the tiny demo configs. How to add a
family: docs/architectures.md.
"""

from __future__ import annotations

from logdiff.probes.arch.base import (
    DOCS,
    ArchAdapter,
    Demo,
    adapter_for,
    adapter_of,
    adapters,
    demo,
    demos,
    find,
    supported,
)

__all__ = [
    "DOCS",
    "ArchAdapter",
    "Demo",
    "adapter_for",
    "adapter_of",
    "adapters",
    "demo",
    "demos",
    "find",
    "supported",
]
