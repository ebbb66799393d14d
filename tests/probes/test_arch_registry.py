"""The architecture registry: lookups, the unsupported-architecture error, and what adapters answer.

Controls: an unsupported architecture is refused (and a supported one is
not); architectures that differ get different answers (q/k norms, biases,
MoE, the sliding-window switch), so the checks can fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from logdiff.probes import arch

from logdiff.errors import InputError
from logdiff.sources import checkpoint
from logdiff.sources.vllm.taps import TAPS as VLLM_TAPS

CONFIG = {"num_hidden_layers": 2}


def test_every_supported_architecture_has_an_adapter_and_demo_names_are_model_types() -> None:
    names = arch.supported()
    assert names[:3] == ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
    assert {"Qwen2ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"} <= set(names)
    for name in names:
        assert arch.adapter_for(name).architecture == name
    demos = arch.demos()
    assert list(demos)[:3] == ["qwen3", "llama", "qwen3-moe"]
    for name, demo in demos.items():
        assert demo.architecture in names and re.fullmatch(r"[a-z0-9-]+", name)
        assert demo.adapter is arch.adapter_for(demo.architecture)
    assert demos["llama3"].settings["rope_parameters"]["rope_type"] == "llama3"


@pytest.mark.parametrize(
    ("given", "nearest"),
    [
        ("FalconForCausalLM", "MixtralForCausalLM"),
        ("MixtralForCausalLm", "MixtralForCausalLM"),
        ("LlamaForCausalLm", "LlamaForCausalLM"),
    ],
)
def test_unsupported_architecture_is_one_line_naming_the_nearest(given: str, nearest: str) -> None:
    with pytest.raises(InputError) as e:
        arch.adapter_for(given)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    assert f"nearest supported: {nearest};" in msg and "docs/architectures.md" in msg
    assert arch.find(given) is None


def test_checkpoint_refuses_an_unsupported_architecture_before_loading(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(InputError, match=r"'FalconForCausalLM' in .*nearest supported: .*docs/architectures\.md"):
        checkpoint.read_config(tmp_path)
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    assert checkpoint.read_config(tmp_path)["model_type"] == "mistral"  # control: supported now


def test_adapter_of_reads_config_then_class_name() -> None:
    class Qwen2ForCausalLM:  # an HF model built from a config has no ``architectures`` yet
        config = SimpleNamespace(architectures=None)

    assert arch.adapter_of(Qwen2ForCausalLM()).architecture == "Qwen2ForCausalLM"
    vllm_like = SimpleNamespace(config=SimpleNamespace(architectures=["MistralForCausalLM"]))
    assert arch.adapter_of(vllm_like).architecture == "MistralForCausalLM"
    with pytest.raises(InputError, match="unsupported architecture"):
        arch.adapter_of(SimpleNamespace(config=SimpleNamespace(architectures=["GPT2LMHeadModel"])))


def test_adapters_answer_where_architectures_differ() -> None:
    qwen2, llama, qwen3 = (arch.adapter_for(a) for a in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"))
    q = "model.layers.0.self_attn.q_proj"
    assert qwen2.contract_keys(q, "linear")[1] == [f"{q}.weight", f"{q}.bias"]
    assert llama.contract_keys(q, "linear")[1] == [f"{q}.weight"]
    assert qwen3.correspondence(CONFIG).get("model.layers.0.self_attn.q_norm") is not None
    assert qwen2.correspondence(CONFIG).get("model.layers.0.self_attn.q_norm") is None
    moe = arch.adapter_for("Qwen3MoeForCausalLM").correspondence({**CONFIG, "mlp_only_layers": [1]})
    assert moe.get("model.layers.0.mlp.gate").kind == "router" and moe.get("model.layers.1.mlp.gate") is None
    # Mistral's window is on whenever sliding_window is set; Qwen2's only with use_sliding_window
    mistral = arch.adapter_for("MistralForCausalLM")
    assert mistral.sliding_window(SimpleNamespace(sliding_window=4096)) == 4096
    assert qwen2.sliding_window(SimpleNamespace(sliding_window=4096, use_sliding_window=False)) is None
    assert qwen2.sliding_window(SimpleNamespace(sliding_window=4096, use_sliding_window=True)) == 4096
    assert mistral.hf_norm_classes == {"MistralRMSNorm"} and qwen3.hf_norm_classes == {"Qwen3RMSNorm"}
    # Mixtral's checkpoint and vLLM call the MoE block block_sparse_moe; HF's module is mlp
    mixtral, qwen3_moe = arch.adapter_for("MixtralForCausalLM"), arch.adapter_for("Qwen3MoeForCausalLM")
    w = "model.layers.2.block_sparse_moe.experts.gate_up_proj"
    assert mixtral.hf_name(w) == "model.layers.2.mlp.experts.gate_up_proj" and qwen3_moe.hf_name(w) == w
    stored = {
        "model.layers.0.block_sparse_moe.experts.0.w1.weight": (4, 8),
        "model.layers.0.block_sparse_moe.gate.weight": (8, 4),
    }
    assert mixtral.per_expert_stored("model.layers.0.mlp.experts.gate_up_proj", stored)
    assert mixtral.per_expert_stored("model.layers.0.mlp.gate.weight", stored)
    assert not qwen3_moe.per_expert_stored("model.layers.0.mlp.gate.weight", stored)
    assert not mixtral.per_expert_stored("model.layers.1.mlp.gate.weight", stored)
    vllm_taps = VLLM_TAPS.taps(mixtral.correspondence(CONFIG))
    vllm_moe = [t.pattern for t in vllm_taps if "moe" in t.pattern or "mlp" in t.pattern]
    assert vllm_moe and all("block_sparse_moe" in p for p in vllm_moe)


def test_function_boundaries_exist_in_the_map() -> None:
    cmap = arch.adapter_for("LlamaForCausalLM").correspondence(CONFIG)
    for role, kind in (("rope_q", "rope"), ("rope_k", "rope"), ("attn_core", "attn")):
        assert cmap.get(cmap.function_boundary(role, 1)).kind == kind
    assert cmap.function_boundary("nope", 1) is None


def test_classify_asks_the_adapter() -> None:
    from logdiff.diagnosis import classify

    qwen2 = arch.adapter_for("Qwen2ForCausalLM")
    k = "model.layers.1.self_attn.k_proj"
    assert classify.contract_keys(k, "linear", qwen2)[1] == [f"{k}.weight", f"{k}.bias"]
    assert classify.contract_keys(k, "linear")[1] == [f"{k}.weight"]  # default: the plain Llama layout
    contracts = {"train": {}, "infer": {}, "differs": [], "weights": {"differs": [f"{k}.bias"], "unverified": []}}
    (cause,) = classify.preflight_only_causes(contracts, [], qwen2)
    assert (cause.boundary, cause.kind) == (k, "weights")
    assert classify.merge_fused([], qwen2) == []
