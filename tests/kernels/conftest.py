"""Fixtures for the kernel tests: seeded generators, tiny HF models, and the two HF paths.

The tiny models are built from configs (no hub) with ``initializer_range=0.2``
so their next-token distributions are peaked (see notes/cpu-numerics.md: at
the default 0.02 every logprob is near -log(V) and differences look tiny).
Each (arch, dtype) model is built once per session; consistent mode always
restores it, so tests can share it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=128,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def build_tiny(arch: str, dtype: torch.dtype, **overrides: object) -> torch.nn.Module:
    """A seeded tiny causal LM of ``arch`` ("qwen3", "qwen2", "llama", "qwen3_moe") in ``dtype``, eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    kwargs = {**TINY, **overrides}
    if arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**kwargs))
    elif arch == "qwen2":  # q/k/v biases, no q/k norms
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**kwargs))
    elif arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kwargs))
    elif arch == "qwen3_moe":
        moe = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**moe, **kwargs))
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def build_model() -> Callable[..., torch.nn.Module]:
    """``build_model(arch, dtype, **config_overrides)`` -> a fresh (unshared) tiny model."""
    return build_tiny


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str, torch.dtype], torch.nn.Module]:
    """``tiny_model("qwen3", torch.bfloat16)`` -> a shared tiny model, built once per session."""
    built: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def get(arch: str, dtype: torch.dtype) -> torch.nn.Module:
        if (arch, dtype) not in built:
            built[arch, dtype] = build_tiny(arch, dtype)
        return built[arch, dtype]

    return get


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from logdiff.kernels import token_log_probs

    return token_log_probs(logits, tokens)


def full_forward_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]
) -> list[torch.Tensor]:
    """Teacher-forced training path: one right-padded batched forward; logprobs of each response."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : lengths[i]] = torch.tensor(p + r)
        mask[i, : lengths[i]] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return [
        _token_logprobs(logits[i, len(p) - 1 : len(p) + len(r) - 1], torch.tensor(r))
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]


def kv_decode_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]
) -> list[torch.Tensor]:
    """Inference path: left-padded batched prefill, then the response tokens one step at a time."""
    from transformers import DynamicCache

    b, width, steps = len(prompts), max(len(p) for p in prompts), len(responses[0])
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out: list[list[torch.Tensor]] = [[] for _ in range(b)]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
        for step in range(steps):
            tokens = torch.tensor([r[step] for r in responses])
            for i, lp in enumerate(_token_logprobs(logits, tokens)):
                out[i].append(lp)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache
            ).logits[:, -1]
    return [torch.stack(x) for x in out]


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two paths' per-sequence logprobs are bitwise equal, sequence by sequence."""
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def hf_paths() -> SimpleNamespace:
    """The two HF paths: ``full(model, prompts, responses)`` and ``decode(...)`` -> per-sequence logprobs;
    ``equal(a, b)`` compares two such results bitwise."""
    return SimpleNamespace(full=full_forward_logprobs, decode=kv_decode_logprobs, equal=bitwise_equal)


@pytest.fixture
def sequences() -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of mixed lengths (3, 11, 6) and 8-token responses, seeded."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (3, 11, 6)]
    responses = [torch.randint(0, TINY["vocab_size"], (8,), generator=g).tolist() for _ in prompts]
    return prompts, responses
