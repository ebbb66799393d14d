"""Untrained demo-shaped models with peaked outputs, for tests and benchmarks that need no training.

A default init (std 0.02) gives near-uniform next-token distributions that hide
divergence (../shared/notes/cpu-numerics.md); every matrix is drawn with std 0.2
instead, seeded, and saved in bf16 through ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_random_model(path: Path, arch: str = "qwen3", *, vocab_size: int = 4096, std: float = 0.2,
                       seed: int = 0, **overrides: Any) -> Path:
    """Save a seeded random bf16 model of ``arch`` (a ``tiny_config``, with ``overrides``) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.demo.configs import tiny_config

    config = tiny_config(arch, vocab_size, **{"pad_token_id": 0, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std)
    model.config.architectures = [type(model).__name__]
    model.to(torch.bfloat16).save_pretrained(path)
    return Path(path)
