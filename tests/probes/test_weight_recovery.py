"""Reading weights back from a vLLM CPU layer, whichever kernel holds them.

vLLM's CPU GEMM dispatch keeps the plain weight on some CPUs and packs it into
a oneDNN/SGL handle (leaving an empty tensor) on others. These tests build the
packed-away case on purpose, so recovery is exercised on every CPU, not only
on those whose dispatch happens to remove the weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logdiff.engines.vllm.weights import dense_weight


def _packed_away(weight: torch.Tensor, gemm=None) -> torch.nn.Module:
    """A layer shaped like vLLM's after ``dispatch_cpu_unquantized_gemm(remove_weight=True)``."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    layer.input_size_per_partition = weight.shape[1]
    layer.cpu_linear = gemm or (lambda x, _weight, bias, w=weight.clone(): F.linear(x, w, bias))
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [96, 1500])  # 1500: more than one identity chunk
def test_a_packed_away_weight_comes_back_bit_exact(dtype: torch.dtype, k: int) -> None:
    weight = (torch.randn(48, k, generator=torch.Generator().manual_seed(k)) / k**0.5).to(dtype)
    recovered = dense_weight(_packed_away(weight))
    assert recovered.dtype == dtype and torch.equal(recovered, weight)


def test_a_kept_weight_is_returned_as_is() -> None:
    layer = torch.nn.Linear(8, 4, bias=False)
    assert dense_weight(layer).data_ptr() == layer.weight.data_ptr()


def test_a_gemm_that_is_not_linear_in_its_weight_is_refused() -> None:
    """Negative control: recovery checks itself against the layer's own GEMM."""
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    layer = _packed_away(weight, gemm=lambda x, _w, bias: F.linear(x, weight, bias) + x.abs().sum(-1, keepdim=True))
    with pytest.raises(RuntimeError, match="could not recover"):
        dense_weight(layer)
