"""gpt-oss: the adapter's layout, sinks as an attention-core weight, and planted faults on the real CPU vLLM.

Without vLLM: the router is ``mlp.router`` and the sinks are read by the
attention core; transformers has no sdpa path for gpt-oss, so the HF engine
and the demo builder pick eager; an HF-against-HF scan calls identical paths
equal. Against the real CPU vLLM (the generic scan and ``--consistent`` checks
are in test_architectures.py): both engines read the same per-layer windows
and SwiGLU constants, and a stale sink (inside vLLM's attention kernel) or a
stale router bias planted on vLLM's side is found and blamed on the op that
reads it, as a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from logdiff.probes.arch import adapter_for
from plants import stale_checkpoint

import logdiff
from logdiff.sources.vllm.taps import TAPS as VLLM_TAPS

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


def test_adapter_puts_sinks_in_the_attention_core_and_names_the_router() -> None:
    gpt = adapter_for("GptOssForCausalLM")
    cmap = gpt.correspondence({"num_hidden_layers": 2})
    a = "model.layers.1.self_attn"
    assert cmap.get("model.layers.1.mlp.router").kind == "router" and cmap.get("model.layers.1.mlp.gate") is None
    assert cmap.get(f"{a}.attn_core").inputs == (f"{a}.rope_q", f"{a}.rope_k", f"{a}.v_proj")
    keys, weights = gpt.contract_keys(f"{a}.attn_core", "attn")
    assert {"sliding_window", "layer_types"} <= set(keys) and weights == [f"{a}.sinks"]
    assert gpt.weight_boundary(f"{a}.sinks") == (f"{a}.attn_core", "attn")
    assert gpt.weight_boundary("model.layers.1.mlp.router.bias") == ("model.layers.1.mlp.router", "router")
    assert f"{a}.o_proj.bias" in gpt.contract_keys(f"{a}.o_proj", "linear")[1]
    keys, weights = gpt.contract_keys("model.layers.1.mlp", "moe")
    assert {"swiglu_alpha", "swiglu_limit", "num_experts_per_tok"} <= set(keys)
    assert "model.layers.1.mlp.experts.gate_up_proj_bias" in weights
    # vLLM's names map to HF's: the embedding, OAIAttention's parameters, the experts' biases
    assert gpt.hf_name("model.embedding.weight") == "model.embed_tokens.weight"
    assert gpt.hf_name("model.layers.3.attn.sinks") == "model.layers.3.self_attn.sinks"
    assert gpt.hf_name("model.layers.3.attn.q_proj.bias") == "model.layers.3.self_attn.q_proj.bias"
    w2_bias = "model.layers.0.mlp.experts.routed_experts.w2_bias"
    assert gpt.hf_name(w2_bias) == "model.layers.0.mlp.experts.down_proj_bias"
    vllm = {t.pattern: t.names for t in VLLM_TAPS.taps(cmap)}
    assert vllm[r"model\.layers\.{N}\.attn\.attn"] == ("model.layers.{N}.self_attn.attn_core",)


def test_hf_runs_gpt_oss_with_eager_attention() -> None:
    from logdiff.demo.configs import tiny_config
    from logdiff.sources.hf.loading import default_attention, supports_sdpa

    config = tiny_config("gpt-oss", 512)
    assert not supports_sdpa(config) and default_attention(config) == "eager"
    assert supports_sdpa(tiny_config("qwen3", 512))  # control: a family with sdpa keeps it
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2


def test_vllm_reader_takes_each_layers_window_from_its_backend() -> None:
    """Without vLLM: a stand-in of vLLM's tree whose layer 1 slides too reads so (vLLM ignores layer_types)."""
    from types import SimpleNamespace as NS

    def layer(window: int | None) -> NS:
        return NS(attn=NS(attn=NS(impl=NS(sliding_window=window))))

    model = NS(model=NS(layers=[layer(8), layer(8), layer(8), layer(None)]))
    from logdiff.sources.vllm.contract_extras import EXTRAS

    extras = EXTRAS.read(adapter_for("GptOssForCausalLM"), model)
    assert extras["layer_types"] == "sliding,sliding,sliding,full"
    assert (extras["swiglu_alpha"], extras["swiglu_limit"]) == (1.702, 7.0)


