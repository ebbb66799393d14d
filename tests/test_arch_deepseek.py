"""DeepSeek-V2/V3 (MLA + shared experts) against the real CPU vLLM, and the adapters' own answers.

The scan and ``--consistent`` bitwise 0 (HF, HF decode, vLLM decode and
prefill) are the generic properties of tests/test_architectures.py (``NEW``);
here: planted one-sided faults in the two places only this family has (the
latent up-projection ``kv_b_proj``, read inside vLLM's MLA op, and a shared
expert), each blamed on the op that reads it, V3's one-sided correction bias
blamed on the router, the adapters' maps without vLLM, and consistent mode's
MLA on each engine: every vLLM ``MLAAttention`` runs the latent kernel on the
paged latent cache (its layout learnt from the CPU backend's own writer), HF's
forward equals its decode bitwise, a YaRN MLA (real checkpoints' rope) is bitwise 0 too, and
any other scaled MLA rope is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plants import stale_checkpoint

import logdiff

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


@pytest.mark.vllm
def test_scan_locates_mla_and_shared_expert_boundaries(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None], shared_scan: Callable[..., dict]
) -> None:
    """Every MLA and shared-expert boundary is recorded on both engines, in HF's order, weights all verified."""
    r = shared_scan(demo_model("deepseek-v2"), infer=["vllm"], **SMALL)  # test_architectures.py's deepseek-v2 scan
    assert not [w for w in r["warnings"] if "probe failed" in w or "could not align" in w or "split" in w]
    table = r["divergence_table"]["boundaries"]
    for part in ("q_proj.nope", "q_proj.pe", "kv_a_proj_with_mqa.compressed_kv", "kv_a_proj_with_mqa.k_pe",
                 "kv_a_layernorm", "rope_q", "rope_k", "latent_attn", "o_proj"):
        assert f"model.layers.1.self_attn.{part}" in table, part
    for part in ("gate", "shared_experts.gate_proj", "shared_experts.act_mul", "shared_experts.down_proj"):
        assert f"model.layers.1.mlp.{part}" in table, part
    assert "model.layers.1.mlp" in table
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    assert r["contracts"]["train"]["rope_style"] == r["contracts"]["infer"]["rope_style"] == "gptj"
    assert r["contracts"]["weights"].get("unverified", []) == []
    # the MLA attention is replayed on vLLM's (q nope, RoPE'd q, latent, RoPE'd k): its own error is separated
    ops = {o["boundary"]: o for o in r["introducing_ops"]}
    latent = ops.get("model.layers.1.self_attn.latent_attn")
    assert not [w for w in r["warnings"] if "could not separate" in w], r["warnings"]
    stock_varies(latent is None, "stock MLA attention introduces no error against HF's here")
    assert latent["method"] == "replay", r["introducing_ops"]
    assert latent["local_max_abs_diff"] <= latent["propagated_max_abs_diff"]


