"""Reference consistent (batch-invariant) kernels.

Every kernel gives a row (token, query) bits that do not depend on how many
other rows share the call, on prefill vs decode vs chunked prefill, or on
padding, and sits beside a plain-torch ``<name>_reference`` written for
obviousness. Installing the same kernels into two engines (``consistent_hf``,
``consistent_vllm``) makes them compute bitwise-equal logprobs.
See ``docs/kernels.md`` for the design of each one.

The kernels are differentiable: called where autograd records (grad mode on,
an input requiring grad) they run as ``torch.autograd.Function``s whose
backward keeps the same fixed-order discipline; otherwise they take the plain
inference path (``differentiable.py``).

This package imports nothing else of logdiff; it needs torch (import it lazily
from a CLI command). The names are imported eagerly on purpose: ``attention``
and ``rope`` are both a function and a submodule, and only an eager
``from .x import x`` keeps the function bound on the package.
"""

from .activation import gelu_tanh_and_mul, gelu_tanh_and_mul_reference, silu_and_mul, silu_and_mul_reference
from .activation import swiglu_oai_and_mul, swiglu_oai_and_mul_reference
from .caches import KernelCaches, kernel_caches
from .collective import chunked_linear, row_parallel_linear
from .attention import KV_BLOCK, Q_TILE, attention, attention_batched, attention_heads_first, attention_reference
from .fixed_order import exp, halving_sum, log, pairwise_sum, tanh
from .logsoftmax import log_softmax, log_softmax_reference, token_log_probs
from .matmul import M_TILE, N_TILE, N_TILED_MAX, fp32_weight_cache, linear, linear_reference, weight_cache
from .moe import (
    moe_combine,
    moe_combine_reference,
    moe_experts,
    moe_experts_oai,
    moe_route,
    moe_route_grouped,
    moe_route_grouped_reference,
    moe_route_reference,
)
from .registry import KERNELS, KernelInfo, SelfTestResult, consistent_kernels, self_test
from .rmsnorm import gemma_rms_norm, gemma_rms_norm_reference, rms_norm, rms_norm_reference
from .softcap import softcap, softcap_reference
from .int8 import fake_quant_linear, int8_linear, int8_linear_reference
from .rope import (
    RopeParams,
    rope,
    rope_apply,
    rope_cos_sin,
    rope_inv_freq,
    rope_inv_freq_reference,
    rope_params,
    rope_reference,
    rope_table_reference,
)

__all__ = [
    "KERNELS",
    "KV_BLOCK",
    "KernelCaches",
    "M_TILE",
    "N_TILE",
    "N_TILED_MAX",
    "Q_TILE",
    "KernelInfo",
    "RopeParams",
    "SelfTestResult",
    "attention",
    "attention_batched",
    "attention_heads_first",
    "attention_reference",
    "chunked_linear",
    "consistent_kernels",
    "exp",
    "fp32_weight_cache",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_reference",
    "gemma_rms_norm",
    "gemma_rms_norm_reference",
    "halving_sum",
    "kernel_caches",
    "linear",
    "linear_reference",
    "log",
    "log_softmax",
    "log_softmax_reference",
    "moe_combine",
    "moe_experts_oai",
    "swiglu_oai_and_mul",
    "swiglu_oai_and_mul_reference",
    "moe_combine_reference",
    "moe_experts",
    "moe_route",
    "moe_route_grouped",
    "moe_route_grouped_reference",
    "moe_route_reference",
    "pairwise_sum",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_apply",
    "rope_cos_sin",
    "rope_inv_freq",
    "rope_inv_freq_reference",
    "rope_params",
    "rope_reference",
    "rope_table_reference",
    "row_parallel_linear",
    "self_test",
    "silu_and_mul",
    "silu_and_mul_reference",
    "softcap",
    "softcap_reference",
    "fake_quant_linear",
    "int8_linear",
    "int8_linear_reference",
    "tanh",
    "token_log_probs",
    "weight_cache",
]