def test_exact_attention_with_sinks_holds_hfs_eager_and_not_one_that_drops_them() -> None:
    """The conformance check's fp64 function: HF's own bf16 gpt-oss attention lands within its bound, the same
    attention without its sinks far outside (the planted divergence)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from logdiff.diagnosis import exact
    from logdiff.diagnosis.spacing import eps

    gen = torch.Generator().manual_seed(0)
    t, heads, kv_heads, d = 24, 4, 2, 16
    q = torch.randn(t, heads * d, generator=gen).bfloat16()
    k = (torch.randn(t, kv_heads * d, generator=gen) * 2).bfloat16()
    v = torch.randn(t, kv_heads * d, generator=gen).bfloat16()
    sinks = (torch.randn(heads, generator=gen) * 2 + 2).bfloat16()
    mask = torch.full((t, t), float("-inf")).triu(1).bfloat16()[None, None]

    def hf(with_sinks: torch.Tensor) -> torch.Tensor:
        module = SimpleNamespace(sinks=with_sinks, num_key_value_groups=heads // kv_heads, training=False)
        split = [x.view(t, -1, d).transpose(0, 1)[None] for x in (q, k, v)]
        return eager_attention_forward(module, *split, mask, 0.25)[0].reshape(t, heads * d)

    ex = exact.attention(q, k, v, torch.arange(t), heads, 0.25, None, None, sinks)
    assert "sinks" in ex.function
    within = exact.error_units(hf(sinks), ex, eps("bfloat16"))
    dropped = exact.error_units(hf(torch.full((heads,), -1e4).bfloat16()), ex, eps("bfloat16"))
    bound = ex.bound.units("bfloat16")
    assert within <= bound < dropped / 4, (within, bound, dropped)


def test_identical_hf_paths_are_called_equal(demo_model: Callable[[str], Path]) -> None:
    r = logdiff.scan(demo_model("gpt-oss"), infer=["hf"], **{**SMALL, "depth": "logprobs"})
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0


# ---------------------------------------------------------------------------- consistent HF (tiny random model)


@pytest.fixture(scope="module")
def tiny_gpt_oss() -> torch.nn.Module:
    from transformers import GptOssForCausalLM

    from logdiff.demo.configs import tiny_config

    torch.manual_seed(0)
    config = tiny_config("gpt-oss", 256, hidden_size=64, head_dim=16, intermediate_size=32, initializer_range=0.3)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).to(torch.bfloat16).eval()
    for layer in model.model.layers:
        layer.self_attn.sinks.data.normal_(0, 2.0)  # sinks that take visible mass
        layer.mlp.experts.gate_up_proj_bias.data.normal_(0, 4.0)  # past the clamp limit: the clamps matter
    return model


def test_consistent_hf_covers_sinks_biased_router_and_clamped_experts(tiny_gpt_oss: torch.nn.Module) -> None:
    from logdiff.sources.hf.consistent import consistent_hf

    model = tiny_gpt_oss
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), consistent_hf(model) as report:
        full = model(ids).logits
        rows = torch.cat([model(ids[i : i + 1]).logits for i in range(3)])
    assert report.replaced["moe_combine"] == [f"model.layers.{n}.mlp.experts" for n in range(4)]
    assert report.replaced["moe_route"] == [f"model.layers.{n}.mlp.router" for n in range(4)]
    assert torch.equal(full, rows)  # a token's logits do not depend on its batch
    with torch.no_grad():
        stock = model(ids).logits
    assert not torch.equal(stock, full)  # control: the stock model computes something else here
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    saved = [s.data.clone() for s in sinks]
    try:
        for s in sinks:
            s.data.fill_(-1e4)  # sinks that take nothing: another function, so the kernel does read them
        with torch.no_grad(), consistent_hf(model):
            assert not torch.equal(model(ids).logits, full)
    finally:
        for s, old in zip(sinks, saved):
            s.data.copy_(old)


# ---------------------------------------------------------------------------- planted faults on the real CPU vLLM


@pytest.mark.vllm
def test_both_engines_read_the_windows_sinks_and_swiglu_alike(demo_model: Callable[[str], Path],
                                                              shared_scan: Callable[..., dict]) -> None:
    r = shared_scan(demo_model("gpt-oss"), infer=["vllm"], **SMALL)  # test_architectures.py's gpt-oss scan
    train, infer = r["contracts"]["train"], r["contracts"]["infer"]
    assert train["layer_types"] == infer["layer_types"] == "sliding,full,sliding,full"
    for key, want in (("sliding_window", 8), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0), ("rope_type", "yarn")):
        assert train[key] == infer[key] == want, key
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    assert r["contracts"]["weights"]["unverified"] == []  # sinks, biases, transposed experts: all recovered
    compared = set(r["divergence_table"]["boundaries"])
    assert {"model.layers.0.self_attn.attn_core", "model.layers.1.mlp.router", "model.layers.3.mlp"} <= compared


@pytest.mark.vllm
def test_a_stale_sink_is_blamed_on_the_attention_core(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """vLLM's attention kernel reads a sink 1.0 higher for layer 1: found there, as a weight, nowhere earlier."""
    model = demo_model("gpt-oss")
    name = "model.layers.1.self_attn.sinks"
    stale = stale_checkpoint(model, tmp_path, name, lambda s: s + 1.0)
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference"]
    assert [c["boundary"] for c in blamed] == ["model.layers.1.self_attn.attn_core"], blamed
    assert blamed[0]["kind"] == "weights" and blamed[0]["differs"] == [name]


