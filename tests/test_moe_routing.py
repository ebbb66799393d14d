"""MoE routing diagnostics: expert flips per router, their cause, and routing replay.

Controls: identical paths flip nothing and name no routing cause; planted router
differences (a one-sided ``norm_topk_prob``, a stale router weight) are framework
differences at their layer; a planted one-ulp rounding difference in the router
logits flips only near-ties and is operator path. Whether stock kernels flip any
expert on this CPU is not assumed anywhere: where a flip is needed and none
occurred, the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import logdiff
from logdiff import routing
from logdiff.engines import base
from logdiff.probes import checkpoint
from logdiff.probes.routing import RouterLogits
from logdiff.reports.schema import validate_result

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}
RULE = routing.Rule(top_k=2, renormalize=True)


def _logits(rows: list[list[float]], layer: int = 0) -> RouterLogits:
    values = np.asarray(rows, np.float32)[None]
    return RouterLogits(f"model.layers.{layer}.mlp.gate", layer, values, np.ones(values.shape[:2], bool), "bfloat16")


# --- the analysis on known logits ------------------------------------------------------------------


def test_identical_logits_flip_nothing() -> None:
    t = _logits([[1.0, 0.5, 0.25, -1.0], [0.0, 2.0, 1.0, 0.5]])
    section, forced = routing.analyze({t.boundary: t}, {t.boundary: t}, RULE, RULE)
    assert section["router_flip_rate"] == {t.boundary: 0.0}
    assert section["class"] is None and section["layers"][0]["class"] is None and forced == {}
    assert section["layers"][0]["weight_max_abs_diff"] == 0.0


def test_one_ulp_near_tie_flip_is_operator_path() -> None:
    # token 0: experts 1 and 2 one bf16 ulp apart (spacing 2**-8 at 0.5), swapped on the other side
    t = _logits([[1.0, 0.5, 0.5 - 2**-8, -1.0], [0.0, 2.0, 1.0, 0.5]])
    i = _logits([[1.0, 0.5 - 2**-8, 0.5, -1.0], [0.0, 2.0, 1.0, 0.5]])
    section, forced = routing.analyze({t.boundary: t}, {t.boundary: i}, RULE, RULE)
    layer = section["layers"][0]
    assert (layer["flips"], layer["flip_rate"]) == (1, 0.5)
    assert (layer["class"], layer["kind"]) == ("operator_path", "near_tie_flip")
    assert layer["margin_ulps_max"] == 1.0
    assert layer["flipped"][0]["train_experts"] == [0, 1] and layer["flipped"][0]["infer_experts"] == [0, 2]
    # the replay forces the inference side's experts at the flipped token only
    assert forced[0][0, 0].tolist() == [0, 2] and (forced[0][0, 1] == -1).all()


def test_differing_router_setting_is_a_framework_difference_in_every_layer() -> None:
    t0, t1 = _logits([[1.0, 0.5, 0.0, -1.0]], 0), _logits([[0.0, 1.0, 0.5, 2.0]], 1)
    contracts = {"differs": ["norm_topk_prob"], "train": {"norm_topk_prob": True}, "infer": {"norm_topk_prob": False}}
    found = routing.analyze({t0.boundary: t0, t1.boundary: t1}, {t0.boundary: t0, t1.boundary: t1}, RULE,
                            routing.Rule(2, False), contracts)[0]  # fmt: skip
    assert [(x["layer"], x["class"], x["kind"]) for x in found["layers"]] == [
        (0, "framework_difference", "moe_routing"), (1, "framework_difference", "moe_routing")]  # fmt: skip
    assert all(x["flips"] == 0 and x["weight_max_abs_diff"] > 0.1 for x in found["layers"])


def test_flip_downstream_of_a_framework_difference_is_not_blamed_on_noise() -> None:
    t = _logits([[1.0, 0.5, 0.0, -1.0]], 2)
    i = _logits([[1.0, -0.5, 0.75, -1.0]], 2)
    causes = [{"boundary": "model.layers.1.self_attn.q_proj", "layer": 1, "class": "framework_difference", "kind": "weights"}]
    layer = routing.analyze({t.boundary: t}, {t.boundary: i}, RULE, RULE, {}, causes)[0]["layers"][0]
    assert (layer["class"], layer["kind"]) == ("framework_difference", "upstream_difference")


# --- scans ---------------------------------------------------------------------------------------


def stale_router(model: Path, tmp: Path, layer: int) -> Path:
    """MODEL's weights with one router's rows rolled by one expert: a mis-synced router on one side.

    Every token's expert set changes (no top-k subset of the experts is invariant under the roll).
    """
    from safetensors.torch import load_file, save_file

    sd = load_file(str(model / "model.safetensors"))
    name = f"model.layers.{layer}.mlp.gate.weight"
    sd[name] = sd[name].roll(1, dims=0).contiguous()
    out = tmp / "stale_router.safetensors"
    save_file(sd, str(out))
    return out


@pytest.fixture(scope="module")
def qwen3_moe(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3-moe")


def test_identical_paths_flip_nothing(qwen3_moe: Path) -> None:
    r = logdiff.scan(qwen3_moe, infer=["hf"], **SMALL)
    moe = r["moe"]
    assert set(moe["router_flip_rate"]) == {f"model.layers.{n}.mlp.gate" for n in range(4)}
    assert all(rate == 0.0 for rate in moe["router_flip_rate"].values())
    assert moe["class"] is None and moe["replay"] is None
    assert all(x["weight_max_abs_diff"] == 0.0 and x["logit_max_abs_diff"] == 0.0 for x in moe["layers"])
    assert validate_result(r) == []


def test_one_sided_norm_topk_prob_is_a_framework_difference(qwen3_moe: Path) -> None:
    r = logdiff.scan(qwen3_moe, infer=["hf"], infer_set={"norm_topk_prob": False}, **SMALL)
    moe = r["moe"]
    assert moe["rules"]["infer"]["renormalize"] is False and moe["rules"]["train"]["renormalize"] is True
    assert moe["class"] == "framework_difference" and moe["kinds"] == ["moe_routing"]
    assert [x["layer"] for x in moe["layers"] if x["kind"] == "moe_routing"] == [0, 1, 2, 3]
    # the renormalisation changes weights, never which experts win in the first router
    assert moe["layers"][0]["flips"] == 0 and moe["layers"][0]["weight_max_abs_diff"] > 0


def test_stale_router_weight_is_found_at_its_layer_and_replayed(qwen3_moe: Path, tmp_path: Path) -> None:
    r = logdiff.scan(qwen3_moe, infer=["hf"], infer_ckpt=stale_router(qwen3_moe, tmp_path, 1), **SMALL)
    layers = {x["layer"]: x for x in r["moe"]["layers"]}
    assert layers[0]["flips"] == 0 and layers[0]["class"] is None  # upstream of the fault: untouched
    assert layers[1]["flips"] > 0
    assert (layers[1]["class"], layers[1]["kind"]) == ("framework_difference", "weights")
    replay = r["moe"]["replay"]
    assert replay["forced_tokens"] > 0
    assert replay["after"]["abs_diff_mean"] < replay["before"]["abs_diff_mean"]
    assert validate_result(r) == []


@contextlib.contextmanager
def one_ulp_router_noise(router: Any, renormalize: bool) -> Iterator[None]:
    """Plant rounding noise in a router: its bf16 logits moved by one ulp up or down (a fixed pattern).

    The same function with a different last bit: operator path by construction.
    """
    orig = router.forward

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, weights, _ = orig(hidden_states)
        up = torch.arange(logits.numel()).reshape(logits.shape) % 3 == 0
        noisy = torch.where(up, torch.nextafter(logits, logits + 1), torch.nextafter(logits, logits - 1))
        probs = torch.softmax(noisy, dtype=torch.float, dim=-1)
        top, ids = torch.topk(probs, router.top_k, dim=-1)
        if renormalize:
            top = top / top.sum(-1, keepdim=True)
        return noisy, top.to(weights.dtype), ids

    router.forward = forward
    try:
        yield
    finally:
        del router.forward


def test_near_tie_flips_from_rounding_noise_are_operator_path(qwen3_moe: Path) -> None:
    from logdiff.probes.arch import adapter_of

    engine = base.acquire("hf-decode", base.EngineSpec(str(checkpoint.stage(qwen3_moe).path)))  # the pooled engine
    arch = adapter_of(engine.model)
    with contextlib.ExitStack() as stack:
        for layer in arch.layers(engine.model):
            router = arch.router(layer)
            stack.enter_context(one_ulp_router_noise(router, arch.router_renormalizes_of(router)))
        r = logdiff.scan(qwen3_moe, infer=["hf-decode"], **{**SMALL, "num_sequences": 4, "response_len": 16})
    flipped = [x for x in r["moe"]["layers"] if x["flips"]]
    if not flipped:
        pytest.skip("no router logits within one ulp of a tie among these tokens: the noise flips nothing here")
    assert all((x["class"], x["kind"]) == ("operator_path", "near_tie_flip") for x in flipped), flipped
    assert r["moe"]["class"] == "operator_path"
