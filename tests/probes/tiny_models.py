"""Tiny random bf16 models with a real architecture's layout, for the probe tests."""

from __future__ import annotations

from pathlib import Path


def build_tiny(path: Path, arch: str = "qwen3", **overrides: object) -> Path:
    """Save a tiny random bf16 model of ``arch`` (a demo config, shrunk) to ``path``."""
    from logdiff.demo import build_random_model

    sizes: dict[str, object] = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
    if arch == "qwen3-moe":
        sizes.pop("intermediate_size")
        sizes["moe_intermediate_size"] = 64
    return build_random_model(path, arch, vocab_size=512, **{**sizes, **overrides})
