"""``vllm-ascend``: the ``vllm`` engine on Huawei Ascend NPUs, through the vllm-ascend platform plugin.

**Coded against the published APIs of vllm-ascend and torch_npu; not yet run on NPU
hardware.** vllm-ascend registers itself as a vLLM platform plugin: once it is
installed, ``vllm.LLM`` runs on ``current_platform.device_type == "npu"`` with the
same model classes. So this engine *is* the ``vllm`` engine (same probes, same
correspondence, the parent's module mapping inherited as a subclass), plus:

* ``check_available`` fails in one line (``EngineUnavailable``, exit 3) when
  ``torch_npu`` or ``vllm_ascend`` is missing, or when vLLM's platform is not the NPU;
* consistent mode picks the ``npu`` backend (``consistent.NPUBackend``) from the
  platform, as ``cpu``/``cuda`` are picked.

Everything NPU is imported lazily: importing this module needs neither package.
Install: ``pip install 'logdiff[npu]'`` and a vllm-ascend matching the CANN toolkit
(its batch-invariant operator library is built only with ``VLLM_BATCH_INVARIANT=1``
set at build time; ``logdiff doctor`` says whether it is there).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from logdiff.errors import EngineUnavailable
from logdiff.sources.base import package_version
from logdiff.sources.vllm import VLLMEngine

#: env variable -> what consistent mode needs of it on the NPU
HCCL_ENV = {"HCCL_DETERMINISTIC": "npu: true for deterministic HCCL collectives (more than one NPU)"}
NPU_HINT = "install it with: pip install 'logdiff[npu]' and a vllm-ascend matching your CANN toolkit"


def import_ascend() -> None:
    """Import ``torch_npu`` and ``vllm_ascend``; one-line ``EngineUnavailable`` when either is missing or broken."""
    for module, label in (("torch_npu", "torch_npu"), ("vllm_ascend", "vllm-ascend")):
        try:
            importlib.import_module(module)
        except ImportError:
            raise EngineUnavailable(f"{label} is not installed; {NPU_HINT}") from None
        except Exception as e:  # noqa: BLE001 - a broken install (no CANN, no device) raises anything
            raise EngineUnavailable(f"{label} failed to import ({type(e).__name__}: {e}); {NPU_HINT}") from None


class VLLMAscendEngine(VLLMEngine):
    """vLLM decode and prefill paths on an Ascend NPU (the ``vllm`` engine on vllm-ascend's platform)."""

    name = "vllm-ascend"
    install_hint = NPU_HINT

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {**super().versions(), "vllm_ascend": package_version("vllm-ascend", "vllm_ascend"),
                "torch_npu": package_version("torch_npu", "torch-npu")}

    @classmethod
    def doctor(cls) -> dict[str, Any]:
        """vllm-ascend and torch_npu, HCCL's determinism and whether vllm-ascend was built batch-invariant (its
        operator library exists only when built with ``VLLM_BATCH_INVARIANT=1``); vLLM's own report comes from
        the ``vllm`` engine."""
        from logdiff.sources.vllm.doctor import env_settings

        info: dict[str, Any] = env_settings(HCCL_ENV)
        ascend = package_version("vllm-ascend", "vllm_ascend")
        info["vllm_ascend"] = ascend or f"not installed (Ascend: {NPU_HINT})"
        if ascend:
            built = importlib.util.find_spec("batch_invariant_ops") is not None
            info["vllm_ascend_batch_invariant_build"] = (
                "yes" if built else "no (rebuild vllm-ascend with VLLM_BATCH_INVARIANT=1 set)")
        info["torch_npu"] = package_version("torch_npu", "torch-npu") or "not installed"
        return info

    @classmethod
    def check_available(cls) -> None:
        import_ascend()
        super().check_available()  # vLLM's own checks (the capture plugin's variable)
        from vllm.platforms import current_platform

        if current_platform.device_type != "npu":
            raise EngineUnavailable(
                f"vllm-ascend is installed but vLLM runs on {current_platform.device_type!r}, not the NPU "
                "(is the 'ascend' platform plugin disabled by VLLM_PLUGINS?)"
            )
