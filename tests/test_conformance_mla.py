"""The exact function of DeepSeek's MLA latent attention (logdiff/diagnosis/exact_mla.py) and its bound.

Without engines: the fp64 function against a straightforward per-head, per-query
evaluation of the paper's definition; bf16 MLA computed both ways an engine
does (HF's explicit up-projection through its own attention functions, and the
absorbed association of vLLM's decode) within the bound; a side with another
softmax scale, or a stale ``kv_b_proj``, outside. Then HF's own bf16 MLA on the
DeepSeek-V2/V3 demo models (the controls that must be called equal) and, with
the real vLLM, a stale ``kv_b_proj`` on the inference side found at the latent
attention as a framework difference with that side outside, and the stock scans
with no framework difference there. No assertion depends on the CPU's kernels:
the exact side is fp64 and the bound derived.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from logdiff.diagnosis import exact_mla
from logdiff.diagnosis.exact import error_units
from logdiff.diagnosis.spacing import OpBound, eps

BF16 = eps("bfloat16")
H, NOPE, ROPE, DV, RANK = 4, 32, 16, 24, 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(t: int = 20, seed: int = 0) -> dict[str, Any]:
    """Random bf16 MLA inputs of one sequence: q nope/rope, a normed-like latent, the shared k rope, kv_b_proj."""
    return {
        "q_nope": (torch.randn(t, H * NOPE, generator=_gen(seed)) * 2).bfloat16(),
        "q_rope": (torch.randn(t, H * ROPE, generator=_gen(seed + 1)) * 2).bfloat16(),
        "latent": torch.randn(t, RANK, generator=_gen(seed + 2)).bfloat16(),
        "k_rope": (torch.randn(t, ROPE, generator=_gen(seed + 3)) * 2).bfloat16(),
        "w": (torch.randn(H * (NOPE + DV), RANK, generator=_gen(seed + 4)) * RANK**-0.5).bfloat16(),
    }


SCALE = (NOPE + ROPE) ** -0.5


def _exact(x: dict[str, Any], scale: float = SCALE, w: Any = None, pos: Any = None) -> exact_mla.Exact:
    up = exact_mla.LatentUp.of(x["w"] if w is None else w, NOPE, DV)
    pos = torch.arange(x["q_nope"].shape[0]) if pos is None else pos
    q_nope, q_rope = x["q_nope"][pos], x["q_rope"][pos]
    return exact_mla.latent_attention(q_nope, q_rope, x["latent"], x["k_rope"], up, pos, scale)


def _units(actual: torch.Tensor, ex: exact_mla.Exact) -> tuple[float, float]:
    return error_units(actual, ex, BF16), ex.bound.units("bfloat16")


def _naive(x: dict[str, Any], scale: float) -> torch.Tensor:
    """The definition, one head and one query at a time, in fp64 (no shared code with exact_mla)."""
    t = x["q_nope"].shape[0]
    c, w = x["latent"].double(), x["w"].double().reshape(H, NOPE + DV, RANK)
    out = torch.zeros(t, H, DV, dtype=torch.float64)
    for h in range(H):
        kv = c @ w[h].T  # [S, nope + v]
        k = torch.cat([kv[:, :NOPE], x["k_rope"].double()], -1)
        v = kv[:, NOPE:]
        for i in range(t):
            q = torch.cat([x["q_nope"][i, h * NOPE : (h + 1) * NOPE], x["q_rope"][i, h * ROPE : (h + 1) * ROPE]])
            s = [scale * float(q.double() @ k[j]) for j in range(i + 1)]
            m = max(s)
            e = [math.exp(z - m) for z in s]
            for j in range(i + 1):
                out[i, h] += e[j] / sum(e) * v[j]
    return out.reshape(t, H * DV)


def _explicit_bf16(x: dict[str, Any], scale: float, w: Any = None, sdpa: bool = False) -> torch.Tensor:
    """HF's steps in bf16: ``kv_b_proj`` up-projection, k = [k_nope | k_rope], then HF's eager attention
    function (or torch's SDPA, HF's ``sdpa``)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import eager_attention_forward

    t = x["q_nope"].shape[0]
    kv = F.linear(x["latent"], x["w"] if w is None else w).view(1, t, H, NOPE + DV).transpose(1, 2)
    k = torch.cat([kv[..., :NOPE], x["k_rope"].view(1, 1, t, ROPE).expand(1, H, t, ROPE)], -1)
    v = kv[..., NOPE:]
    q = torch.cat([x["q_nope"].view(1, t, H, NOPE), x["q_rope"].view(1, t, H, ROPE)], -1).transpose(1, 2)
    if sdpa:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)
    else:
        mask = torch.full((t, t), float("-inf")).triu(1).bfloat16()[None, None]

        class Owner(torch.nn.Module):
            num_key_value_groups = 1

        out, _ = eager_attention_forward(Owner().eval(), q, k, v, mask, scaling=scale)
    return out.reshape(t, H * DV)


