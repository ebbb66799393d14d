"""What the diagnosis reads of a run's settings: a protocol over data, not the scan's config class.

The diagnosis is handed the settings of the run it explains (``logdiff scan``'s ``ScanConfig``,
``logdiff compare``'s reconstruction of it) and, for attribution, asks for variants of them
(``dataclasses.replace``: a kernel family made consistent, a ``--set`` dropped, the inference
weights reset) that a rescan measures. It names the fields it reads here and imports no command,
so the layers stay in the flow's order (docs/design.md): the scan's settings class is defined above
the diagnosis and satisfies this protocol structurally.

The two vocabularies the settings are checked against live here too, beside their one reader:
the consistent-kernel families a lever can switch (``KERNEL_FAMILIES``) and the attribution games
(``ATTRIBUTION_GAMES``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

#: the kernel families ``--consistent-kernels`` and attribution's levers switch
KERNEL_FAMILIES = ("linear", "rms_norm", "rope", "attention", "silu_and_mul", "moe", "log_softmax")
#: how attribution measures its game: end-to-end rescans, or (the default) the training forward patched from the
#: recorded inference rows (logdiff/diagnosis/attribute_patched.py), which falls back to rescans where it cannot
ATTRIBUTION_GAMES = ("rescan", "patched")


class RunSettings(Protocol):
    """The fields of a run's settings the diagnosis reads; a dataclass, so that ``replace`` makes variants."""

    dtype: str
    depth: str
    attribute: bool
    attribution: str
    consistent: bool
    consistent_kernels: Optional[tuple[str, ...]]
    infer_ckpt: Optional[Path]
    train_set: dict[str, Any]
    infer_set: dict[str, Any]
    response_len: int
    is_threshold: float
