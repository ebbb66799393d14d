"""Processed logprobs over any truncated support (issue 33 item 5): the sampler named, or none named.

Synthetic distributions are processed exactly as vLLM 0.32 does it (temperature,
then min-p, then top-k, then top-p over the top-k renormalised distribution) or
as transformers' typical-p does, and the scored token's logprob is compared
with the unprocessed one: each sampler is named with its parameter(s), with a
temperature or kernel-like noise on the logits too. A random kept set is a
renormalisation no sampler describes ("sampler not identified", with the kept
mass per token, checked against the true kept mass). Negative controls: raw
logprobs, kernel noise, identical paths, a temperature alone and tokens drawn
from another distribution (positive offsets on average) give no truncation.

End to end, the real CPU vLLM records rollouts with processed logprobs under
min-p and under top-k + top-p; replayed from JSONL against the trainer, each
is a sampling difference naming its sampler; the same engine at T = 1 without
a truncation (processed = raw) gives no sampling cause.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_sampling_semantics import _replay

from logdiff.diagnosis import sampling, truncation

Keep = Callable[[np.ndarray], np.ndarray]  # [N, V] log-probabilities at T -> the kept tokens [N, V]


# --- the samplers, written out from their definitions ---------------------------------------


def _min_p(m: float) -> Keep:
    return lambda z: z >= z.max(-1, keepdims=True) + np.log(m)  # vLLM MinPLogitsProcessor: p >= min_p * p_max


def _top_k(k: int) -> Keep:
    return lambda z: z >= np.sort(z, -1)[:, -k][:, None]


def _smallest_reaching(z: np.ndarray, score: np.ndarray, p: float) -> np.ndarray:
    """Tokens by ascending ``score`` until their mass reaches p (the token that reaches it kept)."""
    order = np.argsort(score, -1, kind="stable")
    mass = np.cumsum(np.take_along_axis(np.exp(z), order, -1), -1)
    kept = np.zeros_like(z, bool)
    for i, n in enumerate((mass < p).sum(-1) + 1):
        kept[i, order[i, :n]] = True
    return kept


def _top_k_top_p(k: int | None, p: float) -> Keep:
    def keep(z: np.ndarray) -> np.ndarray:
        kept = _top_k(k)(z) if k else np.ones_like(z, bool)
        zk = np.where(kept, z, -np.inf)
        zk = zk - np.log(np.exp(zk).sum(-1, keepdims=True))  # top-p over the renormalised top-k
        return kept & _smallest_reaching(zk, -zk, p)

    return keep


def _typical_p(p: float) -> Keep:
    def keep(z: np.ndarray) -> np.ndarray:
        entropy = -(np.exp(z) * z).sum(-1, keepdims=True)
        return _smallest_reaching(z, np.abs(-z - entropy), p)

    return keep


def _rollout(keep: Keep | None, t: float = 1.0, vocab: int = 64, noise: float = 0.0, seed: int = 0, n: int = 240):
    """(trainer logprobs at T = 1, processed rollout logprobs, the reference [n, vocab], tokens, true kept mass)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.5, (n, vocab))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    seen = ref + rng.normal(0, noise, ref.shape) if noise else ref  # the rollout engine's logits: kernel noise
    z = seen / t - np.log(np.exp(seen / t).sum(-1, keepdims=True))
    kept = keep(z) if keep else np.ones_like(z, bool)
    processed = np.where(kept, z, -np.inf)
    processed -= np.log(np.exp(processed).sum(-1, keepdims=True))
    tokens = np.array([rng.choice(vocab, p=np.exp(r)) for r in processed])
    rows = np.arange(n)
    mass = np.where(kept, np.exp(z), 0.0).sum(-1)
    return sampling.tempered(ref, tokens, 1.0), processed[rows, tokens], ref, tokens, mass


def _split(x: np.ndarray) -> list[np.ndarray]:
    return np.array_split(np.asarray(x), 4)


def _analyse(train: np.ndarray, other: np.ndarray, ref: np.ndarray, tokens: np.ndarray) -> dict | None:
    refs = [sampling.Reference.of(r, t) for r, t in zip(_split(ref), _split(tokens))]
    return sampling.analyse_pair(_split(train), _split(other), [None] * 4, refs)


def _kept(f: dict) -> np.ndarray:
    return np.array([m for row in f["truncation"]["kept_mass"] for m in row], dtype=float)


