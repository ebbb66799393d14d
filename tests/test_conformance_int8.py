"""A quantized linear judged against its own exact function (diagnosis/exact_quant.py, issue 51 item 4).

The engine's INT8 W8A8 linear (``kernels/int8.int8_linear``: vLLM-CPU's bits) and another correct
implementation of the scheme (dividing by the scale, bf16 epilogue) land within the bound; faults planted
inside the quantized GEMM (a wrong rounding mode, a missing per-token scale, a dropped K block, a wrong
channel scale) land far outside; and the plain linear's exact function would call every correct quantized
linear outside, which is why a side whose contract names the scheme is judged against the scheme's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from logdiff.diagnosis import exact, exact_quant
from logdiff.diagnosis.conformance import ConformanceCheck
from logdiff.diagnosis.spacing import eps
from logdiff.kernels import int8 as Q

BF16 = eps("bfloat16")
SCHEME = "int8-w8a8: weights int8 symmetric per-channel static; activations int8 symmetric per-token dynamic"


def _case(k: int = 1100, n: int = 96, m: int = 48, bias: bool = True):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 4 + 0.1)).bfloat16()
    w = (torch.randn(n, k, generator=gen) / 30).bfloat16()
    b = (torch.randn(n, generator=gen) * 0.1).bfloat16() if bias else None
    return x, w, b


def _units(actual: torch.Tensor, ex: exact.Exact) -> tuple[float, float]:
    return exact.error_units(actual, ex, BF16), ex.bound.units("bfloat16")


def _engine(x, w, b, quantize=Q.quantize_activation, epilogue=None):
    """The INT8 linear with one step replaceable (the plants)."""
    q_w, s_w = Q.quantize_weight(w)
    q, s = quantize(x)
    if epilogue is not None:
        return epilogue(q, s, q_w, s_w)
    return Q.scaled_mm(q, s, q_w, s_w, b, x.dtype)


def test_the_engines_quantized_linear_is_within_its_exact_function():
    x, w, b = _case()
    ex = exact_quant.quantized_linear_of(w, b)(x)
    err, bound = _units(Q.int8_linear(x, *Q.quantize_weight(w), b), ex)
    assert err <= bound
    # an engine that ignores its quantization (the bf16 linear) computes another function
    err_bf16, _ = _units(torch.nn.functional.linear(x, w, b), ex)
    assert err_bf16 > 4 * bound


def test_the_quantized_bound_sees_what_the_plain_linears_cannot():
    """The plain linear's bound counts sum |x w|: the whole INT8 error of a correct engine, and a rounding-mode
    fault inside its GEMM, are both inside it. The quantized function's scale is the exact product's: both are
    told apart (docs/kernels.md)."""
    x, w, b = _case()
    correct = Q.int8_linear(x, *Q.quantize_weight(w), b)

    def floor(rows):
        q, s = Q.quantize_activation(rows)
        return torch.floor(torch.clamp(rows.float() / s.clamp_min(1e-30), -128, 127)).to(torch.int8), s

    faulty = _engine(x, w, b, quantize=floor)
    err_correct, bound_plain = _units(correct, exact.linear(x, w, b))
    err_faulty, _ = _units(faulty, exact.linear(x, w, b))
    assert err_correct <= bound_plain and err_faulty <= bound_plain  # the plain bound: blind to both
    ex = exact_quant.quantized_linear_of(w, b)(x)
    assert _units(correct, ex)[0] <= ex.bound.units("bfloat16") < 4 * ex.bound.units("bfloat16") < _units(faulty, ex)[0]


def test_another_implementation_of_the_scheme_is_within():
    """Divides by the scale (a GPU kernel's way: its ties may break the other way, inside the allowance) and
    rounds its epilogue through bf16 twice (the GEMM output, then the bias add)."""
    x, w, b = _case()

    def divided(rows):
        xf = rows.float()
        s = xf.abs().amax(-1, keepdim=True) * (1 / 127.0)
        return torch.round(torch.clamp(xf / s, -128, 127)).to(torch.int8), s

    def bf16_epilogue(q, s, q_w, s_w):
        acc = (q.long() @ q_w.long().t()).float()
        return ((acc * s * s_w.t()).bfloat16().float() + b.float()).bfloat16()

    ex = exact_quant.quantized_linear_of(w, b)(x)
    err, bound = _units(_engine(x, w, b, quantize=divided, epilogue=bf16_epilogue), ex)
    assert err <= bound


@pytest.mark.parametrize("plant", ["floor", "per_tensor_scale", "dropped_k_block", "channel_scale"])
def test_a_fault_inside_the_quantized_gemm_is_outside(plant):
    x, w, b = _case()
    quantize, epilogue = Q.quantize_activation, None
    if plant == "floor":  # rounding toward -inf instead of to nearest

        def quantize(rows):
            q, s = Q.quantize_activation(rows)
            return torch.floor(torch.clamp(rows.float() / s.clamp_min(1e-30), -128, 127)).to(torch.int8), s

    elif plant == "per_tensor_scale":  # the batch's amax instead of the token's

        def quantize(rows):
            q, s = Q.quantize_activation(rows.reshape(1, -1))
            return q.reshape(rows.shape), s.expand(rows.shape[0], 1)

    elif plant == "dropped_k_block":  # a GEMM that skips the last 64 products of K

        def epilogue(q, s, q_w, s_w):
            return Q.scaled_mm(q[:, :-64], s, q_w[:, :-64], s_w, b, x.dtype)

    else:  # one output channel read with its neighbour's scale

        def epilogue(q, s, q_w, s_w):
            return Q.scaled_mm(q, s, q_w, s_w.roll(1, 0), b, x.dtype)

    ex = exact_quant.quantized_linear_of(w, b)(x)
    err, bound = _units(_engine(x, w, b, quantize, epilogue), ex)
    assert err > 4 * bound


def test_the_allowance_counts_only_rounding_ties():
    x, w, b = _case(bias=False)
    ex = exact_quant.quantized_linear_of(w)(x)
    q, s = Q.quantize_activation(x)
    t = x.double() / s.double()
    near = ((t - t.floor() - 0.5).abs() <= 4 * 2.0**-23 * t.abs()).double().mean()
    assert 0 < float(near) < 0.01  # a few ties per thousand elements of bf16 rows
    q_w, s_w = Q.quantize_weight(w)
    terms = (q.double().abs() * s.double()) @ (q_w.double().abs() * s_w.double()).t()
    assert float((ex.allowance / terms).max()) < 0.01  # the ties' steps, and fp32 accumulation's K * eps32


def test_scheme_at_reads_the_contract():
    c = {"quantization": SCHEME, "quantization_ignored": "lm_head"}
    assert exact_quant.scheme_at(c, "model.layers.0.mlp.down_proj") == "int8-w8a8"
    assert exact_quant.scheme_at(c, "lm_head") is None
    assert exact_quant.scheme_at({**c, "quantization_ignored": "re:.*mlp\\.gate$"}, "model.layers.1.mlp.gate") is None
    assert exact_quant.scheme_at({**c, "quantization_ignored": "off"}, "lm_head") == "int8-w8a8"
    assert exact_quant.scheme_at({"quantization": "off"}, "model.layers.0.mlp.down_proj") is None
    assert exact_quant.scheme_at({}, "model.layers.0.mlp.down_proj") is None
    assert exact_quant.scheme_at({"quantization": "fp8-block: ..."}, "model.layers.0.mlp.down_proj") == "fp8-block"


def test_conformance_judges_each_side_by_its_own_contract():
    """The bf16 trainer's linear against the plain function, the INT8 engine's against the scheme's."""
    x, w, _ = _case(k=256, n=64, bias=False)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(256, 64, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        model.proj.weight.copy_(w)
    check = ConformanceCheck.__new__(ConformanceCheck)
    check.model = model
    check.contracts = {"train": {"quantization": "off"}, "infer": {"quantization": SCHEME, "quantization_ignored": "lm_head"}}
    b = SimpleNamespace(kind="linear", name="proj", layer=None)
    site = SimpleNamespace(inputs=[x])
    widened: dict = {}
    train = check._function(b, "train", widened)(site)
    infer = check._function(b, "infer", widened)(site)
    assert train.function.startswith("linear(") and infer.function.startswith("int8_w8a8_linear(")
    quantized = Q.int8_linear(x, *Q.quantize_weight(w))
    plain = torch.nn.functional.linear(x, w)
    assert exact.error_units(quantized, infer, BF16) <= infer.bound.units("bfloat16")
    assert exact.error_units(plain, train, BF16) <= train.bound.units("bfloat16")
    assert exact.error_units(plain, infer, BF16) > 4 * infer.bound.units("bfloat16")  # an engine ignoring its scheme
    assert len(widened) == 2  # one function per (weight, scheme), shared by the sides that use it


def test_a_scheme_without_an_exact_function_is_not_judged():
    """An FP8 side's linear is not judged (no exact function here), rather than against the plain linear, where
    every correct FP8 linear would be a ``semantic`` cause; the bf16 side's linear is still judged."""
    from logdiff.diagnosis.conformance import NotCheckable

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)
    check = ConformanceCheck.__new__(ConformanceCheck)
    check.model = model
    check.contracts = {"train": {"quantization": "off"}, "infer": {"quantization": "fp8-block: weights fp8 ..."}}
    b = SimpleNamespace(kind="linear", name="proj", layer=None)
    assert check._function(b, "train", {})(SimpleNamespace(inputs=[torch.ones(2, 16).bfloat16()])).function.startswith(
        "linear(")
    with pytest.raises(NotCheckable, match="no exact function for a fp8-block quantized linear"):
        check._function(b, "infer", {})
    assert exact_quant.has_exact_function("int8-w8a8") and not exact_quant.has_exact_function("fp8-block")
