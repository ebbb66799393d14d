"""Semantic differences the contracts cannot see: each must be a framework difference naming side and op.

Each plant makes one engine's modules ignore a contracted feature while the
contracts of both sides read the same (the config and the modules' attributes
are untouched; only what the forward computes changes): a soft cap dropped, a
sliding window ignored, a configured attention scale or a norm's eps ignored. (The attention soft cap
exists in Gemma 2 alone: transformers' Gemma 3 never applies it, which its effective contract says; the
second soft-cap plant drops Gemma 3's final logit cap.)
Every plant runs on two architectures, on the training path (HF forward)
against an unplanted HF KV-cache decode, so the cause must name ``hf``; one
runs the other way round and must name ``hf-decode``. The controls: the same
models unplanted give no framework difference, and each plant is checked to
change the planted side's logprobs at all (else the test proves nothing).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import logdiff
from logdiff.commands.config import ScanConfig
from logdiff.commands.scan import engine_spec
from logdiff.sources import checkpoint, pool
from plants import assert_closes

SMALL = {"num_sequences": 2, "prompt_len": 12, "response_len": 12, "depth": "modules", "attribute": False}
EAGER = {"attn_implementation": "eager"}  # HF's eager attention applies soft caps (sdpa drops them)


def configured(model: Path, root: Path, **changes: Any) -> Path:
    """A copy of MODEL whose config.json has ``changes`` (the weights are linked, not copied)."""
    out = root / "-".join(f"{k}={v}" for k, v in changes.items())
    if not out.exists():
        out.mkdir(parents=True)
        for f in model.iterdir():
            (out / f.name).symlink_to(f) if f.name != "config.json" else None
        config = json.loads((model / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def engine(model: Path, name: str, settings: dict[str, Any]) -> Any:
    """The pooled engine a scan of MODEL acquires for ``name`` with ``settings`` (so a plant reaches it)."""
    cfg = ScanConfig(model=model, infer=["hf-decode"])
    return pool.acquire(name, engine_spec(name, checkpoint.stage(model), cfg, dict(settings)))


@contextlib.contextmanager
def during_forward(modules: list[Any], **values: Any) -> Iterator[None]:
    """Each module's forward runs with ``values`` set on it (restored after each call): it ignores its own."""
    for m in modules:
        original = m.forward

        def forward(*a: Any, _m: Any = m, _f: Any = original, **kw: Any) -> Any:
            saved = {k: getattr(_m, k) for k in values}
            for k, v in values.items():
                setattr(_m, k, v)
            try:
                return _f(*a, **kw)
            finally:
                for k, v in saved.items():
                    setattr(_m, k, v)

        m.forward = forward
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def attentions(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def norms(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def drop_softcap(model: Any) -> Any:
    return during_forward(attentions(model), attn_logit_softcapping=None)


def default_scale(model: Any) -> Any:
    mods = attentions(model)
    return during_forward(mods, scaling=mods[0].head_dim**-0.5)


def ignore_window(model: Any) -> Any:
    """The model builds its masks as if no window were configured (its attention modules and config keep theirs)."""
    import copy

    unwindowed = copy.copy(model.config)
    unwindowed.sliding_window = 1 << 20
    return during_forward([model.model], config=unwindowed)


def drop_final_softcap(model: Any) -> Any:
    """The causal-LM head skips the final logit soft cap its config names."""
    import copy

    uncapped = copy.copy(model.config)
    uncapped.final_logit_softcapping = None
    return during_forward([model], config=uncapped)


def ignore_eps(model: Any) -> Any:
    return during_forward(norms(model), variance_epsilon=1e-6)


# (arch, config changes, both sides' settings, plant, the op it must name)
PLANTS = [
    ("gemma2", {"attn_logit_softcapping": 5.0}, EAGER, drop_softcap, "model.layers.0.self_attn.attn_core"),
    ("gemma3", {"final_logit_softcapping": 5.0}, {}, drop_final_softcap, "logits"),
    ("gemma3", {}, {}, ignore_window, "model.layers.0.self_attn.attn_core"),  # the demo's window is 8
    ("mistral", {"sliding_window": 8}, {}, ignore_window, "model.layers.0.self_attn.attn_core"),
    ("gemma2", {"query_pre_attn_scalar": 256}, EAGER, default_scale, "model.layers.0.self_attn.attn_core"),
    ("gemma3", {"query_pre_attn_scalar": 256}, {}, default_scale, "model.layers.0.self_attn.attn_core"),
    ("qwen3", {"rms_norm_eps": 0.5}, {}, ignore_eps, "model.layers.0.input_layernorm"),
    ("llama", {"rms_norm_eps": 0.5}, {}, ignore_eps, "model.layers.0.input_layernorm"),
]


def _id(p: tuple) -> str:
    return f"{p[0]}-{p[3].__name__}"


@pytest.fixture(scope="module")
def models(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("semantic")
    return lambda arch, **changes: configured(demo_model(arch), root / arch, **changes) if changes else demo_model(arch)


@pytest.mark.parametrize(("arch", "changes", "settings", "plant", "boundary"), PLANTS, ids=[_id(p) for p in PLANTS])
def test_a_feature_one_side_ignores_is_a_semantic_framework_difference(
    models: Callable[..., Path], arch: str, changes: dict, settings: dict, plant: Callable, boundary: str
) -> None:
    model = models(arch, **changes)
    sides = {"train_set": settings, "infer_set": settings}
    control = logdiff.scan(model, infer=["hf-decode"], **sides, **SMALL)
    assert not [c for c in control["causes"] if c["class"] == "framework_difference"], control["causes"]
    with plant(engine(model, "hf", settings).model):
        r = logdiff.scan(model, infer=["hf-decode"], **sides, **SMALL)
    assert r["logprobs"]["abs_diff_max"] > control["logprobs"]["abs_diff_max"], "the plant changed nothing"
    assert r["contracts"]["differs"] == [] and not r["contracts"]["weights"]["differs"]  # the contracts read equal
    cause = next((c for c in r["causes"] if c["boundary"] == boundary), None)
    assert cause is not None, [(c["boundary"], c["class"], c["kind"]) for c in r["causes"]]
    assert (cause["class"], cause["kind"], cause["paths"]) == ("framework_difference", "semantic", ["hf"])
    train, infer = cause["conformance"]["train"], cause["conformance"]["infer"]
    assert train["error"] > train["bound"] and infer["error"] <= infer["bound"], cause["conformance"]
    assert r["verdict"] in ("framework_difference", "mixed")
    assert_closes(control)  # the plants act before the logits: within what the ops up to them explain
    assert_closes(r)


def test_the_cause_names_the_inference_side_when_it_is_the_one_that_ignores(models: Callable[..., Path]) -> None:
    model = models("qwen3", rms_norm_eps=0.5)
    with ignore_eps(engine(model, "hf-decode", {}).model):
        r = logdiff.scan(model, infer=["hf-decode"], **SMALL)
    cause = next(c for c in r["causes"] if c["boundary"] == "model.layers.0.input_layernorm")
    assert (cause["class"], cause["kind"], cause["paths"]) == ("framework_difference", "semantic", ["hf-decode"])
    assert cause["conformance"]["infer"]["error"] > cause["conformance"]["infer"]["bound"]
    assert cause["conformance"]["train"]["error"] <= cause["conformance"]["train"]["bound"]
    assert_closes(r)


def test_hf_sdpa_dropping_the_soft_cap_is_read_from_the_effective_contract(models: Callable[..., Path]) -> None:
    """The stock option: HF's sdpa swallows the soft cap it is passed; the contract says so, naming why."""
    model = models("gemma2", attn_logit_softcapping=5.0)
    r = logdiff.scan(model, infer=["hf-decode"], train_set={"attn_implementation": "sdpa"}, infer_set=EAGER, **SMALL)
    assert r["contracts"]["train"]["attn_logit_softcapping"] == "off"  # off: a value (probes.contracts.OFF)
    assert "sdpa" in r["contracts"]["train"]["dropped"]["attn_logit_softcapping"]
    assert "attn_logit_softcapping" in r["contracts"]["differs"]
    cause = next(c for c in r["causes"] if c["boundary"] == "model.layers.0.self_attn.attn_core")
    assert (cause["class"], cause["kind"], cause["paths"]) == ("framework_difference", "semantic", ["hf"])
    # conformance against each side's *effective* function: both within (the cap is absent, not misapplied)
    assert all(cause["conformance"][s]["error"] <= cause["conformance"][s]["bound"] for s in ("train", "infer"))
