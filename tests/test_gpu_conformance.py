"""Device conformance on CUDA (``pytest -m gpu``; run by scripts/gpu-check.sh). Skipped without a GPU.

The properties the CPU suite checks, on the device the accelerator backends target:

* ``kernels.aten_overrides("CUDA")``: a row's ``mm``/``F.linear``/``log_softmax``/``mean`` bits
  do not depend on the other rows in the call, and a planted order-dependent ``mm`` fails the
  same check (negative control);
* the reference kernels (``linear``, ``attention``) are batch-invariant on the device;
* the ``cuda`` backend's FlashAttention cache reader reads back what was written, on device tensors;
* HF's consistent mode on CUDA (module patches plus the aten overrides) gives a prompt's
  logprobs the same bits alone and inside a batch.

**Written without GPU access: none of these has run on hardware yet.**
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (torch sees none)"),
]

DTYPES = [torch.float32, torch.bfloat16]


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype).cuda()


def _batch_invariant(op, k: int, dtype: torch.dtype) -> bool:
    needle = _rows(1, k, dtype, seed=1)
    alone = op(needle)[0]
    for m in (1, 3, 17, 40, 200):
        batch = torch.cat([_rows(m, k, dtype, seed=100 + m), needle, _rows(m // 2, k, dtype, seed=200 + m)])
        if not torch.equal(op(batch)[m], alone):
            return False
    return True


@pytest.mark.parametrize("dtype", DTYPES)
def test_aten_overrides_rows_batch_invariant_on_cuda(dtype):
    from logdiff.kernels.aten_overrides import aten_overrides

    w = _rows(512, 384, dtype, seed=7)
    bias = _rows(1, 384, dtype, seed=8)[0]
    with aten_overrides("CUDA"):
        assert _batch_invariant(lambda x: torch.mm(x, w), 512, dtype)
        assert _batch_invariant(lambda x: F.linear(x, w.t(), bias), 512, dtype)
        assert _batch_invariant(lambda x: torch.log_softmax(x, -1), 4096, dtype)
        assert _batch_invariant(lambda x: x.mean(-1, keepdim=True), 4096, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_aten_overrides_negative_control_on_cuda(dtype):
    from logdiff.kernels.aten_overrides import STOCK, aten_overrides

    def order_dependent_mm(a, b):
        out = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        for idx in torch.arange(a.shape[1], device=a.device).chunk(min(len(a), 8)):
            out = out + STOCK["mm"](a[:, idx], b[idx])
        return out

    w = _rows(512, 128, dtype, seed=7)
    with aten_overrides("CUDA", {"mm": order_dependent_mm}):
        assert not _batch_invariant(lambda x: torch.mm(x, w), 512, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_kernels_batch_invariant_on_cuda(dtype):
    from logdiff import kernels

    w = _rows(384, 512, dtype, seed=3)
    assert _batch_invariant(lambda x: kernels.linear(x, w), 512, dtype)
    k, v = _rows(64, 2 * 64, dtype, seed=4).view(64, 2, 64), _rows(64, 2 * 64, dtype, seed=5).view(64, 2, 64)
    q = _rows(64, 4 * 64, dtype, seed=6).view(64, 4, 64)
    pos = torch.arange(64, device="cuda")
    full = kernels.attention(q, k, v, pos, 0.125)
    for t in (1, 17, 63):
        assert torch.equal(kernels.attention(q[t : t + 1], k[: t + 1], v[: t + 1], pos[t : t + 1], 0.125)[0], full[t])


def test_flash_reader_on_device():
    from types import SimpleNamespace

    from logdiff.sources.vllm.consistent.cuda import FlashKVReader

    head, heads, block = 64, 2, 16
    cache = torch.zeros(4, heads, block, 2 * head, device="cuda")
    k_cache, v_cache = cache.transpose(1, 2).split(head, dim=-1)
    kv = torch.randn(2, 20, heads, head, device="cuda")
    table = [3, 1]
    for pos in range(20):
        k_cache[table[pos // block], pos % block], v_cache[table[pos // block], pos % block] = kv[0, pos], kv[1, pos]
    reader = FlashKVReader.of(SimpleNamespace(head_size=head), None, cache)
    k, v = reader.read_batch(cache, torch.tensor([table], device="cuda"), torch.tensor([20], device="cuda"))
    assert torch.equal(k[0], kv[0]) and torch.equal(v[0], kv[1])


def test_hf_consistent_on_cuda_is_batch_invariant(qwen3):
    """A prompt's logprobs under ``consistent_hf`` on CUDA: the same bits alone and next to others."""
    from transformers import AutoModelForCausalLM

    from logdiff import kernels
    from logdiff.sources.hf.consistent import consistent_hf

    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen).cuda()
    with torch.no_grad(), consistent_hf(model):
        batch = kernels.log_softmax(model(ids).logits)
        alone = kernels.log_softmax(model(ids[2:3]).logits)
    assert torch.equal(batch[2], alone[0])


def test_a_comparison_keeps_its_statistics_on_the_device_without_a_sync():
    """``DiffSummary.update`` of a live side on CUDA never synchronizes (torch's sync debug mode raises on one);
    settled, it is the summary the host fold gives."""
    import numpy as np
    from logdiff.probes.summary import DiffSummary

    gen = torch.Generator().manual_seed(5)
    ref = torch.randn(64, 512, generator=gen).to(torch.bfloat16)
    live = ref.clone()
    live[7, 100] += 1.0
    seq, pos = np.arange(64) // 8, np.arange(64) % 8
    device = DiffSummary(16)
    live_cuda = live.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for a in range(0, 64, 16):
            device.update(ref[a : a + 16], live_cuda[a : a + 16], seq[a : a + 16], pos[a : a + 16])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = DiffSummary(16)
    host.update(ref, live, seq, pos)
    assert device.settle().to_dict() == host.to_dict()
