"""The conformance checks: what every engine must do, for exactly the capabilities it declares.

Each check takes the engine under test and what the reference engine (``hf`` on
the CPU) computed on the same checkpoint and tokens, and raises ``AssertionError``
naming the first violation. The checks test properties no correct engine can
miss whatever its kernels (so no verdict depends on the ISA):

* ``scores``: one array per sequence and path, one finite logprob <= 0 per
  response token, the same bits when scored twice, and close to the reference
  (a loose bound: a shifted or wrong token is off by nats, kernels by far less);
* ``contract``: the keys a preflight compares, equal to the reference's where
  they describe the checkpoint, and weight fingerprints under HF names equal to
  the reference's for every weight both report;
* ``capture``: recording the engine maps every boundary of the architecture to
  rows of every sequence; the embedding rows are bitwise the reference's at the
  same (sequence, position) (a wrong row map cannot pass); the log-softmax rows
  recorded are the ones the engine's scores were read from, bit for bit;
* ``full_logprobs``: one normalised distribution per response position, whose
  values at the response tokens agree with the engine's scores;
* ``sample``: the responses asked for, with a logprob for every sampled token;
* ``consistent``: inside consistent mode a sequence scores the same bits alone
  and inside a batch;
* ``forced_routing``: an empty table forces nothing and changes no bit; forcing
  other experts on every token changes the scores;
* refusals: every capability the engine does not declare refuses, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.sources.base import CAPABILITIES, Engine

#: the preflight's contract keys every engine reports (values may be None where a model has no such feature)
CONTRACT_KEYS = ("dtype", "vocab_size", "rms_norm_eps", "final_norm_eps", "rope_theta", "rope_style",
                 "attention_scale", "tie_word_embeddings", "temperature", "logprobs_mode")
#: contract keys that describe the checkpoint itself: every engine must read the reference's values
CHECKPOINT_KEYS = ("vocab_size", "rms_norm_eps", "final_norm_eps", "rope_theta", "attention_scale",
                   "tie_word_embeddings")
#: the mean |Δ logprob| to the reference beyond which an engine computes another function (bf16 kernels differ
#: by ~1e-2 on the demo; a token off by one position differs by nats)
AGREEMENT = 0.25


@dataclass
class Reference:
    """What the reference engine computed on the conformance sequences."""

    scores: list[np.ndarray]
    contract: dict[str, Any]
    fingerprints: dict[str, str]
    embeddings: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)


class Rows:
    """A recorder sink keeping every boundary's rows by (sequence, position), as float32 numpy."""

    wants_replay = False

    def __init__(self) -> None:
        self.rows: dict[str, dict[tuple[int, int], np.ndarray]] = {}

    def emit(self, name: str, rows: Any, rmap: Any, replay: Any = None) -> None:
        values = rows.float().cpu().numpy()
        kept = self.rows.setdefault(name, {})
        for r in np.nonzero(rmap.valid)[0]:
            kept.setdefault((int(rmap.seq[r]), int(rmap.pos[r])), values[r])


def record(engine: Engine, seqs: list[Any]) -> tuple[Rows, Any, list[Any]]:
    """The rows of the engine's main path (the one named like the engine) while it scores ``seqs``; the
    correspondence map; and the scores."""
    from logdiff.probes.correspondence import build
    from logdiff.probes.record import Recorder

    config = engine.loaded_config().to_dict()
    cmap = build(config["architectures"][0], config)
    sink = Rows()
    with Recorder(engine, cmap, lambda path: [sink] if path == engine.name else [], seqs, 0) as rec:
        scores = engine.score(seqs)
    assert not rec.misaligned_rows, f"{engine.name}: {rec.misaligned_rows} rows did not carry their token ids"
    return sink, cmap, scores


def main_path(engine: Engine, paths: list[Any]) -> Any:
    return next((p for p in paths if p.path == engine.name), paths[0])


def check_scores(engine: Engine, seqs: list[Any], ref: Reference) -> None:
    first = engine.score(seqs)
    assert first, f"{engine.name}: score returned no path"
    for p in first:
        assert len(p.logprobs) == len(seqs), f"{p.path}: {len(p.logprobs)} arrays for {len(seqs)} sequences"
        for s, lp in zip(seqs, p.logprobs):
            lp = np.asarray(lp)
            assert lp.shape == (len(s.response_ids),), f"{p.path}: {lp.shape} for {len(s.response_ids)} tokens"
            assert np.isfinite(lp).all() and (lp <= 1e-6).all(), f"{p.path}: a logprob is not finite or > 0"
    again = engine.score(seqs)
    for p, q in zip(first, again):
        assert all(np.array_equal(a, b) for a, b in zip(p.logprobs, q.logprobs)), f"{p.path}: not deterministic"
    lp = np.concatenate([np.asarray(x, np.float64) for x in main_path(engine, first).logprobs])
    gap = float(np.abs(lp - np.concatenate(ref.scores)).mean())
    assert gap < AGREEMENT, f"{engine.name}: mean |Δ logprob| {gap:.3f} to the reference: another function"


def check_contract(engine: Engine, ref: Reference) -> None:
    contract = engine.contract()
    missing = [k for k in CONTRACT_KEYS if k not in contract]
    assert not missing, f"{engine.name}: the contract lacks {missing}"
    for key in CHECKPOINT_KEYS:
        a, b = contract[key], ref.contract[key]
        same = a == b or (isinstance(a, float) and isinstance(b, float) and np.isclose(a, b, rtol=1e-6))
        assert same, f"{engine.name}: contract {key} = {a!r}, the checkpoint's is {b!r}"
    fingerprints = engine.fingerprints()
    common = set(fingerprints) & set(ref.fingerprints)
    assert len(common) >= 0.9 * len(ref.fingerprints), f"{engine.name}: fingerprints not under HF names"
    differ = sorted(k for k in common if fingerprints[k] != ref.fingerprints[k])
    assert not differ, f"{engine.name}: weights differ from the checkpoint's: {differ[:3]}"
    config = engine.loaded_config()
    assert int(config.num_hidden_layers) > 0 and isinstance(engine.effective_options(), dict)


