"""silu_and_mul: an element's bits depend on its value, not on where it sits in the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logdiff.kernels import KERNELS, silu_and_mul, silu_and_mul_reference

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}["silu_and_mul"]


def _gate_up(gen, m=64, width=31, dtype=torch.float32):
    # width 31: a 1-row call is all scalar tail for a vectorised kernel, a 64-row call mostly vector body
    gate = torch.randn(m, width, generator=gen) * 4
    up = torch.randn(m, width, generator=gen)
    return gate.to(dtype), up.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_rows_do_not_depend_on_batch_size(gen, dtype, m):
    gate, up = _gate_up(gen, dtype=dtype)
    full = silu_and_mul(gate, up)
    assert torch.equal(silu_and_mul(gate[:m], up[:m]), full[:m])
    assert torch.equal(silu_and_mul(gate[-m:], up[-m:]), full[-m:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_alone_equals_the_batch(gen, dtype):
    gate, up = _gate_up(gen, dtype=dtype)
    alone = torch.cat([silu_and_mul(gate[i : i + 1], up[i : i + 1]) for i in range(len(gate))])
    assert torch.equal(alone, silu_and_mul(gate, up))


def test_non_contiguous_halves_of_a_packed_input(gen):
    packed = torch.randn(9, 2 * 48, generator=gen)
    gate, up = packed[:, :48], packed[:, 48:]
    assert torch.equal(silu_and_mul(gate, up), silu_and_mul(gate.contiguous(), up.contiguous()))


def test_extreme_gates_are_finite(gen):
    gate = torch.tensor([-1e4, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4])
    out = silu_and_mul(gate, torch.ones_like(gate))
    assert torch.isfinite(out).all()
    assert torch.equal(out[[0, 3]], torch.zeros(2)) and torch.equal(out[-1], gate[-1])


def test_error_against_fp64_is_within_the_stated_bound(gen):
    gate, up = _gate_up(gen, m=256, width=300)
    ref = silu_and_mul_reference(gate.double(), up.double())
    assert (silu_and_mul(gate, up).double() - ref).abs().max() / ref.abs().max() <= BOUND


@pytest.mark.isa_sensitive
def test_negative_control_stock_silu_depends_on_position(gen, stock_varies):
    gate, up = _gate_up(gen)
    alone = torch.cat([F.silu(gate[i : i + 1]) * up[i : i + 1] for i in range(len(gate))])
    assert torch.equal(
        torch.cat([silu_and_mul(gate[i : i + 1], up[i : i + 1]) for i in range(len(gate))]), silu_and_mul(gate, up)
    )
    stock_varies(torch.equal(alone, F.silu(gate) * up), "stock F.silu is position-independent here")
