"""The ``npu`` backend of consistent mode: vllm-ascend with its batch-invariant build.

**Coded against vllm-ascend's published sources and docs (user_guide/feature_guide/
batch_invariance); not yet run on NPU hardware.** vllm-ascend's batch-invariant mode
needs its custom operator library (``batch_invariant_ops``, built only when
``VLLM_BATCH_INVARIANT=1`` is set while building vllm-ascend, Atlas A2/A3) and
``VLLM_BATCH_INVARIANT=1`` when the engine starts; it then overrides ``aten::mm``,
``matmul``, ``sum``, ``_log_softmax`` and ``log_softmax`` for the ``NPU`` key.
HCCL collectives are deterministic only with ``HCCL_DETERMINISTIC=true``.

What this backend does: refuse (one line) an engine without that build or that
setting, or over more than one NPU; replace what is platform neutral exactly as on
CPU and CUDA (``plan``: RMSNorm, RoPE, SiLU-and-mul, soft cap, the sampler's
log-softmax); and *leave* to vllm-ascend, listed in ``ConsistentVLLM.left`` with no
bitwise claim, what it has not been shown to reach bitwise: the linear layers
(vllm-ascend's own linear methods and fused ops), attention (its ``AscendAttentionBackendImpl``
over its own cache layout), MLA and MoE.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from logdiff.sources.vllm.consistent.plan import Left


class NPUBackend:
    """``plan.Backend`` for ``current_platform.device_type == "npu"`` (vllm-ascend)."""

    name = "npu"

    def check(self, config: Any) -> None:
        import vllm.envs as envs

        if importlib.util.find_spec("batch_invariant_ops") is None:
            raise NotImplementedError(
                "consistent mode on Ascend needs vllm-ascend's batch-invariant build "
                "(VLLM_BATCH_INVARIANT=1 set while building vllm-ascend)"
            )
        if not envs.VLLM_BATCH_INVARIANT:
            raise NotImplementedError(
                "consistent mode on Ascend needs VLLM_BATCH_INVARIANT=1 in the environment before the engine starts"
            )
        if config.parallel_config.world_size > 1:
            raise NotImplementedError("consistent mode on Ascend covers a single-NPU (TP=1, PP=1) engine only")

    def linear(self, module: Any, shared_expert: bool = False) -> Left:
        return Left(f"{type(module.quant_method).__name__} (vllm-ascend's batch-invariant matmul)")

    def attention(self, layer: Any) -> Left:
        return Left(f"{type(layer.impl).__name__} (vllm-ascend's attention)")

    def mla(self, layer: Any) -> Left:
        return Left(f"MLA core {type(layer.impl).__name__} (vllm-ascend)")

    def moe(self, runner: Any) -> Left:
        return Left("fused MoE experts (vllm-ascend)")
