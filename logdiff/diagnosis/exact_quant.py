"""The exact function of a quantized linear (INT8 W8A8, compressed-tensors), in fp64, with its rounding bound.

A quantized rollout engine does not compute ``x @ W.T``: it quantizes each token's activation to int8 with
a per-token scale, multiplies by the int8 weight with per-channel scales, and rounds. Judged against the
plain linear, every one of its linears is far outside the rounding bound, and a kernel bug inside the
quantized GEMM would hide among them. So a side whose contract names the INT8 scheme at a linear is judged
against that scheme's own function (issue 51, item 4):

    z = (q_x * s_x) @ (q_w * s_w).T + b        (fp64)

with ``q_w, s_w`` the scheme's quantization of the training model's weight (``kernels/int8.quantize_weight``:
the weight check verifies the engine holds exactly those) and ``q_x, s_x`` the scheme's quantization of the
side's own recorded input rows (``kernels/int8.quantize_activation``, vLLM-CPU's rounding, bitwise). The
quantization is part of the function, not of its error: its effect is the contract difference
(``framework_difference`` of kind ``quantization``), and only what an engine adds beyond it is measured here.

**Scale and bound** (derived in docs/kernels.md, "Quantized linear: the exact function and its bound").
The integer products ``q_x q_w`` are exact and every INT8 GEMM accumulates them exactly (int32: exact for
K < 2**17; fp32 partial sums: exact up to 2**24). What an implementation of the scheme rounds is the
epilogue: ``float(acc)``, ``* s_w``, ``* s_x``, ``+ b`` in fp32 (each at most ``eps32 / 2`` of its value),
and the output once to its dtype, or twice where the GEMM's output is rounded before the bias is added. So
the scale is ``|P| + |b|`` with ``P = s_x s_w acc`` the dequantized product, not the sum of the absolute
products: cancellation inside an exact integer sum loses nothing, and the bound is ``OpBound(3)``
(three roundings to the output dtype at that scale, the fp32 steps far inside it). This is about
``sum |x w| / |x w|`` times tighter than the plain linear's bound, which matters: measured on bf16 rows,
the whole INT8 quantization error of a correct engine is *inside* the plain linear's bound (0.52 of its
3 units at K = 256, 0.17 at K = 4096), and so are faults inside the quantized GEMM of that size (activations
rounded toward -inf). An implementation that accumulates the integer products in fp32 past
``2**24`` (a dequantizing fallback) adds at most ``K * eps32`` of ``sum |q_x s_x| |q_w s_w|``: an absolute
allowance (fp32's, whatever the output dtype), twice that with the slack.

**Allowance: rounding ties of the activation.** ``x * (1 / s_x)`` is a real number that the engine computes
in fp32 (CPU: the product with an fp32 inverse; a GPU kernel may divide instead, or compute ``s_x`` as
``amax * (1 / 127)``). Where it lies within ``ALLOWANCE_SPACINGS`` fp32 spacings of a half-integer, two
correct implementations of the scheme may round it to neighbouring integers: one step of ``s_x`` times the
weight column. The allowance adds, per output, ``s_x * sum |q_w s_w|`` over those elements of the row (rare:
a few per thousand elements at most), so an implementation of the scheme is never blamed for a tie it broke
the other way, while a wrong rounding mode or scale moves most elements by a step and stays far outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from logdiff.diagnosis.exact import Exact
from logdiff.diagnosis.spacing import EPS32, OpBound
from logdiff.probes.quantization import ignores

#: the scheme name the contracts give the INT8 W8A8 compressed-tensors scheme (``probes/quantization.py``)
INT8_W8A8 = "int8-w8a8"
#: fp32 spacings of ``x / s_x`` within which two implementations of the scheme may round to different integers
ALLOWANCE_SPACINGS = 4.0


def scheme_at(contract: dict[str, Any], module: str) -> str | None:
    """The quantization scheme ``contract`` applies at the linear ``module`` (``model.layers.0.mlp.down_proj``):
    the scheme's name (``int8-w8a8``, ``fp8-block``, ...) where the contract's ``quantization`` names one and
    ``quantization_ignored`` does not list the module (a name, a name's last parts, or compressed-tensors' ``re:``
    pattern), else None (a plain linear). Only ``INT8_W8A8`` has an exact function here (``has_exact_function``)."""
    scheme = contract.get("quantization")
    if not isinstance(scheme, str) or scheme.split(":", 1)[0].strip() in ("", "off"):
        return None
    return None if ignores(str(contract.get("quantization_ignored") or ""), module) else scheme.split(":", 1)[0].strip()


def has_exact_function(scheme: str) -> bool:
    """Whether a linear quantized under ``scheme`` can be judged here. Another scheme's linear (FP8) is not judged
    at all: against the plain linear every correct one would fall outside, a wrong ``semantic`` cause per linear."""
    return scheme == INT8_W8A8


def quantized_linear_of(weight: Any, bias: Any | None = None) -> Callable[[Any], Exact]:
    """The exact INT8 W8A8 linear of the training model's ``weight`` (quantized once), for many calls."""
    import torch

    from logdiff.kernels.int8 import dequantize_weight, int_dot, quantize_activation, quantize_weight

    q_w, s_w = quantize_weight(weight)
    k = int(q_w.shape[1])
    qw_abs = q_w.to(torch.float32).abs()
    w_hat_abs = dequantize_weight(q_w, s_w).double().abs()
    s_w64 = s_w.double().reshape(1, -1)
    b64 = bias.detach().double() if bias is not None else None

    def exact_quantized_linear(x: Any) -> Exact:
        rows = x.detach().reshape(-1, k)
        q, s = quantize_activation(rows)
        s64 = s.double()
        z = int_dot(q, q_w) * s64 * s_w64
        terms = (q.to(torch.float32).abs() @ qw_abs.t()).double() * s64 * s_w64  # a magnitude: fp32 will do
        scale = z.abs()
        t = rows.double() / s64.clamp_min(1e-300)
        tie = ((t - t.floor() - 0.5).abs() <= ALLOWANCE_SPACINGS * EPS32 * t.abs()) & (s64 > 0)
        allowance = (tie.double() @ w_hat_abs.t()) * s64 + 2.0 * k * EPS32 * terms
        if b64 is not None:
            z = z + b64
            scale = scale + b64.abs()
        shape = (*x.shape[:-1], q_w.shape[0])
        what = f"int8_w8a8_linear(K={k}, per-token int8 activations, per-channel int8 weights)"
        return Exact(z.reshape(shape), scale.reshape(shape), OpBound(3.0), what, allowance.reshape(shape))

    return exact_quantized_linear