def check_capture(engine: Engine, seqs: list[Any], ref: Reference) -> None:
    sink, cmap, scores = record(engine, seqs)
    missing = [b for b in cmap.order if b not in sink.rows]
    assert not missing, f"{engine.name}: no rows recorded for {missing[:4]} ({len(missing)} boundaries)"
    for b, rows in sink.rows.items():
        covered = {s for s, _ in rows}
        assert covered == set(range(len(seqs))), f"{engine.name}: {b} has rows of sequences {sorted(covered)} only"
    embed = next(b.name for b in cmap.boundaries if b.kind == "embed")
    wrong = [k for k, row in sink.rows[embed].items() if not np.array_equal(row, ref.embeddings[k])]
    assert not wrong, f"{engine.name}: embedding rows at {wrong[:3]} are not the reference's at that position"
    log_softmax = sink.rows["log_softmax"]
    path = main_path(engine, scores)
    for c, s in enumerate(seqs):
        p = len(s.prompt_ids)
        for j, token in enumerate(s.response_ids):
            row = log_softmax.get((c, p + j - 1))
            assert row is not None, f"{engine.name}: no log_softmax row before response token {j} of sequence {c}"
            got = np.float32(path.logprobs[c][j])
            assert row[token] == got, f"{engine.name}: the recorded log_softmax is not the one scored ({c}, {j})"


def check_full_logprobs(engine: Engine, seqs: list[Any]) -> None:
    full = engine.full_logprobs(seqs, limit=10**9)
    scores = main_path(engine, engine.score(seqs)).logprobs
    assert len(full) == len(seqs)
    for s, lp, scored in zip(seqs, full, scores):
        assert lp.shape[0] == len(s.response_ids) and lp.dtype == np.float32
        total = np.log(np.exp(lp.astype(np.float64)).sum(-1))
        assert np.abs(total).max() < 1e-3, f"{engine.name}: full logprobs are not normalised"
        picked = lp[np.arange(len(s.response_ids)), s.response_ids]
        assert np.abs(picked - scored).mean() < AGREEMENT, f"{engine.name}: full logprobs disagree with its scores"


def check_sample(engine: Engine, prompts: list[list[int]], response_len: int, vocab: int) -> None:
    sampled = engine.sample(prompts, response_len, seed=0)
    assert len(sampled.response_ids) == len(prompts)
    for ids in sampled.response_ids:
        assert len(ids) == response_len and all(0 <= t < vocab for t in ids), f"{engine.name}: bad sample {ids}"
    for p in sampled.scores:
        assert [len(x) for x in p.logprobs] == [response_len] * len(prompts), f"{p.path}: logprobs per token"


def check_consistent(engine: Engine, seqs: list[Any]) -> None:
    with engine.consistent():
        batch = main_path(engine, engine.score(seqs)).logprobs
        for c, s in enumerate(seqs):
            alone = main_path(engine, engine.score([s])).logprobs[0]
            assert np.array_equal(alone, batch[c]), f"{engine.name}: sequence {c} alone is not its bits in a batch"


def check_forced_routing(engine: Engine, seqs: list[Any], layers: list[int], experts: int, top_k: int) -> None:
    from logdiff.probes.routing import ForcedIds

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in seqs]
    plain = main_path(engine, engine.score(seqs)).logprobs
    with engine.forced_routing(ForcedIds({}, lengths)) as counts:
        same = main_path(engine, engine.score(seqs)).logprobs
    assert counts["forced"] == 0 and all(np.array_equal(a, b) for a, b in zip(plain, same)), \
        f"{engine.name}: an empty forcing changed the scores"
    table = np.zeros((len(seqs), max(lengths), top_k), dtype=np.int64)
    table[...] = np.arange(experts - top_k, experts)  # the last experts on every token
    with engine.forced_routing(ForcedIds(dict.fromkeys(layers, table), lengths)) as counts:
        forced = main_path(engine, engine.score(seqs)).logprobs
    assert counts["forced"] > 0, f"{engine.name}: forced routing forced no token"
    assert any(not np.array_equal(a, b) for a, b in zip(plain, forced)), f"{engine.name}: forcing changed nothing"


def check_refusals(engine: Engine, seqs: list[Any]) -> None:
    """Every capability the engine does not declare refuses in one line (an exception with a one-line message)."""
    assert engine.capabilities <= CAPABILITIES, f"unknown capabilities {engine.capabilities - CAPABILITIES}"
    calls = {
        "sample": lambda: engine.sample([[1, 2, 3]], 2, 0),
        "contract": engine.contract,
        "consistent": lambda: engine.consistent().__enter__(),
        "full_logprobs": lambda: engine.full_logprobs(seqs, 8),
        "forced_routing": lambda: engine.forced_routing(None).__enter__(),
        "capture": engine.probes,
    }
    for capability, call in calls.items():
        if capability in engine.capabilities:
            continue
        try:
            call()
        except (InputError, NotImplementedError) as e:
            assert str(e) and "\n" not in str(e), f"{engine.name}: {capability} refused without one line"
        else:
            raise AssertionError(f"{engine.name}: {capability} is not declared, yet it did not refuse")
    if "captured_scoring" not in engine.capabilities:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            assert engine.score_captured(seqs, Path(tmp) / "bundle") is None
