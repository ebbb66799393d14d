"""Sampling semantics from the bundles alone (issue 48, items 1-2): the records, and ``compare`` with no engine.

The real CPU vLLM (the pooled processed-logprobs engine of test_sampling_truncation.py, no new engine) samples
under TRL-like settings with ``processed_logprobs``, captured in process (``sources.vllm.capture.recording``);
the demo model's HF forward scores the same tokens at the trainer's temperature, captured with
``Capture.applied_processing``. ``logdiff compare`` of the two bundles, offline:

* top-p 0.8 on the engine only: a ``framework_difference``/``sampling_semantics`` cause naming top-p and 0.8,
  with its share of the gap; the engine's returned logprobs are reproduced from its recorded logits;
* top-k, min-p and a repetition penalty at temperature 0.7, the trainer at 0.7: each of the three named with
  its value, and the temperature, applied on both sides, is not (the negative control);
* a frequency penalty and a logit bias (what TRL's ``generation_kwargs`` forwards): recorded and named;
* the same temperature alone on both sides: no sampling cause;
* a trainer bundle that declares nothing: one warning naming the missing record, and no sampling cause.

The records themselves are checked too: the settings read from the sampler's input, and invalid records refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from logdiff.errors import InputError
from logdiff.records.processing import clean

PROMPTS, PROMPT_LEN, MAX_TOKENS = 3, 10, 8


def _engine(qwen3: Path) -> Any:
    from logdiff.sources import checkpoint
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire

    # the engine of test_sampling_semantics' and test_sampling_truncation's processed-mode tests (pooled)
    spec = EngineSpec(str(checkpoint.stage(qwen3).path), options=(("logprobs_mode", "processed_logprobs"),
                                                                    ("temperature", 0.7)))  # fmt: skip
    return acquire("vllm", spec)


def _rollout(engine: Any, out: Path, **sampler: Any) -> list[list[int]]:
    """Sample with ``sampler`` under the in-process capture into ``out``; each request's ids."""
    from vllm import SamplingParams

    from logdiff.records.sequences import random_prompts
    from logdiff.sources.vllm.capture import recording

    prompts = [list(s.prompt_ids) for s in random_prompts(PROMPTS, PROMPT_LEN, 4096, seed=5)]
    params = [SamplingParams(**sampler, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True, seed=i)
              for i in range(PROMPTS)]
    runner = engine.llm.llm_engine.model_executor.driver_worker.model_runner
    with recording(runner, out):
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def _train(model: Any, ids: list[list[int]], out: Path, temperature: float, declare: bool = True) -> None:
    """The trainer's pass: log_softmax(logits / T) of each sequence's tokens, captured with its declaration."""
    import torch

    from logdiff.sources.hf.capture import capture

    with torch.no_grad(), capture(model, out, role="train", window="all") as cap:
        if declare:
            cap.applied_processing(temperature=temperature)
        for seq in ids:
            x = torch.tensor([seq])
            logits = model(input_ids=x).logits[:, :-1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
            cap.token_logprobs(lp, start=1, token_ids=x[:, 1:])


@pytest.fixture(scope="module")
def runs(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each scenario's bundles compared offline: name -> result dict (and its infer bundle)."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.commands.compare import compare_bundles
    from logdiff.records.bundle import Bundle

    root = tmp_path_factory.mktemp("sampling-records")
    engine = _engine(qwen3)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.bfloat16).eval()
    out = {}
    for name, sampler, t_train, declare in (
        ("top_p", {"temperature": 1.0, "top_p": 0.8}, 1.0, True),
        ("three", {"temperature": 0.7, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.3}, 0.7, True),
        ("same", {"temperature": 0.7}, 0.7, True),
        ("kwargs", {"temperature": 1.0, "frequency_penalty": 0.5, "logit_bias": {100: 3.0}}, 1.0, True),
        ("undeclared", {"temperature": 0.7, "top_p": 0.8}, 0.7, False),
    ):
        ids = _rollout(engine, root / name / "infer", **sampler)
        _train(model, ids, root / name / "train", t_train, declare)
        result = compare_bundles(root / name / "train", root / name / "infer").to_dict()
        out[name] = {"result": result, "infer": Bundle(root / name / "infer"), "sampler": sampler}
    return out


def _sampling_causes(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in result["causes"] if c["kind"] == "sampling_semantics"]


@pytest.mark.vllm
def test_the_capture_records_what_the_sampler_applied(runs: dict[str, dict[str, Any]]) -> None:
    for name in ("top_p", "three"):
        bundle, sampler = runs[name]["infer"], runs[name]["sampler"]
        records = [s["sampling"] for s in bundle.meta["sequences"]]
        assert len(records) == PROMPTS
        for r in records:
            assert r["logprobs_mode"] == "processed_logprobs" and r["max_tokens"] == MAX_TOKENS
            assert {k: r[k] for k in sampler} == pytest.approx(sampler), (name, r)
        assert records[0]["top_k"] == (20 if name == "three" else 0)  # vLLM's "off" (the vocabulary size) is 0
        assert [r["seed"] for r in records] == list(range(PROMPTS))


@pytest.mark.vllm
def test_a_step_on_the_engine_only_is_a_sampling_cause_with_its_value_and_share(runs: dict[str, dict[str, Any]]) -> None:
    from logdiff.reports.schema import validate_result

    r = runs["top_p"]["result"]
    (c,) = _sampling_causes(r)
    assert (c["class"], c["boundary"], c["differs"]) == ("framework_difference", "log_softmax", ["top_p"])
    found = c["sampling"]["infer"]
    (setting,) = found["settings"]
    assert (setting["setting"], setting["infer"], setting["train"]) == ("top_p", pytest.approx(0.8), "off")
    assert 0.5 < setting["share"] and 0.5 < c["share"], c  # the renormalisation is most of the gap
    assert found["reproduced"]["infer"]["reproduced"] and found["reproduced"]["train"]["reproduced"], found
    assert any("top-p = 0.8" in e for e in c["evidence"]) and "GRPOConfig(top_p=1.0)" in c["fix"]
    assert not any("need the live engines" in w and "sampling" in w for w in r["warnings"])
    assert validate_result(r) == []


@pytest.mark.vllm
def test_each_one_sided_step_is_named_and_the_shared_temperature_is_not(runs: dict[str, dict[str, Any]]) -> None:
    (c,) = _sampling_causes(runs["three"]["result"])
    named = {s["setting"]: s["infer"] for s in c["sampling"]["infer"]["settings"]}
    assert named == pytest.approx({"repetition_penalty": 1.3, "min_p": 0.1, "top_k": 20}), named
    assert "temperature" not in c["differs"] and all(s["share"] >= 0 for s in c["sampling"]["infer"]["settings"])


@pytest.mark.vllm
def test_a_users_generation_kwargs_are_named_too(runs: dict[str, dict[str, Any]]) -> None:
    """What TRL's ``generation_kwargs`` forwards (a frequency penalty, a logit bias) is recorded and named."""
    record = runs["kwargs"]["infer"].meta["sequences"][0]["sampling"]
    assert record["logit_bias"] == [[100, 3.0]] and record["frequency_penalty"] == 0.5
    (c,) = _sampling_causes(runs["kwargs"]["result"])
    found = c["sampling"]["infer"]
    assert found["reproduced"]["infer"]["reproduced"], found["reproduced"]
    named = {s["setting"]: s["infer"] for s in found["settings"]}
    assert named.get("logit_bias") == [[100, 3.0]] or named.get("frequency_penalty") == 0.5, named
    assert "generation_kwargs" in c["fix"] and set(c["differs"]) <= {"logit_bias", "frequency_penalty"}


@pytest.mark.vllm
def test_identical_processing_gives_no_sampling_cause(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["same"]["result"]
    assert _sampling_causes(r) == [], r["causes"]
    assert not any(w.startswith("sampling checks not run") for w in r["warnings"])


@pytest.mark.vllm
def test_a_missing_record_is_one_warning_naming_it(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["undeclared"]["result"]
    assert _sampling_causes(r) == []
    lines = [w for w in r["warnings"] if w.startswith("sampling checks not run")]
    assert len(lines) == 1 and "applied processing" in lines[0] and "sampling settings" not in lines[0], lines


def test_records_are_checked_as_untrusted_input() -> None:
    assert clean({"temperature": 0.7, "top_k": 20, "unknown": [1] * 5}, "x") == {"temperature": 0.7, "top_k": 20}
    for bad in ({"temperature": float("nan")}, {"top_p": 1.5}, {"top_k": True}, {"logit_bias": [[1, "a"]]},
                {"allowed_token_ids": [-1]}, {"logits_processors": "MinP"}, []):
        with pytest.raises(InputError):
            clean(bad, "x")


def test_replay_matches_the_samplers_definitions() -> None:
    """Negative controls of the replay: identity settings change nothing; top-p keeps the smallest prefix."""
    from logdiff.diagnosis import processing

    rng = np.random.default_rng(3)
    z = rng.normal(0, 3, (4, 300)).astype(np.float32)
    plain = processing.process(z, {}, [[]] * 4, [[]] * 4)
    assert np.allclose(plain, z - np.log(np.exp(z.astype(np.float64)).sum(-1, keepdims=True)), atol=1e-5)
    assert processing.differing({"temperature": 0.7}, {"temperature": 0.7, "top_k": 0, "top_p": 1.0}) == []
    cut = processing.process(z, {"top_p": 0.5}, [[]] * 4, [[]] * 4)
    probs = np.sort(np.exp(plain), -1)[:, ::-1]
    kept = np.isfinite(cut).sum(-1)
    assert all(probs[i, : kept[i] - 1].sum() < 0.5 <= probs[i, : kept[i]].sum() + 1e-6 for i in range(4))
    start, end, each = processing.contributions(z, np.argmax(z, -1), {}, {"top_p": 0.5, "temperature": 2.0},
                                                [[]] * 4, [[]] * 4)
    assert list(each) == ["temperature", "top_p"] and np.allclose(sum(each.values()), end - start)


# --- the judgement on synthetic records, without an engine ------------------------------------------


def _synthetic(infer: dict[str, Any], applied: dict[str, Any], returned: Any, seed: int = 0) -> Any:
    """``_judge`` over 4 sequences of 6 response tokens on random logits rows: the engine returns ``returned(z,
    prompts, outputs)``'s logprobs, the trainer ``applied``'s of slightly perturbed logits (kernel noise)."""
    from logdiff.comparison.cause import Findings
    from logdiff.diagnosis import processing, sampling_records
    from logdiff.records.sequences import Sequence

    rng = np.random.default_rng(seed)
    vocab, prompt, n = 400, 5, 6
    seqs = [Sequence(list(rng.integers(0, vocab, prompt)), list(rng.integers(0, vocab, n))) for _ in range(4)]
    sink = sampling_records.RowSink([prompt] * 4, [prompt + n] * 4)
    train_lp, infer_lp = [], []
    for c, s in enumerate(seqs):
        z = rng.normal(0, 3, (n, vocab)).astype(np.float32)
        ids = s.ids
        prompts, outputs = [s.prompt_ids] * n, [ids[prompt:prompt + j] for j in range(n)]
        tok = np.asarray(s.response_ids)
        got = returned(z, prompts, outputs)[np.arange(n), tok]
        tok_ok = np.isfinite(got)  # a token the processing dropped is one the engine never sampled: resample it
        z[~tok_ok, tok[~tok_ok]] = z[~tok_ok].max(-1) + 1
        infer_lp.append(returned(z, prompts, outputs)[np.arange(n), tok])
        noisy = z + rng.normal(0, 1e-3, z.shape).astype(np.float32)
        train_lp.append(processing.process(noisy, applied, prompts, outputs)[np.arange(n), tok])
        for j in range(n):
            sink.rows["logits"][(c, prompt + j - 1)] = z[j]
        s.response_mask = [1] * n
    tokens = [(c, prompt + j) for c in range(4) for j in range(n)]
    return sampling_records._judge(Findings(), applied, {c: infer for c in range(4)}, seqs, tokens, train_lp,
                                   infer_lp, sink, None)


def test_a_one_sided_top_p_is_named_and_kernel_noise_is_not() -> None:
    from logdiff.diagnosis import processing

    infer = {"temperature": 0.7, "top_p": 0.8, "logprobs_mode": "processed_logprobs"}
    found = _synthetic(infer, {"temperature": 0.7}, lambda z, p, o: processing.process(z, infer, p, o))
    (c,) = found.causes
    (s,) = c.sampling["infer"]["settings"]
    assert (c.kind, s["setting"], s["infer"], s["train"]) == ("sampling_semantics", "top_p", 0.8, "off")
    assert c.share > 0.9 and c.sampling["infer"]["reproduced"]["infer"]["reproduced"] and not found.warnings
    # the negative control: the same processing on both sides leaves kernel noise only
    same = {"temperature": 0.7, "logprobs_mode": "processed_logprobs"}
    found = _synthetic(same, {"temperature": 0.7}, lambda z, p, o: processing.process(z, same, p, o))
    assert found.causes == [] and found.warnings == []


def test_raw_logprobs_under_other_settings_and_an_unrecorded_step_are_warnings() -> None:
    from logdiff.diagnosis import processing

    raw = {"temperature": 1.0, "top_p": 0.8, "logprobs_mode": "raw_logprobs"}
    found = _synthetic(raw, {}, lambda z, p, o: processing.process(z, {}, p, o))
    assert found.causes == [] and len(found.warnings) == 1 and "returned raw logprobs" in found.warnings[0]
    # the trainer divides by the sampling temperature, the engine returns raw logprobs: the trainer's step is named
    raw_t = {"temperature": 0.7, "logprobs_mode": "raw_logprobs"}
    found = _synthetic(raw_t, {"temperature": 0.7}, lambda z, p, o: processing.process(z, {}, p, o))
    (c,) = found.causes
    assert c.differs == ["temperature"] and c.sampling["infer"]["settings"][0]["train"] == 0.7, c.sampling
    assert "the trainer only" in c.fix and "logprobs_mode=processed_logprobs" in c.fix and not found.warnings
    # a logit bias the records do not name (a user's logits processor): not reproduced, said once
    recorded = {"temperature": 1.0, "logprobs_mode": "processed_logprobs"}
    found = _synthetic(recorded, {}, lambda z, p, o: processing.process(z, {"logit_bias": [[1, 5.0]]}, p, o))
    assert found.causes == [] and len(found.warnings) == 1 and "not reproduced" in found.warnings[0], found.warnings


def test_applied_processing_is_declared_once_and_checked(qwen3: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.records.bundle import Bundle
    from logdiff.records.processing import trainer_applied
    from logdiff.sources.hf.capture import capture

    model = AutoModelForCausalLM.from_pretrained(str(qwen3)).eval()
    with torch.no_grad(), capture(model, tmp_path / "b", role="train") as cap:
        with pytest.raises(ValueError, match="unknown setting"):
            cap.applied_processing(temprature=0.7)
        with pytest.raises(ValueError, match="top_p"):
            cap.applied_processing(top_p=2.0)
        cap.applied_processing(temperature=1)
        cap.applied_processing(temperature=0.7, top_k=20)  # the last declaration holds
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert trainer_applied(Bundle(tmp_path / "b")) == {"temperature": 0.7, "top_k": 20}
