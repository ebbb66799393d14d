"""Sampling semantics from the bundles alone: each side's recorded processing, replayed on its recorded logits.

A scan tests sampling semantics live (``sampling.py``: it fits temperatures and truncations against the trainer's
distribution). Two capture bundles hold what that needs, and more, where their records say what each side did
to its logits (``logdiff/records/processing.py``): the rollout engine's per-request sampling settings and its
``logprobs_mode`` (a vLLM capture's ``sequences[i].sampling``), the trainer's declared processing
(``Capture.applied_processing``; TRL's integration declares its temperature), and the engine's logits rows of
the sampled tokens (its ``logits`` record). ``logdiff compare`` feeds the rows through ``RowSink`` and calls
``diagnose``:

1. **What each side's logprobs are of.** The engine's returned logprobs carry its sampler's steps where its
   mode is ``processed_logprobs`` (else none: raw logprobs); the trainer's carry what it declared.
2. **Each side against its own records.** The engine's returned logprob of each sampled token is recomputed
   from its logits row under its recorded settings, in vLLM's order (``processing.process``); so is the
   trainer's where its bundle holds logits rows. How close they come is evidence (``reproduced``): a large
   miss says the records do not describe what the side did (a logits processor of the user's, say).
3. **A step on one side only.** The steps whose values differ (``processing.differing``) are switched on one
   at a time on the engine's logits (``processing.contributions``); each one's share of the measured gap is
   ``sum |its change| / sum |Δ logprob|`` over the scored tokens. A step that changes some token's logprob is
   a ``framework_difference`` of kind ``sampling_semantics`` at ``log_softmax`` (the kind the scan's
   sampling checks use), naming the setting, both values and its share, with the fix each framework offers.
   The cause's ``share`` is the sampling steps' share together. What is left, the trainer's processing of the
   engine's logits against the trainer's own logprobs, is the kernels' part (the closure bounds it).
   A temperature both sides apply is the same step on both: no cause (the negative control).
4. **Sampling that the logprobs do not show.** An engine that returned raw logprobs while sampling with
   other settings draws its tokens from another distribution than the one its logprobs describe: one
   warning names the settings (the behaviour policy differs; the logprobs do not show it).

Where a record is missing (a bundle captured before these records, a trainer that declared nothing), one
warning says which, and nothing is guessed; two bundles of which neither sampled (no engine's ``logprobs_mode``,
no request record) nor declared a processing are not a sampling question, and get no warning.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from logdiff.comparison.cause import Findings, framework_cause
from logdiff.diagnosis import processing
from logdiff.records.processing import IDENTITY, PROCESSED, active, engine_requests, trainer_applied

#: the most values one side's sink keeps per record (its rows are a vocabulary wide: 128 MiB of float32)
MAX_VALUES = 1 << 25
#: a step moves the logprobs when its changes sum to more than this per scored token (float32 rounding)
MOVES = 1e-6
#: the returned logprobs are reproduced from the records when they come within this (float32 log-softmax rounding
#: over a large vocabulary, and a top-p boundary token's cumulative sum)
REPRODUCED = 1e-3
#: how each step is named in the evidence
LABEL = {"allowed_token_ids": "allowed token ids", "bad_words_token_ids": "bad words", "min_tokens": "min tokens",
         "logit_bias": "logit bias", "repetition_penalty": "repetition penalty",
         "frequency_penalty": "frequency penalty", "presence_penalty": "presence penalty",
         "temperature": "temperature", "min_p": "min-p", "top_k": "top-k", "top_p": "top-p"}

#: the frameworks' own options for each step (their source files and versions)
TRL = "TRL 1.16 (trl/trainer/grpo_config.py)"
VERL = "verl 0.8.0.dev (verl/trainer/config/rollout/rollout.yaml)"
OPENRLHF = "OpenRLHF 0.11.0 (openrlhf/cli/train_ppo_ray.py)"
FIXES = {
    "top_p": f"{TRL}: GRPOConfig(top_p=1.0); {VERL}: actor_rollout_ref.rollout.top_p=1; {OPENRLHF}: "
             "--rollout.top_p 1.0",
    "top_k": f"{TRL}: GRPOConfig(top_k=0); {VERL}: actor_rollout_ref.rollout.top_k=-1 (OpenRLHF forwards no top-k)",
    "min_p": f"{TRL}: GRPOConfig(min_p=0.0) (verl and OpenRLHF forward no min-p)",
    "repetition_penalty": f"{TRL}: GRPOConfig(repetition_penalty=1.0) (verl and OpenRLHF forward none)",
    "temperature": f"{TRL}: GRPOConfig(temperature=...) sets both sides (trl/trainer/grpo_trainer.py divides the "
                   f"logits by it); {VERL}: rollout.temperature, which verl/workers/actor/dp_actor.py divides the "
                   "logits by; OpenRLHF 0.11.0: --rollout.temperature (openrlhf/models/actor.py applies it)",
}
#: what none of the frameworks applies in the trainer: remove it from the sampling (TRL: generation_kwargs)
OTHER_FIX = f"{TRL}: remove it from GRPOConfig(generation_kwargs=...); verl and OpenRLHF: from the rollout's sampling kwargs"
#: the frameworks' corrections, where the step is kept on purpose
CORRECTION = (f"or keep it and correct the importance ratio for it: {TRL} vllm_importance_sampling_correction / "
              "vllm_importance_sampling_mode (they bound the ratio, not the bias); verl 0.8.0.dev "
              "algorithm.rollout_correction (verl/trainer/config/algorithm.py); OpenRLHF 0.11.0 "
              "--algo.advantage.is_correction_enable; no framework applies top-k, top-p, min-p or penalties in "
              "its trainer")


class RowSink:
    """A probe sink keeping one side's ``logits`` (and ``log_softmax``) rows that score a response token, by
    (common sequence, position), up to ``MAX_VALUES`` values a record (``full`` once rows were left out)."""

    wants_replay = False

    def __init__(self, prompt_lens: list[int], lengths: list[int], names: tuple[str, ...] = ("logits", "log_softmax")):
        self.prompt_lens, self.lengths, self.names = prompt_lens, lengths, names
        self.rows: dict[str, dict[tuple[int, int], np.ndarray]] = {n: {} for n in names}
        self.full = False

    def emit(self, name: str, rows: Any, rmap: Any, replay: Any = None) -> None:
        if name not in self.names:
            return
        store = self.rows[name]
        for j in np.nonzero(rmap.valid)[0]:
            c, p = int(rmap.seq[j]), int(rmap.pos[j])
            if c < 0 or not self.prompt_lens[c] - 1 <= p < self.lengths[c] - 1:  # scores no response token
                continue
            if (len(store) + 1) * rows.shape[-1] > MAX_VALUES:
                self.full = True
                return
            store[(c, p)] = rows[int(j)].float().numpy()


def _key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


def _returned(settings: dict[str, Any]) -> dict[str, Any]:
    """The processing a side's returned logprobs carry: the sampler's steps in a processed mode, else none."""
    if str(settings.get("logprobs_mode", "raw_logprobs")) in PROCESSED:
        return settings
    return {}


def _value(settings: dict[str, Any], key: str) -> Any:
    v = settings.get(key, IDENTITY[key])
    if key == "temperature":
        return v
    return "off" if v == IDENTITY[key] or v is None or (key == "top_k" and v <= 0) else v


def diagnose(tb: Any, ib: Any, matching: Any, seqs: list[Any], train_lp: list[np.ndarray],
             infer_lp: list[np.ndarray], infer_rows: RowSink, train_rows: RowSink | None = None) -> Findings:
    """The sampling findings of a bundle comparison (see the module docstring). ``matching``: the sequences'
    pairing (``pairing.match_sequences``); ``seqs``: the common sequences with their response masks;
    ``train_lp``/``infer_lp``: each side's returned logprobs of the response tokens."""
    found = Findings()
    records = engine_requests(ib)
    applied = trainer_applied(tb)
    per_seq: dict[int, dict[str, Any]] = {c: records[key] for key, c in matching.infer.items() if key in records}
    missing = []
    if not per_seq:
        missing.append("the infer bundle's per-request sampling settings (sequences[i].sampling: a vLLM capture "
                       "of this logdiff records them)")
    if applied is None:
        missing.append("the train bundle's applied processing (Capture.applied_processing: what the trainer did to "
                       "its logits, e.g. its temperature)")
    if per_seq and not infer_rows.rows["logits"]:
        missing.append("the infer bundle's logits rows of the sampled tokens")
    samples = applied is not None or bool(records) or ib.meta.get("logprobs_mode") is not None
    if missing and samples:  # two captures of which neither sampled nor declared anything: nothing to check
        found.warnings.append("sampling checks not run: the bundles lack " + "; and ".join(missing))
    if missing:
        return found
    tokens = [(c, len(s.prompt_ids) + j) for c, s in enumerate(seqs) for j, m in enumerate(s.response_mask or [])
              if m and c in per_seq and (c, len(s.prompt_ids) + j - 1) in infer_rows.rows["logits"]]
    if not tokens:
        found.warnings.append("sampling checks not run: no scored token has an infer logits row in the bundle")
        return found
    if infer_rows.full:
        found.warnings.append(f"sampling checks: the first {len(tokens)} scored tokens only (each logits row is a "
                              f"vocabulary wide; at most {MAX_VALUES:,} values a record are kept)")
    return _judge(found, applied, per_seq, seqs, tokens, train_lp, infer_lp, infer_rows, train_rows)


