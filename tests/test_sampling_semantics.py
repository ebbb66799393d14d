"""Sampling semantics (issue 15 items 5-6): the contract and the numbers.

Synthetic arrays test the numpy core: a temperature on one side is recovered,
processed logprobs over a top-k support are named with their k, an off-by-one
rollout is an alignment; kernel-like noise and identical paths give nothing.
End to end, the real CPU vLLM samples at T = 0.7 with processed logprobs: the
scan names the temperature from its contract and its numbers, and the same
rollout replayed from JSONL (no contract: numbers only) is diagnosed the same
way; shifted by one position it is a token alignment. Negative controls: stock
HF against vLLM at T = 1 (a pure kernel-numerics gap) has no sampling cause.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import logdiff
from logdiff.cli import app
from logdiff.commands.config import ScanConfig
from logdiff.diagnosis import sampling
from logdiff.diagnosis.classify import preflight_only_causes
from logdiff.errors import InputError

RUN = {"num_sequences": 4, "prompt_len": 12, "response_len": 16}  # run_paths: the logprobs alone
SMALL = {**RUN, "depth": "modules", "attribute": False}  # scans classify at modules depth (scan's default)


# --- numpy core on synthetic arrays ----------------------------------------------------------


def _model(n: int = 240, vocab: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw log-probabilities [n, vocab] of a peaked-ish model, and tokens sampled from it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.5, (n, vocab))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens = np.array([rng.choice(vocab, p=np.exp(r)) for r in ref])
    return ref, tokens


def _split(x: np.ndarray, parts: int = 4) -> list[np.ndarray]:
    return np.array_split(np.asarray(x), parts)


def _refs(ref: np.ndarray, tokens: np.ndarray) -> list[sampling.Reference]:
    return [sampling.Reference.of(r, t) for r, t in zip(_split(ref), _split(tokens))]


def _pair(train: np.ndarray, other: np.ndarray, ref: np.ndarray, tokens: np.ndarray) -> dict | None:
    return sampling.analyse_pair(_split(train), _split(other), [None] * 4, _refs(ref, tokens))


@pytest.mark.parametrize("t", [0.5, 0.7, 1.3])
def test_temperature_is_recovered(t: float) -> None:
    ref, tok = _model()
    fitted, err = sampling.fit_temperature(sampling.Reference.of(ref, tok), sampling.tempered(ref, tok, t))
    assert fitted == pytest.approx(t, rel=1e-3) and err < 1e-6


def test_compressed_reference_is_exact_at_t1_and_close_elsewhere() -> None:
    """A large vocabulary is held as its top tokens plus binned tail: same logprobs up to 1e-4."""
    ref, tok = _model(n=32, vocab=4096)
    compressed = sampling.Reference.of(ref, tok)
    assert compressed.values.shape[1] < 4096
    assert np.abs(compressed.tempered(1.0) - sampling.tempered(ref, tok, 1.0)).max() < 1e-9
    for t in (0.1, 0.7, 2.0, 10.0):
        assert np.abs(compressed.tempered(t) - sampling.tempered(ref, tok, t)).max() < 1e-4


def test_temperature_on_the_inference_side_only() -> None:
    ref, tok = _model()
    noise = np.random.default_rng(1).normal(0, 0.01, len(tok))  # kernel-like noise on top
    f = _pair(sampling.tempered(ref, tok, 1.0), sampling.tempered(ref, tok, 0.7) + noise, ref, tok)
    assert f is not None and f["kind"] == "sampling_semantics"
    assert f["temperature"]["train"] == 1.0 and f["temperature"]["other"] == pytest.approx(0.7, abs=0.01)
    assert f["truncation"] is None


def test_temperature_on_the_training_side_only() -> None:
    ref, tok = _model()
    f = _pair(sampling.tempered(ref, tok, 0.8), sampling.tempered(ref, tok, 1.0), ref, tok)
    assert f["temperature"]["train"] == pytest.approx(0.8, abs=0.01) and f["temperature"]["other"] == 1.0


@pytest.mark.parametrize(("vocab", "k"), [(64, 8), (4096, 50)])
def test_processed_logprobs_over_top_k_are_a_constant_offset(vocab: int, k: int) -> None:
    ref, tok = _model(vocab=vocab)
    kth = np.sort(ref, axis=-1)[:, -k][:, None]
    cut = np.where(ref >= kth, ref, -np.inf)
    processed = cut - np.log(np.exp(cut).sum(-1, keepdims=True))  # vLLM processed_logprobs at T = 1, top-k 8
    kept = processed[np.arange(len(tok)), tok] > -np.inf
    ref, tok, processed = ref[kept], tok[kept], processed[kept]
    f = _pair(sampling.tempered(ref, tok, 1.0), processed[np.arange(len(tok)), tok], ref, tok)
    assert f is not None and f["temperature"] is None
    assert f["truncation"]["top_k"] == k and f["truncation"]["offset_max"] > 0


@pytest.mark.parametrize("t", [1.0, 0.8])
def test_processed_logprobs_over_top_p_name_the_p(t: float) -> None:
    """vLLM's processed logprobs at top-p 0.9 (and a temperature: both fitted together)."""
    ref, tok = _model()
    z = ref / t - np.log(np.exp(ref / t).sum(-1, keepdims=True))
    order = np.argsort(-z, axis=-1)
    mass = np.cumsum(np.take_along_axis(np.exp(z), order, -1), -1)
    keep_n = np.argmax(mass >= 0.9, axis=1) + 1  # the smallest prefix reaching p = 0.9
    kept = np.zeros_like(ref, bool)
    for i, n in enumerate(keep_n):
        kept[i, order[i, :n]] = True
    cut = np.where(kept, z, -np.inf)
    processed = cut - np.log(np.exp(cut).sum(-1, keepdims=True))
    rows = kept[np.arange(len(tok)), tok]
    ref, tok, processed = ref[rows], tok[rows], processed[rows]
    f = _pair(sampling.tempered(ref, tok, 1.0), processed[np.arange(len(tok)), tok], ref, tok)
    assert f["truncation"]["top_k"] is None and f["truncation"]["top_p"] == pytest.approx(0.9, abs=0.03)
    if t == 1.0:
        assert f["temperature"] is None
    else:
        assert f["temperature"]["other"] == pytest.approx(t, abs=0.02)


