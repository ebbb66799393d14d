"""Gemma 3 (text) against the real CPU vLLM: q/k norms, a RoPE base per layer type, a window shorter than the context.

The generic properties (a real first divergence, both engines' contracts and
weights agreeing, every cause classified; ``--consistent`` bitwise 0) are
asserted for every new architecture in test_architectures.py; here are the
ones only Gemma 3 has, and controls for its new readings (a stale q-norm weight
planted on one side of the real engines, a stand-in vLLM whose sliding layers
rotate with another base) so that the agreeing contracts are not vacuous. The
window kernel's end-to-end check on Gemma 2 (its refusal is gone) is here too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import logdiff

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


def test_adapter_places_qk_norms_between_projections_and_rope() -> None:
    """Without vLLM: each rope reads its norm, HF's norms are read heads-first, the new keys have their ops."""
    from logdiff.probes.arch import adapter_for

    from logdiff.sources.hf.taps import TAPS as HF_TAPS

    gemma3 = adapter_for("Gemma3ForCausalLM")
    cmap = gemma3.correspondence({"num_hidden_layers": 2})
    a = "model.layers.1.self_attn"
    assert cmap.get(f"{a}.q_norm").inputs == (f"{a}.q_proj",)
    assert cmap.get(f"{a}.rope_q").inputs == (f"{a}.q_norm",) and cmap.get(f"{a}.rope_k").inputs == (f"{a}.k_norm",)
    hf = {t.pattern: t.select for t in HF_TAPS.taps(cmap)}
    assert hf[r"model\.layers\.{N}\.self_attn\.q_norm"] == "heads_first"
    assert hf[r"lm_head"] == "tensor"  # no final soft cap: replayable logits
    capped = gemma3.correspondence({"num_hidden_layers": 2, "final_logit_softcapping": 30.0})
    assert "logits_field" in {t.select for t in HF_TAPS.taps(capped)}  # a final cap: the model output's logits
    assert gemma3.contract_keys(f"{a}.q_norm", "norm") == (["qk_norm_eps"], [f"{a}.q_norm.weight"])
    assert "rope_local_base_freq" in gemma3.contract_keys(f"{a}.rope_q", "rope")[0]
    assert "layer_types" in gemma3.contract_keys(f"{a}.attn_core", "attn")[0]


@pytest.mark.vllm
def test_scan_reads_both_rope_bases_and_the_window_alike(demo_model: Callable[[str], Path],
                                                          shared_scan: Callable[..., dict]) -> None:
    r = shared_scan(demo_model("gemma3"), infer=["vllm"], **SMALL)  # test_architectures.py's gemma3 scan
    train, infer = r["contracts"]["train"], r["contracts"]["infer"]
    for key, want in (("rope_theta", 1e6), ("rope_local_base_freq", 1e4), ("sliding_window", 8)):
        assert train[key] == infer[key] == want, key
    assert train["layer_types"] == infer["layer_types"] == "sliding,full,sliding,full"
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    assert r["contracts"]["weights"]["verified"] == 54  # Gemma 2's 46 + q/k norms of 4 layers
    # the q/k norms are compared on both sides (HF's heads-first tensors aligned with vLLM's)
    compared = set(r["divergence_table"]["boundaries"])
    assert {"model.layers.0.self_attn.q_norm", "model.layers.3.self_attn.k_norm"} <= compared


@pytest.mark.vllm
def test_stale_q_norm_weight_is_blamed_on_q_norm(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = demo_model("gemma3")
    name = "model.layers.1.self_attn.q_norm.weight"
    sd = load_file(str(model / "model.safetensors"))
    sd[name] = (sd[name].float() + 0.25).to(sd[name].dtype)
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=ckpt, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference"]
    assert [c["boundary"] for c in blamed] == ["model.layers.1.self_attn.q_norm"], blamed
    assert blamed[0]["kind"] == "weights" and blamed[0]["differs"] == [name]


def test_vllm_reader_takes_each_layer_types_base_from_its_own_layers() -> None:
    """Without vLLM: a stand-in of vLLM's module tree whose sliding layers rotate with another base reads so."""
    from types import SimpleNamespace as NS

    from logdiff.probes.arch import adapter_for

    from logdiff.sources.vllm.contract_extras import EXTRAS

    def layer(window: int, base: float) -> NS:
        impl = NS(sliding_window=window, logits_soft_cap=None)
        return NS(self_attn=NS(attn=NS(impl=impl), rotary_emb=NS(base=base)))

    def model(local_base: float) -> NS:
        layers = [layer(8, local_base), layer(-1, 1e6), layer(8, local_base), layer(-1, 1e6)]
        embed = NS(weight=NS(dtype=None))
        return NS(model=NS(layers=layers, embed_tokens=embed, normalizer=None), logits_processor=NS(soft_cap=None))

    gemma3 = adapter_for("Gemma3ForCausalLM")
    right, wrong = EXTRAS.read(gemma3, model(1e4)), EXTRAS.read(gemma3, model(2e4))
    assert right["rope_local_base_freq"] == 1e4 and wrong["rope_local_base_freq"] == 2e4
    assert right["rope_theta"] == wrong["rope_theta"] == 1e6
    assert right["layer_types"] == "sliding,full,sliding,full"


@pytest.mark.vllm
def test_consistent_covers_gemma2_with_a_window_shorter_than_the_sequences(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None]
) -> None:
    """The window kernel is not Gemma 3's alone: the Gemma 2 demo told a window of 8 on both sides (16-token
    sequences) was refused before; now HF = HF decode = vLLM bitwise, and stock vLLM still differs (control)."""
    window = {"sliding_window": 8}
    fast = {**SMALL, "depth": "logprobs"}
    model = demo_model("gemma2")
    stock = logdiff.scan(model, infer=["hf-decode", "vllm"], train_set=window, infer_set=window, **fast)
    sides = {"train_set": window, "infer_set": window}
    fixed = logdiff.scan(model, infer=["hf-decode", "vllm"], consistent=True, **sides, **fast)
    assert {"hf-decode", "vllm"} <= {p["infer"] for p in fixed["pairs"]}
    assert all(p["metrics"]["abs_diff_max"] == 0.0 for p in fixed["pairs"]), [p["metrics"] for p in fixed["pairs"]]
    assert fixed["verdict"] == "consistent"
    stock_diff = next(p for p in stock["pairs"] if p["infer"] == "vllm")["metrics"]["abs_diff_max"]
    stock_varies(stock_diff == 0.0, "stock vLLM matches HF bitwise on the windowed Gemma 2")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_consistent_training_step_runs_with_the_inference_bits(demo_model: Callable[[str], Path], arch: str) -> None:
    """``train.grad=true`` under ``--consistent`` (refused before: no soft-capped attention or gelu-tanh backward):
    the HF path runs a real step (train mode, backward through the kernels) and equals the HF decode bitwise."""
    fast = {**SMALL, "depth": "logprobs"}
    r = logdiff.scan(demo_model(arch), infer=["hf-decode"], consistent=True, train_set={"grad": True}, **fast)
    assert next(p for p in r["paths"] if p["role"] == "train")["settings"]["grad"] is True
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0
