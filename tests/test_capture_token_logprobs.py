"""``Capture.token_logprobs``: a trainer's own per-token logprobs, for a fused head that never calls ``lm_head``.

The demo Qwen3 in bf16, captured in-process. The inference bundle runs the sequences one per step with a
planted stale weight (a nonzero gap to measure). Three training captures of the same sequences:

* the normal one: ``model(ids).logits`` through ``Capture.logprobs`` (the ``log_softmax`` boundary);
* a fused head: the decoder alone (``model.model``), then the head computed from ``lm_head.weight`` without
  calling ``lm_head``, gathered at the next tokens: ``[batch, length - 1]``, given to ``token_logprobs``.
  The bundle holds no ``logits`` or ``log_softmax`` record, and ``compare`` reads the same per-token logprobs
  and the same gap as the normal capture's;
* the same, response-only (TRL's ``logits_to_keep``, verl's ``responses``), with ``start`` and ``token_ids``.

Misaligned calls: an ``[batch, length]`` layout or a ``start`` that runs past the step is a ``ValueError``;
``token_ids`` that are not the scored columns (an off-by-one ``start``) is a ``ValueError``; an off-by-one
``start`` without ``token_ids`` cannot be seen at capture: it is recorded, and ``compare`` runs and reports
the far larger gap of logprobs scored against the wrong tokens (it does not crash).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

IDS = [[5, 17, 3, 9, 42, 7, 11, 2, 8, 1], [8, 1, 30, 4, 6, 19, 23, 13, 3, 3]]
PROMPT = 4  # the response-only layout scores the tokens from this column on
PLANTED = "model.layers.1.post_attention_layernorm"


def _model(model_dir: Path, plant: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    if plant:
        with torch.no_grad():
            model.get_submodule(PLANTED).weight.mul_(1.05)
    return model


def _fused(model, ids):
    """A fused head's per-token logprobs: the decoder alone, the head from its weight (``lm_head`` is never
    called), float32 log-softmax gathered at the next tokens: ``[batch, length - 1]``."""
    import torch

    hidden = model.model(input_ids=ids).last_hidden_state
    logits = torch.nn.functional.linear(hidden, model.lm_head.weight)
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def _capture(model, out: Path, role: str, mode: str, batches=None) -> Path:
    import torch

    import logdiff

    with logdiff.capture(model, out, role, window="all") as cap, torch.no_grad():
        for batch in batches or [IDS]:
            ids = torch.tensor(batch)
            if mode == "logits":
                cap.logprobs(model(ids).logits)
            elif mode == "fused":
                cap.token_logprobs(_fused(model, ids))
            elif mode == "response":
                lp = _fused(model, ids)[:, PROMPT - 1 :]  # scores ids[:, PROMPT:]
                cap.token_logprobs(lp, start=PROMPT, token_ids=ids[:, PROMPT:])
            elif mode == "shifted":  # off by one: the logprob of token t+1 recorded as token t's
                cap.token_logprobs(_fused(model, ids)[:, 1:], start=1)
    return out


@pytest.fixture(scope="module")
def bundles(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model_dir = demo_model("qwen3")
    root = tmp_path_factory.mktemp("token-logprobs")
    model = _model(model_dir)
    out = {mode: _capture(model, root / mode, "train", mode) for mode in ("logits", "fused", "response", "shifted")}
    out["infer"] = _capture(_model(model_dir, plant=True), root / "infer", "infer", "logits",
                            [[ids] for ids in reversed(IDS)])
    return out


def _compare(train: Path, infer: Path):
    from logdiff.commands.compare import compare_bundles

    return compare_bundles(train, infer).to_dict()


def _train_logprobs(train: Path, infer: Path) -> list[list[float]]:
    """The training side's logprob of every scored token, as ``compare`` reads it."""
    from logdiff.comparison import bundle_feed
    from logdiff.comparison.pairing import match_sequences
    from logdiff.records.bundle import Bundle

    tb, ib = Bundle(train), Bundle(infer)
    matching = match_sequences(tb.sequence_table(), ib.sequence_table())
    scores, _ = bundle_feed.feed_side(tb, matching.train, matching.ids, None, "train", "hf")
    return [[float(v) for v, h in zip(lp, has) if h] for lp, has in zip(scores.logprobs, scores.has)]