def test_logprobs_of_a_single_kept_token_are_top_k_1_without_a_temperature() -> None:
    """All zeros (e.g. a forced-token replay in processed mode): a support of one token, T unidentifiable."""
    ref, tok = _model()
    f = _pair(sampling.tempered(ref, tok, 1.0), np.zeros(len(tok)), ref, tok)
    assert f["truncation"]["top_k"] == 1 and f["temperature"] is None


def test_off_by_one_is_an_alignment() -> None:
    ref, tok = _model()
    train = sampling.tempered(ref, tok, 1.0)
    seqs = _split(train)
    for shift in (1, -1):
        other = [np.roll(s, -shift) for s in seqs]  # other[t] = train[t + shift]
        f = sampling.analyse_pair(seqs, other, [None] * 4, _refs(ref, tok))
        assert f["kind"] == "token_alignment" and f["shift"] == shift


def test_kernel_noise_and_identical_paths_are_not_sampling_negative_control() -> None:
    ref, tok = _model()
    train = sampling.tempered(ref, tok, 1.0)
    rng = np.random.default_rng(2)
    for scale in (1e-3, 0.02, 0.1):  # reordering noise of any size: no temperature, no truncation
        assert _pair(train, train + rng.normal(0, scale, len(tok)), ref, tok) is None
    assert _pair(train, train.copy(), ref, tok) is None


def test_masked_positions_are_not_fitted() -> None:
    """Only scored positions feed the fit (a tool token's logprob says nothing about the sampler)."""
    ref, tok = _model()
    train, other = sampling.tempered(ref, tok, 1.0), sampling.tempered(ref, tok, 0.7)
    masks = [[i % 3 != 0 for i in range(len(s))] for s in _split(tok)]
    f = sampling.analyse_pair(_split(train), _split(other), masks, _refs(ref, tok))
    assert f["positions"] == sum(map(sum, masks)) < len(tok)
    assert f["temperature"]["other"] == pytest.approx(0.7, abs=0.01)


