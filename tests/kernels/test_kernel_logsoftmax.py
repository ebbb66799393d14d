"""log_softmax: fp32 log-probabilities whose rows do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import KERNELS, log_softmax, log_softmax_reference, token_log_probs

BOUND = {k.name: k.bound for k in KERNELS}["log_softmax"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_rows_do_not_depend_on_batch_size(gen, dtype, m):
    logits = (torch.randn(8, 1000, generator=gen) * 5).to(dtype)
    full = log_softmax(logits)
    assert full.dtype == torch.float32
    assert torch.equal(log_softmax(logits[-m:]), full[-m:])


def test_long_vocabulary_single_row_equals_row_in_batch(gen):
    logits = torch.randn(4, 151936, generator=gen) * 3
    assert torch.equal(log_softmax(logits[:1]), log_softmax(logits)[:1])


def test_chunking_does_not_change_bits(gen, monkeypatch):
    import sys

    logits = torch.randn(10, 500, generator=gen)
    whole = log_softmax(logits)
    monkeypatch.setattr(sys.modules["logdiff.kernels.logsoftmax"], "CHUNK_ELEMENTS", 1)
    assert torch.equal(log_softmax(logits), whole)


def test_token_log_probs_equals_gathered_log_softmax(gen):
    logits = torch.randn(2, 5, 300, generator=gen).bfloat16()
    tokens = torch.randint(0, 300, (2, 5), generator=gen)
    assert torch.equal(token_log_probs(logits, tokens), log_softmax(logits).gather(-1, tokens[..., None])[..., 0])


def test_error_against_fp64_is_within_the_stated_bound(gen):
    logits = torch.randn(16, 4096, generator=gen) * 8
    ref = log_softmax_reference(logits.double())
    assert (log_softmax(logits).double() - ref).abs().max() / ref.abs().max() <= BOUND


def test_probabilities_sum_to_one(gen):
    lp = log_softmax(torch.randn(3, 777, generator=gen) * 10)
    assert torch.allclose(lp.double().exp().sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-5)