def _judge(found: Findings, applied: dict[str, Any], per_seq: dict[int, dict[str, Any]], seqs: list[Any],
           tokens: list[tuple[int, int]], train_lp: list[np.ndarray], infer_lp: list[np.ndarray],
           infer_rows: RowSink, train_rows: RowSink | None) -> Findings:
    ids = [s.ids for s in seqs]
    groups: dict[str, list[tuple[int, int]]] = {}
    for c, n in tokens:
        groups.setdefault(_key(per_seq[c]), []).append((c, n))
    gap, sampling_part, replay_miss, train_miss = [], [], [], []
    steps: dict[str, list[float]] = {}
    values: dict[str, tuple[Any, Any]] = {}
    kept = [0, 0]
    raw_unshown: dict[str, Any] = {}
    for key, members in groups.items():
        settings = per_seq[members[0][0]]
        returned = _returned(settings)
        if not returned:
            raw_unshown.update({k: v for k, v in active(settings).items() if k not in active(applied)})
        z = np.stack([infer_rows.rows["logits"][(c, n - 1)] for c, n in members])
        tok = np.asarray([ids[c][n] for c, n in members], np.int64)
        prompts = [seqs[c].prompt_ids for c, _ in members]
        outputs = [ids[c][len(seqs[c].prompt_ids):n] for c, n in members]
        start, end, each = processing.contributions(z, tok, applied, returned, prompts, outputs)
        got_i = np.asarray([infer_lp[c][n - len(seqs[c].prompt_ids)] for c, n in members], np.float64)
        got_t = np.asarray([train_lp[c][n - len(seqs[c].prompt_ids)] for c, n in members], np.float64)
        gap.append(got_i - got_t)
        sampling_part.append(end - start)
        replay_miss.append(np.abs(end - got_i))
        for step, change in each.items():
            steps.setdefault(step, []).extend(np.abs(change).tolist())
            values[step] = (_value(applied, step), _value(returned, step))
        recorded = [infer_rows.rows["log_softmax"].get((c, n - 1)) for c, n in members]
        if returned and all(r is not None for r in recorded):  # the kept set, where the engine's rows show it
            replayed = processing.process(z, returned, prompts, outputs)
            # as many tokens kept: bf16 logits tie often, and which of two equal tokens top-k/top-p keeps at its
            # boundary is the sort's choice (the kept mass, and every kept token's logprob, are the same)
            same = [int(np.isfinite(r).sum()) == int(np.isfinite(q).sum()) for r, q in zip(recorded, replayed)]
            kept[0], kept[1] = kept[0] + sum(same), kept[1] + len(same)
        if train_rows is not None and all((c, n - 1) in train_rows.rows["logits"] for c, n in members):
            zt = np.stack([train_rows.rows["logits"][(c, n - 1)] for c, n in members])
            mine = processing.process(zt, applied, prompts, outputs)[np.arange(len(tok)), tok]
            train_miss.append(np.abs(mine - got_t))
    d, e = np.concatenate(gap), np.concatenate(sampling_part)
    total = float(np.abs(d).sum())
    share = lambda x: None if total == 0 else round(float(np.sum(x)) / total, 4)  # noqa: E731
    miss = np.concatenate(replay_miss)
    reproduced = {"infer": {"max_abs_diff": float(miss.max()), "mean_abs_diff": float(miss.mean()),
                            "reproduced": bool(miss.max() <= REPRODUCED)}}  # fmt: skip
    if kept[1]:
        reproduced["infer"]["kept_sets_equal"] = f"{kept[0]}/{kept[1]}"
    if train_miss:
        tm = np.concatenate(train_miss)
        reproduced["train"] = {"max_abs_diff": float(tm.max()), "mean_abs_diff": float(tm.mean()),
                               "reproduced": bool(tm.max() <= REPRODUCED)}
    if raw_unshown:
        named = ", ".join(f"{LABEL[k]} = {v!r}" for k, v in raw_unshown.items())
        found.warnings.append(f"the rollout sampled with {named} but returned raw logprobs: its tokens were drawn from "
                              "another distribution than its logprobs describe (the logprobs do not show it)")
    moving = {k: v for k, v in steps.items() if sum(v) > MOVES * len(v)}
    if not reproduced["infer"]["reproduced"]:
        found.warnings.append(f"the infer bundle's returned logprobs are not reproduced from its logits under its "
                              f"recorded sampling settings (up to {miss.max():.3g}): the engine applied something its "
                              "records do not name (a logits processor of the user's?)")
    if not moving:
        return found
    settings_out = [{"setting": k, "train": values[k][0], "infer": values[k][1], "share": share(v)}
                    for k, v in moving.items()]
    settings_out.sort(key=lambda x: -(x["share"] or 0.0))  # the largest first: the one a report shows
    raw = any(not _returned(per_seq[c]) for c, _ in tokens)
    cause = _cause(settings_out, active(applied), raw, reproduced, kept, (share(np.abs(e)), share(np.abs(d - e))), len(d))
    cause.sampling = {"infer": {"kind": "sampling_semantics", "source": "records", "positions": len(d),
                                "temperature": None, "truncation": None, "settings": settings_out,
                                "reproduced": reproduced,
                                "mean_abs_diff": {"as_is": float(np.abs(d).mean()),
                                                  "explained": float(np.abs(d - e).mean())}}}  # fmt: skip
    found.causes.append(cause)
    return found