@pytest.mark.parametrize("rescored", [4, 1])  # 1: ``_bos_test`` rescored the first sequences only (BOS_TEST_POSITIONS)
def test_a_bos_on_one_side_only_is_a_tokens_finding(rescored: int) -> None:
    ref, tok = _model()
    shifted, _ = _model(seed=5)  # the same tokens scored after another prefix
    refs = _refs(ref, tok)
    toggled = [sampling.Reference.of(r, t) for r, t in zip(_split(shifted), _split(tok))][:rescored]
    noise = np.random.default_rng(3).normal(0, 0.01, len(tok))
    f = sampling.bos_finding(_split(sampling.tempered(shifted, tok, 1.0) + noise), [None] * 4, refs, toggled, True)
    assert f["kind"] == "tokens" and f["bos"] == "missing"
    assert f["positions"] == sum(len(part) for part in _split(tok)[:rescored])  # the rescored sequences alone
    # negative control: the logprobs of the sequences as given (kernel-like noise on top) are no BOS finding
    assert sampling.bos_finding(_split(sampling.tempered(ref, tok, 1.0) + noise), [None] * 4, refs, toggled, True) is None


# --- the contract ---------------------------------------------------------------------------


def _contracts(train: dict, infer: dict) -> dict:
    base = {"temperature": 1.0, "logprobs_mode": "raw_logprobs", **sampling_defaults()}
    t, i = {**base, **train}, {**base, **infer}
    return {"train": t, "infer": i, "differs": [k for k in t if t[k] != i[k]], "weights": None}


def sampling_defaults() -> dict:
    from logdiff.probes.contracts import sampler

    return sampler({})


def test_sampler_temperature_is_a_cause_whatever_the_logprobs_mode() -> None:
    c = sampling.contract_cause(_contracts({}, {"sampling_temperature": 0.8}))  # raw rollout logprobs
    assert (c.class_, c.kind, c.differs) == ("framework_difference", "sampling_semantics", ["sampling_temperature"])
    assert any("raw logprobs" in e for e in c.evidence) and "0.8" in c.fix
    cut = sampling.contract_cause(_contracts({}, {"sampling_top_p": 0.9}))
    assert cut.differs == ["sampling_top_p"] and "top-k/top-p" in cut.fix
    # the preflight lists every sampling key in one cause, not one generic cause per key
    processed = _contracts({}, {"sampling_temperature": 0.7, "temperature": 0.7, "logprobs_mode": "processed_logprobs"})
    (only,) = preflight_only_causes(processed, [])
    assert only.kind == "sampling_semantics" and set(only.differs) == {"sampling_temperature", "temperature",
                                                                           "logprobs_mode"}  # fmt: skip


def test_identical_settings_give_no_contract_cause_negative_control() -> None:
    assert sampling.contract_cause(_contracts({"sampling_temperature": 0.7}, {"sampling_temperature": 0.7})) is None


@pytest.mark.parametrize(("item", "fragment"), [("infer.top_k=-2", "an integer >= -1"), ("infer.top_p=1.5", "(0, 1]"),
                                                ("infer.top_p=0", "(0, 1]")])  # fmt: skip
def test_bad_top_k_top_p_are_input_errors(tmp_path: Path, item: str, fragment: str) -> None:
    key, value = item.split(".", 1)[1].split("=")
    with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ScanConfig(model=tmp_path, infer=["vllm"], infer_set={key: float(value) if "." in value else int(value)})
    ScanConfig(model=tmp_path, infer=["vllm"], infer_set={"top_k": 5, "top_p": 0.9})  # negative control


# --- end to end through the real CPU vLLM ---------------------------------------------------


def _sampling_causes(r: dict) -> list[dict]:
    return [c for c in r["causes"] if c["kind"] in ("sampling_semantics", "token_alignment", "tokens")]


