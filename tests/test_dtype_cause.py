"""An fp32 trainer against a bf16 engine: one ``dtype`` cause, never stale weights.

TRL builds its trainer's model in float32 by default while vLLM runs bf16. The
weights are compared at the narrower dtype (equal after rounding is equal), each
side's ops are judged in its own dtype's spacing, and the dtype itself is the
cause. Negative controls: a weight that differs after rounding is still named,
and two sides in one dtype give no dtype cause.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from logdiff.diagnosis.classify import preflight_only_causes
from logdiff.diagnosis.preflight import narrower_dtype, preflight
from logdiff.sources.hf.contract import hf_contract, hf_fingerprints


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """One tiny random Qwen3 in fp32 (the trainer) and its bf16 copy (the engine)."""
    from transformers import AutoModelForCausalLM

    from logdiff.demo.configs import tiny_config

    torch.manual_seed(0)
    config = tiny_config("qwen3", 256, num_hidden_layers=2, hidden_size=64, head_dim=16, intermediate_size=96)
    fp32 = AutoModelForCausalLM.from_config(config).float().eval()
    bf16 = AutoModelForCausalLM.from_config(config).eval()
    bf16.load_state_dict(fp32.state_dict())
    return fp32, bf16.to(torch.bfloat16)


class _Side:
    """A minimal engine: its contract and its fingerprints (at a narrower dtype on request)."""

    def __init__(self, model: Any):
        self.model = model

    def contract(self) -> dict[str, Any]:
        return hf_contract(self.model, {})

    def fingerprints(self, at: str | None = None) -> dict[str, str]:
        return hf_fingerprints(self.model, at)


def test_narrower_dtype() -> None:
    assert narrower_dtype("float32", "bfloat16") == "bfloat16"
    assert narrower_dtype("bfloat16", "float32") == "bfloat16"
    assert narrower_dtype("bfloat16", "bfloat16") is None
    assert narrower_dtype("bfloat16", "float16") is None  # the same width, another format: compared as they are
    assert narrower_dtype(None, "float32") is None


def test_fp32_weights_equal_after_rounding_are_equal(models: tuple[Any, Any]) -> None:
    fp32, bf16 = models
    assert hf_fingerprints(fp32) != hf_fingerprints(bf16)  # the hashes are dtype-exact
    assert hf_fingerprints(fp32, "bfloat16") == hf_fingerprints(bf16)
    block = preflight(_Side(fp32), _Side(bf16))
    assert block["weights"]["differs"] == [] and block["weights"]["verified"] > 0
    assert block["differs"] == ["dtype"]
    causes = preflight_only_causes(block, [])
    assert [(c.class_, c.kind, c.differs) for c in causes] == [("framework_difference", "dtype", ["dtype"])]
    assert "float32" in causes[0].evidence[0] and "bfloat16" in causes[0].fix


def test_a_weight_that_differs_after_rounding_is_still_named(models: tuple[Any, Any]) -> None:
    fp32, bf16 = models
    stale = type(bf16)(bf16.config).eval().to(torch.bfloat16)
    stale.load_state_dict(bf16.state_dict())
    with torch.no_grad():
        stale.model.layers[1].mlp.down_proj.weight.mul_(1.25)
    block = preflight(_Side(fp32), _Side(stale))
    assert block["weights"]["differs"] == ["model.layers.1.mlp.down_proj.weight"]
    kinds = {c.kind for c in preflight_only_causes(block, [])}
    assert kinds == {"dtype", "weights"}


def test_one_dtype_is_no_dtype_cause(models: tuple[Any, Any]) -> None:
    _, bf16 = models
    block = preflight(_Side(bf16), _Side(bf16))
    assert block["differs"] == [] and block["weights"]["differs"] == []
    assert preflight_only_causes(block, []) == []
