"""The exact function of a routed MoE block, in fp64, with its rounding bound.

A block is two ops the probes see apart: the router (``x @ W_r.T (+ b)``, the
logits, checked like any linear: ``exact.linear``) and the routed experts
with their weighted sum, checked here. The block's exact function on one
side takes that side's recorded input rows ``x``, its recorded router logits
and, where the block adds one, its recorded shared-expert output, and
computes from their definitions (the Switch / Mixtral / DeepSeek-V2/V3 /
GLM-4.5 / gpt-oss model cards):

1. **routing** under the side's own rule (``routing_rules.Rule`` from its
   contract: top-k, softmax or sigmoid scoring, the correction bias steering
   the choice, grouped top-k with ``n_group`` / ``topk_group``,
   renormalisation, ``routed_scaling_factor``) on the side's recorded logits:
   the router's rounding is the router op's own error (judged there), and a
   decision that flips against the exact logits is exactly a flip that the
   router's rounding, within its bound, can cause;
2. **each chosen expert**: ``act(x W_g^T + b_g) * (x W_u^T + b_u)`` then
   ``W_d`` (+ ``b_d``), with SiLU, or gpt-oss's clamped SwiGLU
   ``(clamp(u, -l, l) + 1) * g' sigmoid(alpha g')`` with ``g' = min(g, l)``;
3. **the weighted sum** of the chosen experts' outputs, plus the shared
   expert's output where the block has one.

A stock implementation accumulates each GEMM in fp32 and rounds the gate and
up outputs, the activation, the product, the down projection, each weight,
each weighted output and each partial sum to the output dtype (spacing
``eps``). Cancellation inside the experts is strong (an expert's output is far
smaller than ``|x| @ |W|``), so the bound is not one magnitude scale times a
rounding count, as for a single GEMM, but the first-order error itself, each
rounding at the value it rounds (``r = eps32 / eps``, ``K`` the reduction):

    e_g = |g|/2 + K r s_g          (likewise e_u; s_g = |x| @ |W_g|^T + |b_g|)
    e_h = |dh/dg| e_g + |dh/du| e_u + |h|
    e_y = e_h @ |W_d|^T + |y| + K r (|h| @ |W_d|^T)
    e   = sum_k w_k e_y,k + (5 + k) / 2 * sum_k |w_k y_k| + |shared| / 2 + |out| / 2

``dh/dg`` and ``dh/du`` are the activation's derivatives (zero where
gpt-oss's clamp holds); the ``sum |w y|`` term holds the weights' rounding
(twice: gpt-oss computes its softmax in bf16), each product's and each of the
``k`` partial sums'. ``Exact.scale`` is this ``e`` in units of ``eps`` and the
bound one rounding's worth with the usual slack. A side that routes by another
rule, scores with another function, scales its weights otherwise or holds
another expert's weights moves some output by far more.

A token whose routing is an exact tie under its own logits (two experts at
the k-th place, as bf16 logits can be) could have gone either way: it is
left unjudged (infinite scale) and counted in the function's description.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from logdiff.diagnosis.exact import Exact, _f64
from logdiff.diagnosis.routing_rules import Rule, decide
from logdiff.diagnosis.spacing import EPS32, OpBound

#: the activations of routed experts this module knows (``experts_activation`` of the adapters)
EXPERT_ACTIVATIONS = frozenset({"silu", "swiglu_oai"})


@dataclass(frozen=True)
class Experts:
    """One block's routed experts as the training model holds them, in one layout.

    ``gate_up [E, 2I, H]`` (gate rows then up rows, or interleaved pairs for
    ``swiglu_oai``), ``down [E, H, I]``, optional biases ``[E, 2I]`` / ``[E, H]``.
    Each expert is widened to fp64 only when a token chose it.
    """

    gate_up: Any
    down: Any
    gate_up_bias: Any = None
    down_bias: Any = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    fp32_units: float = EPS32 / 2.0**-7  # fp32's spacing in units of the output dtype's (bf16 by default)

    @classmethod
    def of(cls, module: Any, parts: tuple[str, ...], activation: str) -> Experts:
        """The experts of an HF fused-experts module (``experts_parts`` names gate_up and down); gpt-oss's
        transposed, biased layout is turned into the one above."""
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"no exact function for the experts' activation {activation!r}")
        gate_up, down = (getattr(module, p) for p in parts)
        if activation == "swiglu_oai":  # HF holds [E, H, 2I] and [E, I, H]
            return cls(gate_up.transpose(1, 2), down.transpose(1, 2), module.gate_up_proj_bias,
                       module.down_proj_bias, activation, float(module.alpha), float(module.limit))  # fmt: skip
        if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
            raise ValueError(f"no exact function for the experts layout of {type(module).__name__}")
        return cls(gate_up, down)

    def expert(self, e: int, x64: Any) -> tuple[Any, Any]:
        """``(y, e_y)``: expert ``e``'s fp64 output on rows ``x64`` and its first-order error in units of the
        output dtype's spacing ``eps`` (module docstring), with ``r = eps32 / eps`` (``fp32_units``)."""
        import torch

        w13, w2 = _f64(self.gate_up[e]), _f64(self.down[e])
        gu = x64 @ w13.T
        s_gu = x64.abs() @ w13.abs().T
        if self.gate_up_bias is not None:
            b = _f64(self.gate_up_bias[e])
            gu, s_gu = gu + b, s_gu + b.abs()
        hidden, inter = self.widths
        e_gu = gu.abs() / 2 + hidden * self.fp32_units * s_gu
        if self.activation == "swiglu_oai":
            g, u, e_g, e_u = gu[:, 0::2], gu[:, 1::2], e_gu[:, 0::2], e_gu[:, 1::2]
            gc, uc = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
            sig = torch.sigmoid(self.alpha * gc)
            glu = gc * sig
            h = (uc + 1) * glu
            dg = (g < self.limit) * (uc + 1) * (sig + self.alpha * gc * sig * (1 - sig))
            du = (u.abs() < self.limit) * glu
        else:
            half = gu.shape[1] // 2
            g, u, e_g, e_u = gu[:, :half], gu[:, half:], e_gu[:, :half], e_gu[:, half:]
            sig = torch.sigmoid(g)
            h = g * sig * u
            dg = sig * (1 + g * (1 - sig)) * u
            du = g * sig
        e_h = dg.abs() * e_g + du.abs() * e_u + h.abs()
        y = h @ w2.T
        if self.down_bias is not None:
            y = y + _f64(self.down_bias[e])
        e_y = e_h @ w2.abs().T + y.abs() + inter * self.fp32_units * (h.abs() @ w2.abs().T)
        return y, e_y

    @property
    def widths(self) -> tuple[int, int]:
        """(hidden, intermediate): the two reduction lengths."""
        return int(self.down.shape[1]), int(self.down.shape[2])


