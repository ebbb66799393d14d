"""Backward passes: correct (gradcheck, fp64 reference), deterministic, and batch-invariant where the forward is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from logdiff.kernels.fixed_order import halving_sum
from logdiff.kernels.matmul import W_GRAD_TILE
from torch.autograd import gradcheck

from logdiff import kernels as K

GRAD_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
"""Largest |kernel grad - fp64 autograd of the reference| relative to the largest |reference grad| (docs/kernels.md)."""
LOOSE = dict(eps=1e-3, atol=1e-3, rtol=1e-3)
"""gradcheck for kernels that compute in fp32 even for fp64 input (the numerical Jacobian then has fp32 noise)."""


@dataclass(frozen=True)
class Op:
    """A kernel as ``fn(*rows, *shared)``: ``rows`` inputs have one row per token (dim 0), ``shared`` are weights."""

    name: str
    fn: Callable[..., torch.Tensor]
    ref: Callable[..., torch.Tensor]
    make: Callable[[torch.Generator, int], tuple[list[torch.Tensor], list[torch.Tensor]]]
    strict: bool = False  # computes fp64 in fp64: default gradcheck tolerances


def _pos(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[0]) * 7 % 50  # a row's position depends only on its index


def _tok(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[0]) * 13 % x.shape[-1]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _norm_pair(f: Callable) -> Callable:
    return lambda x, r, w: torch.cat(f(x, w, 1e-6, residual=r), dim=-1)


OPS = [
    Op("linear", K.linear, K.linear_reference, lambda g, m: ([_randn(g, m, 12)], [_randn(g, 10, 12), _randn(g, 10)])),
    Op("linear_no_bias", K.linear, K.linear_reference, lambda g, m: ([_randn(g, m, 12)], [_randn(g, 10, 12)]), True),
    Op(
        "rms_norm",
        lambda x, w: K.rms_norm(x, w, 1e-6),
        lambda x, w: K.rms_norm_reference(x, w, 1e-6),
        lambda g, m: ([_randn(g, m, 16, scale=3)], [_randn(g, 16).abs() + 0.5]),
    ),
    Op(
        "rms_norm_residual",
        _norm_pair(K.rms_norm),
        _norm_pair(K.rms_norm_reference),
        lambda g, m: ([_randn(g, m, 16, scale=3), _randn(g, m, 16)], [_randn(g, 16).abs() + 0.5]),
    ),
    Op(
        "rope",
        lambda x: K.rope(x, _pos(x), 1e4),
        lambda x: K.rope_reference(x, _pos(x), 1e4),
        lambda g, m: ([_randn(g, m, 2, 8)], []),
    ),
    Op(
        "rope_gptj_partial",
        lambda x: K.rope(x, _pos(x), 1e4, "gptj", 4),
        lambda x: K.rope_reference(x, _pos(x), 1e4, "gptj", 4),
        lambda g, m: ([_randn(g, m, 2, 8)], []),
    ),
    Op(
        "silu_and_mul",
        K.silu_and_mul,
        K.silu_and_mul_reference,
        lambda g, m: ([_randn(g, m, 12, scale=3), _randn(g, m, 12)], []),
        True,
    ),
    Op("log_softmax", K.log_softmax, K.log_softmax_reference, lambda g, m: ([_randn(g, m, 37, scale=3)], [])),
    Op(
        "token_log_probs",
        lambda x: K.token_log_probs(x, _tok(x)),
        lambda x: K.log_softmax_reference(x).gather(-1, _tok(x)[:, None])[:, 0],
        lambda g, m: ([_randn(g, m, 37, scale=3)], []),
    ),
]
OPS += [
    Op(
        f"moe_route_{'renormalized' if renorm else 'plain'}",
        lambda x, renorm=renorm: K.moe_route(x, 2, renorm)[0],
        lambda x, renorm=renorm: K.moe_route_reference(x, 2, renorm)[0],
        lambda g, m: ([_randn(g, m, 8, scale=2)], []),
    )
    for renorm in (True, False)
]
_BIAS = torch.linspace(-0.2, 0.2, 8, dtype=torch.float64)  # a correction bias that changes the choice
_GROUPED = {"bias": _BIAS, "n_group": 2, "topk_group": 1, "scaling": 2.5}
OPS.append(
    Op(
        "moe_route_grouped",
        lambda x: K.moe_route_grouped(x, 2, True, **_GROUPED)[0],
        lambda x: K.moe_route_grouped_reference(x, 2, True, **_GROUPED)[0],
        lambda g, m: ([_randn(g, m, 8, scale=2)], []),
    )
)
IDS = [op.name for op in OPS]


def _grads(op: Op, inputs: list[torch.Tensor], dy: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Gradients of ``sum(dy * op(inputs))`` w.r.t. every input (dy seeded when not given)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = op.fn(*leaves)
    if dy is None:
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return list(torch.autograd.grad(out, leaves, dy.to(out.dtype)))


def _case(op: Op, m: int, dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], int]:
    rows, shared = op.make(torch.Generator().manual_seed(seed), m)
    return [t.to(dtype) for t in rows + shared], len(rows)


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_gradcheck_against_the_kernel_itself(op):
    inputs, _ = _case(op, 3, torch.float64)
    leaves = tuple(t.requires_grad_() for t in inputs)
    assert gradcheck(op.fn, leaves, fast_mode=True, **({} if op.strict else LOOSE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_gradients_agree_with_fp64_autograd_of_the_reference(op, dtype):
    inputs, _ = _case(op, 5, dtype)
    ours = _grads(op, inputs)
    ref_op = Op(op.name, op.ref, op.ref, op.make)
    ref = _grads(ref_op, [t.double() for t in inputs])
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).abs().max() <= GRAD_BOUND[dtype] * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_two_runs_are_bitwise_equal(op, dtype):
    inputs, _ = _case(op, 70, dtype)
    for a, b in zip(_grads(op, inputs), _grads(op, inputs), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("m", [1, 3, K.M_TILE + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_a_rows_gradients_do_not_depend_on_the_other_rows(op, dtype, m):
    """Row grads are bitwise those of the rows alone; weight grads equal those of a batch whose other rows are masked."""
    inputs, n_rows = _case(op, 2 * K.M_TILE + 5, dtype)
    out_shape = op.fn(*inputs).shape
    dy = torch.randn(out_shape, generator=torch.Generator().manual_seed(1))
    dy[m:] = 0  # the other rows are masked tokens: they reach the weights with exact zeros
    full = _grads(op, inputs, dy)
    alone = _grads(op, [t[:m] for t in inputs[:n_rows]] + inputs[n_rows:], dy[:m])
    for i, (a, b) in enumerate(zip(alone, full, strict=True)):
        assert torch.equal(a, b[:m] if i < n_rows else b)


def _ignores_masked_rows(weight_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``weight_grad(dy, x)`` is bitwise unchanged by appending masked rows (dy = 0) to the batch."""
    gen = torch.Generator().manual_seed(2)
    dy, x = torch.randn(5 * W_GRAD_TILE, 10, generator=gen), torch.randn(5 * W_GRAD_TILE, 12, generator=gen)
    masked_dy = torch.cat([dy, torch.zeros(3 * W_GRAD_TILE, 10)])
    masked_x = torch.cat([x, torch.randn(3 * W_GRAD_TILE, 12, generator=gen)])
    return torch.equal(weight_grad(dy, x), weight_grad(masked_dy, masked_x))


