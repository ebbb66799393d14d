"""The accelerator backends' CPU-checkable parts: platform choice, refusals, FlashAttention's cache
reading, and the ``vllm-ascend`` engine's registration. No GPU or NPU runs here (see
tests/test_gpu_conformance.py and scripts/gpu-check.sh for what needs one)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from logdiff import kernels

HEAD, KV_HEADS, BLOCK = 16, 2, 4


def _flash_cache(seqs: list[torch.Tensor], tables: list[list[int]], blocks: int) -> torch.Tensor:
    """A FlashAttention cache ``[blocks, kv_heads, block, 2 * head]`` written the way vLLM's
    ``FlashAttentionImpl.do_kv_cache_update`` writes it (through ``transpose(1, 2).split``)."""
    cache = torch.full((blocks, KV_HEADS, BLOCK, 2 * HEAD), float("nan"))
    k_cache, v_cache = cache.transpose(1, 2).split(HEAD, dim=-1)
    for kv, table in zip(seqs, tables, strict=True):
        for pos in range(kv.shape[1]):
            block, slot = table[pos // BLOCK], pos % BLOCK
            k_cache[block, slot], v_cache[block, slot] = kv[0, pos], kv[1, pos]
    return cache


def _seqs(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, KV_HEADS, HEAD, generator=gen) for n in lengths]


def test_flash_reader_reads_back_what_vllm_wrote_following_the_block_table():
    from logdiff.sources.vllm.consistent.cuda import FlashKVReader

    seqs = _seqs((7, 3, 9))
    tables = [[5, 1], [0, 6], [2, 7, 3]]  # scattered blocks, not in order
    cache = _flash_cache(seqs, tables, blocks=8)
    reader = FlashKVReader.of(SimpleNamespace(head_size=HEAD), None, cache)
    rows = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    lens = torch.tensor([s.shape[1] for s in seqs])
    k, v = reader.read_batch(cache, rows, lens)
    for i, kv in enumerate(seqs):
        n = kv.shape[1]
        assert torch.equal(k[i, :n], kv[0]) and torch.equal(v[i, :n], kv[1])
        assert not k[i, n:].any() and not v[i, n:].any()  # exact zeros past the length, whatever the cache holds
    # Negative control: another request's block table reads other keys.
    k_other, _ = reader.read_batch(cache, rows[[1]], lens[[0]])
    assert not torch.equal(k_other[0, :7], seqs[0][0])


def test_flash_attention_forward_matches_the_reference_per_request():
    """The ``cuda`` backend's attention over a FlashAttention cache, run on CPU tensors: each request
    gets the reference kernel's result on its own contiguous keys, alone or batched with others."""
    from logdiff.sources.vllm import consistent_ops as ops
    from logdiff.sources.vllm.consistent.cuda import FlashKVReader

    seqs = _seqs((7, 3, 9))
    tables = [[5, 1], [0, 6], [2, 7, 3]]
    cache = _flash_cache(seqs, tables, blocks=8)
    impl = SimpleNamespace(scale=HEAD**-0.5, logits_soft_cap=0, sliding_window=(-1, -1), sinks=None, head_size=HEAD)
    forward = ops.attention_forward(impl, reader=FlashKVReader.of, window=None)
    new = (2, 1, 3)  # this step's query tokens per request (the last ones of each sequence)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(new), 2 * KV_HEADS, HEAD, generator=gen)
    starts = torch.tensor([0, 2, 3, 6])
    meta = SimpleNamespace(
        causal=True,
        query_start_loc=starts,
        seq_lens=torch.tensor([7, 3, 9]),
        block_table=torch.tensor([t + [0] * (3 - len(t)) for t in tables]),
    )
    out = forward(None, query, None, None, cache, meta, torch.zeros_like(query))
    for i, kv in enumerate(seqs):
        n, t = kv.shape[1], new[i]
        q = query[starts[i] : starts[i + 1]]
        ref = kernels.attention(q, kv[0], kv[1], torch.arange(n - t, n), impl.scale)
        assert torch.equal(out[starts[i] : starts[i + 1]], ref)


def test_backend_follows_the_platform_and_refuses_unknown_ones():
    from logdiff.sources.vllm.consistent import backend_for

    assert backend_for("cpu").name == "cpu"
    assert backend_for("cuda").name == "cuda"
    assert backend_for("npu").name == "npu"
    with pytest.raises(NotImplementedError, match="no backend for vLLM platform 'tpu'"):
        backend_for("tpu")


