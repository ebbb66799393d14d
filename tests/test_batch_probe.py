"""The batch-invariance probe: the same sequences scored at several batch compositions."""

from __future__ import annotations

from pathlib import Path

import pytest
from plants import batch_dependent

import logdiff
from logdiff.sources import base, checkpoint, pool

SIZES = (1, 4, 8)




@pytest.mark.isa_sensitive
def test_probe_detects_batch_dependence_and_consistent_mode_removes_it(qwen3: Path) -> None:
    common = {"infer": ["hf-decode"], "dtype": "float32", "num_sequences": 8, "prompt_len": 16, "response_len": 8}
    stock = logdiff.scan(qwen3, batch_sizes=SIZES, **common)["batch_invariance"]
    assert stock["engine"] == "hf-decode" and stock["reference_batch_size"] == 1
    assert [c["batch_size"] for c in stock["comparisons"]] == [4, 8]
    # Whether stock fp32 decode is batch-invariant is this CPU's business; the report must say which.
    assert stock["invariant"] == all(c["bitwise_equal_fraction"] == 1.0 for c in stock["comparisons"])

    engine = pool.acquire("hf-decode", base.EngineSpec(str(checkpoint.stage(qwen3).path), "float32"))
    with batch_dependent(engine.model.get_submodule("model.layers.1.mlp.down_proj")) as ran:
        result = logdiff.scan(qwen3, batch_sizes=SIZES, **common)
    planted, prompts = result["batch_invariance"], result["sequences"]["prompt_lens"]
    assert {1, 8} <= set(ran), "the scan did not run through the planted module"
    assert planted["invariant"] is False
    assert all(c["bitwise_equal_fraction"] < 1.0 for c in planted["comparisons"])
    for c in planted["comparisons"]:  # the worst token: absolute position and response index (one convention)
        assert c["worst"]["position"] == prompts[c["worst"]["sequence"]] + c["worst"]["response_index"]

    fixed = logdiff.scan(qwen3, batch_sizes=SIZES, consistent=True, **common)["batch_invariance"]
    assert fixed["invariant"] is True
    assert all(c["abs_diff_max"] == 0.0 for c in fixed["comparisons"])


@pytest.mark.vllm
@pytest.mark.isa_sensitive
def test_vllm_on_long_sequences(qwen3: Path) -> None:
    """Reports the real engine's behaviour per path; under consistent mode it must be invariant."""
    common = {"infer": ["vllm"], "num_sequences": 8, "prompt_len": 200, "response_len": 16}
    stock = logdiff.scan(qwen3, batch_sizes=SIZES, **common)["batch_invariance"]
    assert {c["path"] for c in stock["comparisons"]} == {"vllm", "vllm-prefill"}
    assert max(stock["sequence_lengths"]) >= 200
    assert stock["invariant"] == all(c["bitwise_equal_fraction"] == 1.0 for c in stock["comparisons"])
    fixed = logdiff.scan(qwen3, batch_sizes=SIZES, consistent=True, **common)["batch_invariance"]
    assert fixed["invariant"] is True