def _linear_weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w = torch.randn(10, 12, generator=torch.Generator().manual_seed(3)).requires_grad_()
    return torch.autograd.grad(K.linear(x, w), w, dy)[0]


def _halving_over_tiles(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Negative control: the same tile GEMMs, added in a tree whose pairing depends on the number of tiles."""
    tiles = [dy[i : i + W_GRAD_TILE].t() @ x[i : i + W_GRAD_TILE] for i in range(0, dy.shape[0], W_GRAD_TILE)]
    return halving_sum(torch.stack(tiles), 0)


def test_weight_gradient_ignores_masked_rows_and_a_batch_dependent_order_does_not():
    assert _ignores_masked_rows(_linear_weight_grad)
    assert not _ignores_masked_rows(_halving_over_tiles)



def test_rope_tables_take_no_gradient():
    cos, sin = K.rope_cos_sin(torch.arange(4), 1e4, 8)
    x = torch.randn(4, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="no gradient"):
        K.rope_apply(x, cos.unsqueeze(-2).requires_grad_(), sin.unsqueeze(-2))

# ----------------------------------------------------------------------------- attention

HQ, HKV, D = 4, 2, 8


def _qkv(t: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)]


def _attention_grads(q, k, v, q_positions, kv_lens, dy, softcap=None, window=None) -> list[torch.Tensor]:
    """Grads of ``attention_batched`` (the entry point consistent mode calls) w.r.t. q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = K.attention_batched(*leaves, q_positions, 0.3, kv_lens, softcap, window)
    return list(torch.autograd.grad(out, leaves, dy.to(out.dtype)))


def test_attention_gradcheck_with_padding_and_gqa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, h, 4, generator=gen, dtype=torch.float64).requires_grad_() for h in (HQ, HKV, HKV))
    q_positions, kv_lens = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]), torch.tensor([5, 3])
    assert gradcheck(lambda *a: K.attention_batched(*a, q_positions, 0.5, kv_lens), (q, k, v), fast_mode=True, **LOOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gradients_agree_with_fp64_autograd_of_the_reference(dtype):
    q, k, v = _qkv(37, dtype)
    positions = torch.arange(37)
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = torch.autograd.grad(K.attention(*leaves, positions, 0.3), leaves, dy.to(dtype))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(K.attention_reference(*ref_leaves, positions, 0.3), ref_leaves, dy.double())
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).abs().max() <= GRAD_BOUND[dtype] * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap, window", [(None, None), (1.5, 6)], ids=["plain", "softcap-window"])  # Gemma's
def test_attention_gradients_of_a_sequence_do_not_depend_on_the_batch(dtype, softcap, window):
    """Sequence 0 (11 tokens) alone vs right-padded beside a 37-token sequence, twice: q, k and v grads bitwise."""
    short, long = _qkv(11, dtype), _qkv(37, dtype, seed=1)
    dy = torch.randn(2, 37, HQ, D, generator=torch.Generator().manual_seed(2))
    dy[0, 11:] = torch.nan  # padding queries' incoming gradient is ignored
    batch = [torch.zeros(2, 37, *t.shape[1:], dtype=dtype) for t in short]
    for padded, a, b in zip(batch, short, long, strict=True):
        padded[0, :11], padded[1] = a, b
    positions = torch.stack([torch.where(torch.arange(37) < 11, torch.arange(37), -1), torch.arange(37)])
    kw = {"softcap": softcap, "window": window}
    together = _attention_grads(*batch, positions, torch.tensor([11, 37]), dy, **kw)
    again = _attention_grads(*batch, positions, torch.tensor([11, 37]), dy, **kw)
    alone = _attention_grads(*(t[None] for t in short), torch.arange(11)[None], torch.tensor([11]), dy[:1, :11], **kw)
    for a, b, c in zip(alone, together, again, strict=True):
        assert torch.equal(b, c)
        assert torch.equal(a[0], b[0, :11]) and not b[0, 11:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_query_gradients_are_the_same_in_prefill_and_in_decode_steps(dtype):
    q, k, v = _qkv(37, dtype)
    dy = torch.randn(1, 37, HQ, D, generator=torch.Generator().manual_seed(3))
    prefill = _attention_grads(q[None], k[None], v[None], torch.arange(37)[None], torch.tensor([37]), dy)[0]
    for step in (0, 16, 36):  # one query against the keys up to it (a decode step)
        kv = torch.tensor([step + 1])
        decode = _attention_grads(q[None, step : step + 1], k[None], v[None], torch.tensor([[step]]), kv, dy[:, step : step + 1])
        assert torch.equal(decode[0][0, 0], prefill[0, step])


# ----------------------------------------------------------------------------- MoE experts and combine

E, H, I, TOP_K = 4, 8, 6, 2


def _moe_case(t: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([x, weights, w13, w2], ids)`` with each token's top-2 of 4 experts, seeded."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, H, generator=gen)
    weights, ids = K.moe_route(torch.randn(t, E, generator=gen), TOP_K, True)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / 3, torch.randn(E, H, I, generator=gen) / 3
    return [a.to(dtype) for a in (x, weights, w13, w2)], ids


def _moe_reference(ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    def run(x, weights, w13, w2):
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = K.linear_reference(rows, w13[e])
            return K.linear_reference(K.silu_and_mul_reference(gate_up[:, :I], gate_up[:, I:]), w2[e])

        return K.moe_combine_reference(x, weights, ids, expert)

    return run


def _moe_grads(inputs: list[torch.Tensor], ids: torch.Tensor, dy: torch.Tensor, fn=None) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = (fn or (lambda *a: K.moe_experts(a[0], a[1], ids, a[2], a[3])))(*leaves)
    return list(torch.autograd.grad(out, leaves, dy.to(out.dtype)))


def test_moe_experts_gradcheck():
    inputs, ids = _moe_case(5, torch.float64)
    leaves = tuple(t.requires_grad_() for t in inputs)
    assert gradcheck(lambda x, w, a, b: K.moe_experts(x, w, ids, a, b), leaves, fast_mode=True, **LOOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_gradients_agree_with_fp64_autograd_of_the_reference(dtype):
    inputs, ids = _moe_case(9, dtype)
    dy = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    ours = _moe_grads(inputs, ids, dy)
    ref = _moe_grads([t.double() for t in inputs], ids, dy, _moe_reference(ids))
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).abs().max() <= GRAD_BOUND[dtype] * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_gradients_are_deterministic_and_a_tokens_own_do_not_depend_on_the_batch(dtype):
    """Two runs bitwise (expert weights too); a token's x and routing-weight grads equal its grads alone."""
    inputs, ids = _moe_case(70, dtype)
    dy = torch.randn(70, H, generator=torch.Generator().manual_seed(2))
    first, second = _moe_grads(inputs, ids, dy), _moe_grads(inputs, ids, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    masked = dy.clone()
    masked[3:] = 0
    full = _moe_grads(inputs, ids, masked)
    alone = _moe_grads([inputs[0][:3], inputs[1][:3], *inputs[2:]], ids[:3], dy[:3])
    assert torch.equal(alone[0], full[0][:3]) and torch.equal(alone[1], full[1][:3])


# ----------------------------------------------------------------------------- forward bits and a whole model


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_the_differentiable_path_computes_the_inference_bits(op):
    inputs, _ = _case(op, 70, torch.bfloat16)
    with torch.no_grad():
        plain = op.fn(*inputs)
    assert torch.equal(op.fn(*(t.clone().requires_grad_() for t in inputs)), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_under_consistent_hf_is_deterministic_and_computes_the_inference_logprobs(build_model, dtype):
    from logdiff.sources.hf.consistent import consistent_hf

    model = build_model("qwen3", dtype).train()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with consistent_hf(model):
            logprobs = K.token_log_probs(model(input_ids=ids, attention_mask=mask).logits[:, :-1], ids[:, 1:])
            (-(logprobs * mask[:, 1:]).sum()).backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    (first_lp, first), (second_lp, second) = step(), step()
    with torch.no_grad(), consistent_hf(model):
        inference = K.token_log_probs(model(input_ids=ids, attention_mask=mask).logits[:, :-1], ids[:, 1:])
    assert torch.equal(first_lp, inference) and torch.equal(second_lp, inference)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
