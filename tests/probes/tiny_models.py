"""Tiny random bf16 models with a real architecture's layout, for the probe tests."""

from __future__ import annotations

from pathlib import Path


def build_tiny(path: Path, arch: str = "qwen3", **overrides: object) -> Path:
    """Save a tiny random bf16 model of ``arch`` (a demo config, shrunk) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.demo import tiny_config

    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "pad_token_id": 0}
    if arch == "qwen3-moe":
        sizes.pop("intermediate_size")
        sizes["moe_intermediate_size"] = 64
    config = tiny_config(arch, 512, **{**sizes, **overrides})
    config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(path)
    return path
