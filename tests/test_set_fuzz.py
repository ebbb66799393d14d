"""Every ``--set`` value is validated or refused in one line (issue 33, item 4).

The fuzz: for every demo architecture and every key of its config, the pre-load
check the CLI runs (``overrides.check_before_load``) gets the current value (the
negative control: it must pass), a wrong-typed value, non-finite numbers (for a
number or None) and nested values (dicts, lists, the current structure with a wrong leaf or an
unknown key). The only allowed outcomes are success or a one-line ``InputError``
(exit 2). No engine loads in the fuzz: the models are config plus uninitialised
weights of the right shapes (the check reads shapes only).

Around it: the recursive checker's rules one by one (``logdiff.commands.override_types``),
the structured read-back after loading (``check_applied``), and the issue's case
end to end, a structured ``rope_parameters`` on the Llama 3 demo through a real
HF load and the CLI.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, TypedDict

import pytest
from typer.testing import CliRunner

from logdiff.cli import app
from logdiff.commands.config import parse_value
from logdiff.commands.override_types import NO_ANNOTATION, Mismatch, conform
from logdiff.errors import InputError

#: keys whose current value is refused, and why (everything else must accept its own value)
REFUSED_AS_IS = {"model_type": "a constant of the config class"}
NESTED = ({"a": [1, {"b": None}]}, [[1, 2], {"c": "d"}], [], {})
NON_FINITE = (float("nan"), float("inf"))


def _wrong_type(current: Any) -> Any:
    if isinstance(current, bool):
        return "maybe"
    if isinstance(current, (int, float)):
        return "not-a-number"
    if isinstance(current, str):
        return 12345
    if isinstance(current, (list, dict)):
        return "abc"
    return True  # None: whatever the annotation, a bool is rarely it


def _structural(current: Any) -> list[Any]:
    """The current structure with one wrong leaf, and with one unknown key (or item)."""
    out: list[Any] = []
    if isinstance(current, dict) and current:
        first = next(iter(current))
        out += [{**current, first: {"x": [1]}}, {**current, "no_such_key": 1.5}]
        inner = current[first]
        if isinstance(inner, dict) and inner:  # one level down (Gemma 3's per-layer RoPE)
            out.append({**current, first: {**inner, next(iter(inner)): [None]}})
    if isinstance(current, list) and current:
        out += [[*current, {"x": 1}], [_wrong_type(current[0])] * len(current)]
    return out


def _fuzz_values(current: Any) -> list[Any]:
    numeric = current is None or (isinstance(current, (int, float)) and not isinstance(current, bool))
    return [_wrong_type(current), *(NON_FINITE if numeric else ()), *NESTED, *_structural(current)]


@pytest.fixture(scope="module")
def staged_demos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every demo architecture as a staged model: its config and uninitialised weights of the right shapes."""
    import torch
    from logdiff.probes.arch import demos
    from transformers import AutoModelForCausalLM

    from logdiff.demo.configs import tiny_config
    from logdiff.sources import checkpoint

    out = {}
    for name in demos():
        path = tmp_path_factory.mktemp(name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config(name, 128, pad_token_id=0))
        model = model.to_empty(device="cpu")
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(path)
        out[name] = checkpoint.stage(path)
    return out


def _check(staged: Any, key: str, value: Any) -> str | None:
    """None when ``--set infer.KEY=VALUE`` passes the pre-load check, else its one error line."""
    from logdiff.commands.overrides import check_before_load

    try:
        check_before_load(staged, "infer", {key: value})
    except InputError as e:
        line = str(e)
        assert "\n" not in line and line.startswith(f"--set infer.{key}"), line
        return line
    return None


def test_every_key_of_every_demo_validated_or_refused_in_one_line(staged_demos: dict[str, Any]) -> None:
    from transformers import AutoConfig

    outcomes = {"passed": 0, "refused": 0}
    for name, staged in staged_demos.items():
        config = AutoConfig.from_pretrained(str(staged.path))
        for key, current in config.to_dict().items():
            as_given = parse_value(json.dumps(current, default=str))  # what the CLI hands over
            error = _check(staged, key, as_given)
            if key in REFUSED_AS_IS:
                assert error is not None, (name, key)
            else:  # negative control: a config's own value is always valid
                assert error is None, (name, key, error)
            for value in _fuzz_values(current):
                # anything else (a TypeError, a KeyError from a config class) fails here
                outcomes["passed" if _check(staged, key, value) is None else "refused"] += 1
    assert outcomes["refused"] > outcomes["passed"], outcomes