def _cause(settings: list[dict[str, Any]], applied: dict[str, Any], raw: bool, reproduced: dict[str, Any],
           kept: list[int], shares: tuple[float | None, float | None], tokens: int) -> Any:
    """The ``sampling_semantics`` cause of the steps in ``settings`` (each applied on one side only, or with another
    value), with its evidence and each framework's fix."""
    evidence = [f"{LABEL[s['setting']]} = {s['infer']!r} on the infer side, {s['train']!r} on the train side: "
                f"{_pct(s['share'])} of the measured |Δ logprob|" for s in settings]  # fmt: skip
    miss = reproduced["infer"]["max_abs_diff"]
    what = ("raw logprobs (logprobs_mode raw_logprobs: none of its sampler's steps)" if raw else
            "the sampler's processed logprobs")
    evidence.append(f"the infer logprobs are {what}, recomputed from its recorded logits under its recorded "
                    f"settings to within {miss:.3g}" + (f" (as many tokens kept at {kept[0]} of {kept[1]} rows)"
                                                        if kept[1] else "")
                    + "; the trainer applied " + _listed(applied))  # fmt: skip
    evidence.append(f"together the sampling steps account for {_pct(shares[0])} of the measured gap over {tokens} "
                    f"tokens; the rest ({_pct(shares[1])}) is the two sides' logits under the same processing")
    fixes = []
    for s in settings:
        label, framework = LABEL[s["setting"]], FIXES.get(s["setting"], OTHER_FIX)
        if s["train"] == "off":  # the engine only: sample without it, as the trainer scores
            fixes.append(f"{label} (the engine only): sample without it, {framework}")
        elif s["infer"] == "off" or raw:  # the trainer only: its logprobs are of another distribution
            fixes.append(f"{label} (the trainer only): have the engine report processed logprobs at the same setting "
                         "(vLLM logprobs_mode=processed_logprobs: TRL sets it; verl rollout.logprobs_mode; OpenRLHF "
                         f"with --algo.advantage.is_correction_enable), or drop it in the trainer; {framework}")
        else:
            fixes.append(f"{label}: one value on both sides, {framework}")
    fix = "; ".join(fixes) + "; " + CORRECTION
    cause = framework_cause("log_softmax", "log_softmax", "sampling_semantics", evidence, fix,
                            [s["setting"] for s in settings])
    cause.paths, cause.share = ["infer"], shares[0]
    return cause


def _listed(steps: dict[str, Any]) -> str:
    """``temperature = 0.7 only``, or ``no processing``."""
    return ", ".join(f"{LABEL[k]} = {v!r}" for k, v in steps.items()) + " only" if steps else "no processing"


def _pct(x: float | None) -> str:
    return "an unmeasured part" if x is None else f"{100 * x:.1f}%"
