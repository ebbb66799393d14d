"""``logdiff doctor``: what this machine can run, without loading any model.

Python, torch, the device and the CPU kernels here; then the engines, in two
rows: those installed here and those logdiff knows but whose packages are
missing (an engine is installed when every package its ``Engine.versions``
names is: installed metadata only, nothing imported). Then each installed
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
    """Versions, device, CPU kernels, the engines installed and not, then each installed engine's own report."""
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
    }
    installed, missing = engine_status(engine_names())
    info["engines installed"] = installed or "none"
    info["engines not installed"] = [f"{name} (needs {', '.join(pkgs)}{'; ' + hint if hint else ''})"
                                     for name, (pkgs, hint) in missing.items()] or "none"
    for name in installed:
        try:
            info.update(get_engine(name).doctor())
        except Exception as e:  # noqa: BLE001 - report, don't fail
            info[f"engine {name}"] = f"no report ({type(e).__name__}: {e})"
    return info


def engine_status(names: list[str]) -> tuple[list[str], dict[str, tuple[list[str], str | None]]]:
    """The engines among ``names`` whose packages are all installed, and each other one with the packages it
    lacks and its ``install_hint``."""
    from logdiff.sources.registry import get_engine

    installed: list[str] = []
    missing: dict[str, tuple[list[str], str | None]] = {}
    for name in names:
        try:
            engine = get_engine(name)
            lacks = [pkg for pkg, version in engine.versions().items() if version is None]
            hint = engine.install_hint
        except Exception as e:  # noqa: BLE001 - an engine that cannot say is reported as such, never fatal
            lacks, hint = [f"its versions unknown: {type(e).__name__}"], None
        if lacks:
            missing[name] = (lacks, hint)
        else:
            installed.append(name)
    return installed, missing


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