@pytest.mark.parametrize("value,fragment", [
    ({"rope_type": "default", "rope_theta": "x"}, "rope_parameters.rope_theta must be float | None in LlamaConfig"),
    ({"rope_type": "default", "foo": 1}, "rope_parameters has no key 'foo' (RopeParameters keys:"),
    ({"rope_type": "bogus", "rope_theta": 1e4}, "unknown rope_type 'bogus'"),
    ({"rope_type": "default", "rope_theta": float("inf")}, "rope_parameters.rope_theta must be a finite number"),
    ([1, 2], "rope_parameters must be RopeParameters | None in LlamaConfig"),
    ({"rope_type": "llama3", "rope_theta": 5e5}, "the model cannot be built with this config"),  # needs factor
])  # fmt: skip
def test_structured_rope_refusals_name_the_place(staged_demos: dict[str, Any], value: Any, fragment: str) -> None:
    error = _check(staged_demos["llama3"], "rope_parameters", value)
    assert error is not None and fragment in error, error


def test_structured_rope_parameters_pass_as_a_structure(staged_demos: dict[str, Any]) -> None:
    from logdiff.commands.overrides import check_before_load

    overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000}}
    check_before_load(staged_demos["llama3"], "infer", overrides)
    assert overrides == {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert isinstance(overrides["rope_parameters"]["rope_theta"], float)  # int -> float, as at the top level
    # Gemma 3 keeps one RoPE per layer type: that form is the one checked there
    per_layer = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8}}  # fmt: skip
    check_before_load(staged_demos["gemma3"], "infer", {"rope_parameters": per_layer})
    error = _check(staged_demos["gemma3"], "rope_parameters", {"rope_type": "default", "rope_theta": 1e4})
    assert error is not None and "rope_parameters.rope_type must be a dict (JSON object) of RopeParameters" in error
    error = _check(staged_demos["gemma3"], "full_attention", {"rope_type": "default", "rope_theta": "high"})
    assert error is not None and "full_attention.rope_theta must be float | None" in error, error


# --- the recursive checker, rule by rule (each with a value it accepts) --------------------------


class _Rope(TypedDict):
    rope_type: str | None
    factor: float | None
    needed: int


def test_conform_rules() -> None:
    assert conform(_Rope, {"needed": 1, "factor": 2}) == {"needed": 1, "factor": 2.0}
    with pytest.raises(Mismatch, match="needs key 'needed'"):
        conform(_Rope, {"factor": 2.0})  # a key whose hint admits None may be omitted; this one may not
    with pytest.raises(Mismatch, match="has no key 'other'"):
        conform(_Rope, {"needed": 1, "other": 1})
    assert conform(int | None, None) is None and conform(Optional[float], 3) == 3.0
    with pytest.raises(Mismatch, match="must be int"):
        conform(int, True)  # a bool is never an int
    assert conform(Literal["a", "b"], "b") == "b"
    with pytest.raises(Mismatch, match="one of 'a', 'b'"):
        conform(Literal["a", "b"], "c")
    assert conform(list[str], ["x", "y"]) == ["x", "y"]
    with pytest.raises(Mismatch) as e:
        conform(list[str], ["x", 2])
    assert e.value.where("layer_types") == "layer_types[1]"
    assert conform(dict[int, str] | dict[str, str] | None, {"0": "a"}) == {0: "a"}  # JSON keys are strings
    with pytest.raises(Mismatch, match="constant"):
        conform(ClassVar[str], "llama")
    # no annotation: the current value's shape, recursively; a key it lacks takes any value
    current = {"a": 1.0, "b": {"c": "s"}}
    assert conform(NO_ANNOTATION, {"a": 2, "b": {"c": "t"}, "new": [1]}, current) == {"a": 2.0, "b": {"c": "t"},
                                                                                   "new": [1]}  # fmt: skip
    with pytest.raises(Mismatch) as e:
        conform(NO_ANNOTATION, {"b": {"c": 3}}, current)
    assert e.value.where("k") == "k.b.c" and e.value.problem == "must be str"
    assert conform(NO_ANNOTATION, "anything", None) == "anything"  # current None: no rule
    with pytest.raises(Mismatch, match="finite"):
        conform(NO_ANNOTATION, {"x": [float("nan")]}, None)


