"""gpt-oss's clamped SwiGLU and biased experts: batch-invariant bits, HF's function, a float64 gradcheck."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import moe_experts_oai, moe_route, swiglu_oai_and_mul, swiglu_oai_and_mul_reference

DTYPES = [torch.float32, torch.bfloat16]


def _gate_up(gen, rows, width=96, dtype=torch.float32):
    """Values well past the clamp limit (7) on both sides, so both clamps act."""
    gate = (torch.randn(rows, width, generator=gen) * 6).to(dtype)
    up = (torch.randn(rows, width, generator=gen) * 6).to(dtype)
    return gate, up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 200])
def test_rows_do_not_depend_on_the_batch(gen, dtype, rows):
    gate, up = _gate_up(gen, 211, dtype=dtype)
    full = swiglu_oai_and_mul(gate, up)
    for start in range(0, 211, rows):
        part = slice(start, start + rows)
        assert torch.equal(swiglu_oai_and_mul(gate[part], up[part]), full[part]), (rows, start)
    assert torch.equal(swiglu_oai_and_mul(gate[:, 5:], up[:, 5:]), full[:, 5:])  # nor on its place in the row


def test_matches_hfs_apply_gate_and_the_clamps_matter(gen):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gate, up = _gate_up(gen, 40, dtype=torch.float64)
    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=96, num_local_experts=1))
    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)  # HF's [g0, u0, g1, u1, ...]
    hf = experts._apply_gate(interleaved)
    mine = swiglu_oai_and_mul(gate, up)
    assert (mine - hf).abs().max() < 1e-12 * hf.abs().max()
    assert (swiglu_oai_and_mul_reference(gate, up) - hf).abs().max() < 1e-12 * hf.abs().max()
    # control: without the clamps (a limit nothing reaches) the function is another one on these inputs
    assert not torch.allclose(swiglu_oai_and_mul(gate, up, limit=1e9), mine)


def test_gradcheck_in_float64(gen):
    gate, up = _gate_up(gen, 6, width=10, dtype=torch.float64)
    gate[0, :3] = torch.tensor([7.5, -8.0, 9.0], dtype=torch.float64)  # clamped: zero slope
    gate.requires_grad_(True)
    up.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda g, u: swiglu_oai_and_mul(g, u, 1.702, 7.0), (gate, up))


def _experts(gen, e=4, h=32, inter=24, dtype=torch.float32):
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.3).to(dtype)
    b13 = (torch.randn(e, 2 * inter, generator=gen) * 3).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.3).to(dtype)
    b2 = torch.randn(e, h, generator=gen).to(dtype)
    return w13, b13, w2, b2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 30])
def test_experts_token_output_does_not_depend_on_its_batch(gen, dtype, rows):
    w13, b13, w2, b2 = _experts(gen, dtype=dtype)
    x = torch.randn(60, 32, generator=gen).to(dtype)
    weights, ids = moe_route(torch.randn(60, 4, generator=gen), 2, True)
    full = moe_experts_oai(x, weights, ids, w13, b13, w2, b2)
    for start in range(0, 60, rows):
        part = slice(start, start + rows)
        assert torch.equal(moe_experts_oai(x[part], weights[part], ids[part], w13, b13, w2, b2), full[part])


def test_experts_compute_hfs_gpt_oss_experts(gen):
    """HF's module (its transposed, interleaved ``gate_up_proj``) in float64 against the kernel on vLLM's layout."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    w13, b13, w2, b2 = _experts(gen, dtype=torch.float64)
    hf = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4)).double()
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(b13)
        hf.down_proj.copy_(w2.transpose(1, 2))
        hf.down_proj_bias.copy_(b2)
        x = torch.randn(20, 32, generator=gen, dtype=torch.float64)
        weights, ids = moe_route(torch.randn(20, 4, generator=gen, dtype=torch.float64), 2, True)
        want = hf(x, ids, weights)
        got = moe_experts_oai(x, weights, ids, w13, b13, w2, b2)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()  # moe_combine sums in fp32: a layout slip is O(1)
    # control: the biases are read (without them the experts compute something else)
    assert not torch.allclose(moe_experts_oai(x, weights, ids, w13, b13 * 0, w2, b2 * 0), want)
