"""Consistent mode in a real in-process vLLM: bitwise equal to HF, batch-invariant, fully undone.

Every bitwise assertion compares fp32 logprob tensors with ``torch.equal``
(rtol = atol = 0). The negative controls run the same comparison on stock vLLM
and must find a difference; if consistent mode stopped doing anything, the
bitwise tests would fail, and if vLLM became consistent on its own, the
negative control would fail and say so.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

PROMPT_LENS = (5, 40, 17, 70)  # 40 and 70 exceed the 32-token step budget: chunked prefill
RESPONSE_LEN = 8


def _prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lens]


def _decode(llm: Any, prompts: list[list[int]], temperature: float = 1.0) -> tuple[list[list[int]], list[Any]]:
    """Sampled tokens and the decode-path logprob vLLM reported for each."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=RESPONSE_LEN, logprobs=0, temperature=temperature, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        torch.tensor([step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)])
        for o, toks in zip(outs, tokens)
    ]
    return tokens, logprobs


def _prefill(llm: Any, seqs: list[list[int]]) -> list[Any]:
    """vLLM ``prompt_logprobs`` of tokens 1..n-1 of each sequence."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    return [torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))]) for o, s in zip(outs, seqs)]


def _hf_logprobs(model: Any, seqs: list[list[int]]) -> list[Any]:
    """HF teacher-forced logprobs of tokens 1..n-1: kernel log_softmax of the model's logits."""
    from logdiff.kernels import log_softmax

    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor([s])).logits[0]
            out.append(log_softmax(logits)[:-1].gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
    return out


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@contextmanager
def _record_steps(llm: Any) -> Any:
    """Record (query_len, seq_len) per request of every step, from layer 0's attention."""
    from vllm.model_executor.layers.attention import Attention

    steps: list[list[tuple[int, int]]] = []
    holder: list[Any] = []
    llm.apply_model(holder.append)
    attn = next(m for m in holder[0].modules() if isinstance(m, Attention))
    inner = attn.impl.forward

    def forward(layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, meta: Any, output: Any, **kw: Any) -> Any:
        if meta is not None:
            starts = meta.query_start_loc.tolist()
            steps.append([(b - a, n) for a, b, n in zip(starts, starts[1:], meta.seq_lens.tolist())])
        return inner(layer, query, key, value, kv_cache, meta, output, **kw)

    attn.impl.forward = forward
    try:
        yield steps
    finally:
        attn.impl.forward = inner


def _snapshot(llm: Any) -> dict[str, Any]:
    """Identity of every instance attribute consistent mode may replace."""
    from logdiff.sources.vllm.consistent import engine_objects

    model, runner = engine_objects(llm)
    snap: dict[str, Any] = {"sampler": vars(runner.sampler).get("compute_logprobs")}
    for name, module in model.named_modules():
        for attr in ("forward", "cpu_linear"):
            snap[f"{name}.{attr}"] = vars(module).get(attr)
        impl = getattr(module, "impl", None)
        if impl is not None:
            snap[f"{name}.impl.forward"] = vars(impl).get("forward")
    return snap


def test_decode_and_prefill_bitwise_equal_to_hf(llm: Any, hf_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from logdiff import kernels
    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.vllm.consistent import consistent_vllm

    rows: list[int] = []
    log_softmax = kernels.log_softmax
    monkeypatch.setattr(kernels, "log_softmax", lambda x: rows.append(x.shape[0]) or log_softmax(x))
    prompts = _prompts()
    with consistent_vllm(llm) as replaced:
        with _record_steps(llm) as steps:
            tokens, decode = _decode(llm, prompts)
        decode_rows = sum(rows)
        seqs = [p + t for p, t in zip(prompts, tokens)]
        prefill = _prefill(llm, seqs)
    # Both the sampler's and the prompt-logprobs' log_softmax went through the kernel.
    assert decode_rows >= len(prompts) * RESPONSE_LEN
    assert sum(rows) - decode_rows >= sum(len(s) - 1 for s in seqs)
    with consistent_hf(hf_model):
        ref = _hf_logprobs(hf_model, seqs)

    assert {"linear", "rms_norm", "rope", "attention", "log_softmax"} <= set(replaced.replaced)
    # The run really had chunked prefill (a multi-token query after earlier context)
    # and steps that mix prefill chunks with decode tokens.
    assert any(1 < q < n for step in steps for q, n in step)
    assert any({q == 1 for q, _ in step} == {True, False} for step in steps)

    for p, dec, pre, hf in zip(prompts, decode, prefill, ref):
        assert torch.equal(dec, hf[len(p) - 1 :]), f"decode vs HF max diff {float((dec - hf[len(p) - 1:]).abs().max())}"
        assert torch.equal(pre, hf), f"prefill vs HF max diff {float((pre - hf).abs().max())}"


@pytest.mark.isa_sensitive
def test_stock_vllm_differs_and_originals_come_back(llm: Any, hf_model: Any, stock_varies: Any) -> None:
    """Negative control: stock vLLM is not bitwise equal to HF; after exit, stock bits return."""
    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.vllm.consistent import consistent_vllm

    prompts = _prompts()
    before = _snapshot(llm)
    stock_tokens, _ = _decode(llm, prompts, temperature=0.0)
    seqs = [p + t for p, t in zip(prompts, stock_tokens)]
    stock = _prefill(llm, seqs)
    with consistent_hf(hf_model):
        ref = _hf_logprobs(hf_model, seqs)
    stock_hf = _hf_logprobs(hf_model, seqs)

    with consistent_vllm(llm):
        inside = _prefill(llm, seqs)
    assert all(torch.equal(a, b) for a, b in zip(inside, ref))
    assert _snapshot(llm) == before
    after_tokens, _ = _decode(llm, prompts, temperature=0.0)
    after = _prefill(llm, seqs)
    assert after_tokens == stock_tokens
    assert all(torch.equal(a, b) for a, b in zip(after, stock))
    # Only where stock differs from both HF paths do the checks above show the originals came back.
    stock_varies(_max_diff(stock, ref) == 0 or _max_diff(stock, stock_hf) == 0, "stock vLLM matches HF bitwise here")


def test_batch_invariant_inside_consistent_mode(llm: Any) -> None:
    from logdiff.sources.vllm.consistent import consistent_vllm

    batch = _prompts((40, 5, 70, 17), seed=2)
    with consistent_vllm(llm):
        alone_tokens, alone = _decode(llm, batch[:1], temperature=0.0)
        batch_tokens, batched = _decode(llm, batch, temperature=0.0)
    assert alone_tokens[0] == batch_tokens[0]
    assert torch.equal(alone[0], batched[0])


def test_originals_restored_after_an_exception(llm: Any) -> None:
    from logdiff.sources.vllm.consistent import consistent_vllm

    before = _snapshot(llm)
    with pytest.raises(RuntimeError, match="boom"):
        with consistent_vllm(llm):
            assert _snapshot(llm) != before
            with pytest.raises(RuntimeError, match="already active"):
                with consistent_vllm(llm):
                    pass  # pragma: no cover
            raise RuntimeError("boom")
    assert _snapshot(llm) == before


def test_unsupported_attention_raises_before_patching(llm: Any) -> None:
    from vllm.model_executor.layers.attention import Attention

    from logdiff.sources.vllm.consistent import consistent_vllm

    holder: list[Any] = []
    llm.apply_model(holder.append)
    impl = next(m for m in holder[0].modules() if isinstance(m, Attention)).impl
    before = _snapshot(llm)
    impl.alibi_slopes = torch.zeros(impl.num_heads)  # (a sliding window is covered now: the kernel masks it)
    try:
        with pytest.raises(NotImplementedError, match="ALiBi"):
            with consistent_vllm(llm):
                pass  # pragma: no cover
        assert _snapshot(llm) == before
    finally:
        impl.alibi_slopes = None


@pytest.mark.isa_sensitive
def test_recovered_weights_equal_the_checkpoint(arch: str, llm: Any, tiny_models: Any) -> None:
    """Whatever the CPU's GEMM and MoE dispatch kept or packed away, the weights come back bit-exact.

    Whether vLLM keeps the plain weight is the ISA's choice (AVX-512 BF16: oneDNN packs it away;
    AVX2: the torch fallback keeps it), so the test holds either way;
    tests/probes/test_weight_recovery.py forces the packed-away case on any CPU.
    """
    from logdiff.probes.contracts import fingerprint
    from safetensors.torch import load_file

    from logdiff.sources.vllm.weights import dense_weight, dispatched_fingerprints, moe_runner_weights

    sd = load_file(str(tiny_models[arch] / "model.safetensors"))
    holder: list[Any] = []
    llm.apply_model(holder.append)
    layer = holder[0].model.layers[0]
    qkv = layer.self_attn.qkv_proj
    ref = torch.cat([sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(dense_weight(qkv), ref)
    recorded = dispatched_fingerprints(qkv)  # where the dispatch packed the weight away, hashed as it loaded
    assert (recorded is None) == (qkv.weight.numel() > 0)
    if recorded is not None:
        assert recorded.parts == tuple(fingerprint(sd[f"model.layers.0.self_attn.{p}_proj.weight"]) for p in "qkv")
    if arch == "qwen3-moe":
        runner = layer.mlp.experts
        n = runner.moe_config.num_experts

        def expert(e: int, proj: str) -> torch.Tensor:
            return sd[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"]

        plain13 = torch.stack([torch.cat([expert(e, "gate"), expert(e, "up")]) for e in range(n)])
        plain2 = torch.stack([expert(e, "down") for e in range(n)])
        w13, w2 = moe_runner_weights(runner)
        assert torch.equal(w13, plain13) and torch.equal(w2, plain2)


@pytest.mark.isa_sensitive
def test_vllm_fingerprints_verify_every_weight(arch: str, llm: Any, hf_model: Any) -> None:
    """The preflight compares every tensor, packed or not, on whatever dispatch this CPU chose."""
    from logdiff.diagnosis.preflight import compare_fingerprints
    from logdiff.sources.hf.contract import hf_contract, hf_fingerprints
    from logdiff.sources.vllm.contract import vllm_contract, vllm_fingerprints

    holder: list[Any] = []
    llm.apply_model(holder.append)
    model = holder[0]
    weights = compare_fingerprints(hf_fingerprints(hf_model), vllm_fingerprints(model, int(model.config.vocab_size)))
    assert weights["unverified"] == [] and weights["differs"] == []
    assert weights["fingerprint_train"] == weights["fingerprint_infer"]
    train, infer = hf_contract(hf_model, {}), vllm_contract(model, {})
    for key in ("num_experts_per_tok", "norm_topk_prob", "rms_norm_eps", "rope_theta"):
        assert infer[key] == train[key], key


def test_prefix_cache_from_stock_mode_is_not_reused(
    arch: str, llm: Any, hf_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV blocks cached by a stock run must not feed a consistent run (and vice versa)."""
    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.vllm import consistent as module

    if arch != "qwen3":
        pytest.skip("one architecture is enough: the cache is engine machinery, not model numerics")
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    prompt = _prompts((block_size + 12,), seed=3)  # one full block gets cached
    # (prompt_logprobs requests bypass the prefix cache, so this goes through decode)

    def consistent_vs_hf() -> bool:
        _decode(llm, prompt, temperature=0.0)  # stock run: caches the prompt's first block
        with module.consistent_vllm(llm):
            tokens, decode = _decode(llm, prompt, temperature=0.0)
        with consistent_hf(hf_model):
            ref = _hf_logprobs(hf_model, [prompt[0] + tokens[0]])[0]
        return torch.equal(decode[0], ref[len(prompt[0]) - 1 :])

    assert consistent_vs_hf()
    # Negative control: without the resets the stock block is reused and the logprobs differ.
    monkeypatch.setattr(module, "_reset_prefix_cache", lambda llm: None)
    try:
        assert not consistent_vs_hf()
    finally:
        llm.reset_prefix_cache()