def test_nested_config_checked_against_its_class() -> None:
    from transformers import LlamaConfig

    sub = LlamaConfig(hidden_size=64, num_attention_heads=4)
    merged = conform(LlamaConfig, {"rms_norm_eps": 1}, sub)
    assert merged["rms_norm_eps"] == 1.0 and merged["hidden_size"] == 64  # merged onto the current sub-config
    with pytest.raises(Mismatch) as e:
        conform(typing.Union[dict, LlamaConfig, None], {"rms_norm_eps": "x"}, sub)
    assert e.value.where("text_config") == "text_config.rms_norm_eps"
    with pytest.raises(Mismatch, match="has no key 'nope'"):
        conform(LlamaConfig, {"nope": 1}, sub)


# --- read-back after loading: structures compared item by item ----------------------------------


class _Loaded:
    name, options = "fake", frozenset()

    def __init__(self, **config: Any):
        self.config = type("Config", (), config)()

    def effective_options(self) -> dict:
        return {}

    def contract(self) -> dict:
        return {}

    def loaded_config(self) -> Any:
        return self.config


def test_read_back_compares_structures() -> None:
    from logdiff.commands.overrides import check_applied

    want = {"rope_type": "default", "rope_theta": 500000.0, "factor": None}
    engine = _Loaded(rope_parameters={"rope_type": "default", "rope_theta": 500000, "partial_rotary_factor": 1.0},
                     layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    check_applied(engine, "infer", {"rope_parameters": want, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(InputError, match="infer.rope_parameters=.* did not take effect on fake"):
        check_applied(engine, "infer", {"rope_parameters": {**want, "rope_theta": 1e4}})
    with pytest.raises(InputError, match="infer.layer_types=.* did not take effect"):
        check_applied(engine, "infer", {"layer_types": ["full_attention"]})


def test_an_input_of_a_derived_key_must_change_it() -> None:
    """Qwen2's ``layer_types`` is derived from ``max_window_layers`` when the config is built; an override is set
    on the built config, so ``max_window_layers`` alone leaves every layer as it was: it did not take effect."""
    from transformers import Qwen2Config

    from logdiff.commands.overrides import check_applied

    engine = _Loaded()
    engine.config = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=4)
    assert engine.config.layer_types == ["full_attention"] * 4  # the config: a window on no layer
    engine.config.max_window_layers = 0  # as the loaders apply --set infer.max_window_layers=0
    with pytest.raises(InputError, match=r"infer.max_window_layers=0 did not take effect on fake: transformers "
                                         r"derives layer_types .* set infer.layer_types=\[\"sliding_attention\""):
        check_applied(engine, "infer", {"max_window_layers": 0})
    engine.config.layer_types = ["sliding_attention"] * 4  # the control: the derived key given as well
    check_applied(engine, "infer", {"max_window_layers": 0, "layer_types": ["sliding_attention"] * 4})
    engine.config.max_window_layers = 4  # and an input set to what the derived key already follows
    engine.config.layer_types = ["full_attention"] * 4
    check_applied(engine, "infer", {"max_window_layers": 4})


def test_structured_overrides_key_the_engine_pool() -> None:
    from logdiff.sources.base import EngineSpec

    a = EngineSpec("m", overrides=(("rope_parameters", {"rope_type": "default", "rope_theta": 1.0}),))
    b = EngineSpec("m", overrides=(("rope_parameters", {"rope_theta": 1.0, "rope_type": "default"}),))
    c = EngineSpec("m", overrides=(("rope_parameters", {"rope_type": "default", "rope_theta": 2.0}),))
    assert {a: 1}[b] == 1 and a != c


# --- the case, end to end ------------------------------------------------------------------

ROPE = '{"rope_type":"default","rope_theta":500000.0}'


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from logdiff.demo.untrained import build_random_model

    return build_random_model(tmp_path_factory.mktemp("llama3-random"), "llama3", vocab_size=512)


def test_structured_rope_reaches_a_real_hf_load(llama3_model: Path) -> None:
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.hf.loading import load_model

    value = parse_value(ROPE)
    model = load_model(EngineSpec(str(llama3_model), "float32", overrides=(("rope_parameters", value),)))
    assert model.config.rope_parameters["rope_type"] == "default"
    assert model.config.rope_parameters["rope_theta"] == 500000.0
    assert model.model.rotary_emb.rope_type == "default"  # the llama3 scaling is gone, as asked
    assert value == json.loads(ROPE)  # the --set value itself is untouched by the load


def test_cli_structured_rope_exit_0_and_a_wrong_one_exit_2(llama3_model: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    fast = ["--infer", "hf", "--depth", "logprobs", "--num-sequences", "1", "--prompt-len", "4",
            "--response-len", "4"]  # fmt: skip
    res = runner.invoke(app, ["scan", str(llama3_model), *fast, "--set", f"infer.rope_parameters={ROPE}",
                              "--json", str(tmp_path / "r.json")])  # fmt: skip
    assert res.exit_code == 0, res.output
    overrides = json.loads((tmp_path / "r.json").read_text())["settings"]["overrides"]["infer"]
    assert overrides == {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    res = runner.invoke(app, ["scan", str(llama3_model), *fast, "--set",
                              'infer.rope_parameters={"rope_type":"default","rope_theta":[1]}'])  # fmt: skip
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert res.exit_code == 2 and lines[-1].startswith("logdiff: error: --set infer.rope_parameters="), res.output
    assert "rope_parameters.rope_theta must be float | None" in lines[-1] and "internal error" not in res.output


# --- a sample of the fuzz's structured values through a whole scan at the default depth ------------------------

#: one value of each structured kind the fuzz sends, on a demo whose config has that key: a dict (Llama 3's
#: ``rope_parameters`` without its llama3 scaling: the issue's case, once ``internal error: unhashable type``)
#: and a list (Qwen2's ``layer_types``, every layer sliding where the config's window acted on none). Each must
#: pass every stage (engine pool, read-back, conformance, the reference and attribution rescans, the report)
#: and be named as its cause: the RoPE difference at RoPE, the window at the attention core.
DEFAULT_DEPTH_SAMPLE = [
    ("llama3_model", "rope_parameters", json.loads(ROPE), "rope", ["rope_type"]),
    ("qwen2_window_layers", "layer_types", ["sliding_attention"] * 4, "attn", ["sliding_window", "layer_types"]),
]


@pytest.mark.parametrize(("fixture", "key", "value", "op_kind", "differs"), DEFAULT_DEPTH_SAMPLE,
                         ids=[s[1] for s in DEFAULT_DEPTH_SAMPLE])  # fmt: skip
def test_structured_override_gives_a_full_diagnosis_at_the_default_depth(
    request: pytest.FixtureRequest, tmp_path: Path, fixture: str, key: str, value: Any, op_kind: str,
    differs: list[str],
) -> None:
    model = request.getfixturevalue(fixture)
    args = ["scan", str(model), "--infer", "hf", "--num-sequences", "2", "--prompt-len", "8", "--response-len", "8",
            "--set", f"infer.{key}={json.dumps(value)}", "--json", str(tmp_path / "r.json")]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output  # the case ended in exit 101 (internal error) here
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["settings"]["depth"] == "modules" and r["settings"]["overrides"]["infer"] == {key: value}
    causes = [c for c in r["causes"] if c["op_kind"] == op_kind and c["class"] == "framework_difference"]
    assert causes, [(c["boundary"], c["class"], c["kind"]) for c in r["causes"]]
    assert all(c["differs"] == differs for c in causes), [c["differs"] for c in causes]
    assert causes[0]["conformance"]["under_other_contract"], causes[0]["evidence"]  # judged under both contracts
    # attribution drops the structured override as one lever, and it closes the gap
    [lever] = r["attribution"]["levers"]
    assert lever["lever"] == f"config:{key}" and lever["share"] == pytest.approx(1.0)
