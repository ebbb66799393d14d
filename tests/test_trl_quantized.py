"""TRL GRPO with a quantized colocated engine (issue 51, item 6): vLLM on the INT8 W8A8 checkpoint ``logdiff quantize``
wrote, the trainer bf16, every weight sync quantizing the trainer's weights under the checkpoint's scheme.

One run of ``examples/trl_grpo.py --infer-ckpt INT8 --verify-sync --diagnosis`` (2 steps, 6 tokens) and its negative
control, the same run with ``--no-sync``; each made once for the module. What is asserted:

* the sync is right: after training, one more sync, and the engine's prompt logprobs equal a fresh engine's on the
  trainer's weights saved and quantized by ``logdiff quantize``, bit for bit and finite (the control: without syncs
  the same check finds them different);
* each step's comparison names the ``framework_difference``/``quantization`` cause with its share, and every quantized
  weight equals the trainer's through the scheme (no stale weight); logdiff's gap is TRL's own;
* the skipped sync names the stale weights through the quantization at the step after the first;
* a quantized engine logdiff cannot re-quantize for, and a rollout checkpoint of another model, are refused in one
  line (no engine needed).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from trl_runs import TRL_GAP

trl_missing = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                 reason="trl is not installed (pip install 'logdiff[trl]')")
SMALL = ("--dtype", "bfloat16", "--max-tokens", "6", "--steps", "2")


@pytest.fixture(scope="module")
def int8_runs(trl_runner: Any, qwen3: Path, int8_checkpoint: Any,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The synced run (with the live engines' diagnosis: the quantization's share) and the ``--no-sync`` control."""
    int8 = int8_checkpoint("qwen3")
    return {
        "synced": trl_runner.run(qwen3, tmp_path_factory.mktemp("trl-int8"), *SMALL, "--infer-ckpt", str(int8),
                                 "--verify-sync", "--diagnosis"),
        "no-sync": trl_runner.run(qwen3, tmp_path_factory.mktemp("trl-int8-no-sync"), *SMALL, "--infer-ckpt",
                                  str(int8), "--verify-sync", "--no-sync"),
    }


def _results(run: dict[str, Any]) -> list[dict[str, Any]]:
    return run["results"]


@pytest.mark.vllm
@trl_missing
def test_the_synced_int8_engine_equals_a_fresh_engine_on_the_quantized_weights(int8_runs) -> None:
    check = int8_runs["synced"]["sync_check"]
    assert check["reference"].endswith("synced-quantized") and check["tokens"] > 20, check
    assert check["finite"] and check["bitwise"] and check["max_abs_diff"] == 0.0, check
    control = int8_runs["no-sync"]["sync_check"]  # the engine kept the first weights: the check sees it
    assert control["finite"] and not control["bitwise"] and control["max_abs_diff"] > 1e-3, control


@pytest.mark.vllm
@trl_missing
def test_each_step_names_the_quantization_with_its_share_and_no_stale_weight(int8_runs) -> None:
    run = int8_runs["synced"]
    assert len(run["steps"]) == 2 and len(_results(run)) == 2
    for logged, result in zip(run["steps"], _results(run)):
        assert logged["logdiff/gap_mean"] == pytest.approx(logged[TRL_GAP[0]], abs=1e-5)
        assert logged["logdiff/gap_max"] == pytest.approx(logged[TRL_GAP[1]], abs=1e-5)
        assert 0 < logged[TRL_GAP[1]] < 1  # finite, and a quantized engine's size of gap
        (cause,) = [c for c in result["causes"] if c["kind"] == "quantization"]
        assert cause["class"] == "framework_difference" and cause["paths"] == ["vllm"]
        assert any("int8-w8a8" in e for e in cause["evidence"]), cause["evidence"]
        assert cause["share"] is not None and 0 < cause["share"] <= 1, cause
        weights = result["contracts"]["weights"]
        assert weights["differs"] == [] and weights["unverified"] == [], weights
        assert "28 equal (no stale weight)" in weights["through_quantization"], weights
        assert not any(c["kind"] == "weights" for c in result["causes"]), result["causes"]
        assert result["contracts"]["infer"]["quantization"].startswith("int8-w8a8")


@pytest.mark.vllm
@trl_missing
def test_a_skipped_sync_names_the_stale_weights_through_the_quantization(int8_runs) -> None:
    first, second = _results(int8_runs["no-sync"])
    assert first["contracts"]["weights"]["differs"] == []  # step 0: the trainer has not moved yet
    stale = second["contracts"]["weights"]["differs"]
    assert len(stale) >= 28, stale  # every trained linear (the norms and embeddings too)
    assert "28 differ" in second["contracts"]["weights"]["through_quantization"]
    assert any(c["kind"] == "weights" for c in second["causes"]), second["causes"]
    assert any(c["kind"] == "quantization" for c in second["causes"])


def test_a_quantized_engine_logdiff_cannot_requantize_for_is_refused_in_one_line() -> None:
    from logdiff.sources.vllm.quantized_sync import unsupported

    assert unsupported("int8-w8a8") is None
    for scheme in ("fp8-block", "other"):
        line = unsupported(scheme)
        assert line.startswith("sync_vllm_weights: the engine runs a quantized checkpoint") and "\n" not in line


@trl_missing
def test_a_rollout_checkpoint_of_another_model_is_refused_before_the_engine(qwen3: Path, tmp_path: Path) -> None:
    """``rollout_checkpoint``: a checkpoint whose shapes are not the trainer's model's is one line, before vLLM runs."""
    import trl.generation.vllm_generation as generation

    from logdiff.integrations.trl import rollout_checkpoint

    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((qwen3 / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] * 2}))
    with rollout_checkpoint(other), pytest.raises(ValueError, match="is not a checkpoint of the trainer's model") as e:
        generation.LLM(model=str(qwen3))
    assert "vocab_size" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="has no config.json"), rollout_checkpoint(tmp_path / "nothing"):
        pass
