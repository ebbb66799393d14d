"""Consistent mode for a real, in-process vLLM engine (vLLM 0.32; CPU build, CUDA, Ascend).

``with consistent_vllm(llm): ...`` swaps every operator on the numerical path
of ``llm``'s model for the reference kernels in ``logdiff.kernels`` and puts
every original back on exit, exceptions included. The same kernels installed
into HF by ``consistent_hf`` then give bitwise-equal logprobs on both sides.

The package: ``plan`` walks the model and decides, before anything is patched,
what is replaced and what is refused (platform neutral); a backend per platform
(``cpu``, ``cuda``, ``npu`` in ``logdiff.sources.vllm_ascend``), picked from
``vllm.platforms.current_platform``, says how each module is reached there. The
table below is the ``cpu`` backend (the one that has run); ``cuda.py`` lists what
differs on CUDA, where some ops may be *left* to vLLM's batch-invariant kernels
(``ConsistentVLLM.left``: no bitwise claim for them).

What is replaced on CPU (all as *instance* attributes: classes are never touched):

==========================  ==========================================  ==================
vLLM object                 attribute                                   kernel
==========================  ==========================================  ==================
linear layers, lm_head      ``layer.cpu_linear`` (layers/utils.py,      ``linear``
(anything with a CPU GEMM)  ``dispatch_cpu_unquantized_gemm``)
``RMSNorm``                 ``forward`` (with/without fused residual)   ``rms_norm``
``RotaryEmbedding``, its    ``forward`` (the module's ``RopeParams``,   ``rope``
llama3, linear and yarn     checked against its ``_compute_inv_freq``)
subclasses, DeepSeek's
``DeepseekScaling...``
``GemmaRMSNorm``            ``forward`` (``(1 + w)``, same fusions)      ``gemma_rms_norm``
``SiluAndMul``              ``forward``                                 ``silu_and_mul``
``GeluAndMul`` (tanh)       ``forward``                                 ``gelu_tanh_and_mul``
``LogitsProcessor`` with    ``forward`` (its ``_get_logits``, then the  ``softcap``
a ``soft_cap`` (Gemma 2)    kernel's cap)
``Attention.impl``          ``forward`` (v1/attention/backends/         ``attention``
(CPUAttentionBackendImpl)   cpu_attn.py); the cache write is kept;
                            its ``sinks`` (gpt-oss) go to the kernel
``MLAAttention``            ``forward_impl`` (layers/attention/         ``latent_attention``
(DeepSeek, CPU or AMX MLA)  mla_attention.py): every request from the
                            paged latent cache (``kv_cache.
                            LatentCacheReader``), no absorbed decode;
                            vLLM's cache write is kept; its wrapper
                            (``MultiHeadLatentAttentionWrapper``) only
                            calls patched children
``MoERunner``               ``forward`` (fused_moe/runner/moe_runner;   ``moe_route`` or
                            gate GEMM, router and fused experts; a      ``moe_route_grouped``,
                            shared expert through its own patched       ``moe_experts``
                            linears and ``SiluAndMul``, added last;     (gpt-oss:
                            gpt-oss's biased ``swigluoai`` experts)     ``moe_experts_oai``)
``model_runner.sampler``    ``compute_logprobs`` (v1/sample/sampler.py; ``log_softmax``
                            also the prompt-logprobs path)
==========================  ==========================================  ==================

The plan is built and checked *before* anything is patched: a module on the
numerical path that no replacement covers (another norm, a RoPE class other
than ``RotaryEmbedding``, its llama3, linear and yarn subclasses and DeepSeek's
yarn (dynamic NTK, ...),
a quantized layer, speculative decoding, ...) raises
``NotImplementedError`` naming it, rather than giving a silently half-consistent
engine. Weights that the CPU build has packed away are recovered bit-exactly
(``weights``). The prefix cache is reset on entry and on exit, because a
cached block computed in the other mode would leak its numerics into this one.

The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator
from typing import Any

from logdiff.probes.patching import Patches
from logdiff.sources.vllm.consistent.plan import Backend, ConsistentVLLM, build_plan

__all__ = ["ConsistentVLLM", "backend_for", "consistent_vllm", "engine_objects", "is_active"]

_ACTIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # models currently in consistent mode


@contextlib.contextmanager
def consistent_vllm(llm: Any, only: Collection[str] | None = None) -> Iterator[ConsistentVLLM]:
    """Run ``llm`` (a ``vllm.LLM``) on the logdiff reference kernels inside the block.

    ``only`` limits the swap to some op families (``linear``, ``rms_norm``, ``rope``,
    ``silu_and_mul``, ``attention``, ``moe``, ``log_softmax``): attribution installs
    one family at a time.
    """
    from logdiff import kernels

    model, runner = engine_objects(llm)
    if model in _ACTIVE:
        raise RuntimeError("consistent mode is already active on this engine")
    backend = backend_for()
    plan, summary = build_plan(llm, model, runner, backend)
    if only is not None:
        summary.replaced = {k: v for k, v in summary.replaced.items() if k in only}
    _ACTIVE.add(model)
    try:
        with Patches() as patches:
            # Registered first, so it runs last: once every original is back.
            patches.on_exit(lambda: _reset_prefix_cache(llm))
            _reset_prefix_cache(llm)
            for kind, obj, name, value in plan:
                if only is None or kind in only:
                    patches.set(obj, name, value)
            with kernels.weight_cache(), _platform_context(backend):
                yield summary
    finally:
        _ACTIVE.discard(model)


def backend_for(device_type: str | None = None) -> Backend:
    """The consistent-mode backend of ``device_type`` (default: vLLM's ``current_platform``)."""
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type
    if device_type == "cpu":
        from logdiff.sources.vllm.consistent.cpu import CPUBackend

        return CPUBackend()
    if device_type == "cuda":
        from logdiff.sources.vllm.consistent.cuda import CUDABackend

        return CUDABackend()
    if device_type == "npu":
        from logdiff.sources.vllm_ascend.consistent import NPUBackend

        return NPUBackend()
    raise NotImplementedError(f"consistent mode has no backend for vLLM platform {device_type!r}")


def _platform_context(backend: Backend) -> Any:
    """The backend's own context for the block (the CUDA aten overrides), or none."""
    context = getattr(backend, "context", None)
    return context() if context is not None else contextlib.nullcontext()


def is_active(model: Any) -> bool:
    """Whether consistent mode is on for ``model`` (the live model of ``engine_objects``)."""
    return model in _ACTIVE


def engine_objects(llm: Any) -> tuple[Any, Any]:
    """The live model and model runner; both exist only for an in-process engine."""
    holder: list[Any] = []
    llm.apply_model(holder.append)
    runners = llm.collective_rpc(_model_runner)
    if not holder or not runners or runners[0] is None or runners[0].get_model() is not holder[0]:
        raise RuntimeError(
            "consistent mode needs the engine in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it"
        )
    return holder[0], runners[0]


def _model_runner(worker: Any) -> Any:
    return getattr(worker, "model_runner", None)


def _reset_prefix_cache(llm: Any) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("could not reset vLLM's prefix cache (requests still running?)")