# --- each sampler named with its parameters -------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "params", "t", "vocab"),
    [
        (_min_p(0.1), {"sampler": "min_p", "min_p": 0.1}, 1.0, 4096),
        (_min_p(0.05), {"sampler": "min_p", "min_p": 0.05}, 0.8, 4096),
        (_min_p(0.2), {"sampler": "min_p", "min_p": 0.2}, 1.0, 64),
        (_top_k_top_p(20, 0.9), {"sampler": "top_k_top_p", "top_k": 20, "top_p": 0.9}, 1.0, 4096),
        (_top_k_top_p(20, 0.9), {"sampler": "top_k_top_p", "top_k": 20, "top_p": 0.9}, 0.7, 64),
        (_top_k(8), {"sampler": "top_k", "top_k": 8}, 1.0, 4096),
        (_top_k_top_p(None, 0.8), {"sampler": "top_p", "top_p": 0.8}, 1.0, 4096),
        (_typical_p(0.9), {"sampler": "typical_p", "typical_p": 0.9}, 1.0, 64),
    ],
)
def test_each_sampler_is_named_with_its_parameters(keep: Keep, params: dict, t: float, vocab: int) -> None:
    train, other, ref, tok, mass = _rollout(keep, t, vocab)
    f = _analyse(train, other, ref, tok)
    assert f is not None and f["kind"] == "sampling_semantics"
    cut = f["truncation"]
    assert {k: cut[k] for k in params} == params, cut
    assert all(cut[k] is None for k in truncation.PARAMETERS if k not in params)  # only its own parameters
    if t == 1.0:
        assert f["temperature"] is None
    else:
        assert f["temperature"]["other"] == pytest.approx(t, abs=0.02)
    assert np.allclose(_kept(f), mass, atol=2e-3)  # the kept mass per token is the support's own mass


def test_samplers_are_named_through_kernel_noise_on_the_logits() -> None:
    """The rollout engine's logits differ from the trainer's by noise; the sampler is still the one named."""
    for keep, params in ((_min_p(0.1), {"min_p": 0.1}), (_top_k_top_p(20, 0.9), {"top_k": 20, "top_p": 0.9})):
        train, other, ref, tok, _ = _rollout(keep, 1.0, 4096, noise=0.02, seed=1)
        cut = _analyse(train, other, ref, tok)["truncation"]
        assert {k: cut[k] for k in params} == params, cut


# --- a support no sampler describes ---------------------------------------------------------


@pytest.mark.parametrize("vocab", [64, 4096])
def test_a_random_kept_set_is_a_renormalisation_with_no_sampler_named(vocab: int) -> None:
    """A logits processor of the user's: a random half of the vocabulary (the sampled token's row keeps its top token)."""
    rng = np.random.default_rng(7)

    def random_half(z: np.ndarray) -> np.ndarray:
        return (rng.random(z.shape) < 0.5) | (z == z.max(-1, keepdims=True))

    train, other, ref, tok, mass = _rollout(random_half, 1.0, vocab)
    f = _analyse(train, other, ref, tok)
    assert f is not None and f["temperature"] is None
    cut = f["truncation"]
    assert cut["sampler"] is None and all(cut[k] is None for k in truncation.PARAMETERS)
    assert np.allclose(_kept(f), mass, atol=1e-3)  # the kept mass per token, from the offsets alone
    (cause,) = sampling.numeric_causes({"rollout": f})
    line = next(e for e in cause.evidence if "truncated support" in e)
    assert "sampler not identified" in line and "kept mass per token" in line
    assert "logits processors" in cause.fix


# --- negative controls ----------------------------------------------------------------------


def test_raw_logprobs_kernel_noise_and_identical_paths_are_no_truncation_negative_control() -> None:
    train, raw, ref, tok, _ = _rollout(None, 1.0, 4096, noise=0.02)  # raw: no processing, another engine's noise
    assert _analyse(train, raw, ref, tok) is None
    assert _analyse(train, train.copy(), ref, tok) is None
    rng = np.random.default_rng(3)
    for scale in (1e-3, 0.05):  # symmetric noise on the logprobs themselves
        assert _analyse(train, train + rng.normal(0, scale, len(tok)), ref, tok) is None


