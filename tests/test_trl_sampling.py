"""Each sampling setting TRL's ``GRPOConfig`` forwards to vLLM, in one real TRL GRPO run (issue 48, "done when").

``examples/trl_grpo.py --sampling-per-step`` makes one run, with one engine, sample each step under another
setting (set where ``GRPOTrainer.__init__`` puts ``GRPOConfig``'s values): the temperature 0.7, top-p 0.8,
top-k 5, min-p 0.1, a repetition penalty 1.3, a user's ``generation_kwargs`` (a presence penalty 1.0), and the
defaults. TRL asks vLLM for processed logprobs and its trainer applies the temperature only. At every step:

* the engine sampled under that step's setting, as its bundle records it (the example does what it claims);
* logdiff's gap is TRL's own logged ``sampling/sampling_logp_difference`` (mean and max) to 1e-5;
* a setting the trainer does not apply is a ``framework_difference``/``sampling_semantics`` cause naming the
  setting and its value, with its share of the gap;
* the negative controls: the temperature (applied by TRL on both sides) and the defaults give no sampling cause.

The run is the session fixture ``trl_sampled`` (tests/conftest.py, tests/trl_runs.py: made once, shared with
tests/test_same_answer.py), on the demo Qwen3 with a bf16 trainer and 6 tokens per completion. The temperature
step also checks the example itself: TRL 1.16 scores through a fused LM head holding the temperature it was built
with, so a per-step temperature must reach that head (``logdiff.integrations.trl.fused_head_temperature``), or
the trainer would score at 1.0 against vLLM's 0.7 and the control would fail.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from trl_runs import SAMPLING_STEPS, TRL_GAP

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install "
                                 "'logdiff[trl]')")]

STEPS = SAMPLING_STEPS


def sampling_causes(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in result["causes"] if c["kind"] == "sampling_semantics"]


def named_settings(cause: dict[str, Any]) -> dict[str, Any]:
    """setting -> (value on the engine, share) over every path the cause's records name."""
    return {s["setting"]: s for found in cause["sampling"].values() for s in found.get("settings", [])}


def test_each_step_samples_under_its_own_setting(trl_sampled: dict[str, Any]) -> None:
    """The example does what it claims: every request of step N carries that step's setting, and only it."""
    from logdiff.records.bundle import Bundle

    base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert len(trl_sampled["results"]) == len(STEPS)
    for n, (setting, _) in enumerate(STEPS):
        want = {**base, **(setting.get("generation_kwargs") or {}),
                **{k: v for k, v in setting.items() if k != "generation_kwargs"}}
        bundle = Bundle(trl_sampled["out"] / f"step-{n:06d}" / "infer")
        records = [s["sampling"] for s in bundle.meta["sequences"]]
        assert records, f"step {n}: no sampling records"
        for r in records:
            assert r["logprobs_mode"] == "processed_logprobs", r
            assert {k: r.get(k, base[k]) for k in want} == pytest.approx(want), (n, r)


def test_the_gap_is_trls_own_at_every_step(trl_sampled: dict[str, Any]) -> None:
    assert len(trl_sampled["steps"]) == len(STEPS)
    for logged in trl_sampled["steps"]:
        assert logged["logdiff/gap_mean"] == pytest.approx(logged[TRL_GAP[0]], abs=1e-5)
        assert logged["logdiff/gap_max"] == pytest.approx(logged[TRL_GAP[1]], abs=1e-5)


def test_each_engine_only_setting_is_named_with_its_value_and_share(trl_sampled: dict[str, Any]) -> None:
    for (setting, expected), result in zip(STEPS, trl_sampled["results"]):
        if expected is None:
            continue
        name, value = expected
        causes = sampling_causes(result)
        assert len(causes) == 1, (setting, result["causes"])
        (c,) = causes
        assert c["class"] == "framework_difference" and name in c["differs"], (setting, c)
        named = named_settings(c)
        assert name in named and named[name]["infer"] == pytest.approx(value), (setting, named)
        assert named[name]["train"] == "off" and named[name]["share"] > 0, (setting, named)
        assert "temperature" not in c["differs"]
        assert 0.5 < c["share"] < 1.5, c  # most of the gap (kernel noise on top can add or cancel a little)


def test_the_shared_temperature_and_the_defaults_are_no_cause(trl_sampled: dict[str, Any]) -> None:
    """The negative controls: TRL applies the temperature in its trainer too; the defaults process nothing."""
    for (setting, expected), result in zip(STEPS, trl_sampled["results"]):
        if expected is None:
            assert sampling_causes(result) == [], (setting, result["causes"])
            assert result["verdict"] != "framework_difference" and not any(
                w.startswith("sampling checks not run") for w in result["warnings"]), result["warnings"]


def test_the_fused_heads_temperature_is_read_and_set(qwen3) -> None:
    """What the trainer scores with is the temperature inside TRL's fused LM head (``fused_head.py``): read and
    set there, the head's log-probabilities follow it; a model without the head has none (the control)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from logdiff.integrations.trl import fused_head_temperature

    model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32).eval()
    assert fused_head_temperature(model) is None
    with pytest.raises(ValueError, match="no TRL fused LM head"):
        fused_head_temperature(model, 0.7)
    ids = torch.tensor([[5, 9, 14, 3, 27, 8]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    add_fused_lm_head(model, temperature=1.0)
    assert fused_head_temperature(model) == 1.0
    assert fused_head_temperature(model, 0.7) == 0.7
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert not torch.allclose(got, torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], atol=1e-2)
