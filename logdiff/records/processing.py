"""What each side did to its logits before the logprobs it returned: the records, their schema and their reader.

A bundle's logprobs are the logits' log-softmax *after* whatever processing that side applied: a sampler's
temperature, penalties and truncation (vLLM ``logprobs_mode="processed_logprobs"``, TRL's and verl's default),
a trainer's temperature. Two records say what it was, so that ``logdiff compare`` can judge it from the
bundles alone (``logdiff/diagnosis/sampling_records.py``):

* **the engine's requests** (``meta["sequences"][i]["sampling"]`` of a vLLM capture,
  ``logdiff/sources/vllm/sampler_records.py``): per request, the settings the sampler applied, read from the
  sampler's input when it first sampled for the request (its ``SamplingMetadata`` rows and the request's own
  ``SamplingParams``), never from a config, plus the engine's ``logprobs_mode`` and its logits processors by
  class name;
* **the trainer's applied processing** (``meta["applied_processing"]``, ``Capture.applied_processing``): what
  the trainer did to its logits before its log-softmax (TRL: the temperature).

Both use the keys of ``SETTINGS``; a key left out has its identity value (the step is off). The reader treats
them as untrusted input (``untrusted.py``): unknown keys are ignored, a known key of the wrong type or out of
its range, or a list longer than ``MAX_IDS``, is one ``InputError`` naming the bundle.
"""

from __future__ import annotations

import math
from typing import Any

from logdiff.errors import InputError

#: each setting, in the order vLLM 0.32's sampler applies it (vllm/v1/sample/sampler.py: the allowed-token mask,
#: bad words, the non-argmax-invariant processors (min tokens, logit bias), the penalties, then temperature,
#: min-p, top-k and top-p), with its identity value (the step does nothing)
STEPS: tuple[tuple[str, Any], ...] = (
    ("allowed_token_ids", None),
    ("bad_words_token_ids", None),
    ("min_tokens", 0),
    ("logit_bias", None),
    ("repetition_penalty", 1.0),
    ("frequency_penalty", 0.0),
    ("presence_penalty", 0.0),
    ("temperature", 1.0),
    ("min_p", 0.0),
    ("top_k", 0),
    ("top_p", 1.0),
)
IDENTITY = dict(STEPS)
#: what is recorded beside the steps: it moves no logprob, but says what the request was
CONTEXT = ("seed", "max_tokens", "stop", "stop_token_ids", "all_stop_token_ids", "ignore_eos", "logprobs",
           "logprobs_mode", "logits_processors", "greedy")
SETTINGS = (*IDENTITY, *CONTEXT)
#: the longest id list a record may hold (a vocabulary's worth)
MAX_IDS = 1 << 20
#: logprobs modes whose numbers carry the sampler's processing (vLLM's ``PROCESSED_LOGPROBS_MODES``)
PROCESSED = ("processed_logprobs", "processed_logits")
#: below this temperature vLLM samples greedily and applies none of temperature, min-p, top-k, top-p
GREEDY_BELOW = 1e-5


def _number(value: Any, lo: float, hi: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


def _ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_IDS and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_IDS for t in value)


#: each key's check
_VALID = {
    "allowed_token_ids": lambda v: v is None or _ids(v),
    "bad_words_token_ids": lambda v: v is None or (isinstance(v, list) and len(v) <= MAX_IDS and all(_ids(w) for w in v)),
    "min_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31,
    "logit_bias": lambda v: v is None or (isinstance(v, list) and len(v) <= MAX_IDS and all(
        isinstance(p, list) and len(p) == 2 and _ids([p[0]]) and _number(p[1], -1e4, 1e4) for p in v)),
    "repetition_penalty": lambda v: _number(v, 1e-6, 1e6),
    "frequency_penalty": lambda v: _number(v, -1e4, 1e4),
    "presence_penalty": lambda v: _number(v, -1e4, 1e4),
    "temperature": lambda v: _number(v, 0.0, 1e6),
    "min_p": lambda v: _number(v, 0.0, 1.0),
    "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and -1 <= v < 1 << 31,
    "top_p": lambda v: _number(v, 0.0, 1.0),
    "seed": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "max_tokens": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "stop": lambda v: v is None or (isinstance(v, list) and len(v) <= 1024 and all(isinstance(s, str) for s in v)),
    "stop_token_ids": lambda v: v is None or _ids(v),
    "all_stop_token_ids": lambda v: v is None or _ids(v),
    "ignore_eos": lambda v: isinstance(v, bool),
    "logprobs": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "logprobs_mode": lambda v: isinstance(v, str) and len(v) <= 64,
    "logits_processors": lambda v: isinstance(v, list) and len(v) <= 256 and all(isinstance(s, str) and len(s) <= 200 for s in v),
    "greedy": lambda v: isinstance(v, bool),
}


def clean(record: Any, where: str) -> dict[str, Any]:
    """A record's known settings, each checked (``where`` names it in the one-line refusal)."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: a processing record must be a JSON object")
    out = {}
    for key in SETTINGS:
        if key in record:
            value = record[key]
            if not _VALID[key](value):
                raise InputError(f"{where}: processing record {key!r} = {str(value)[:60]!r} is not a valid value")
            out[key] = value
    return out


def active(settings: dict[str, Any], vocab: int | None = None) -> dict[str, Any]:
    """The steps of ``settings`` that change the logits, with their values (greedy sampling: none of
    temperature, min-p, top-k, top-p; a top-k of 0, -1 or the vocabulary's size: off)."""
    greedy = float(settings.get("temperature", 1.0)) < GREEDY_BELOW
    out = {}
    for key, identity in STEPS:
        value = settings.get(key, identity)
        if greedy and key in ("temperature", "min_p", "top_k", "top_p"):
            continue
        if key == "top_k" and (value <= 0 or (vocab and value >= vocab)):
            continue
        if key == "min_tokens" and not (value and settings.get("all_stop_token_ids")):
            continue
        if value not in (identity, []) and value is not None:
            out[key] = value
    return out


def engine_requests(bundle: Any) -> dict[tuple[tuple[int, ...], int], dict[str, Any]]:
    """Each captured sequence's sampling record (``(tp group, sequence id)`` as ``Bundle.sequence_table``'s), where
    its rank's metadata holds one."""
    out = {}
    for group in bundle.groups():
        part = bundle.part_of(group)
        listed = part.meta.get("sequences")
        if not isinstance(listed, list):
            continue
        for seq, entry in enumerate(listed):
            if isinstance(entry, dict) and "sampling" in entry:
                out[(group, seq)] = clean(entry["sampling"], f"{part.dir / 'manifest.json'}: sequence {seq}")
    return out


def trainer_applied(bundle: Any) -> dict[str, Any] | None:
    """The processing the training side declared it applied to its logits (``Capture.applied_processing``), or
    None where its bundle records none."""
    record = bundle.meta.get("applied_processing")
    if record is None:
        return None
    return clean(record, f"{bundle.ranks[0].dir / 'manifest.json'}: applied_processing")