def _absorbed_bf16(x: dict[str, Any], scale: float) -> torch.Tensor:
    """vLLM's decode association in bf16: ``q_nope W_UK`` against the latent, ``(p @ c) W_UV^T`` after."""
    t = x["q_nope"].shape[0]
    w = x["w"].reshape(H, NOPE + DV, RANK)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]  # [H, nope, R], [H, v, R]
    q_lat = torch.einsum("thn,hnr->thr", x["q_nope"].view(t, H, NOPE), w_uk)  # rounded to bf16
    q = torch.cat([q_lat, x["q_rope"].view(t, H, ROPE)], -1).transpose(0, 1)  # [H, T, R + rope]
    kv = torch.cat([x["latent"], x["k_rope"]], -1)  # [S, R + rope]
    scores = (q @ kv.T).float() * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(scores, -1).bfloat16()
    o_lat = p @ x["latent"]  # [H, T, R]
    return torch.einsum("htr,hvr->thv", o_lat, w_uv).reshape(t, H * DV)


def test_exact_function_is_the_definition() -> None:
    x = _inputs(t=9)
    got = _exact(x).value
    assert torch.allclose(got, _naive(x, SCALE), rtol=1e-10, atol=1e-12)
    # later queries alone see every earlier key: the same rows
    tail = _exact(x, pos=torch.arange(5, 9)).value
    assert torch.allclose(tail, got[5:], rtol=1e-12, atol=0)


def test_scale_bounds_the_output_and_holds_the_up_projection_term() -> None:
    """The scale (the first-order error in units of eps) is at least |o| (cancellation never shrinks the bound),
    and more than plain attention's on the same fp64 k and v: the up-projection's rounding, propagated."""
    from logdiff.diagnosis import exact

    x = _inputs()
    ex = _exact(x)
    assert bool((ex.scale >= ex.value.abs()).all())
    t = x["q_nope"].shape[0]
    kv = (x["latent"].double() @ x["w"].double().T).view(t, H, NOPE + DV)
    k = torch.cat([kv[..., :NOPE], x["k_rope"].double()[:, None].expand(t, H, ROPE)], -1).reshape(t, -1)
    q = torch.cat([x["q_nope"].double().view(t, H, NOPE), x["q_rope"].double().view(t, H, ROPE)], -1)
    plain = exact.attention(q.reshape(t, -1), k, kv[..., NOPE:].reshape(t, -1), torch.arange(t), H, SCALE, None, None)
    assert torch.equal(plain.value, ex.value)
    assert bool((ex.scale > plain.bound.roundings / 2 * plain.scale).all()) and ex.bound == OpBound(2.0)


def test_rounding_only_the_up_projection_is_within() -> None:
    """k_nope and v rounded to bf16 once, everything else exact: the first-order term alone must cover it."""
    x = _inputs()
    t = x["q_nope"].shape[0]
    kv = (x["latent"].double() @ x["w"].double().T).bfloat16().double().view(t, H, NOPE + DV)
    k = torch.cat([kv[..., :NOPE], x["k_rope"].double()[:, None].expand(t, H, ROPE)], -1)
    q = torch.cat([x["q_nope"].double().view(t, H, NOPE), x["q_rope"].double().view(t, H, ROPE)], -1)
    s = torch.einsum("thd,shd->hts", q, k) * SCALE
    p = torch.softmax(s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1)[None], float("-inf")), -1)
    out = torch.einsum("hts,shd->thd", p, kv[..., NOPE:]).reshape(t, -1)
    err, bound = _units(out, _exact(x))
    assert 0 < err <= bound


@pytest.mark.parametrize("how", ["eager", "sdpa", "absorbed"])
def test_bf16_mla_is_within_whichever_association(how: str) -> None:
    """HF's explicit up-projection (eager or SDPA) and vLLM's absorbed decode: the same function, within."""
    for seed in range(3):
        x = _inputs(seed=10 * seed)
        out = _absorbed_bf16(x, SCALE) if how == "absorbed" else _explicit_bf16(x, SCALE, sdpa=how == "sdpa")
        err, bound = _units(out, _exact(x))
        assert err <= bound, f"seed {seed}: {err:.3g} units against a bound of {bound:.3g}"


@pytest.mark.parametrize("how", ["eager", "absorbed"])
def test_another_softmax_scale_is_outside(how: str) -> None:
    """A side that drops yarn's mscale ** 2 (factor 4, mscale_all_dim 0.707: x1.21) computes another function."""
    x = _inputs()
    m = 0.1 * 0.707 * math.log(4.0) + 1.0
    out = _absorbed_bf16(x, SCALE) if how == "absorbed" else _explicit_bf16(x, SCALE)
    err, bound = _units(out, _exact(x, scale=SCALE * m * m))
    assert err > bound


