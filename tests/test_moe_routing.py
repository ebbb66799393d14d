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
import io
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from logdiff.probes.routing import RouterLogits
from logdiff.reports.html import render_html
from logdiff.reports.schema import validate_result
from logdiff.reports.terminal import print_summary
from plants import stale_checkpoint
from rich.console import Console

import logdiff
from logdiff.comparison.result import Cause
from logdiff.diagnosis import routing
from logdiff.sources import checkpoint, pool

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
    assert layer["flipped"][0]["decision"] == "expert" and layer["group_flips"] == 0  # one group: the expert choice
    # the replay forces the inference side's experts at the flipped token only
    assert forced[0][0, 0].tolist() == [0, 2] and (forced[0][0, 1] == -1).all()


def test_a_flip_after_an_earlier_flip_of_the_same_token_says_so() -> None:
    t0, t1 = _logits([[1.0, 0.5, 0.5 - 2**-8, -1.0]], 0), _logits([[1.0, 0.5, 0.25, -1.0]], 1)
    i0, i1 = _logits([[1.0, 0.5 - 2**-8, 0.5, -1.0]], 0), _logits([[1.0, 0.25, 0.5, -1.0]], 1)
    section = routing.analyze({t1.boundary: t1, t0.boundary: t0}, {t0.boundary: i0, t1.boundary: i1}, RULE, RULE)[0]
    assert [x["layer"] for x in section["layers"]] == [0, 1]
    assert [x["flips"] for x in section["layers"]] == [1, 1]
    assert not any("earlier router" in e for e in section["layers"][0]["evidence"])
    assert any("earlier router" in e for e in section["layers"][1]["evidence"])


def test_an_exact_tie_broken_another_way_is_no_flip() -> None:
    # experts 1 and 2 tie exactly on the training side: which one it takes is its top-k's business
    t = _logits([[1.0, 0.5, 0.5, -1.0]])
    i = _logits([[1.0, 0.5 - 2**-8, 0.5, -1.0]])
    layer = routing.analyze({t.boundary: t}, {t.boundary: i}, RULE, RULE)[0]["layers"][0]
    assert (layer["flips"], layer["tied_tokens"], layer["class"]) == (0, 1, None)


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
    causes = [Cause("model.layers.1.self_attn.q_proj", 1, "linear", "linear", "framework_difference", "weights", [], "")]
    layer = routing.analyze({t.boundary: t}, {t.boundary: i}, RULE, RULE, {}, causes)[0]["layers"][0]
    assert (layer["class"], layer["kind"]) == ("framework_difference", "upstream_difference")


# --- scans ---------------------------------------------------------------------------------------


def stale_router(model: Path, tmp: Path, layer: int) -> Path:
    """MODEL's weights with one router's rows rolled by one expert: a mis-synced router on one side.

    Every token's expert set changes (no top-k subset of the experts is invariant under the roll).
    """
    return stale_checkpoint(model, tmp, f"model.layers.{layer}.mlp.gate.weight", lambda w: w.roll(1, dims=0))


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


def test_planted_router_differences_are_framework_differences_at_their_layers(qwen3_moe: Path, tmp_path: Path) -> None:
    """A one-sided ``norm_topk_prob`` (every router) and a stale router weight in layer 1, at once."""
    stale = stale_router(qwen3_moe, tmp_path, 1)
    r = logdiff.scan(qwen3_moe, infer=["hf"], infer_set={"norm_topk_prob": False}, infer_ckpt=stale, **SMALL)
    moe = r["moe"]
    assert moe["rules"]["infer"]["renormalize"] is False and moe["rules"]["train"]["renormalize"] is True
    layers = {x["layer"]: x for x in moe["layers"]}
    assert [(n, x["class"], x["kind"]) for n, x in layers.items()] == [
        (0, "framework_difference", "moe_routing"), (1, "framework_difference", "weights"),
        (2, "framework_difference", "moe_routing"), (3, "framework_difference", "moe_routing")]  # fmt: skip
    assert [n for n, x in layers.items() if any("router weight differs" in e for e in x["evidence"])] == [1]
    # the renormalisation changes the weights, never which experts win; the stale router changes them all
    assert layers[0]["flips"] == 0 and layers[0]["weight_max_abs_diff"] > 0
    assert layers[1]["flips"] == layers[1]["tokens"] > 0
    # With the renormalisation also differing downstream, forcing layer 1's experts may widen the gap or close
    # it, depending on the sampled tokens (so on the CPU): what it must do alone is below.
    assert moe["replay"]["forced_tokens"] > 0
    assert validate_result(r) == []
    # the reports: one table row per router with its cause, the replay line, one terminal line
    html = render_html(r)
    row = re.search(r'<tr><td class="mono">model\.layers\.1\.mlp\.gate</td>(.*?)</tr>', html)
    assert row and "framework_difference / weights" in row.group(1)
    assert 'id="moe-replay"' in html
    console = Console(record=True, no_color=True, width=400, file=io.StringIO())
    print_summary(r, console)
    line = next(x for x in console.export_text().splitlines() if x.startswith("moe routing: "))
    assert "framework_difference (moe_routing, weights)" in line and "routing replay" in line


