"""A tiny random Qwen3 and the left-padded batch TRL feeds its no-grad logprob pass, for tests of the capture and
its replay (tests/test_capture_batching.py, tests/test_loop_replay.py): seconds to build, no cache."""

from __future__ import annotations

from typing import Any

PAD = 0


def tiny_qwen3() -> Any:
    """A random 2-layer Qwen3 in float32, eval mode, seeded: the same weights at every call."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.demo.configs import tiny_config

    torch.manual_seed(0)
    config = tiny_config("qwen3", 128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def left_padded(seqs: list[list[int]], position_ids: bool = False) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """One forward's kwargs for ``seqs`` left-padded to the longest (``position_ids`` counting from each row's
    first token where asked; without them a row's positions are shifted by its pad count), and where each
    sequence sits: (row, first column)."""
    import torch

    n = max(map(len, seqs))
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
    kw: dict[str, Any] = {"input_ids": torch.tensor([[PAD] * (n - len(s)) + s for s in seqs]), "attention_mask": mask}
    if position_ids:
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return kw, [(b, n - len(s)) for b, s in enumerate(seqs)]
