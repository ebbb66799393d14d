"""The position-independent exp/log and the fixed-order sums the kernels are built from."""

from __future__ import annotations

import torch

from logdiff.kernels import exp, halving_sum, log, pairwise_sum


def test_exp_is_accurate_to_about_one_ulp(gen):
    x = torch.linspace(-87.0, 88.0, 50001)
    rel = (exp(x).double() - torch.exp(x.double())).abs() / torch.exp(x.double())
    assert rel.max() < 2.5e-7


def test_exp_edges_are_exact_zero_and_inf():
    x = torch.tensor([-1e30, -float("inf"), -100.0, 0.0, 100.0, 1e30])
    assert exp(x).tolist() == [0.0, 0.0, 0.0, 1.0, float("inf"), float("inf")]


def test_exp_and_log_depend_only_on_the_value(gen):
    x = torch.randn(4099, generator=gen) * 20
    whole = exp(x)
    pieces = torch.cat([exp(x[i : i + 7]) for i in range(0, len(x), 7)])
    assert torch.equal(whole, pieces) and torch.equal(exp(x[5:]), whole[5:])
    y = x.abs() + 1e-3
    assert torch.equal(log(y[3:]), log(y)[3:])


def test_log_is_accurate_to_about_one_ulp():
    x = torch.logspace(-30, 30, 20001)
    err = (log(x).double() - torch.log(x.double())).abs()
    assert (err <= 2.5e-7 * torch.log(x.double()).abs().clamp(min=1.0)).all()


def test_pairwise_sum_ignores_appended_zeros(gen):
    x = torch.randn(6, 13, generator=gen)
    base = pairwise_sum(x, 1)
    for extra in (1, 3, 19):
        assert torch.equal(pairwise_sum(torch.cat([x, torch.zeros(6, extra)], 1), 1), base)


def test_sums_are_accurate(gen):
    x = torch.rand(3, 10000, generator=gen)
    ref = x.double().sum(-1)
    for total in (halving_sum(x, -1), pairwise_sum(x, -1)):
        assert ((total.double() - ref).abs() / ref).max() < 1e-6
