"""What this process computes with, for a result's ``environment``: versions, the CPU's kernels, the device.

A scan (``pipeline``) and a comparison of bundles (``offline``) both write it. The engines' package
versions come from the registry (``Engine.versions``: installed metadata only, no engine is loaded), so
this module names no engine.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

from logdiff import isa
from logdiff.sources.registry import engine_names, get_engine


def environment() -> dict[str, Any]:
    """Versions (every registered engine's packages: ``Engine.versions``) and the device, for the report."""
    import torch

    device = "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    versions: dict[str, Any] = {}
    for name in engine_names():
        versions.update(get_engine(name).versions())
    return {
        "cpu_isa": isa.cpu_isa(),
        "cpu_isa_emulated": isa.emulated_isa() is not None,
        **({"cpu_isa_host": isa.host_isa()} if isa.emulated_isa() else {}),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        **versions,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": device,
    }
