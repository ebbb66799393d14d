"""Reading weights back from a vLLM CPU layer, whichever kernel holds them.

vLLM's CPU GEMM dispatch keeps the plain weight on some CPUs and packs it into
a oneDNN/SGL handle (leaving an empty tensor) on others. These tests build the
packed-away case on purpose, so recovery is exercised on every CPU, not only
on those whose dispatch happens to remove the weight. Likewise MLA's
``kv_b_proj``, which vLLM's AMX MLA backend releases after packing it per head:
a stand-in impl with the same split and a private (non-AMX) packing exercises
the recovery on every CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from logdiff.probes.contracts import fingerprint

from logdiff.sources.vllm.weights import dense_weight, latent_up_weight


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


def test_fingerprints_recorded_at_dispatch_stand_for_the_weight_until_the_gemm_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While an engine loads, each weight the CPU dispatch packs away is hashed first, per packed part."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import utils

    from logdiff.sources.vllm.weights import dispatched_fingerprints, fingerprint_at_dispatch

    def packs_away(layer: torch.nn.Module, remove_weight: bool) -> None:  # the dispatch of a host that packs
        plain = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, _weight, bias: F.linear(x, plain, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=plain.dtype), requires_grad=False)

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", packs_away)
    weight = torch.randn(12, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed, single, kept = (torch.nn.Linear(8, 12, bias=False) for _ in range(3))
    for layer in (packed, single, kept):
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    packed.output_sizes = [8, 4]
    with fingerprint_at_dispatch():
        utils.dispatch_cpu_unquantized_gemm(packed, remove_weight=True)
        utils.dispatch_cpu_unquantized_gemm(single, remove_weight=True)
        utils.dispatch_cpu_unquantized_gemm(kept, remove_weight=False)  # an embedding: the weight stays
    assert utils.dispatch_cpu_unquantized_gemm is packs_away  # the wrapper is gone with the block
    assert dispatched_fingerprints(packed).parts == (fingerprint(weight[:8]), fingerprint(weight[8:]))
    assert dispatched_fingerprints(single).whole == fingerprint(weight) and dispatched_fingerprints(single).parts == ()
    assert dispatched_fingerprints(kept) is None
    packs_away(packed, remove_weight=True)  # a reload outside the block builds another GEMM: the record is stale
    assert dispatched_fingerprints(packed) is None


def _vnni_like(w: torch.Tensor) -> torch.Tensor:
    """A shape-keeping permutation of each head's matrix (pairs along the last dim moved row-major to column-major)."""
    return w.unflatten(-1, (-1, 2)).transpose(-2, -3).contiguous().view(w.shape)


class _PackingMLAImpl:
    """``AMXMLAImpl.process_weights_after_loading``'s steps with ``pack`` for ``convert_weight_packed``."""

    pack = staticmethod(_vnni_like)

    def __init__(self, weight: torch.Tensor, heads: int, rank: int, nope: int, v_dim: int) -> None:
        self.kv_b_proj = torch.nn.Module()
        self.kv_b_proj.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim = heads, rank, nope, v_dim
        self.process_weights_after_loading(weight.dtype)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        w = self.kv_b_proj.weight.to(act_dtype).T.view(self.kv_lora_rank, self.num_heads, -1)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        self._w_uk_packed = self.pack(w_uk.permute(1, 0, 2).contiguous())
        self._w_uv_packed = self.pack(w_uv.permute(1, 2, 0).contiguous())
        self._w_scale = None


class _HeadsReversed(_PackingMLAImpl):
    """A packing that is not head by head (a layout is learnt per impl class and shape)."""

    pack = staticmethod(lambda w: _vnni_like(w).flip(0))


def _released_mla(heads: int = 3, impl=_PackingMLAImpl, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """An ``MLAAttention`` stand-in after the AMX backend packed ``kv_b_proj`` and emptied its weight."""
    rank, nope, v_dim = 16, 8, 6
    weight = torch.randn(heads * (nope + v_dim), rank, generator=torch.Generator().manual_seed(seed)).bfloat16()
    mla = torch.nn.Module()
    mla.impl = impl(weight, heads, rank, nope, v_dim)
    mla.kv_b_proj = mla.impl.kv_b_proj
    mla.kv_b_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    mla.kv_b_proj.cpu_linear = F.linear
    mla.kv_b_proj._cpu_skip_gemm_dispatch = True
    return mla, weight


@pytest.mark.parametrize("heads", [1, 3])
def test_an_mla_weight_packed_per_head_comes_back_bit_exact(heads: int) -> None:
    """The packing is learnt from the impl's own method on two heads, inverted, and checked by packing again."""
    mla, weight = _released_mla(heads, seed=heads)
    assert torch.equal(latent_up_weight(mla), weight)
    assert torch.equal(dense_weight(mla.kv_b_proj, [torch.nn.Linear(2, 2), mla]), weight)  # found among owners
    with pytest.raises(NotImplementedError, match="no MLA layer"):
        dense_weight(mla.kv_b_proj)


def test_an_mla_packing_that_mixes_heads_or_scales_is_refused() -> None:
    """Negative controls: heads packed out of order, and an FP8 copy (a scale: not the checkpoint's weight)."""
    mla, _ = _released_mla(3, impl=_HeadsReversed, seed=7)
    with pytest.raises(NotImplementedError, match="head by head"):
        latent_up_weight(mla)
    mla, _ = _released_mla(3, seed=8)
    mla.impl._w_scale = torch.ones(())
    with pytest.raises(NotImplementedError, match="FP8"):
        latent_up_weight(mla)
