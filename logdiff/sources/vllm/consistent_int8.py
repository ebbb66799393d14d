"""Consistent mode for an INT8 W8A8 rollout: vLLM's quantized linears on ``kernels.int8_linear``.

A compressed-tensors W8A8 int8 checkpoint loads each targeted linear with ``CompressedTensorsLinearMethod``
and the ``CompressedTensorsW8A8Int8`` scheme; its ``apply(layer, x, bias)`` quantizes the activations per
token and runs the platform's int8 GEMM (oneDNN on x86 without AMX, the sgl kernel with AMX, CUTLASS on
CUDA). Consistent mode replaces that ``apply`` (an instance attribute of the layer's own ``quant_method``)
with ``kernels.int8_linear`` on the layer's int8 weight and per-channel scales: the function the HF side's
``fake_quant_linear`` computes from the trainer's weight (``sources/hf/consistent_quant.py``), bitwise.

**The weight.** vLLM drops the int8 weight after loading: the oneDNN path hands it to a prepacked handler
(``layer.weight`` becomes None), the sgl path re-lays it out for VNNI. It is recovered through the layer's
own ``apply``: negated identity rows ``-e_k`` (one token per input channel) quantize to ``-127 e_k`` with the
scale ``1/127``, so row ``k`` of the output is ``-q_w[:, k] * s_w`` up to the epilogue's roundings (fp32 ones
when the rows go in as fp32: far under a step), and ``round(-out / s_w)`` is ``q_w`` exactly. The scales are
the layer's ``weight_scale``. The rows are negated because a host without VNNI (AVX2) runs oneDNN's s8s8
GEMM as ``u8 x s8`` on the activations plus 128, summing each pair of products in int16 with saturation
(``int8_host.py``): ``+127`` becomes 255 and its pair can saturate, ``-127`` becomes 1 and no pair of a
one-hot row can (``1 * 127 + 128 * 127 < 2**15``), so the recovery reads the weights on every x86 host. The
recovery is checked: every recovered value must lie within a quarter step of the layer's output, else the
layer is refused.

Covered: the channel-wise weight strategy with dynamic, symmetric per-token activations (the scheme
``logdiff quantize --scheme int8-w8a8`` writes, llm-compressor's W8A8 preset). Refused, naming the layer:
static or asymmetric activations, per-tensor weights, and linear transforms.
"""

from __future__ import annotations

from typing import Any

#: identity rows per call of the layer's own apply during recovery
RECOVERY_ROWS = 256


def int8_problem(module: Any) -> str | None:
    """Why ``module``'s quantized linear has no consistent kernel, or None (an INT8 W8A8 layer covered here)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Int8

    qm = getattr(module, "quant_method", None)
    scheme = getattr(module, "scheme", None)
    if type(qm) is not CompressedTensorsLinearMethod or not isinstance(scheme, CompressedTensorsW8A8Int8):
        return f"quantized: {type(qm).__name__}" + (f" ({type(scheme).__name__})" if scheme is not None else "")
    if str(getattr(scheme.strategy, "value", scheme.strategy)) != "channel":
        return f"INT8 W8A8 with {scheme.strategy} weight scales (only per-channel is covered)"
    if scheme.is_static_input_scheme or not scheme.input_symmetric:
        return "INT8 W8A8 with static or asymmetric activations (only dynamic symmetric per-token is covered)"
    return None


def recover_int8_weight(module: Any, dtype: Any) -> tuple[Any, Any]:
    """``(q_w int8 [N, K], s_w fp32 [N, 1])`` of a loaded INT8 W8A8 layer, through its own ``apply``.

    The identity rows go in fp32 where the layer's kernel takes them (its output then carries fp32
    roundings only), else in the model's ``dtype``; either way every recovered value must lie within a
    quarter step of the output (a bf16 output rounds ``q s_w`` by up to ``2**-8 |q|``: recoverable only
    for small ``|q|``), or the layer is refused."""
    import torch

    s_w = module.weight_scale.detach().to(torch.float32).reshape(-1, 1)
    for probe_dtype in (torch.float32, dtype):
        try:
            out = _identity_outputs(module, probe_dtype, s_w.device)
        except (RuntimeError, TypeError, ValueError):  # a kernel without fp32 inputs (AMX's sgl path)
            continue
        ratio = out / s_w
        q = torch.round(ratio)
        if bool(((ratio - q).abs() <= 0.25).all()) and not bool((q.abs() > 128).any()):
            return q.to(torch.int8).contiguous(), s_w.contiguous()
    raise NotImplementedError("INT8 W8A8 weight could not be recovered exactly from the layer's output")


def _identity_outputs(module: Any, dtype: Any, device: Any) -> Any:
    """``[N, K]``: the layer's output for each negated one-hot input row, negated (``q_w * s_w`` up to the
    epilogue's rounding)."""
    import torch

    k = int(module.input_size_per_partition)
    rows = []
    with torch.no_grad():
        for start in range(0, k, RECOVERY_ROWS):
            n_rows = min(RECOVERY_ROWS, k - start)
            eye = torch.zeros(n_rows, k, dtype=dtype, device=device)
            eye[torch.arange(n_rows), torch.arange(start, start + n_rows)] = -1  # -127 after quantization
            rows.append(-module.quant_method.apply(module, eye, None).to(torch.float32))
    return torch.cat(rows).t()


def int8_apply(q_w: Any, s_w: Any) -> Any:
    """The replacement of ``layer.quant_method.apply(layer, x, bias=None)``: ``kernels.int8_linear``."""
    import torch

    from logdiff.kernels.int8 import int8_linear

    q_w = q_w.to(torch.float32)  # widened once (exact integers): int_dot's GEMMs take it as is

    def apply(layer: Any, x: Any, bias: Any = None) -> Any:
        return int8_linear(x, q_w, s_w, bias)

    return apply


def int8_linear_patch(module: Any, dtype: Any) -> tuple[Any, str, Any] | str:
    """The patch ``(module.quant_method, "apply", replacement)``, or why there is none."""
    problem = int8_problem(module)
    if problem:
        return problem
    try:
        q_w, s_w = recover_int8_weight(module, dtype)
    except NotImplementedError as e:
        return str(e)
    return module.quant_method, "apply", int8_apply(q_w, s_w)
