"""``logdiff doctor``: what this machine can run, without loading any model.

Python, torch, the device and the CPU kernels here, then each registered
engine's own report (``Engine.doctor``): its package versions, the platform it
would run on (for vLLM the attention backend its platform selects) and the
deterministic settings its consistent mode depends on (``VLLM_BATCH_INVARIANT``,
``CUBLAS_WORKSPACE_CONFIG``, ``HCCL_DETERMINISTIC``, vllm-ascend's
batch-invariant build). Every probe reports its failure as text: ``doctor``
never raises.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

from logdiff import isa


def collect() -> dict[str, Any]:
    """Versions, device, CPU kernels, then each registered engine's own report (``Engine.doctor``)."""
    import torch

    from logdiff.sources.base import package_version
    from logdiff.sources.registry import engine_names, get_engine

    info: dict[str, Any] = {
        "logdiff": package_version("logdiff"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_threads": torch.get_num_threads(),
        **cpu_kernels(torch),
        "engines": engine_names(),
    }
    for name in engine_names():
        try:
            info.update(get_engine(name).doctor())
        except Exception as e:  # noqa: BLE001 - report, don't fail
            info[f"engine {name}"] = f"no report ({type(e).__name__}: {e})"
    return info


def cpu_kernels(torch: Any) -> dict[str, Any]:
    """What decides CPU numerics here: the ISA (and any emulation) and torch's kernel choice."""
    emulated = isa.emulated_isa()
    return {
        "cpu_isa": isa.host_isa() + (f" (emulating {emulated}: LOGDIFF_EMULATE_ISA)" if emulated else ""),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch_onednn": "on" if torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled else "off",
    }


def render(info: dict[str, Any], console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="logdiff doctor", show_header=False)
    for key, value in info.items():
        table.add_row(key, Text(", ".join(value) if isinstance(value, list) else str(value)))  # not markup: "[cpu]"
    console.print(table)
