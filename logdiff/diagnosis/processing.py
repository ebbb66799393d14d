"""A sampler's processing of recorded logits, step by step, as vLLM 0.32 applies it (numpy, float32).

``logdiff/diagnosis/sampling_records.py`` replays each side's recorded processing
(``logdiff/records/processing.py``) on logits rows a bundle holds. ``process`` applies the steps a settings
record names, in vLLM 0.32's order (vllm/v1/sample/sampler.py ``Sampler.forward``):

1. the allowed-token mask (``allowed_token_ids``: every other token -inf);
2. bad words (``bad_words_token_ids``): a word's last token -inf where the output so far ends with the rest of it;
3. the non-argmax-invariant processors: min tokens (the stop ids -inf while the output is shorter than
   ``min_tokens``) and the logit bias (added);
4. the penalties (vllm/model_executor/layers/utils.py ``apply_penalties``): repetition over the prompt and the
   output so far (a positive logit divided by it, a negative one multiplied), then frequency (times each
   token's count in the output) and presence (once per token seen in the output), subtracted;
5. greedy sampling (temperature below 1e-5) stops here: the log-softmax of what steps 1-4 left;
6. the temperature (divided), min-p (vllm/v1/sample/logits_processor/builtin.py: tokens whose probability is
   below ``min_p`` times the largest -inf), top-k (the k largest logits kept, ties with the k-th too), then
   top-p over what top-k kept (vllm/v1/sample/ops/topk_topp_sampler.py: ascending order, a token is dropped
   while the cumulative probability up to it is at most ``1 - p``; the largest always kept);
7. the log-softmax, in float32 (``processed_logprobs``).

``process`` takes the steps to apply (``only``) so that each can be added one at a time: ``contributions``
walks from one side's processing to the other's in that order and returns each step's change of the
scored tokens' logprobs, which is how a step's share of a gap is measured. This module imports nothing of
logdiff but the records' step list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from logdiff.records.processing import GREEDY_BELOW, IDENTITY, STEPS

NEG = np.float32(-np.inf)
#: a token the processing dropped has logprob -inf; ``contributions`` reads it as this, so that changes stay finite
FLOOR = -1e4


def _log_softmax(z: np.ndarray) -> np.ndarray:
    top = z.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shifted = z - top
        return (shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))).astype(np.float32)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top_k(z: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= z.shape[-1]:
        return z
    kth = np.sort(z, -1)[:, -k][:, None]
    return np.where(z < kth, NEG, z)


def _top_p(z: np.ndarray, p: float) -> np.ndarray:
    if p >= 1.0:
        return z
    order = np.argsort(z, -1, kind="stable")
    ordered = np.take_along_axis(z, order, -1)
    cum = np.cumsum(_softmax(ordered.astype(np.float32)), -1, dtype=np.float32)
    drop = cum <= np.float32(1.0 - p)
    drop[:, -1] = False
    out = z.copy()
    np.put_along_axis(out, order, np.where(drop, NEG, ordered), -1)
    return out


def _min_p(z: np.ndarray, m: float) -> np.ndarray:
    if m <= 0:
        return z
    probs = _softmax(z)
    return np.where(probs < probs.max(-1, keepdims=True) * np.float32(m), NEG, z)


def _penalise(z: np.ndarray, s: dict[str, Any], prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]], steps: set[str]) -> np.ndarray:
    vocab = z.shape[-1]
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        out = np.asarray([t for t in output if 0 <= t < vocab], np.int64)
        if "repetition_penalty" in steps:
            r = np.float32(s["repetition_penalty"])
            seen = np.unique(np.concatenate([np.asarray([t for t in prompt if 0 <= t < vocab], np.int64), out]))
            row = z[i, seen]
            z[i, seen] = np.where(row > 0, row / r, row * r)
        counts = np.bincount(out, minlength=vocab).astype(np.float32)
        if "frequency_penalty" in steps:
            z[i] -= np.float32(s["frequency_penalty"]) * counts
        if "presence_penalty" in steps:
            z[i] -= np.float32(s["presence_penalty"]) * (counts > 0)
    return z


def _masks(z: np.ndarray, s: dict[str, Any], outputs: Sequence[Sequence[int]], steps: set[str]) -> np.ndarray:
    vocab = z.shape[-1]
    if "allowed_token_ids" in steps:
        allowed = np.zeros(vocab, bool)
        allowed[[t for t in s["allowed_token_ids"] if t < vocab]] = True
        z[:, ~allowed] = NEG
    for i, output in enumerate(outputs):
        if "bad_words_token_ids" in steps:
            for word in s["bad_words_token_ids"]:
                head = list(word[:-1])
                if word and word[-1] < vocab and (not head or list(output[-len(head):]) == head):
                    z[i, word[-1]] = NEG
        if "min_tokens" in steps and len(output) < int(s["min_tokens"]):
            z[i, [t for t in s.get("all_stop_token_ids") or [] if t < vocab]] = NEG
    if "logit_bias" in steps:
        for t, b in s["logit_bias"]:
            if t < vocab:
                z[:, t] += np.float32(b)
    return z


def process(logits: np.ndarray, settings: dict[str, Any], prompts: Sequence[Sequence[int]],
            outputs: Sequence[Sequence[int]], only: set[str] | None = None) -> np.ndarray:
    """The processed log-probabilities ``[N, V]`` of logits rows ``[N, V]`` under ``settings`` (row ``i`` samples
    after ``prompts[i]`` and ``outputs[i]``, the output so far); ``only``: apply just these steps (default: every
    step ``settings`` turns on)."""
    from logdiff.records.processing import active

    on = active(settings, logits.shape[-1])
    steps = set(on) if only is None else set(on) & set(only)
    z = np.array(logits, dtype=np.float32, copy=True)
    z = _masks(z, settings, outputs, steps)
    z = _penalise(z, settings, prompts, outputs, steps)
    if float(settings.get("temperature", 1.0)) < GREEDY_BELOW:
        return _log_softmax(z)
    if "temperature" in steps:
        z = z / np.float32(settings["temperature"])
    if "min_p" in steps:
        z = _min_p(z, float(settings["min_p"]))
    if "top_k" in steps:
        z = _top_k(z, int(settings["top_k"]))
    if "top_p" in steps:
        z = _top_p(z, float(settings["top_p"]))
    return _log_softmax(z)


def differing(a: dict[str, Any], b: dict[str, Any], vocab: int | None = None) -> list[str]:
    """The steps whose values differ between two settings records (each step's identity where one leaves it off),
    in vLLM's order."""
    from logdiff.records.processing import active

    on_a, on_b = active(a, vocab), active(b, vocab)
    return [k for k, _ in STEPS if on_a.get(k, IDENTITY[k]) != on_b.get(k, IDENTITY[k])]


def contributions(logits: np.ndarray, tokens: np.ndarray, start: dict[str, Any], end: dict[str, Any],
                  prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The scored tokens' logprobs under ``start`` and under ``end`` processing of the same logits rows, and each
    differing step's change on the way, the steps switched from ``start``'s value to ``end``'s one at a time in
    vLLM's order (the changes add up to end - start; a dropped token's -inf is read as ``FLOOR``)."""
    rows = np.arange(len(tokens))
    vocab = logits.shape[-1]
    current = {k: v for k, v in start.items()}
    before = np.maximum(process(logits, current, prompts, outputs)[rows, tokens].astype(np.float64), FLOOR)
    first, out = before.copy(), {}
    for key in differing(start, end, vocab):
        current[key] = end.get(key, IDENTITY[key])
        if key == "min_tokens":
            current["all_stop_token_ids"] = end.get("all_stop_token_ids")
        after = np.maximum(process(logits, current, prompts, outputs)[rows, tokens].astype(np.float64), FLOOR)
        out[key], before = after - before, after
    return first, before, out
