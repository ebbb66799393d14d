"""Tiny transformers configs for the demo models: a common shape plus each architecture's demo entry.

What is specific to an architecture (q/k norms, biases, MoE, RoPE scaling,
its transformers config class) lives with its adapter, as a ``Demo`` entry in
``logdiff/probes/arch/`` (``demos()`` lists them, in registration order); this
module adds the shape every demo shares (hidden 256, 4 layers, 4 query / 2
kv heads of 64), at a size that trains and runs on two CPU cores. The table of
every demo (MLP, experts, biases, norms, parameters) is in docs/demo-model.md.

Grouped-query attention (2 kv heads for 4 query heads) is kept on purpose:
it is where engines differ in how they lay out and repeat K/V.
"""

from __future__ import annotations

from typing import Any

from logdiff.errors import InputError


def _demos() -> dict[str, Any]:
    from logdiff.probes.arch import demos

    return demos()


SUPPORTED_DEMO_ARCHS: tuple[str, ...] = tuple(_demos())

_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_cache": True,
}


class UnsupportedArchError(InputError, ValueError):
    """An architecture the demo builder does not know (exit code 2 in the CLI)."""


def check_arch(arch: str) -> str:
    """Return ``arch`` if it is supported, else raise UnsupportedArchError naming the supported ones."""
    if arch not in SUPPORTED_DEMO_ARCHS:
        raise UnsupportedArchError(
            f"unsupported demo architecture {arch!r}; supported: {', '.join(SUPPORTED_DEMO_ARCHS)}"
        )
    return arch


def tiny_config(arch: str, vocab_size: int, **overrides: Any):
    """A tiny transformers config for ``arch`` with ``vocab_size`` tokens.

    ``overrides`` replace any config key (e.g. ``num_hidden_layers=2``,
    ``bos_token_id=1``). The result is an untrained-model recipe: pass it to
    ``AutoModelForCausalLM.from_config`` to get random weights.
    """
    check_arch(arch)
    import copy

    import transformers

    demo = _demos()[arch]
    config_cls = getattr(transformers, demo.config_class)
    kwargs: dict[str, Any] = {**_COMMON, **copy.deepcopy(dict(demo.settings)), "vocab_size": vocab_size}
    kwargs.update(overrides)
    return config_cls(**kwargs)
