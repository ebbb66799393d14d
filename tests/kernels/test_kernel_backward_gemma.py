"""Gemma's backwards: soft-capped (and windowed) attention, gelu_tanh_and_mul, the final soft cap, (1 + w) RMSNorm.

The same three properties as tests/kernels/test_kernel_backward.py: correct
(gradcheck in fp64 against the kernel itself; fp64 autograd of the
``*_reference``), deterministic, and a row's gradients bitwise the same whatever
else is in the batch. Controls: a backward that drops the cap's slope is caught
by the reference check; the stock ATen gelu backward called on the whole batch
gives a row other bits (where this CPU's kernels make it so); dk regrouped by left
padding differs (the bitwise checks are not vacuous). Then a whole training step
of the demo Gemma 2 and Gemma 3 under ``consistent_hf``.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from logdiff import kernels as K

GRAD_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
"""As tests/kernels/test_kernel_backward.py (docs/kernels.md, "Backward passes")."""
LOOSE = {"eps": 1e-3, "atol": 1e-3, "rtol": 1e-3}
"""gradcheck for kernels that compute in fp32 even for fp64 input."""
DTYPES = [torch.float32, torch.bfloat16]
HQ, HKV, D = 4, 2, 16
CAP, WINDOW, SCALE = 1.5, 6, 0.5  # scores of unit-variance inputs reach past the cap: the slope matters


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return list(torch.autograd.grad(out, leaves, dy.to(out.dtype)))


def _rel_error(ours, ref) -> float:
    return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(ours, ref, strict=True))


# ----------------------------------------------------------------------------- elementwise: gelu_tanh_and_mul, softcap

ELEMENTWISE = {
    "gelu_tanh_and_mul": (K.gelu_tanh_and_mul, K.gelu_tanh_and_mul_reference, 2),
    "softcap": (lambda x: K.softcap(x, 3.0), lambda x: K.softcap_reference(x, 3.0), 1),
}


def _inputs(name: str, m: int, dtype: torch.dtype, width: int = 31) -> list[torch.Tensor]:
    """width 31: a 1-row call is all scalar tail for a vectorised ATen kernel, a long batch mostly vector body."""
    gen = torch.Generator().manual_seed(0)
    n = ELEMENTWISE[name][2]
    return [(torch.randn(m, width, generator=gen, dtype=torch.float64) * (4 if i == 0 else 1)).to(dtype) for i in range(n)]


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_gradcheck(name):
    """fp64 in fp64 (ATen's gelu and its backward; torch.tanh): default gradcheck tolerances, full Jacobian."""
    fn = ELEMENTWISE[name][0]
    assert gradcheck(fn, tuple(t.requires_grad_() for t in _inputs(name, 3, torch.float64, 7)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_gradients_agree_with_fp64_autograd_of_the_reference(name, dtype):
    fn, ref, _ = ELEMENTWISE[name]
    inputs = _inputs(name, 5, dtype)
    dy = torch.randn(5, 31, generator=torch.Generator().manual_seed(1))
    ours = _grads(fn, inputs, dy)
    assert all(a.dtype == dtype for a in ours)
    assert _rel_error(ours, _grads(ref, [t.double() for t in inputs], dy.double())) <= GRAD_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_rows_gradients_are_deterministic_and_do_not_depend_on_the_batch(name, dtype):
    """A 70-row batch twice (bitwise), and rows 1, 3 and 8 alone vs inside it: bitwise equal; the forward too."""
    fn = ELEMENTWISE[name][0]
    inputs = _inputs(name, 70, dtype)
    dy = torch.randn(70, 31, generator=torch.Generator().manual_seed(1))
    full, again = _grads(fn, inputs, dy), _grads(fn, inputs, dy)
    assert all(torch.equal(a, b) for a, b in zip(full, again, strict=True))
    for m in (1, 3, 8):
        for rows in (slice(0, m), slice(70 - m, 70)):
            alone = _grads(fn, [t[rows] for t in inputs], dy[rows])
            assert all(torch.equal(a, b[rows]) for a, b in zip(alone, full, strict=True))
    with torch.no_grad():
        plain = fn(*inputs)
    assert torch.equal(fn(*(t.clone().requires_grad_() for t in inputs)), plain)  # training forward = inference bits


def test_negative_control_stock_gelu_backward_depends_on_position(stock_varies):
    """ATen's gelu_backward called once on the whole batch: a row's bits where it sits in a vector body or tail."""
    gate, up = _inputs("gelu_tanh_and_mul", 64, torch.float32)
    dy = torch.randn(64, 31, generator=torch.Generator().manual_seed(1))

    def stock(g: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(d * u, g, approximate="tanh")

    alone = torch.cat([stock(gate[i : i + 1], up[i : i + 1], dy[i : i + 1]) for i in range(64)])
    ours_alone = torch.cat([_grads(K.gelu_tanh_and_mul, [gate[i : i + 1], up[i : i + 1]], dy[i : i + 1])[0] for i in range(64)])
    assert torch.equal(ours_alone, _grads(K.gelu_tanh_and_mul, [gate, up], dy)[0])
    stock_varies(torch.equal(alone, stock(gate, up, dy)), "stock gelu_backward is position-independent here")


# ----------------------------------------------------------------------------- gemma_rms_norm, (1 + w)


def _norm_case(m: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(m, 24, generator=gen) * 3).to(dtype), (torch.randn(24, generator=gen) / 2).to(dtype)]


def _gemma_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return K.gemma_rms_norm(x, w, 1e-6)


def test_gemma_rms_norm_gradcheck():
    """It computes fp32 for fp64 input: the loose tolerances, as rms_norm's."""
    x, w = (t.double().requires_grad_() for t in _norm_case(3, torch.float64))
    assert gradcheck(_gemma_norm, (x, w), fast_mode=True, **LOOSE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_gradients_agree_with_fp64_autograd_of_the_reference(dtype):
    x, w = _norm_case(5, dtype)
    dy = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    ours = _grads(_gemma_norm, [x, w], dy)
    ref = _grads(lambda a, b: K.gemma_rms_norm_reference(a, b, 1e-6), [x.double(), w.double()], dy.double())
    assert all(a.dtype == dtype for a in ours) and _rel_error(ours, ref) <= GRAD_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_gradients_are_row_invariant_and_masked_rows_change_no_weight_bit(dtype):
    """dx of rows alone = inside a 70-row batch; dw of 5 rows = dw with 65 masked rows (dy = 0) appended."""
    x, w = _norm_case(70, dtype)
    dy = torch.randn(70, 24, generator=torch.Generator().manual_seed(1))
    full = _grads(_gemma_norm, [x, w], dy)
    assert all(torch.equal(a, b) for a, b in zip(full, _grads(_gemma_norm, [x, w], dy), strict=True))
    for m in (1, 3, 8):
        assert torch.equal(_grads(_gemma_norm, [x[-m:], w], dy[-m:])[0], full[0][-m:])
    masked = dy.clone()
    masked[5:] = 0
    assert torch.equal(_grads(_gemma_norm, [x[:5], w], dy[:5])[1], _grads(_gemma_norm, [x, w], masked)[1])
    with torch.no_grad():
        plain = _gemma_norm(x, w)
    assert torch.equal(_gemma_norm(x.clone().requires_grad_(), w), plain)  # training forward = inference bits


# ----------------------------------------------------------------------------- soft-capped, windowed attention


def _qkv(t: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)]


def _attention(q, k, v, q_positions, kv_lens, softcap=CAP, window=WINDOW):
    return K.attention_batched(q, k, v, q_positions, SCALE, kv_lens, softcap, window)


def _attention_grads(q, k, v, q_positions, kv_lens, dy, **kwargs):
    return _grads(lambda *a: _attention(*a, q_positions, kv_lens, **kwargs), (q, k, v), dy)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_softcapped_attention_gradcheck_with_padding_and_gqa(window):
    """Two sequences (one right-padded, 21 queries: two query tiles and two key blocks), fp64 leaves."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 21, h, 4, generator=gen, dtype=torch.float64).requires_grad_() for h in (HQ, HKV, HKV))
    q_positions = torch.tensor([list(range(21)), list(range(14)) + [-1] * 7])
    kv_lens = torch.tensor([21, 14])
    fn = lambda *a: _attention(*a, q_positions, kv_lens, window=window)
    assert gradcheck(fn, (q, k, v), fast_mode=True, **LOOSE)


def _reference_grads(q, k, v, dy, window=WINDOW, softcap=CAP):
    positions = torch.arange(q.shape[0])
    ref = lambda *a: K.attention_reference(*a, positions, SCALE, softcap=softcap, window=window)
    return _grads(ref, [t.double() for t in (q, k, v)], dy.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_softcapped_attention_gradients_agree_with_fp64_autograd_of_the_reference(dtype, window):
    q, k, v = _qkv(37, dtype)
    dy = torch.randn(37, HQ, D, generator=torch.Generator().manual_seed(1))
    ours = _grads(lambda *a: K.attention(*a, torch.arange(37), SCALE, softcap=CAP, window=window), (q, k, v), dy)
    assert all(a.dtype == dtype for a in ours)
    assert _rel_error(ours, _reference_grads(q, k, v, dy, window)) <= GRAD_BOUND[dtype]


def test_planted_fault_a_backward_without_the_caps_slope_is_caught(monkeypatch):
    """Control: with the slope ``1 - tanh^2`` forced to 1 the reference check fails by orders of magnitude."""
    import logdiff.kernels.attention_backward as backward

    q, k, v = _qkv(37, torch.float32)
    dy = torch.randn(37, HQ, D, generator=torch.Generator().manual_seed(1))
    ref = _reference_grads(q, k, v, dy)
    monkeypatch.setattr(backward, "tanh", torch.zeros_like)
    no_slope = _grads(lambda *a: K.attention(*a, torch.arange(37), SCALE, softcap=CAP, window=WINDOW), (q, k, v), dy)
    assert _rel_error(no_slope, ref) > 100 * GRAD_BOUND[torch.float32]


def test_negative_control_regrouped_query_tiles_change_dk_but_not_dq():
    """5 padding queries in front of a sequence (its keys stay) move its queries inside their tiles: dq keeps
    its bits (rows are independent), dk, a sum over the tiles, does not: the bitwise checks above can fail."""
    q, k, v = _qkv(11, torch.float32)
    dy = torch.randn(1, 11, HQ, D, generator=torch.Generator().manual_seed(2))
    alone = _attention_grads(q[None], k[None], v[None], torch.arange(11)[None], torch.tensor([11]), dy)
    q_left = torch.cat([torch.zeros(5, HQ, D), q])[None]
    positions = torch.cat([torch.full((5,), -1), torch.arange(11)])[None]
    dy_left = torch.cat([torch.zeros(1, 5, HQ, D), dy], 1)
    left = _attention_grads(q_left, k[None], v[None], positions, torch.tensor([11]), dy_left)
    assert torch.equal(left[0][0, 5:], alone[0][0])
    assert not torch.equal(left[1], alone[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcapped_windowed_query_gradients_are_the_same_in_prefill_and_in_decode_steps(dtype):
    q, k, v = _qkv(37, dtype)
    dy = torch.randn(1, 37, HQ, D, generator=torch.Generator().manual_seed(3))
    prefill = _attention_grads(q[None], k[None], v[None], torch.arange(37)[None], torch.tensor([37]), dy)[0]
    for step in range(37):  # one query against the keys up to it (a decode step)
        kv = torch.tensor([step + 1])
        decode = _attention_grads(
            q[None, step : step + 1], k[None], v[None], torch.tensor([[step]]), kv, dy[:, step : step + 1]
        )
        assert torch.equal(decode[0][0, 0], prefill[0, step])


def test_softcapped_attention_training_forward_computes_the_inference_bits():
    q, k, v = _qkv(37, torch.bfloat16)
    positions, kv = torch.arange(37)[None], torch.tensor([37])
    with torch.no_grad():
        plain = _attention(q[None], k[None], v[None], positions, kv)
    leaves = [t[None].clone().requires_grad_() for t in (q, k, v)]
    assert torch.equal(_attention(*leaves, positions, kv), plain)


# ----------------------------------------------------------------------------- a whole Gemma training step


def _demo(demo_model, arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model(arch)).train()


def _step(model, ids: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, consistent: bool = True):
    """One step's (logprobs, {name: grad}) for the loss ``-sum(weight[row] * mask * logprob)``."""
    import contextlib

    from logdiff.sources.hf.consistent import consistent_hf

    model.zero_grad(set_to_none=True)
    with consistent_hf(model) if consistent else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        if consistent:
            logprobs = K.token_log_probs(logits, ids[:, 1:])
        else:
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(logprobs * mask[:, 1:] * weight[:, None]).sum()).backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Three 20-token rows; row 0 is 12 tokens, right-padded (what a trainer's batch looks like)."""
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0
    return ids, mask


ROW_0 = torch.tensor([1.0, 0.0, 0.0])
"""Loss weights: row 0 counts, the other rows ride along with zero weight (their gradient is exact zeros)."""


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_consistent_gemma_training_step_is_deterministic_batch_invariant_and_computes_the_inference_bits(
    demo_model, arch, monkeypatch
):
    """The demo model (bf16; Gemma 2: both soft caps, Gemma 3: q/k norms and a window of 8 < 20 tokens).

    Twice: the same logprobs and gradients bitwise, the logprobs equal to inference's. Row 0 (12 tokens) alone
    vs right-padded in the 3-row batch whose other rows carry zero loss weight: the same logprobs and every
    parameter's gradient bitwise (the other rows reach the weight sums as exact zeros, after row 0's).
    Control: forcing the attention cap's slope to 1 changes Gemma 2's gradients (the cap's backward is in the
    step) and none of Gemma 3's (no attention cap)."""
    from logdiff.sources.hf.consistent import consistent_hf

    model = _demo(demo_model, arch)
    config = model.config
    if arch == "gemma2":  # what the step must go through
        assert config.attn_logit_softcapping and config.final_logit_softcapping
    else:
        assert config.sliding_window < 20 and "sliding_attention" in config.layer_types
    ids, mask = _batch(model)
    (first_lp, first), (second_lp, second) = _step(model, ids, mask, ROW_0), _step(model, ids, mask, ROW_0)
    with torch.no_grad(), consistent_hf(model):
        inference = K.token_log_probs(model(input_ids=ids, attention_mask=mask).logits[:, :-1], ids[:, 1:])
    assert torch.equal(first_lp, inference) and torch.equal(second_lp, inference)
    assert first.keys() == second.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert first["model.layers.0.self_attn.q_proj.weight"].abs().max() > 0  # the backward reached the attention
    alone_lp, alone = _step(model, ids[:1, :12], mask[:1, :12], torch.ones(1))
    assert torch.equal(alone_lp[0], first_lp[0, :11])
    assert [n for n in alone if not torch.equal(alone[n], first[n])] == []
    import logdiff.kernels.attention_backward as backward

    monkeypatch.setattr(backward, "tanh", torch.zeros_like)
    _, no_slope = _step(model, ids, mask, ROW_0)
    assert any(not torch.equal(no_slope[n], first[n]) for n in first) == (arch == "gemma2")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_negative_control_a_stock_gemma_step_depends_on_the_batch(demo_model, stock_varies, arch):
    """Stock HF (no kernels installed): row 0's logprobs and gradients alone vs in the batch, compared the same way."""
    model = _demo(demo_model, arch)
    ids, mask = _batch(model)
    batched_lp, batched = _step(model, ids, mask, ROW_0, consistent=False)
    alone_lp, alone = _step(model, ids[:1, :12], mask[:1, :12], torch.ones(1), consistent=False)
    equal = torch.equal(alone_lp[0], batched_lp[0, :11]) and all(torch.equal(alone[n], batched[n]) for n in alone)
    stock_varies(equal, f"stock HF {arch}: row 0's step is the same alone and in the batch")
