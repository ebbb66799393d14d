"""Consistent mode's replacement forwards for HF's linear, norm, MLP and MoE modules.

Each function takes one module (as the plan in ``consistent._plan`` found it) and returns the
``forward`` that ``consistent.consistent_hf`` sets on that instance: the same computation
through ``logdiff.kernels`` (``linear``, ``rms_norm``/``gemma_rms_norm``, ``softcap``, the gated
``silu_and_mul``/``gelu_tanh_and_mul``, ``moe_route``/``moe_route_grouped``, ``moe_experts`` and
gpt-oss's ``moe_experts_oai``). Parameters are read from the module at each call, never copied,
so training that moves them is seen. Nothing here checks whether a module is covered: the plan
did that before anything was patched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def linear_forward(module: Any) -> Callable:
    from logdiff import kernels

    def forward(x: Any) -> Any:
        return kernels.linear(x, module.weight, module.bias)

    return forward


def norm_forward(module: Any, offset: bool) -> Callable:
    """``rms_norm``, or ``gemma_rms_norm`` for a ``(1 + w)`` norm (whose eps HF calls ``eps``)."""
    from logdiff import kernels

    if offset:
        return lambda hidden_states: kernels.gemma_rms_norm(hidden_states, module.weight, module.eps)

    def forward(hidden_states: Any) -> Any:
        return kernels.rms_norm(hidden_states, module.weight, module.variance_epsilon)

    return forward


def softcapped_logits_forward(module: Any, cap: float) -> Callable:
    """``lm_head`` with the final soft cap folded in (HF's own cap is switched off meanwhile)."""
    from logdiff import kernels

    return lambda x: kernels.softcap(kernels.linear(x, module.weight, module.bias), cap)


def mlp_forward(module: Any, parts: tuple[str, ...], gated: str = "silu_and_mul") -> Callable:
    """``down(act(gate(x)) * up(x))`` with the ``gated`` kernel; three parts (gate_up, down, act) mean a
    packed gate/up (Phi-3)."""
    from logdiff import kernels

    act_mul = getattr(kernels, gated)
    if len(parts) == 3:
        gate_up, down = getattr(module, parts[0]), getattr(module, parts[1])

        def fused(x: Any) -> Any:
            return down(act_mul(*gate_up(x).chunk(2, dim=-1)))

        return fused
    gate, up, down = (getattr(module, p) for p in parts[:3])

    def forward(x: Any) -> Any:
        return down(act_mul(gate(x), up(x)))

    return forward


def router_forward(
    module: Any, renormalize: bool, rule: dict | None = None, bias_of: Callable | None = None
) -> Callable:
    """Softmax top-k routing, or with a ``rule`` the grouped, bias-corrected one on fp32 logits (as HF's
    DeepSeek-V3 and GLM-4.5 routers compute them); ``bias_of`` reads the router's correction bias at
    each call (training may move it)."""
    from logdiff import kernels

    def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
        rows = hidden_states.reshape(-1, module.weight.shape[1])
        if rule is None:
            router_logits = kernels.linear(rows, module.weight, getattr(module, "bias", None))  # gpt-oss: biased
            weights, ids = kernels.moe_route(router_logits, int(module.top_k), renormalize)
            return router_logits, weights, ids
        router_logits = kernels.linear(rows.float(), module.weight)  # fp32 GEMM (the kernel casts the weight)
        bias = bias_of(module) if bias_of is not None else None
        weights, ids = kernels.moe_route_grouped(router_logits, int(module.top_k), renormalize, bias=bias, **rule)
        return router_logits, weights, ids

    return forward


def experts_forward(module: Any, parts: tuple[str, ...]) -> Callable:
    from logdiff import kernels

    gate_up, down = parts

    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        return kernels.moe_experts(hidden_states, top_k_weights, top_k_index, getattr(module, gate_up), getattr(module, down))

    return forward


#: a gpt-oss experts module's parameters and constants
OAI_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "alpha", "limit")


def oai_experts_forward(module: Any) -> Callable:
    """gpt-oss's experts (``gate_up_proj [E, H, 2I]``, gate/up interleaved, biased, clamped SwiGLU) through
    ``moe_experts_oai``, which takes vLLM's ``[E, 2I, H]`` layout: HF's tensors transposed, read at each call
    (training may move them)."""
    from logdiff import kernels

    def forward(hidden_states: Any, router_indices: Any, routing_weights: Any) -> Any:
        m = module
        return kernels.moe_experts_oai(
            hidden_states, routing_weights, router_indices, m.gate_up_proj.transpose(1, 2), m.gate_up_proj_bias,
            m.down_proj.transpose(1, 2), m.down_proj_bias, float(m.alpha), float(m.limit),
        )

    return forward