@pytest.mark.vllm
def test_a_stale_router_bias_flips_experts_and_is_blamed_on_the_router(
    demo_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = demo_model("gpt-oss")
    name = "model.layers.2.mlp.router.bias"

    def favour_expert_5(bias: torch.Tensor) -> torch.Tensor:
        bias[5] += 4.0
        return bias

    stale = stale_checkpoint(model, tmp_path, name, favour_expert_5)
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = {c["boundary"]: c for c in r["causes"] if c["class"] == "framework_difference"}
    assert "model.layers.2.mlp.router" in blamed, blamed
    assert all(c["kind"] == "weights" and c["differs"] == [name] for c in blamed.values()), blamed
    layers = {s["layer"]: s for s in r["moe"]["layers"]}
    assert layers[2]["flips"] > 0 and layers[1]["flips"] == 0, layers


@pytest.mark.vllm
def test_consistent_vllm_patches_sinks_router_and_biased_experts(demo_model: Callable[[str], Path]) -> None:
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire
    from logdiff.sources.vllm.consistent import consistent_vllm

    spec = EngineSpec(model_dir=str(demo_model("gpt-oss")), dtype="bfloat16",
                      options=(("max_model_len", 256), ("max_num_seqs", 4)))  # fmt: skip
    llm = acquire("vllm", spec).llm
    with consistent_vllm(llm) as summary:
        assert summary.replaced["moe"] == [f"model.layers.{n}.mlp.experts" for n in range(4)]
        assert summary.replaced["attention"] == [f"model.layers.{n}.attn.attn" for n in range(4)]
        assert "model.layers.0.mlp.router" in summary.replaced["linear"]  # the biased router GEMM


@pytest.mark.vllm
def test_consistent_training_step_equals_vllm_bitwise(demo_model: Callable[[str], Path]) -> None:
    """``train.grad=true``: HF runs a real step (train mode, backward) through the sinks' attention backward
    and the clamped SwiGLU's, and still equals vLLM bitwise."""
    small = {**SMALL, "depth": "logprobs", "train_set": {"grad": True}}
    r = logdiff.scan(demo_model("gpt-oss"), infer=["vllm"], consistent=True, **small)
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0
    assert next(p for p in r["paths"] if p["role"] == "train")["settings"]["grad"] is True