def tie_tolerance(values: np.ndarray) -> np.ndarray:
    """Per row, how near two ranked values must be for the side's own fp32 scoring to order them either way."""
    finite = np.where(np.isfinite(values), np.abs(values), 0.0)
    return 8 * EPS32 * (1.0 + finite.max(-1))


def routed(
    x: Any, logits: Any, experts: Experts, rule: Rule, bias: np.ndarray | None = None, shared: Any = None
) -> Exact:
    """The block's exact output on one side's rows ``x [N, H]``, routed by ``rule`` on that side's recorded
    ``logits [N, E]`` (``bias``: the correction bias steering the choice), plus its recorded ``shared`` output."""
    import torch

    x64 = _f64(x)
    d = decide(_f64(logits).numpy(), rule, bias)
    tied = d.margin <= tie_tolerance(d.choice)
    if d.group_margin is not None:
        tied |= d.group_margin <= tie_tolerance(d.group_scores)
    value = torch.zeros(x64.shape, dtype=torch.float64)
    carried = torch.zeros(x64.shape, dtype=torch.float64)  # sum_k w_k e_y,k
    weighted = torch.zeros(x64.shape, dtype=torch.float64)  # sum_k |w_k y_k|
    ids, weights = torch.from_numpy(d.ids), torch.from_numpy(d.weights)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        y, e_y = experts.expert(e, x64[rows])
        w = weights[rows, slot][:, None]
        value.index_add_(0, rows, w * y)
        carried.index_add_(0, rows, w.abs() * e_y)
        weighted.index_add_(0, rows, (w * y).abs())
    scale = carried + (5 + rule.top_k) / 2 * weighted
    if shared is not None:
        sh = _f64(shared)
        value, scale = value + sh, scale + sh.abs() / 2
    scale = scale + value.abs() / 2
    scale[torch.from_numpy(tied)] = float("inf")  # either choice was the side's to make: not judged
    what = f"moe({rule.describe()}, {experts.activation} experts" + (", + shared expert" if shared is not None else "")
    what += f", {int(tied.sum())} tied tokens not judged)" if tied.any() else ")"
    # ``scale`` is the first-order error in units of eps, every rounding counted in it: one rounding's bound
    return Exact(value, scale, OpBound(2.0), what)