@pytest.mark.vllm
def test_kernel_numerics_gap_is_not_sampling_negative_control(qwen3: Path, stock_varies: Callable) -> None:
    """Stock HF against vLLM at T = 1: identical settings, a pure kernel gap, no sampling cause."""
    r = logdiff.scan(qwen3, infer=["vllm"], **SMALL)
    stock_varies(r["logprobs"]["bitwise_equal_fraction"] == 1.0, "stock HF and vLLM logprobs agree bitwise here")
    assert _sampling_causes(r) == [] and r["verdict"] != "framework_difference", r["causes"]


@pytest.mark.vllm
def test_raw_rollout_at_temperature_is_caught_by_the_contract(qwen3: Path) -> None:
    """`--set infer.temperature=0.8` with raw logprobs: the numbers agree, the sampler does not."""
    from logdiff.commands.scan import run_paths
    from logdiff.diagnosis.preflight import preflight
    from logdiff.sources.vllm.contract import vllm_contract

    run = run_paths(ScanConfig(model=qwen3, infer=["vllm"], **RUN))  # the session's default engines
    infer = run.infer_engines[0]
    contracts = preflight(run.train_engine, infer, weights=False)
    assert not any(k in contracts["differs"] for k in (*sampling.SAMPLER_KEYS, *sampling.SCORING_KEYS))
    raw = vllm_contract(infer.module(), {"temperature": 0.8})  # what an engine sampling at 0.8 reports
    assert (raw["temperature"], raw["logprobs_mode"], raw["sampling_temperature"]) == (1.0, "raw_logprobs", 0.8)
    processed_t1 = vllm_contract(infer.module(), {"logprobs_mode": "processed_logprobs"})
    assert processed_t1["logprobs_mode"] == "raw_logprobs"  # nothing processes them at T = 1: no false difference
    top_k = vllm_contract(infer.module(), {"top_k": 20, "logprobs_mode": "processed_logprobs"})
    assert (top_k["logprobs_mode"], top_k["temperature"], top_k["sampling_top_k"]) == ("processed_logprobs", 1.0, 20)
    c = sampling.contract_cause({**contracts, "infer": raw, "differs": ["sampling_temperature"]})
    assert c.kind == "sampling_semantics" and any("raw logprobs" in e for e in c.evidence)


