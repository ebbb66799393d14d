"""A capture bundle of the demo model's HF forwards, for the tests that compare bundles.

``capture_hf(model_dir, out, role, batches)`` loads the model in bf16, records each batch's forward with
``logdiff.capture`` (every record whole) and its float32 ``log_softmax`` through ``Capture.logprobs``;
``edit(model)`` changes the model first (a planted weight).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def capture_hf(model_dir: Path, out: Path, role: str, batches: list[list[list[int]]],
               edit: Callable[[Any], None] | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    import logdiff

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    if edit is not None:
        with torch.no_grad():
            edit(model)
    with logdiff.capture(model, out, role, window="all") as cap, torch.no_grad():
        for ids in batches:
            cap.logprobs(model(torch.tensor(ids)).logits)
    return out