@pytest.mark.parametrize(("sigma", "vocab"), [(1.0, 64), (3.0, 64), (1.0, 4096), (3.0, 4096)])
def test_tokens_drawn_from_another_distribution_are_no_truncation_negative_control(sigma: float, vocab: int) -> None:
    """Other logits (stale weights, say) with the tokens drawn from them: the rollout's logprobs exceed the
    trainer's on average (the tokens are likely under the distribution they came from), yet fall below them
    at some positions by as much: no renormalisation, named or not."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2.5, (240, vocab))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    other = ref + rng.normal(0, sigma, ref.shape)
    other -= np.log(np.exp(other).sum(-1, keepdims=True))
    tok = np.array([rng.choice(vocab, p=np.exp(r)) for r in other])
    rows = np.arange(len(tok))
    assert np.mean(other[rows, tok] - ref[rows, tok]) > 0  # the premise: positive on average
    f = _analyse(ref[rows, tok], other[rows, tok], ref, tok)
    assert f is None or f["truncation"] is None, f


def test_a_temperature_alone_is_no_truncation_negative_control() -> None:
    train, other, ref, tok, _ = _rollout(None, 0.7, 4096, noise=0.02)
    f = _analyse(train, other, ref, tok)
    assert f["temperature"]["other"] == pytest.approx(0.7, abs=0.02) and f["truncation"] is None


def test_every_offset_of_one_sign_is_not_enough_for_a_sampler() -> None:
    """A constant offset (kept mass 0.9 at every position, a flat vocabulary) fits several samplers
    roughly: none is named where another fits about as well."""
    train, _, ref, tok, _ = _rollout(None, 1.0, 4096)
    f = _analyse(train, train - np.log(0.9), ref, tok)
    cut = f["truncation"]
    assert cut["sampler"] is None or not cut["also"], cut
    assert np.allclose(_kept(f), 0.9, atol=1e-4)


# --- the evidence and the result schema -----------------------------------------------------


def test_the_named_sampler_is_in_the_evidence_and_the_fix() -> None:
    train, other, ref, tok, _ = _rollout(_min_p(0.1), 1.0, 4096)
    f = _analyse(train, other, ref, tok)
    (cause,) = sampling.numeric_causes({"rollout": f})
    assert cause.kind == "sampling_semantics" and cause.class_ == "framework_difference"
    assert any("truncated support (min-p = 0.1)" in e and "kept mass per token" in e for e in cause.evidence)
    assert "min-p = 0.1" in cause.fix
    json.dumps(cause.to_dict())  # plain JSON: no numpy scalars
    # a fit written before min-p was tried has no "sampler": its top-k or top-p is still the one named
    assert sampling._support_label({"top_k": None, "top_p": 0.9}) == "top-p = 0.9"


# --- end to end through the real CPU vLLM ---------------------------------------------------


def _record(qwen3: Path, tmp_path: Path, name: str, **sampler: float) -> Path:
    """Rollouts sampled by vLLM with processed logprobs under ``sampler``, as a logdiff JSONL dump."""
    from vllm import SamplingParams

    from logdiff.records.sequences import random_prompts
    from logdiff.sources import checkpoint
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire

    # the engine of test_sampling_semantics' processed-mode test (pooled: no extra engine when both run)
    spec = EngineSpec(str(checkpoint.stage(qwen3).path), options=(("logprobs_mode", "processed_logprobs"),
                                                                    ("temperature", 0.7)))  # fmt: skip
    engine = acquire("vllm", spec)
    seqs = random_prompts(8, 12, 4096, seed=11)
    params = [SamplingParams(**{"temperature": 1.0, **sampler}, max_tokens=24, logprobs=1, ignore_eos=True, seed=i)
              for i in range(len(seqs))]  # fmt: skip
    outs = engine.generate([list(s.prompt_ids) for s in seqs], params)
    rows = []
    for s, o in zip(seqs, outs):
        response = list(o.outputs[0].token_ids)
        logprobs = [float(e[t].logprob) for e, t in zip(o.outputs[0].logprobs, response)]
        rows.append(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": response, "rollout_logprobs": logprobs}))
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path




@pytest.mark.vllm
def test_vllm_rollouts_under_min_p_and_top_k_top_p_name_their_sampler(qwen3: Path, tmp_path: Path) -> None:
    from logdiff.reports.schema import validate_result

    for name, sampler, params in (
        ("min_p", {"min_p": 0.1}, {"sampler": "min_p", "min_p": 0.1}),
        ("top_k_top_p", {"top_k": 20, "top_p": 0.9}, {"sampler": "top_k_top_p", "top_k": 20, "top_p": 0.9}),
    ):
        r = _replay(qwen3, _record(qwen3, tmp_path, name, **sampler), tmp_path / f"{name}.json")
        assert r["rollout_replay"]["reproduced"] is False
        (c,) = [c for c in r["causes"] if c["kind"] == "sampling_semantics"]
        assert (c["class"], c["paths"]) == ("framework_difference", ["rollout"])
        fit = c["sampling"]["rollout"]
        assert fit["temperature"] is None and {k: fit["truncation"][k] for k in params} == params, fit
        assert any("renormalised over a truncated support" in e for e in c["evidence"])
        assert r["verdict"] == "framework_difference" and validate_result(r) == []
    # negative control: the same engine at T = 1 with no truncation reports processed = raw logprobs
    r = _replay(qwen3, _record(qwen3, tmp_path, "plain"), tmp_path / "plain.json")
    assert [c for c in r["causes"] if c["kind"] == "sampling_semantics"] == [], r["causes"]