def test_a_fused_head_bundle_has_no_logits(bundles) -> None:
    from logdiff.records.bundle import Bundle

    fused = Bundle(bundles["fused"])
    names = {n for step in range(fused.num_steps) for n in fused.names(step)}
    assert "token_logprobs" in names and not names & {"logits", "log_softmax"}
    assert {n for n in Bundle(bundles["logits"]).names(0)} & {"logits", "log_softmax"}  # the control has them


def test_the_decoder_alone_records_every_boundary_but_the_logits(bundles) -> None:
    """The fused head's decoder-only forward is a step with the model's boundaries, equal to the normal capture's;
    so ``compare`` finds the planted weight at the same boundary through either."""
    import numpy as np

    from logdiff.records.bundle import Bundle

    fused, normal = Bundle(bundles["fused"]), Bundle(bundles["logits"])
    names = set(fused.names(0))
    assert set(normal.names(0)) - names == {"logits", "log_softmax"}
    for name in sorted(names - {"token_logprobs"}):
        for (group, a), b in zip(fused.logical(0, name).items(), normal.logical(0, name).values()):
            assert np.array_equal(a.value, b.value), name
    first = [_compare(bundles[k], bundles["infer"])["first_divergence"]["boundary"] for k in ("fused", "logits")]
    assert first[0] == first[1]


def test_token_logprobs_equal_the_normal_capture_and_give_the_same_gap(bundles) -> None:
    normal = _train_logprobs(bundles["logits"], bundles["infer"])
    fused = _train_logprobs(bundles["fused"], bundles["infer"])
    assert [len(x) for x in fused] == [len(ids) - 1 for ids in IDS]
    assert fused == normal  # the same ops on the same rows: bit for bit
    a, b = _compare(bundles["logits"], bundles["infer"]), _compare(bundles["fused"], bundles["infer"])
    assert a["logprobs"]["abs_diff_max"] > 0  # the planted weight: a gap to measure
    for key in ("abs_diff_max", "abs_diff_mean", "num_tokens"):
        assert b["logprobs"][key] == a["logprobs"][key], key
    assert b["pairs"][0]["metrics"]["argmax_flip_fraction"] is None  # no top-1 token was given


def test_response_only_layout_scores_the_response_tokens(bundles) -> None:
    normal = _train_logprobs(bundles["logits"], bundles["infer"])
    response = _train_logprobs(bundles["response"], bundles["infer"])
    assert response == [x[PROMPT - 1 :] for x in normal]
    result = _compare(bundles["response"], bundles["infer"])
    assert result["logprobs"]["num_tokens"] == sum(len(ids) - PROMPT for ids in IDS)


def test_an_off_by_one_start_without_token_ids_is_a_larger_gap_not_a_crash(bundles) -> None:
    normal = _compare(bundles["logits"], bundles["infer"])["logprobs"]["abs_diff_max"]
    shifted = _compare(bundles["shifted"], bundles["infer"])["logprobs"]["abs_diff_max"]
    assert shifted > 10 * normal


def test_misaligned_calls_are_refused(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    import logdiff

    model = _model(demo_model("qwen3"))
    ids = torch.tensor(IDS)
    with logdiff.capture(model, tmp_path / "b", "train", window="all") as cap, torch.no_grad():
        with pytest.raises(RuntimeError, match="without a recorded forward"):
            cap.token_logprobs(torch.zeros(2, 9))
        lp = _fused(model, ids)
        with pytest.raises(ValueError, match="column 0 has no prefix"):
            cap.token_logprobs(torch.zeros(2, 10))  # [batch, length]: token 0 has no logprob
        with pytest.raises(ValueError, match="do not fit"):
            cap.token_logprobs(lp, start=2)  # runs one past the step
        with pytest.raises(ValueError, match="misaligned"):
            cap.token_logprobs(lp[:, 1:], start=1, token_ids=ids[:, 2:])  # off by one, with the ids it scored
        with pytest.raises(ValueError, match=r"\[batch=2, n\]"):
            cap.token_logprobs(lp[0])
        cap.token_logprobs(lp, token_ids=ids[:, 1:])  # the right call, after the refused ones
    from logdiff.records.bundle import Bundle

    (values,) = [Bundle(tmp_path / "b").ranks[0].load(0, ["token_logprobs"])["token_logprobs"]]
    assert values.shape == (sum(len(x) - 1 for x in IDS), 1)
    assert np.array_equal(np.sort(values[:, 0]), np.sort(lp.float().numpy().reshape(-1)))
