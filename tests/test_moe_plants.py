"""MoE blocks judged against their exact function in real scans of HF against the CPU vLLM.

Each plant changes one side's MoE function (a stale layer of experts, another
scaling factor, another scoring function) and must come out a framework
difference naming the op; the stale experts must also put the inference side
outside its bound of the exact function while the training side stays within.
The negative control is the stock scan of every demo architecture
(test_architectures.py, test_classify.py): no framework difference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import logdiff
from plants import assert_closes, stale_checkpoint

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}

pytestmark = pytest.mark.vllm


def _blamed(r: dict[str, Any], boundary: str) -> dict[str, Any]:
    found = [c for c in r["causes"] if c["boundary"] == boundary and c["class"] == "framework_difference"]
    assert found, [(c["boundary"], c["class"], c["kind"]) for c in r["causes"]]
    return found[0]


def test_stale_experts_put_the_inference_side_outside_its_bound(
    demo_model: Callable[[str], Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    model = demo_model("qwen3-moe")
    sd = load_file(str(model / "model.safetensors"))
    stale = [n for n in sd if n.startswith("model.layers.1.mlp.experts.") and n.endswith("gate_proj.weight")]
    assert stale
    for n in stale:  # every expert of layer 1 stale: whichever experts the kept tokens chose
        sd[n] = (sd[n].float() * 1.25).to(sd[n].dtype)
    path = tmp_path / "stale.safetensors"
    save_file(sd, str(path))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=path, **SMALL)
    c = _blamed(r, "model.layers.1.mlp")
    assert c["kind"] == "weights" and c["differs"] == ["model.layers.1.mlp.experts.gate_up_proj"]
    conf = c["conformance"]
    assert conf["infer"]["error"] > conf["infer"]["bound"], conf
    assert conf["train"]["error"] <= conf["train"]["bound"], conf
    assert conf["train"]["function"].startswith("moe(")
    assert_closes(r)


def test_a_one_sided_scaling_factor_is_a_routing_difference_each_side_within_its_own(
    demo_model: Callable[[str], Path],
) -> None:
    r = logdiff.scan(demo_model("glm4-moe"), infer=["vllm"], infer_set={"routed_scaling_factor": 2.0}, **SMALL)
    assert "routed_scaling_factor" in r["contracts"]["differs"]
    moe = [c for c in r["causes"] if c["op_kind"] == "moe" and c["class"] == "framework_difference"]
    assert moe and all(c["kind"] == "moe_routing" and "routed_scaling_factor" in c["differs"] for c in moe)
    judged = [c for c in moe if c.get("conformance")]
    assert judged, "no MoE block was judged against its exact function"
    for c in judged:  # each side computes the function its own contract names, scaling included
        conf = c["conformance"]
        assert all(conf[s]["error"] <= conf[s]["bound"] for s in ("train", "infer")), conf
        assert "scaled by 2," in conf["infer"]["function"] and "scaled by 2," not in conf["train"]["function"]
    assert_closes(r)


def test_a_one_sided_scoring_function_is_a_routing_difference(demo_model: Callable[[str], Path]) -> None:
    r = logdiff.scan(demo_model("deepseek-v3"), infer=["vllm"], infer_set={"scoring_func": "softmax"}, **SMALL)
    assert "scoring_func" in r["contracts"]["differs"]
    assert r["contracts"]["infer"]["scoring_func"] == "softmax"
    c = _blamed(r, next(c["boundary"] for c in r["causes"] if "scoring_func" in c["differs"]))
    assert c["kind"] == "moe_routing" and c["op_kind"] in ("router", "moe")
    assert r["verdict"] in ("framework_difference", "mixed")
    assert_closes(r)


def test_stale_checkpoint_helper_changes_the_named_tensor(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """The plant above changes what it names and nothing else (its own negative control)."""
    from safetensors.torch import load_file

    model = demo_model("qwen3-moe")
    name = next(n for n in load_file(str(model / "model.safetensors")) if n.endswith("experts.0.gate_proj.weight"))
    path = stale_checkpoint(model, tmp_path, name, lambda w: w * 1.25)
    old, new = load_file(str(model / "model.safetensors")), load_file(str(path))
    assert [n for n in old if not torch.equal(old[n], new[n])] == [name]
