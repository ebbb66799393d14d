"""What vLLM's sampler applied to each request: read from the sampler's own input, for the capture's records.

``logdiff.sources.vllm.capture.recording`` wraps the worker's ``Sampler.forward``; on each call within the
capture, before the sampler runs (it edits the logits in place, never its metadata), ``settings`` reads every
request of the batch it has not read yet:

* from the ``SamplingMetadata`` the sampler was given, row by row in the input batch's order
  (``runner.input_batch.req_ids``): temperature (0 where the request samples greedily: the runner stores 0,
  and ``all_greedy`` skips every step after the penalties), top-k (vLLM stores the vocabulary's size for "off":
  recorded as 0), top-p, and the presence, frequency and repetition penalties. A tensor the batch does not
  need is None there (no request uses top-p): the identity value;
* from the request's own ``SamplingParams`` (the runner's ``CachedRequestState``), what the metadata holds
  only in a processor's state: min-p, logit bias, allowed and bad token ids, min tokens with the stop ids it
  masks, seed, max tokens and stop;
* from the sampler: its ``logprobs_mode`` (the override a call passes wins) and the logits processors the batch
  runs, by class name (vLLM's built-ins, min-p, logit bias and min tokens, act only where a request sets them).

Each request is read once, at its first sampled step (the settings of a request never change); the record
is ``meta["sequences"][i]["sampling"]`` (``logdiff/records/processing.py``). Reading it costs one host copy
of the batch's small per-request tensors, only in steps the capture records.
"""

from __future__ import annotations

from typing import Any


def _row(tensor: Any, i: int) -> Any:
    """Row ``i`` of a per-request metadata tensor as a Python number, or None where the batch has none."""
    if tensor is None:
        return None
    try:
        value = tensor[i].item()
    except (IndexError, RuntimeError):
        return None
    return float(f"{value:.7g}") if isinstance(value, float) else value  # a float32 tensor's 0.8, not 0.800000011920929


def _list(value: Any) -> list | None:
    return None if value is None else [int(t) for t in value]


def processors(metadata: Any) -> list[str]:
    """The class names of the logits processors the sampler runs on this batch."""
    procs = getattr(metadata, "logitsprocs", None)
    out = []
    for group in ("non_argmax_invariant", "argmax_invariant"):
        out += [type(p).__name__ for p in getattr(procs, group, None) or []]
    return list(dict.fromkeys(out))


def settings(metadata: Any, index: int, params: Any, vocab: int, logprobs_mode: str) -> dict[str, Any]:
    """The settings the sampler applies to row ``index`` of ``metadata`` (``params``: that request's
    ``SamplingParams``, or None), as ``logdiff/records/processing.py`` records them."""
    temperature = _row(getattr(metadata, "temperature", None), index)
    greedy = bool(getattr(metadata, "all_greedy", False)) or (temperature is not None and temperature < 1e-5)
    top_k = _row(getattr(metadata, "top_k", None), index)
    out: dict[str, Any] = {
        "temperature": 0.0 if greedy else float(temperature if temperature is not None else 1.0),
        "greedy": greedy,
        "top_k": 0 if top_k is None or top_k <= 0 or top_k >= vocab else int(top_k),
        "top_p": float(_row(getattr(metadata, "top_p", None), index) or 1.0),
        "logprobs_mode": str(logprobs_mode),
        "logits_processors": processors(metadata),
    }
    for key, default in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        value = None if getattr(metadata, "no_penalties", False) else _row(getattr(metadata, key[:-1] + "ies", None), index)
        out[key] = float(default if value is None else value)
    if params is None:
        return out
    bias = getattr(params, "logit_bias", None)
    bad = getattr(params, "_bad_words_token_ids", None) or getattr(params, "bad_words_token_ids", None)
    out.update({
        "min_p": float(getattr(params, "min_p", 0.0) or 0.0),
        "logit_bias": None if not bias else [[int(t), float(b)] for t, b in bias.items()],
        "allowed_token_ids": _list(getattr(params, "allowed_token_ids", None) or None),
        "bad_words_token_ids": [[int(t) for t in w] for w in bad] if bad else None,
        "min_tokens": int(getattr(params, "min_tokens", 0) or 0),
        "all_stop_token_ids": _list(sorted(getattr(params, "all_stop_token_ids", None) or [])) or None,
        "seed": getattr(params, "seed", None),
        "max_tokens": getattr(params, "max_tokens", None),
        "stop": [getattr(params, "stop")] if isinstance(getattr(params, "stop", None), str) else (
            list(getattr(params, "stop", None) or []) or None),
        "stop_token_ids": _list(getattr(params, "stop_token_ids", None) or None),
        "ignore_eos": bool(getattr(params, "ignore_eos", False)),
        "logprobs": getattr(params, "logprobs", None),
    })
    return out


def wrap_sampler(sampler: Any, runner: Any, record: Any) -> Any:
    """``sampler.forward``, calling ``record(request id, settings)`` for each request of the batch first."""
    forward = sampler.forward

    def sample_and_record(logits: Any, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("logprobs_mode_override") or getattr(sampler, "logprobs_mode", "raw_logprobs")
        try:
            vocab = int(logits.shape[-1])
            for i, rid in enumerate(list(runner.input_batch.req_ids)[: int(logits.shape[0])]):
                state = runner.requests.get(rid)
                record(rid, lambda i=i, state=state: settings(sampling_metadata, i, getattr(state, "sampling_params", None),
                                                                vocab, str(mode)))
        except Exception as e:  # noqa: BLE001 - a probe must never break the engine's own run
            record(None, e)
        return forward(logits, sampling_metadata, *args, **kwargs)

    return sample_and_record
