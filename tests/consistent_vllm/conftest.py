"""Fixtures for consistent mode inside a real in-process vLLM.

Tiny bf16 models (Qwen3, Llama, Qwen3-MoE, Llama with llama3, linear and yarn RoPE scaling) are built from transformers configs
with weights drawn at std 0.2, so that next-token distributions are peaked and
logprob differences are as large as on a trained model (std 0.02 makes every
logprob about -8.4 and hides divergence). Each is saved once per session.

vLLM holds process-wide state, so only one engine lives at a time: engines come
from the project's engine pool (``logdiff.sources.pool.acquire``), which evicts
the previous vLLM engine when another is requested. Tests are parametrized by
``arch`` through a session-scoped fixture, so pytest runs all tests of one
architecture together and each engine is loaded once per session.

Every engine uses ``max_num_batched_tokens=32``: prompts longer than that are
prefilled in chunks, and a batch of mixed lengths has steps that mix prefill
chunks with decode tokens. Prefix caching is on, as in production serving, so
that a KV block cached in one mode could leak into the other.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ARCHS = ("qwen3", "llama", "qwen3-moe", "llama3", "llama-linear", "llama-yarn")
#: Llama with scaled RoPE: Llama 3's (``rope_type: llama3``; original context 256 puts the 32 frequencies
#: of head_dim 64 in all three bands: kept, interpolated, divided by the factor), linear, and yarn (original
#: context 128: its ramp lies inside the 32 frequencies, cos/sin times 1.14)
SCALED_ROPES = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "llama-linear": {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0},
    "llama-yarn": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 128},
}
MAX_NUM_BATCHED_TOKENS = 32
MAX_MODEL_LEN = 256
INIT_STD = 0.2

_COMMON = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _build(arch: str, path: Path) -> Path:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**_COMMON))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON))
    elif arch in SCALED_ROPES:
        model = LlamaForCausalLM(LlamaConfig(**_COMMON, rope_parameters=SCALED_ROPES[arch]))
    elif arch == "qwen3-moe":
        config = Qwen3MoeConfig(
            **_COMMON,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(arch)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else INIT_STD * noise)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> directory; built lazily, once per session."""
    return _LazyModels(tmp_path_factory)


class _LazyModels(dict):
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self._factory = factory

    def __missing__(self, arch: str) -> Path:
        path = _build(arch, self._factory.mktemp(f"tiny-{arch}"))
        self[arch] = path
        return path


@pytest.fixture(scope="session", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    return request.param


@pytest.fixture
def llm(arch: str, tiny_models: dict[str, Path]) -> Any:
    """The pooled in-process ``vllm.LLM`` for ``arch`` (loaded once, reused across tests)."""
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire

    spec = EngineSpec(
        model_dir=str(tiny_models[arch]),
        dtype="bfloat16",
        options=(
            ("max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS),
            ("max_model_len", MAX_MODEL_LEN),
            ("max_num_seqs", 8),
            ("enable_prefix_caching", True),
        ),
    )
    return acquire("vllm", spec).llm


@pytest.fixture(scope="session")
def hf_models(tiny_models: dict[str, Path]) -> dict[str, Any]:
    """arch -> HF model in eval mode (bf16), loaded lazily once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    class Models(dict):
        def __missing__(self, arch: str) -> Any:
            model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.bfloat16).eval()
            self[arch] = model
            return model

    return Models()


@pytest.fixture
def hf_model(arch: str, hf_models: dict[str, Any]) -> Any:
    return hf_models[arch]