@pytest.mark.vllm
def test_kv_b_proj_fault_is_blamed_on_the_latent_attention(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """vLLM absorbs kv_b_proj into its MLA op: a stale up-projection is found at the attention that reads it."""
    model = demo_model("deepseek-v2")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    stale = stale_checkpoint(model, tmp_path, name, lambda w: w * 1.5)
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference" and c["kind"] == "weights"]
    assert [c["boundary"] for c in blamed] == ["model.layers.1.self_attn.latent_attn"], blamed
    assert blamed[0]["differs"] == [name]


@pytest.mark.vllm
def test_shared_expert_fault_is_blamed_on_its_projection(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """A stale shared-expert weight (vLLM packs gate/up) is named at the shared expert's own projection."""
    model = demo_model("deepseek-v2")
    name = "model.layers.2.mlp.shared_experts.up_proj.weight"
    stale = stale_checkpoint(model, tmp_path, name, lambda w: w * 1.5)
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    blamed = [c for c in r["causes"] if c["class"] == "framework_difference" and c["kind"] == "weights"]
    assert [c["boundary"] for c in blamed] == ["model.layers.2.mlp.shared_experts.up_proj"], blamed
    assert blamed[0]["differs"] == [name]


@pytest.mark.vllm
def test_rms_norm_eps_set_on_both_sides_still_differs_in_the_latent_norm(demo_model: Callable[[str], Path]) -> None:
    """HF builds kv_a_layernorm with the default eps whatever rms_norm_eps says; vLLM uses rms_norm_eps.

    The same ``--set rms_norm_eps`` on both engines leaves their latent norms apart:
    the contract names it and the causes sit at the latent norms, not at the norms it was set for.
    """
    eps = {"rms_norm_eps": 1e-5}
    r = logdiff.scan(demo_model("deepseek-v2"), infer=["vllm"], train_set=eps, infer_set=eps, **SMALL)
    assert r["contracts"]["differs"] == ["latent_norm_eps"], r["contracts"]["differs"]
    assert (r["contracts"]["train"]["latent_norm_eps"], r["contracts"]["infer"]["latent_norm_eps"]) == (1e-6, 1e-5)
    blamed = [c for c in r["causes"] if "latent_norm_eps" in c.get("differs", [])]
    latent_norms = {f"model.layers.{n}.self_attn.kv_a_layernorm" for n in range(4)}
    assert blamed and {c["boundary"] for c in blamed} <= latent_norms
    assert all(c["class"] == "framework_difference" for c in blamed), blamed


@pytest.mark.vllm
def test_v3_correction_bias_fault_is_a_router_weight(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """V3 routes on sigmoid + e_score_correction_bias: a one-sided bias is blamed on the router, as a weight."""
    from safetensors.torch import load_file, save_file

    model = demo_model("deepseek-v3")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    sd = load_file(str(model / "model.safetensors"))
    bias = sd[name].clone()
    bias[0] += 0.5  # trained as zeros: a scale would change nothing
    sd[name] = bias
    ckpt = tmp_path / "stale.safetensors"
    save_file(sd, str(ckpt))
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=ckpt, **SMALL)
    assert r["contracts"]["weights"]["differs"] == [name]
    assert r["contracts"]["train"]["scoring_func"] == r["contracts"]["infer"]["scoring_func"] == "sigmoid"
    blamed = {c["boundary"]: c for c in r["causes"] if c["class"] == "framework_difference" and c["kind"] == "weights"}
    assert set(blamed) <= {"model.layers.2.mlp.gate", "model.layers.2.mlp"}, blamed
    assert "model.layers.2.mlp.gate" in blamed, blamed
    assert blamed["model.layers.2.mlp.gate"]["differs"] == [name]


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_consistent_vllm_runs_every_mla_layer_from_the_latent_cache(
    demo_model: Callable[[str], Path], arch: str
) -> None:
    """Every MLAAttention's forward_impl is the latent kernel (its absorbed decode and SDPA prefill are not
    reached); the wrapper's own children (q/kv projections, latent norm, RoPE, o_proj) are planned kernels."""
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire
    from logdiff.sources.vllm.consistent import consistent_vllm, engine_objects

    spec = EngineSpec(model_dir=str(demo_model(arch)), dtype="bfloat16",
                      options=(("max_model_len", 256), ("max_num_seqs", 4)))  # fmt: skip
    llm = acquire("vllm", spec).llm
    model, _ = engine_objects(llm)
    layers = range(len(model.model.layers))
    mla = [f"model.layers.{n}.self_attn.mla_attn.mla_attn" for n in layers]
    stock = model.model.layers[1].self_attn.mla_attn.mla_attn.forward_impl
    with consistent_vllm(llm) as summary:
        assert summary.replaced["attention"] == mla
        q = "q_b_proj" if arch == "deepseek-v3" else "q_proj"
        kv_a = "fused_qkv_a_proj" if arch == "deepseek-v3" else "kv_a_proj_with_mqa"
        for n in layers:
            a = f"model.layers.{n}.self_attn"
            assert {f"{a}.{q}", f"{a}.{kv_a}", f"{a}.kv_b_proj", f"{a}.o_proj"} <= set(summary.replaced["linear"])
            assert f"{a}.kv_a_layernorm" in summary.replaced["rms_norm"]
        assert model.model.layers[1].self_attn.mla_attn.mla_attn.forward_impl != stock
    assert model.model.layers[1].self_attn.mla_attn.mla_attn.forward_impl == stock  # the original is back


@pytest.mark.vllm
def test_latent_cache_reader_reads_back_what_the_cpu_mla_backend_wrote() -> None:
    """The layout is learnt from CPUMLAImpl.do_kv_cache_update itself; random rows written at scattered slots of
    a paged cache come back bitwise, per request, in position order, zero past each request's length."""
    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from logdiff.sources.vllm.kv_cache import LatentCacheReader

    impl = object.__new__(CPUMLAImpl)  # the write method reads nothing of the instance but its dtype setting
    impl.kv_cache_dtype = "auto"
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(9, 16, 576, generator=gen).to(torch.bfloat16)  # garbage wherever nothing is written
    reader = LatentCacheReader.discover(impl, cache, 512, 64)
    tables = torch.tensor([[7, 2, 5], [0, 8, 3]])
    lens = torch.tensor([40, 17])
    latent = torch.randn(2, 40, 512, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(2, 40, 64, generator=gen).to(torch.bfloat16)
    for b in range(2):
        n = int(lens[b])
        slots = tables[b, torch.arange(n) // 16] * 16 + torch.arange(n) % 16
        impl.do_kv_cache_update(latent[b, :n], k_pe[b, :n, None], cache, slots, "auto", torch.ones(()))
    got_latent, got_pe = reader.read_batch(cache, tables, lens)
    assert got_latent.shape == (2, 40, 512) and got_pe.shape == (2, 40, 64)
    for b in range(2):
        n = int(lens[b])
        assert torch.equal(got_latent[b, :n], latent[b, :n]) and torch.equal(got_pe[b, :n], k_pe[b, :n])
        assert not got_latent[b, n:].any() and not got_pe[b, n:].any()


def test_latent_cache_reader_learns_a_private_layout() -> None:
    """A backend that stores each block's rope part first and the latent transposed is read back right."""
    import torch

    from logdiff.sources.vllm.kv_cache import LatentCacheReader

    class Private:
        kv_cache_dtype = "auto"

        def do_kv_cache_update(self, latent, k_pe, cache, slots, dtype, scale):  # noqa: ANN001, ANN202
            for row, slot in enumerate(slots.tolist()):
                block, i = divmod(slot, 4)
                flat = cache[block].view(-1)
                flat[i * 3 : i * 3 + 3] = k_pe[row, 0]  # [4 slots x 3 rope] first
                flat[12:].view(5, 4)[:, i] = latent[row]  # then the latent, dim-major

    cache = torch.zeros(3, 4, 8)
    reader = LatentCacheReader.discover(Private(), cache, 5, 3)
    latent, k_pe = torch.randn(6, 5), torch.randn(6, 3)
    table = torch.tensor([[2, 0]])
    slots = table[0, torch.arange(6) // 4] * 4 + torch.arange(6) % 4
    Private().do_kv_cache_update(latent, k_pe[:, None], cache, slots, "auto", None)
    got_latent, got_pe = reader.read_batch(cache, table, torch.tensor([6]))
    assert torch.equal(got_latent[0], latent) and torch.equal(got_pe[0], k_pe)


def _hf_paths(model: Any) -> tuple[Any, Any, Any]:
    """(full forward, KV-cache decode steps after a 5-token prefill, row 1 alone) logits of 2 x 20 tokens."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for i in range(5, 20):
            out = model(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
        return model(ids).logits, torch.cat(steps, 1), model(ids[1:]).logits


@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_consistent_hf_mla_forward_equals_decode_and_batch_rows(demo_model: Callable[[str], Path], arch: str) -> None:
    """Without vLLM: HF's MLA under consistent_hf gives a token the same logits in a full forward, in KV-cache
    decode steps (the latent cache up-projected again each step) and alone in its batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.sources.hf.consistent import consistent_hf

    model = AutoModelForCausalLM.from_pretrained(demo_model(arch), dtype=torch.bfloat16).eval()
    stock = _hf_paths(model)[0]
    with consistent_hf(model) as report:
        full, steps, alone = _hf_paths(model)
    assert [n for n in report.replaced["rope"] if n.endswith("self_attn.forward")] == [
        f"model.layers.{n}.self_attn.forward" for n in range(model.config.num_hidden_layers)
    ]
    assert torch.equal(full, steps) and torch.equal(full[1:], alone)
    # the originals are back: no patched forward is left, and the model computes its stock bits again
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert torch.equal(_hf_paths(model)[0], stock)


def test_consistent_hf_mla_training_forward_has_the_inference_bits(demo_model: Callable[[str], Path]) -> None:
    """With autograd recording, the MLA kernels' differentiable paths (rope_apply, linear, attention with v heads
    narrower than q/k) give the inference logits bitwise, and gradients reach kv_b_proj and the q-LoRA."""
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.sources.hf.consistent import consistent_hf

    model = AutoModelForCausalLM.from_pretrained(demo_model("deepseek-v3"), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with consistent_hf(model):
        with torch.no_grad():
            inference = model(ids).logits
        logits = model(ids).logits
        logits.float().logsumexp(-1).mean().backward()
    assert torch.equal(logits.detach(), inference)
    attn = model.model.layers[1].self_attn
    for weight in (attn.kv_b_proj.weight, attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight):
        assert weight.grad is not None and torch.isfinite(weight.grad).all() and weight.grad.abs().max() > 0


@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_negative_control_stock_hf_mla_varies_across_paths(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None], arch: str
) -> None:
    """The comparison above can fail: stock HF's MLA decode or batch rows differ (where this CPU's kernels vary)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model(arch), dtype=torch.bfloat16).eval()
    full, steps, alone = _hf_paths(model)
    same = torch.equal(full, steps) and torch.equal(full[1:], alone)
    stock_varies(same, f"stock HF {arch} gives the same logits in decode and alone in its batch")


#: DeepSeek yarn (real checkpoints' rope) on the demo: factor 4 over 512 of its 2048 positions; V2 with
#: mscale != mscale_all_dim (cos/sin and the softmax scale both rescaled), V3 with DeepSeek-V3's 0.707 / 0.707
YARN = {
    "deepseek-v2": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    "deepseek-v3": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}  # fmt: skip


def _yarn_demo(demo_model: Callable[[str], Path], arch: str, tmp_path: Path) -> Path:
    """The demo model with its config's ``rope_parameters`` set to ``YARN[arch]`` (same weights)."""
    import json
    import shutil

    path = tmp_path / f"{arch}-yarn"
    shutil.copytree(demo_model(arch), path)
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == 4 * YARN[arch]["original_max_position_embeddings"]
    config["rope_parameters"] = dict(YARN[arch])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_consistent_hf_yarn_mla_forward_equals_decode(
    demo_model: Callable[[str], Path], tmp_path: Path, arch: str
) -> None:
    """Without vLLM: a YaRN MLA under consistent_hf: the rotary module is read as the kernel's yarn (cos/sin times
    mscale over mscale_all_dim), the softmax scale is HF's own (mscale_all_dim's mscale squared folded in), and a
    token's logits are the same bits in a full forward, in decode steps and alone in its batch."""
    import math

    import torch
    from logdiff.kernels.rope import yarn_attention_factor
    from transformers import AutoModelForCausalLM

    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.hf.consistent_rope import rope_params_of

    rope = YARN[arch]
    model = AutoModelForCausalLM.from_pretrained(_yarn_demo(demo_model, arch, tmp_path), dtype=torch.bfloat16).eval()
    params = rope_params_of(model.model.rotary_emb)[None]
    assert params.rope_type == "yarn"
    assert params.attention_factor == yarn_attention_factor(4.0, rope["mscale"], rope["mscale_all_dim"])
    attn = model.model.layers[0].self_attn
    m = 0.1 * rope["mscale_all_dim"] * math.log(4.0) + 1.0
    assert attn.scaling == attn.qk_head_dim**-0.5 * m * m != attn.qk_head_dim**-0.5
    with consistent_hf(model) as report:
        full, steps, alone = _hf_paths(model)
    assert "model.rotary_emb" in report.replaced["rope"]
    assert torch.equal(full, steps) and torch.equal(full[1:], alone)


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_consistent_yarn_mla_is_bitwise_zero_against_vllm(
    demo_model: Callable[[str], Path], tmp_path: Path, arch: str
) -> None:
    """A YaRN MLA (vLLM: DeepseekScalingRotaryEmbedding, its mscale folded into the MLA op's scale) is bitwise 0
    between HF, HF decode, vLLM decode and vLLM prefill under --consistent: each engine's own softmax scale
    (HF ``module.scaling``, vLLM ``impl.scale``) and cos/sin factor agree to the bit."""
    fast = {**SMALL, "depth": "logprobs"}
    fixed = logdiff.scan(_yarn_demo(demo_model, arch, tmp_path), infer=["hf-decode", "vllm"], consistent=True, **fast)
    assert {p["infer"] for p in fixed["pairs"]} == {"hf-decode", "vllm", "vllm-prefill"}
    assert all(p["metrics"]["abs_diff_max"] == 0.0 for p in fixed["pairs"]), [p["metrics"] for p in fixed["pairs"]]
    assert fixed["verdict"] == "consistent" and fixed["warnings"] == []


@pytest.mark.vllm
def test_vllm_and_hf_fold_the_same_mscale_into_the_mla_scale(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    """The live softmax scales a YaRN MLA runs with: vLLM's ``MLAAttention.impl.scale`` (what consistent mode's MLA
    op reads) is HF's ``module.scaling`` to the last bit, qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2
    in the same float operations, and vLLM's rotary module is the DeepseekScalingRotaryEmbedding whose ``mscale``
    is HF's ``attention_scaling``."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.sources.vllm import import_vllm

    vllm = import_vllm()
    arch = "deepseek-v2"  # mscale != mscale_all_dim: both factors differ from 1
    path = _yarn_demo(demo_model, arch, tmp_path)
    llm = vllm.LLM(model=str(path), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256)

    def read(model: Any) -> tuple[list[float], list[float]]:
        mla = [float(m.impl.scale) for m in model.modules() if type(m).__name__ == "MLAAttention"]
        ropes = [float(m.mscale) for m in model.modules() if type(m).__name__ == "DeepseekScalingRotaryEmbedding"]
        return mla, ropes

    vllm_scales, vllm_mscales = llm.apply_model(read)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf_scales = [float(layer.self_attn.scaling) for layer in hf.model.layers]
    assert vllm_scales == hf_scales and len(hf_scales) == hf.config.num_hidden_layers
    m = 0.1 * YARN[arch]["mscale_all_dim"] * math.log(YARN[arch]["factor"]) + 1.0
    assert hf_scales[0] == hf.model.layers[0].self_attn.qk_head_dim**-0.5 * m * m
    assert vllm_mscales and set(vllm_mscales) == {float(hf.model.rotary_emb.attention_scaling)} != {1.0}


def test_consistent_refuses_other_scaled_mla_rope_in_one_line() -> None:
    """Default and YaRN MLA are covered; any other scaled rope (here linear, which vLLM's DeepSeek would run as
    its deepseek_yarn) is refused, named, in one line."""
    from logdiff.probes.arch.deepseek_v2 import MLA_SHAPE
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from logdiff.sources.hf.consistent import consistent_hf

    linear = {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}
    config = DeepseekV2Config(vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, q_lora_rank=None, first_k_dense_replace=1, rope_parameters=linear,
                              **MLA_SHAPE)  # fmt: skip
    model = DeepseekV2ForCausalLM(config).eval()
    refused = r"MLA attention with rope_type 'linear' .*\(model\.layers\.0\.self_attn\)"
    with pytest.raises(NotImplementedError, match=refused) as e:
        with consistent_hf(model):
            pass
    assert "\n" not in str(e.value)


def test_hf_decode_scan_records_every_mla_boundary(demo_model: Callable[[str], Path]) -> None:
    """Without vLLM: HF's KV-cache decode (the cache holds the latent) against its full forward, q-LoRA included."""
    r = logdiff.scan(demo_model("deepseek-v3"), infer=["hf-decode"], **SMALL)
    assert r["warnings"] == []
    table = r["divergence_table"]["boundaries"]
    for part in ("q_a_proj", "q_a_layernorm", "q_b_proj.nope", "q_b_proj.pe", "kv_a_proj_with_mqa.compressed_kv",
                 "rope_q", "rope_k", "latent_attn"):
        assert f"model.layers.3.self_attn.{part}" in table, part
    assert r["contracts"]["differs"] == [] and r["contracts"]["weights"]["differs"] == []
    first = r["first_divergence"]
    assert first is None or first["inputs_equal"] is True


def test_adapter_maps_mla_weights_to_the_ops_that_read_them() -> None:
    """Without vLLM: split projections read their projection's weight; kv_b_proj belongs to the attention."""
    from logdiff.probes.arch import adapter_for

    from logdiff.sources.vllm.taps import TAPS as VLLM_TAPS

    ds = adapter_for("DeepseekV2ForCausalLM")
    a = "model.layers.1.self_attn"
    assert ds.contract_keys(f"{a}.q_proj.pe", "linear")[1] == [f"{a}.q_proj.weight"]
    assert ds.contract_keys(f"{a}.kv_a_proj_with_mqa.k_pe", "linear")[1] == [f"{a}.kv_a_proj_with_mqa.weight"]
    assert ds.contract_keys(f"{a}.latent_attn", "attn")[1] == [f"{a}.kv_b_proj.weight"]
    assert ds.weight_boundary(f"{a}.kv_b_proj.weight") == (f"{a}.latent_attn", "attn")
    assert ds.weight_boundary(f"{a}.q_b_proj.weight") == (f"{a}.q_b_proj.nope", "linear")
    # q-LoRA layout: q_a_proj -> q_a_layernorm -> q_b_proj, first layer dense, then MoE with shared experts
    cmap = ds.correspondence(
        {"num_hidden_layers": 2, "q_lora_rank": 64, "first_k_dense_replace": 1, "n_routed_experts": 4}
    )
    order = cmap.order
    assert order.index(f"{a}.q_a_proj") < order.index(f"{a}.q_a_layernorm") < order.index(f"{a}.q_b_proj.pe")
    assert "model.layers.0.mlp.gate" not in order and "model.layers.1.mlp.shared_experts.down_proj" in order
    assert cmap.rope_function == "apply_rotary_emb"
    # V3: HF's rope_interleave returns the pairs de-interleaved; vLLM's interleaved output is compared that way
    v3 = adapter_for("DeepseekV3ForCausalLM").correspondence({"num_hidden_layers": 1, "q_lora_rank": 64})
    assert v3.rope_function == "apply_rotary_pos_emb_interleave"
    assert [t.select for t in VLLM_TAPS.taps(v3) if t.pattern.endswith("rotary_emb")] == ["pair_deinterleaved"]
    assert adapter_for("DeepseekV3ForCausalLM").contract_keys("model.layers.1.mlp.gate", "router")[1][-1] == (
        "model.layers.1.mlp.gate.e_score_correction_bias"
    )


def test_deinterleaved_vllm_rope_equals_hfs_interleave_layout() -> None:
    """vLLM's GPT-J rotation, de-interleaved, is bitwise HF's apply_rotary_pos_emb_interleave (fp32 math)."""
    import torch
    from logdiff.probes.selection import deinterleave
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 6, 64), torch.randn(1, 1, 6, 64)
    freqs = torch.arange(6)[:, None].float() * (1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.cat((freqs, freqs), dim=-1)
    hq, hk = hf.apply_rotary_pos_emb_interleave(q, k, emb.cos()[None], emb.sin()[None])

    def gptj(x: torch.Tensor) -> torch.Tensor:  # vLLM's forward_native with is_neox_style=False
        cos, sin, x1, x2 = freqs.cos(), freqs.sin(), x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    assert torch.equal(hq, deinterleave(gptj(q))) and torch.equal(hk, deinterleave(gptj(k)))
    assert not torch.equal(hq, gptj(q))  # control: compared as stored, the layouts differ