def test_a_stale_up_projection_is_outside() -> None:
    """A side that up-projects the latent with another kv_b_proj (scaled, or one step of noise off) is outside."""
    x = _inputs()
    for stale in (x["w"] * 1.5, (x["w"].float() + 0.05 * torch.randn(x["w"].shape, generator=_gen(7))).bfloat16()):
        err, bound = _units(_explicit_bf16(x, SCALE, w=stale), _exact(x))
        assert err > bound


def test_softmax_scale_is_the_configs_definition() -> None:
    base = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64}
    assert exact_mla.softmax_scale(base) == 192**-0.5
    yarn = {**base, "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    m = 0.1 * math.log(40.0) + 1.0
    assert exact_mla.softmax_scale(yarn) == pytest.approx(192**-0.5 * m * m, rel=1e-15)
    no_all_dim = {**base, "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0}}
    assert exact_mla.softmax_scale(no_all_dim) == 192**-0.5


def test_kv_b_proj_rows_must_split_per_head() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        exact_mla.LatentUp.of(torch.zeros(100, RANK), NOPE, DV)


# --- HF's own MLA on the DeepSeek demo models ------------------------------------------------------


@contextlib.contextmanager
def _capture(model: Any) -> Iterator[dict[int, dict[str, Any]]]:
    """Forward hooks and an attention-interface wrapper that keep every layer's MLA inputs and output."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    layers = {id(layer.self_attn): n for n, layer in enumerate(model.model.layers)}
    seen: dict[int, dict[str, Any]] = {n: {} for n in layers.values()}
    impl = model.config._attn_implementation
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had = impl in local
    original = local.get(impl) or ALL_ATTENTION_FUNCTIONS._global_mapping.get(impl)
    if original is None:
        original = sys.modules[type(model.model.layers[0].self_attn).__module__].eager_attention_forward

    def wrapped(owner: Any, q: Any, k: Any, v: Any, *a: Any, **kw: Any) -> Any:
        out = original(owner, q, k, v, *a, **kw)
        seen[layers[id(owner)]].update(q=q, k=k, out=out[0], scaling=kw.get("scaling"))
        return out

    def keep_latent(n: int) -> Any:
        return lambda module, args, out: seen[n].update(latent=out)

    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(keep_latent(n))
             for n, layer in enumerate(model.model.layers)]  # fmt: skip
    local[impl] = wrapped
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()
        if had:
            local[impl] = original
        else:
            local.pop(impl, None)


def _hf_sites(model: Any, ids: torch.Tensor) -> list[dict[str, Any]]:
    """HF's MLA inputs and output of every layer on one sequence, as the probes hold them (rows)."""
    with _capture(model) as seen, torch.no_grad():
        model(ids[None])
    t, sites = ids.shape[0], []
    for n, layer in enumerate(model.model.layers):
        nope = layer.self_attn.qk_nope_head_dim
        q, k = seen[n]["q"][0].transpose(0, 1), seen[n]["k"][0]  # [T, H, nope + rope], [H, S, nope + rope]
        sites.append({
            "q_nope": q[..., :nope].reshape(t, -1), "q_rope": q[..., nope:].reshape(t, -1),
            "latent": seen[n]["latent"][0], "k_rope": k[0, :, nope:], "out": seen[n]["out"][0].reshape(t, -1),
            "scaling": seen[n]["scaling"], "up": exact_mla.LatentUp.of_module(layer.self_attn),
        })  # fmt: skip
    return sites


def _site_units(site: dict[str, Any], scale: float, up: Any = None) -> tuple[float, float]:
    pos = torch.arange(site["q_nope"].shape[0])
    ex = exact_mla.latent_attention(site["q_nope"], site["q_rope"], site["latent"], site["k_rope"],
                                    up or site["up"], pos, scale)  # fmt: skip
    return _units(site["out"], ex)


@pytest.fixture(scope="module", params=["deepseek-v2", "deepseek-v3"])
def hf_mla(request: pytest.FixtureRequest, demo_model: Callable[[str], Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model(request.param), dtype=torch.bfloat16).eval()
    return {"arch": request.param, "model": model}


#: a real DeepSeek-V3 checkpoint's yarn (factor 40, mscale_all_dim 1): the mscale ** 2 a side may drop
V3_MSCALE2 = (0.1 * math.log(40.0) + 1.0) ** 2


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_demo_mla_is_within_its_own_contract(hf_mla: dict[str, Any], impl: str) -> None:
    """HF's bf16 MLA (eager and SDPA) on the demo, every layer: within the bound of the function at its own
    contract's scale (the config's definition); against another layer's kv_b_proj, outside."""
    from logdiff.sources.hf.contract import hf_contract

    model = hf_mla["model"]
    model.config._attn_implementation = impl
    scale = float(hf_contract(model, {})["attention_scale"])
    assert scale == pytest.approx(exact_mla.softmax_scale(model.config.to_dict()), rel=1e-12)
    sites = _hf_sites(model, torch.randint(0, model.config.vocab_size, (40,), generator=_gen(0)))
    for n, site in enumerate(sites):
        assert site["scaling"] == scale
        err, bound = _site_units(site, scale)
        assert err <= bound, f"{hf_mla['arch']} {impl} layer {n}: {err:.3g} units against a bound of {bound:.3g}"
        err, bound = _site_units(site, scale, sites[(n + 1) % len(sites)]["up"])
        assert err > bound, f"layer {n} against the next layer's kv_b_proj"


def test_hf_demo_mla_with_another_softmax_scale_is_outside(hf_mla: dict[str, Any]) -> None:
    """A side whose contract names a real V3's yarn scale (mscale ** 2 = 1.87 folded in) while it computes the
    plain one is outside. Layer 0, whose scores are not saturated: where a layer's softmax is nearly one-hot, a
    scale change moves its output less than the bound (the attention's own |s| |v - o| term), and hides."""
    model = hf_mla["model"]
    model.config._attn_implementation = "eager"
    site = _hf_sites(model, torch.randint(0, model.config.vocab_size, (40,), generator=_gen(0)))[0]
    err, bound = _site_units(site, site["scaling"] * V3_MSCALE2)
    assert err > bound


def test_hf_demo_mla_with_a_stale_kv_b_proj_is_outside(hf_mla: dict[str, Any]) -> None:
    """HF itself running a kv_b_proj scaled by 1.5 (the planted weight) is outside the function of the shared one."""
    model = hf_mla["model"]
    model.config._attn_implementation = "sdpa"
    attn = model.model.layers[1].self_attn
    shared = exact_mla.LatentUp.of_module(attn)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=_gen(1))
    kept = attn.kv_b_proj.weight.data.clone()
    try:
        attn.kv_b_proj.weight.data.mul_(1.5)
        site = _hf_sites(model, ids)[1]
    finally:
        attn.kv_b_proj.weight.data.copy_(kept)
    err, bound = _site_units(site, float(attn.scaling), shared)
    assert err > bound


# --- the real vLLM ------------------------------------------------------------------------------------

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}


@pytest.mark.vllm
def test_stale_kv_b_proj_on_vllm_is_outside_at_the_latent_attention(
    demo_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """A stale kv_b_proj on the inference side: the latent attention is a framework difference, vLLM's side
    outside the bound of the shared weight's function, HF's within."""
    from plants import stale_checkpoint

    import logdiff

    model = demo_model("deepseek-v2")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    r = logdiff.scan(model, infer=["vllm"], infer_ckpt=stale_checkpoint(model, tmp_path, name, lambda w: w * 1.5),
                     **SMALL)  # fmt: skip
    causes = {c["boundary"]: c for c in r["causes"]}
    latent = causes.get("model.layers.1.self_attn.latent_attn")
    assert latent is not None, r["causes"]
    assert latent["class"] == "framework_difference" and latent["differs"] == [name], latent
    conf = latent["conformance"]
    assert conf["infer"]["error"] > conf["infer"]["bound"], conf
    assert conf["train"]["error"] <= conf["train"]["bound"], conf
    assert "latent_attention" in conf["infer"]["function"]
    assert any("vllm" in line and "OUTSIDE" in line for line in latent["evidence"]), latent["evidence"]


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_stock_scan_judges_the_latent_attention_by_both_sides_conformance(
    demo_model: Callable[[str], Path], stock_varies: Callable[[bool, str], None], shared_scan: Callable[..., dict],
    arch: str,
) -> None:
    """The stock demo against vLLM: no framework difference at the latent attention; each latent attention that
    introduces error is judged by both sides' conformance, both within (operator path)."""
    r = shared_scan(demo_model(arch), infer=["vllm"], **SMALL)  # test_architectures.py's scan of it
    latent = [c for c in r["causes"] if c["boundary"].endswith("self_attn.latent_attn")]
    stock_varies(not latent, f"stock {arch} MLA attention introduces no error against vLLM's here")
    for c in latent:
        conf = c.get("conformance") or {}
        assert set(conf) >= {"train", "infer"}, c
        assert all(conf[s]["error"] <= conf[s]["bound"] for s in ("train", "infer")), conf
        assert all("latent_attention" in conf[s]["function"] for s in ("train", "infer")), conf
        assert c["class"] == "operator_path", c