def _config(world_size: int = 1, eager: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=world_size), model_config=SimpleNamespace(enforce_eager=eager)
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="reads vllm.envs")
def test_cuda_backend_refuses_in_one_line_what_it_cannot_cover(monkeypatch):
    import vllm.envs as envs

    from logdiff.sources.vllm.consistent.cuda import CUDABackend

    # set on the module, as vLLM reads it: an engine started earlier in this process may have cached the environment
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)
    with pytest.raises(NotImplementedError, match=r"^consistent mode on CUDA needs VLLM_BATCH_INVARIANT=1"):
        CUDABackend().check(_config())
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    CUDABackend().check(_config())  # covered: no error
    with pytest.raises(NotImplementedError, match="single-GPU"):
        CUDABackend().check(_config(world_size=2))
    with pytest.raises(NotImplementedError, match="enforce_eager"):
        CUDABackend().check(_config(eager=False))


def test_cuda_backend_leaves_other_attention_backends_and_patches_a_linears_apply():
    from logdiff.sources.vllm.consistent.cuda import CUDABackend
    from logdiff.sources.vllm.consistent.plan import Left

    backend = CUDABackend()
    left = backend.attention(SimpleNamespace(impl=type("TritonAttentionImpl", (), {})()))
    assert isinstance(left, Left) and "TritonAttentionImpl" in left.why
    weight = torch.randn(256 + 128, 64)
    method = SimpleNamespace(apply=None)
    layer = SimpleNamespace(quant_method=method, weight=weight, output_partition_sizes=[256, 128])
    obj, attr, apply = backend.linear(layer)
    assert (obj, attr) == (method, "apply")
    x = torch.randn(5, 64)
    assert torch.equal(apply(layer, x), torch.cat([kernels.linear(x, weight[:256]), kernels.linear(x, weight[256:])], -1))
    assert backend.linear(SimpleNamespace(quant_method=method, weight=weight)) == "a quant_method shared between layers"


def test_vllm_ascend_is_registered_and_unavailable_in_one_line_without_torch_npu():
    from logdiff.errors import EngineUnavailable
    from logdiff.sources.registry import engine_names, get_engine
    from logdiff.sources.vllm import VLLMEngine

    assert "vllm-ascend" in engine_names()
    cls = get_engine("vllm-ascend")
    assert issubclass(cls, VLLMEngine) and cls.tap_mapping is VLLMEngine.tap_mapping
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    with pytest.raises(EngineUnavailable) as err:
        cls.check_available()
    assert err.value.exit_code == 3 and "\n" not in str(err.value) and "torch_npu" in str(err.value)


@pytest.mark.vllm
def test_plan_with_a_leaving_backend_lists_what_is_left_and_patches_nothing_it_leaves(qwen3):
    """The platform-neutral plan on a real (CPU) vLLM engine, driven by the ``npu`` backend (every
    linear, attention and MoE left to the platform): the neutral ops are planned, each left op is
    listed by name and never patched, and nothing is refused. Negative control: the ``cpu`` backend
    on the same engine leaves nothing."""
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire
    from logdiff.sources.vllm.consistent import engine_objects
    from logdiff.sources.vllm.consistent.cpu import CPUBackend
    from logdiff.sources.vllm.consistent.plan import build_plan
    from logdiff.sources.vllm_ascend.consistent import NPUBackend

    class LeavingBackend(NPUBackend):
        def check(self, config):  # the NPU build's checks do not apply on this CPU
            pass

    llm = acquire("vllm", EngineSpec(model_dir=str(qwen3), dtype="bfloat16", options=(("max_num_seqs", 4),))).llm
    model, runner = engine_objects(llm)
    plan, summary = build_plan(llm, model, runner, LeavingBackend())
    assert summary.platform == "npu"
    assert {"rms_norm", "rope", "silu_and_mul", "log_softmax"} <= set(summary.replaced)
    assert "linear" not in summary.replaced and "attention" not in summary.replaced
    layers = model.config.num_hidden_layers
    left_attention = [entry for entry in summary.left if entry.startswith("attention ")]
    assert len(left_attention) == layers and all("CPUAttentionBackendImpl" in e for e in left_attention)
    assert any(entry.startswith("linear ") and "qkv_proj" in entry for entry in summary.left)
    assert all(kind not in ("linear", "attention") for kind, *_ in plan)
    _, cpu_summary = build_plan(llm, model, runner, CPUBackend())
    assert cpu_summary.left == [] and len(cpu_summary.replaced["attention"]) == layers