def test_replaying_a_stale_routers_choice_closes_part_of_the_gap(qwen3_moe: Path, tmp_path: Path) -> None:
    """A stale router is the only difference: forcing its experts on the training path narrows the gap."""
    r = logdiff.scan(qwen3_moe, infer=["hf"], infer_ckpt=stale_router(qwen3_moe, tmp_path, 1), **SMALL)
    replay = r["moe"]["replay"]
    assert replay["forced_tokens"] > 0
    assert 0 < replay["after"]["abs_diff_mean"] < replay["before"]["abs_diff_mean"]  # weights still differ: not all
    assert replay["share"] == pytest.approx(1 - replay["after"]["abs_diff_mean"] / replay["before"]["abs_diff_mean"])


@contextlib.contextmanager
def rounding_against_the_tie(router: Any, renormalize: bool) -> Iterator[None]:
    """Plant rounding noise in a router's output: per token, the k-th logit one ulp down, the (k+1)-th one up.

    Every logit moves by at most one unit in the last place, against the tie, and the
    expert choice is recomputed from the moved logits: the same function with other
    last bits, operator path by construction. Only tokens at most two ulps from a tie flip.
    """

    def hook(_module: Any, _args: Any, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits, weights, _ = out
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        kth, nxt = order[:, router.top_k - 1 : router.top_k], order[:, router.top_k : router.top_k + 1]
        moved = logits.clone()
        moved.scatter_(1, kth, torch.nextafter(logits.gather(1, kth), torch.full_like(kth, -1e4, dtype=logits.dtype)))
        moved.scatter_(1, nxt, torch.nextafter(logits.gather(1, nxt), torch.full_like(nxt, 1e4, dtype=logits.dtype)))
        probs = torch.softmax(moved, dtype=torch.float, dim=-1)
        top, ids = torch.topk(probs, router.top_k, dim=-1)
        if renormalize:
            top = top / top.sum(-1, keepdim=True)
        return moved, top.to(weights.dtype), ids

    handle = router.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_near_tie_flips_from_rounding_noise_are_operator_path(qwen3_moe: Path) -> None:
    """Two HF engines that compute bitwise alike; rounding noise planted in the inference side's first router."""
    from logdiff.probes.arch import adapter_of

    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import engine_spec, run_paths
    from logdiff.diagnosis.preflight import preflight

    cfg = ScanConfig(model=qwen3_moe, infer=["hf"], infer_set={"batch_size": 4}, num_sequences=4, prompt_len=28,
                     response_len=4, depth="modules")  # fmt: skip
    infer = pool.acquire("hf", engine_spec("hf", checkpoint.stage(qwen3_moe), cfg, cfg.infer_set))  # what the scan acquires
    arch = adapter_of(infer.model)
    router = arch.router(arch.layers(infer.model)[0])
    with rounding_against_the_tie(router, arch.router_renormalizes_of(router)):
        run = run_paths(cfg)
    run.probes.close()
    assert run.infer_engines[0] is infer and run.train_engine is not infer
    contracts = preflight(run.train_engine, infer)
    config = run.train_engine.loaded_config().to_dict()
    section, _ = routing.moe_section(run.probes.routers, (run.train.path, run.infers[0].path), contracts, [], config, arch.router_renormalizes)
    first = section["layers"][0]
    assert first["logit_max_abs_diff"] > 0  # the plant reached the recorded logits
    if not first["flips"]:
        pytest.skip("no router-0 logits within two ulps of a tie among these tokens: the noise flips nothing here")
    assert (first["class"], first["kind"]) == ("operator_path", "near_tie_flip")
    # one ulp against the tie on each side of it swaps only experts at most two ulps apart (four across a binade)
    assert first["margin_ulps_max"] <= 4.0, first["flipped"]


@pytest.mark.vllm
def test_vllm_routers_are_recorded_and_compared_per_layer(qwen3_moe: Path, shared_scan: Callable[..., dict]) -> None:
    """Against a real vLLM: every router's logits come out of its ``gate`` on both paths, per token."""
    r = shared_scan(qwen3_moe, infer=["vllm"], **SMALL)  # test_classify.py's qwen3-moe scan
    moe = r["moe"]
    assert (moe["train"], moe["infer"]) == ("hf", "vllm")
    assert list(moe["router_flip_rate"]) == [f"model.layers.{n}.mlp.gate" for n in range(4)]
    seqs = r["sequences"]  # vLLM never feeds a sequence's last response token
    compared = sum(p + n - 1 for p, n in zip(seqs["prompt_lens"], seqs["response_lens"]))
    assert all(x["tokens"] == compared and x["logit_max_abs_diff"] < 1.0 for x in moe["layers"])
    assert moe["rules"]["train"] == moe["rules"]["infer"] == {"top_k": 2, "renormalize": True}
    flipped = [x for x in moe["layers"] if x["flips"]]
    assert all(x["class"] is not None and x["flipped"] for x in flipped)
    assert (moe["replay"] is None) == (not flipped)
    assert validate_result(r) == []
