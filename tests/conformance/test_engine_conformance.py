"""Every registered engine, on every device it can run on, against the conformance checks (``checks.py``).

Parametrised over the engine registry (``engine_names()``) and the ``fake``
engine of ``fake/`` (a third engine added without touching any architecture
adapter), on the CPU and, marked ``gpu``, on CUDA. Each capability's check runs
for the engines that declare it; every engine's undeclared capabilities must
refuse in one line. An engine that cannot load here (vllm-ascend without
``torch_npu``, CUDA without a GPU) is skipped with its one-line reason, which a
test of its own checks.

The suite is proven by the fake engine twice over: it passes every check (a
correct engine is called conformant), and three broken variants of it fail the
check they break (a shifted row map, scores of the wrong token, an undeclared
capability that does not refuse).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import checks
import numpy as np
import pytest
import torch
from fake import FakeEngine, registered_fake
from fake.probes import FakeProbes

from logdiff.records.sequences import Sequence
from logdiff.sources.base import EngineSpec, EngineUnavailable
from logdiff.sources.pool import engine_pool
from logdiff.sources.registry import engine_names, get_engine

#: settings that keep vLLM small on 2 cores
VLLM_OPTIONS = (("max_num_seqs", 4), ("max_model_len", 128), ("max_num_batched_tokens", 128))
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device here (torch sees none)")])]


def _classes() -> dict[str, type]:
    return {**{name: get_engine(name) for name in engine_names()}, FakeEngine.name: FakeEngine}


def engines_with(capability: str | None) -> list[Any]:
    """pytest params (engine name, device) of every engine declaring ``capability`` (None: every engine)."""
    out = []
    for name, cls in _classes().items():
        if capability is not None and capability not in cls.capabilities:
            continue
        marks = [pytest.mark.vllm] if "vllm" in name else []
        for device in DEVICES:
            if name == FakeEngine.name and device.values[0] != "cpu":
                continue
            out.append(pytest.param(name, device.values[0], id=f"{name}-{device.id}",
                                    marks=[*marks, *device.marks]))
    return out


def _sequences(vocab: int) -> list[Sequence]:
    rng = np.random.default_rng(7)
    return [Sequence(prompt_ids=rng.integers(5, vocab, p).tolist(), response_ids=rng.integers(5, vocab, r).tolist())
            for p, r in ((9, 6), (5, 8), (13, 4))]


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    with engine_pool() as scoped, registered_fake():
        yield scoped


@pytest.fixture(scope="module")
def load(pool: Any) -> Callable[[str, str, Path], Any]:
    def get(name: str, device: str, model: Path) -> Any:
        cls = get_engine(name)
        try:
            cls.check_available()
        except EngineUnavailable as e:
            pytest.skip(f"{name} cannot run here: {e}")
        options = VLLM_OPTIONS if "vllm" in name else ()
        return pool.acquire(name, EngineSpec(model_dir=str(model), options=options, device=device))

    return get


@pytest.fixture(scope="module")
def seqs(qwen3: Path) -> list[Sequence]:
    return _sequences(json.loads((qwen3 / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def reference(load: Callable[[str, str, Path], Any], qwen3: Path, seqs: list[Sequence]) -> checks.Reference:
    hf = load("hf", "cpu", qwen3)
    sink, _, scores = checks.record(hf, seqs)
    return checks.Reference(scores[0].logprobs, hf.contract(), hf.fingerprints(), sink.rows["model.embed_tokens"])


@pytest.mark.parametrize(("name", "device"), engines_with(None))
def test_scores(load: Any, qwen3: Path, seqs: list[Sequence], reference: checks.Reference, name: str,
                device: str) -> None:
    checks.check_scores(load(name, device, qwen3), seqs, reference)


@pytest.mark.parametrize(("name", "device"), engines_with(None))
def test_undeclared_capabilities_refuse_in_one_line(load: Any, qwen3: Path, seqs: list[Sequence], name: str,
                                                    device: str) -> None:
    checks.check_refusals(load(name, device, qwen3), seqs)


@pytest.mark.parametrize(("name", "device"), engines_with("contract"))
def test_contract(load: Any, qwen3: Path, reference: checks.Reference, name: str, device: str) -> None:
    checks.check_contract(load(name, device, qwen3), reference)


@pytest.mark.parametrize(("name", "device"), engines_with("capture"))
def test_capture(load: Any, qwen3: Path, seqs: list[Sequence], reference: checks.Reference, name: str,
                 device: str) -> None:
    checks.check_capture(load(name, device, qwen3), seqs, reference)


@pytest.mark.parametrize(("name", "device"), engines_with("full_logprobs"))
def test_full_logprobs(load: Any, qwen3: Path, seqs: list[Sequence], name: str, device: str) -> None:
    checks.check_full_logprobs(load(name, device, qwen3), seqs)


@pytest.mark.parametrize(("name", "device"), engines_with("sample"))
def test_sample(load: Any, qwen3: Path, seqs: list[Sequence], name: str, device: str) -> None:
    engine = load(name, device, qwen3)
    checks.check_sample(engine, [s.prompt_ids for s in seqs], 5, int(engine.contract()["vocab_size"]))


@pytest.mark.parametrize(("name", "device"), engines_with("consistent"))
def test_consistent(load: Any, qwen3: Path, seqs: list[Sequence], name: str, device: str) -> None:
    checks.check_consistent(load(name, device, qwen3), seqs)


@pytest.mark.parametrize(("name", "device"), engines_with("forced_routing"))
def test_forced_routing(load: Any, demo_model: Callable[[str], Path], name: str, device: str) -> None:
    moe = demo_model("qwen3-moe")
    config = json.loads((moe / "config.json").read_text())
    engine = load(name, device, moe)
    layers = [n for n in range(config["num_hidden_layers"]) if n not in (config.get("mlp_only_layers") or [])]
    experts = config.get("num_experts") or config["num_local_experts"]
    top_k = config["num_experts_per_tok"]
    checks.check_forced_routing(engine, _sequences(config["vocab_size"]), layers, experts, top_k)


@pytest.mark.parametrize("name", sorted(_classes()))
def test_an_engine_that_cannot_run_here_says_why_in_one_line(name: str) -> None:
    try:
        _classes()[name].check_available()
    except EngineUnavailable as e:
        assert str(e) and "\n" not in str(e)


# ---- the suite itself: broken engines fail the check they break ------------------------------------------


class _ShiftedRows(FakeProbes):
    def rows(self, rec: Any, p: Any, args: tuple, kwargs: dict) -> Any:
        return super().rows(rec, p, args, {**kwargs, "positions": kwargs["positions"] + 1})


class ShiftedRowsFake(FakeEngine):
    """Its probes place every row one position late."""

    def probes(self) -> Any:
        return _ShiftedRows(self)


class WrongTokenFake(FakeEngine):
    """Reports the logprob of the token after the one it was asked for."""

    def score(self, seqs: list[Any]) -> list[Any]:
        shifted = [Sequence(prompt_ids=s.prompt_ids, response_ids=s.response_ids[1:] + s.response_ids[:1])
                   for s in seqs]
        return super().score(shifted)


class SilentFake(FakeEngine):
    """Accepts consistent mode without declaring it: a scan would believe kernels were swapped."""

    def consistent(self, only: Any = None, fixed_order_rows: bool = False) -> Any:
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize(("broken", "check"), [
    (ShiftedRowsFake, lambda e, seqs, ref: checks.check_capture(e, seqs, ref)),
    (WrongTokenFake, lambda e, seqs, ref: checks.check_scores(e, seqs, ref)),
    (SilentFake, lambda e, seqs, ref: checks.check_refusals(e, seqs)),
], ids=["shifted-rows", "wrong-token", "silent-capability"])
def test_a_broken_engine_fails_the_check_it_breaks(qwen3: Path, seqs: list[Sequence], reference: checks.Reference,
                                                   broken: type, check: Any) -> None:
    engine = broken(EngineSpec(model_dir=str(qwen3)))
    with pytest.raises(AssertionError):
        check(engine, seqs, reference)


def test_a_scan_localizes_and_classifies_against_an_engine_no_adapter_knows(pool: Any, qwen3: Path,
                                                                             seqs: list[Sequence],
                                                                             tmp_path: Path) -> None:
    """``scan --infer fake --depth modules`` with a planted eps on the fake's side: the fake's taps (in its own
    folder) align every boundary, and the scan localizes the plant where it enters and classifies it, with the
    fake's own op measured against its exact function."""
    from logdiff.probes.correspondence import build

    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import scan

    rows = tmp_path / "seqs.jsonl"
    rows.write_text("".join(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids}) + "\n"
                            for s in seqs))
    result = scan(ScanConfig(model=qwen3, infer=["fake"], depth="modules", sequences=rows,
                             response_len=max(len(s.response_ids) for s in seqs),
                             infer_set={"rms_norm_eps": 1e-3})).to_dict()
    assert not [w for w in result["warnings"] if "probe failed" in w or "could not align" in w]
    (pair,) = result["pairs"]
    compared = {b["boundary"] for b in pair["boundaries"]}
    config = json.loads((qwen3 / "config.json").read_text())
    assert set(build(config["architectures"][0], config).order) <= compared  # nothing unaligned
    first = result["first_divergence"]
    assert first["boundary"] == "model.layers.0.input_layernorm" and first["inputs_equal"] is True
    cause = next(c for c in result["causes"] if c["boundary"] == first["boundary"])
    assert (cause["class"], cause["kind"], cause["differs"]) == ("framework_difference", "config_contract",
                                                                 ["rms_norm_eps"])
    assert "function" in cause["conformance"]["infer"]  # the fake's norm, against the exact rms_norm it names


@pytest.mark.parametrize(("settings", "said"), [({"consistent": True}, "--consistent"),
                                                ({"depth": "modules", "infer": ["hf"], "train": "fake"}, None)])
def test_a_scan_asks_engines_for_capabilities_before_loading(pool: Any, qwen3: Path, settings: dict,
                                                            said: str | None) -> None:
    """What an engine does not declare is refused when the scan is configured, in one line naming it; what it
    declares is accepted (the fake as the training path at module depth)."""
    from logdiff.commands.config import ScanConfig
    from logdiff.errors import InputError

    config = {"infer": ["fake"], **settings}
    if said is None:
        ScanConfig(model=qwen3, **config)
        return
    with pytest.raises(InputError, match=f"{said}: engine fake has no such capability") as refused:
        ScanConfig(model=qwen3, **config)
    assert "\n" not in str(refused.value)