def _jsonl(path: Path, seqs: list, logprobs: list | None = None, shift: int = 0, prefix: tuple = ()) -> Path:
    rows = []
    for i, s in enumerate(seqs):
        row = {"prompt_ids": [*prefix, *s.prompt_ids], "response_ids": s.response_ids}
        if logprobs is not None:
            lp = [float(x) for x in logprobs[i]]
            row["rollout_logprobs"] = lp[shift:] + lp[:shift] if shift > 0 else lp
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def _replay(model: Path, jsonl: Path, out: Path) -> dict:
    """``logdiff scan MODEL --infer hf --sequences JSONL``: the trainer against the recorded rollout."""
    res = CliRunner().invoke(app, ["scan", str(model), "--infer", "hf", "--sequences", str(jsonl), "--no-attribute",
                                   "--json", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_rollout_scored_after_a_bos_is_a_tokens_cause(qwen3: Path, tmp_path: Path) -> None:
    """The rollout engine saw a BOS the trainer's prompt ids lack; identical ids are the negative control."""
    from logdiff.commands.scan import run_paths
    from logdiff.records.sequences import random_prompts

    bos = json.loads((qwen3 / "config.json").read_text())["bos_token_id"]
    seqs = random_prompts(4, 10, 256, seed=3, avoid={bos})
    for i, s in enumerate(seqs):
        s.response_ids = [(7 * i + 3 * t) % 200 + 5 for t in range(12)]
    with_bos = run_paths(ScanConfig(model=qwen3, infer=["hf"], depth="logprobs",
                                    sequences=_jsonl(tmp_path / "bos.jsonl", seqs, prefix=(bos,))))  # fmt: skip
    r = _replay(qwen3, _jsonl(tmp_path / "nobos.jsonl", seqs, with_bos.train.logprobs), tmp_path / "r.json")
    (c,) = _sampling_causes(r)
    assert (c["class"], c["kind"], c["paths"]) == ("framework_difference", "tokens", ["rollout"])
    assert c["sampling"]["rollout"]["bos"] == "missing" and c["sampling"]["rollout"]["bos_id"] == bos
    same = _replay(qwen3, _jsonl(tmp_path / "same.jsonl", with_bos.sequences, with_bos.train.logprobs), tmp_path / "s.json")
    assert same["causes"] == [] and same["verdict"] == "consistent"


@pytest.mark.vllm
def test_vllm_rollout_at_temperature_is_sampling_semantics(qwen3: Path, tmp_path: Path) -> None:
    from logdiff.reports import validate_result

    from logdiff.commands.scan import run_paths

    infer_set = {"temperature": 0.7, "logprobs_mode": "processed_logprobs"}
    r = logdiff.scan(qwen3, infer=["vllm"], infer_set=dict(infer_set), **SMALL)
    (c,) = [c for c in r["causes"] if c["kind"] == "sampling_semantics"]
    assert c["class"] == "framework_difference" and "sampling_temperature" in c["differs"]
    assert c["sampling"]["vllm"]["temperature"]["other"] == pytest.approx(0.7, abs=0.01)
    assert "vllm-prefill" not in c["paths"]  # prompt logprobs are raw: kernel noise only
    assert r["verdict"] in ("framework_difference", "mixed") and validate_result(r) == []

    # The same rollout as a JSONL dump, replayed against HF alone: no contract, the numbers decide.
    run = run_paths(ScanConfig(model=qwen3, infer=["vllm"], infer_set=dict(infer_set), **RUN))
    decode = run.infers[0].logprobs
    for shift, kind in ((0, "sampling_semantics"), (1, "token_alignment")):
        f = _jsonl(tmp_path / f"rollout{shift}.jsonl", run.sequences, decode, shift)
        replay = _replay(qwen3, f, tmp_path / f"r{shift}.json")
        (c,) = _sampling_causes(replay)
        assert (c["class"], c["kind"], c["paths"]) == ("framework_difference", kind, ["rollout"])
        if shift:
            assert c["sampling"]["rollout"]["shift"] == 1
        else:
            assert c["sampling"]["rollout"]["temperature"]["other"] == pytest.approx(0.7, abs=0.01)
        assert replay["verdict"] == "framework_difference" and any(g["kind"] == kind for g in replay["cause_groups"])


@pytest.mark.vllm
def test_vllm_refuses_to_replay_given_tokens_in_processed_mode(qwen3: Path, tmp_path: Path) -> None:
    """vLLM computes processed logprobs after the processor that forces replayed tokens: refused, not 0s."""
    from logdiff.records.sequences import Sequence
    from logdiff.sources import checkpoint
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire

    seqs = [Sequence([5, 6, 7, 8], [9, 10, 11])]
    spec = EngineSpec(str(checkpoint.stage(qwen3).path), options=(("logprobs_mode", "processed_logprobs"),
                                                                    ("temperature", 0.7)))  # fmt: skip
    engine = acquire("vllm", spec)
    assert not engine.replays_as_sampled
    with pytest.raises(InputError, match="cannot replay given tokens"):
        engine.score(seqs)
    raw = acquire("vllm", EngineSpec(spec.model_dir))  # the control: raw logprobs replay as sampled
    assert raw.replays_as_sampled and all(np.all(lp < 0) for lp in raw.score(seqs)[0].logprobs)


def test_one_odd_token_is_no_truncation() -> None:
    """Negative control: one position above the trainer's logprob (kernel noise) names no top-k/top-p.

    On sharp distributions some top-k's offsets are ~0 everywhere but at that one
    position (seed 23 here), so a fit alone would name it: a cut needs several positions.
    """
    for seed in (21, 22, 23, 24):
        rng = np.random.default_rng(seed)
        logits = rng.normal(0, 8.0, (16, 512))
        ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        tok = np.array([rng.choice(512, p=np.exp(r)) for r in ref])
        train = sampling.tempered(ref, tok, 1.0)
        for pos in range(16):
            other = train.copy()
            other[pos] += 0.0147
            assert _pair(train, other, ref, tok) is None, (seed, pos)
