"""The exact functions and their rounding bounds, without engines.

For each op: a stock bf16 implementation of the contracted function lands
within the bound (the control that must call it equal), and the same op with
one contracted feature dropped or changed lands far outside (the planted
divergence it must find). The bounds are derived, not fitted: these tests pin
that the derivation holds for torch's own kernels on this machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logdiff.diagnosis import exact
from logdiff.diagnosis.conformance import Conformance, SideCheck
from logdiff.diagnosis.spacing import OpBound, eps

BF16 = eps("bfloat16")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def units(actual: torch.Tensor, ex: exact.Exact) -> tuple[float, float]:
    return exact.error_units(actual, ex, BF16), ex.bound.units("bfloat16")


def test_bound_arithmetic() -> None:
    # one rounding to bf16 moves a value by at most half a spacing: 0.5 units, doubled by the slack
    assert OpBound(1.0).units("bfloat16") == pytest.approx(1.0, rel=1e-3)
    # an fp32 reduction of length K adds K * eps32 / eps in the dtype's units
    long = OpBound(1.0, 1 << 16).units("bfloat16")
    assert long == pytest.approx(2 * (0.5 + (1 << 16) * 2.0**-23 / BF16))
    assert eps("float32") == 2.0**-23 and eps("torch.bfloat16") == BF16


def test_linear_in_bf16_is_within_and_a_misloaded_weight_is_not() -> None:
    x = torch.randn(64, 256, generator=_gen()).bfloat16()
    w = torch.randn(96, 256, generator=_gen(1)).bfloat16() * 0.05
    err, bound = units(F.linear(x, w), exact.linear(x, w))
    assert err <= bound
    # split-K with each half rounded to bf16 (the reduction-order plant): the same function, within
    k = x.shape[1] // 2
    split = F.linear(x[:, :k], w[:, :k]) + F.linear(x[:, k:], w[:, k:])
    err, bound = units(split, exact.linear(x, w))
    assert err <= bound
    # rows shifted by one (a mis-loaded shard): another function. The bound counts the sum of |x w|, so
    # a small weight change hides under it; the weight fingerprints catch those (preflight.py)
    err, bound = units(F.linear(x, w.roll(1, 0)), exact.linear(x, w))
    assert err > 4 * bound


def test_rms_norm_within_and_an_ignored_eps_outside() -> None:
    x = torch.randn(32, 128, generator=_gen()).bfloat16() * 0.05  # mean(x^2) ~ 2.5e-3: eps matters
    w = (1 + 0.1 * torch.randn(128, generator=_gen(1))).bfloat16()
    hf = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-3)).bfloat16() * w
    err, bound = units(hf, exact.rms_norm(x, w, 1e-3, offset=False))
    assert err <= bound
    ignored = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * w
    err, bound = units(ignored, exact.rms_norm(x, w, 1e-3, offset=False))
    assert err > 4 * bound


def test_rms_norm_groups_per_head_and_gemma_offset() -> None:
    x = torch.randn(8, 4 * 16, generator=_gen()).double()
    w = torch.randn(16, generator=_gen(1)).double()
    got = exact.rms_norm(x, w, 1e-6, offset=True).value.reshape(8, 4, 16)
    heads = x.reshape(8, 4, 16)
    want = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


#: an HF activation name -> torch's bf16 implementation of it
TORCH_ACT = {"silu": F.silu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu,
             "gelu_new": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}  # fmt: skip


@pytest.mark.parametrize("activation", sorted(TORCH_ACT))
def test_gated_activation(activation: str) -> None:
    g = torch.randn(32, 64, generator=_gen()).bfloat16()
    u = torch.randn(32, 64, generator=_gen(1)).bfloat16()
    err, bound = units(TORCH_ACT[activation](g) * u, exact.act_mul(g, u, activation))
    assert err <= bound
    other = F.silu(g) if activation != "silu" else F.gelu(g)  # the wrong activation
    err, bound = units(other * u, exact.act_mul(g, u, activation))
    assert err > 4 * bound


def _hf_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb in bf16 on [rows, heads * dim] rows."""
    freqs = pos.float()[:, None] * inv_freq.float()[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().bfloat16()[:, None], emb.sin().bfloat16()[:, None]
    q = x.reshape(x.shape[0], heads, -1)
    half = q.shape[-1] // 2
    turned = torch.cat([-q[..., half:], q[..., :half]], -1)
    return (q * cos + turned * sin).reshape(x.shape)


def test_rope_within_and_another_base_outside() -> None:
    heads, dim = 4, 32
    x = torch.randn(40, heads * dim, generator=_gen()).bfloat16()
    pos = torch.arange(40)
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    err, bound = units(_hf_rope(x, pos, inv, heads), exact.rope(x, pos, inv, 1.0, heads, dim))
    assert err <= bound
    other = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    err, bound = units(_hf_rope(x, pos, other, heads), exact.rope(x, pos, inv, 1.0, heads, dim))
    assert err > 4 * bound


def test_rope_in_float32_far_from_position_0_allows_the_angles_rounding_and_no_more() -> None:
    """In float32 the angle's own rounding (position * inv_freq in float32, as every engine computes it) moves an
    output by more than the output's spacing at large positions (TRL's left-padded rows start there): allowed,
    in proportion to the angle; a base 0.1% off is still far outside."""
    heads, dim = 4, 32
    x = torch.randn(64, heads * dim, generator=_gen())
    pos = torch.arange(2000, 2064)
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def hf_fp32(inv_freq: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * inv_freq.float()[None]
        emb = torch.cat([freqs, freqs], -1)
        q = x.reshape(x.shape[0], heads, -1)
        turned = torch.cat([-q[..., dim // 2 :], q[..., : dim // 2]], -1)
        return (q * emb.cos()[:, None] + turned * emb.sin()[:, None]).reshape(x.shape)

    ex, bound = exact.rope(x, pos, inv, 1.0, heads, dim), OpBound(4.0).units("float32")

    def err(actual: torch.Tensor, ex: exact.Exact) -> float:
        return exact.error_units(actual, ex, eps("float32"))

    assert err(hf_fp32(inv), ex) <= bound
    assert err(hf_fp32(inv), exact.Exact(ex.value, ex.scale, ex.bound, ex.function)) > bound  # without it: outside
    other = 1.0 / 10010.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert err(hf_fp32(other), ex) > 4 * bound


def test_embedding_rows_rounded_once_are_within_and_another_row_outside() -> None:
    """The embedding's exact function is the training weight's rows: an engine holding them in bf16 (an fp32
    trainer's weights synced into a bf16 vLLM) is within one rounding; a stale row or a dropped scale is not."""
    weight = torch.randn(50, 64, generator=_gen(3))
    tokens = torch.tensor([3, 7, 7, 42])
    ex = exact.embedding(weight, tokens)
    assert units(weight.bfloat16()[tokens], ex)[0] <= units(weight.bfloat16()[tokens], ex)[1]
    assert units(weight.bfloat16()[tokens + 1], ex)[0] > 4 * ex.bound.units("bfloat16")
    scaled = exact.embedding(weight, tokens, 8.0)
    assert units((weight[tokens] * 8.0).bfloat16(), scaled)[0] <= scaled.bound.units("bfloat16")
    assert units(weight.bfloat16()[tokens], scaled)[0] > 4 * scaled.bound.units("bfloat16")


def test_rope_interleaved_pairs() -> None:
    """GPT-J style (DeepSeek's complex multiply) rotates (x0, x1), (x2, x3), ... by the i-th frequency."""
    x = torch.randn(6, 2 * 8, generator=_gen()).double()
    pos = torch.arange(6)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    got = exact.rope(x, pos, inv, 1.0, 2, 8, style="gptj").value
    z = torch.view_as_complex(x.reshape(6, 2, 4, 2).contiguous())
    turn = torch.polar(torch.ones(6, 4, dtype=torch.float64), pos[:, None].double() * inv[None])[:, None]
    assert torch.allclose(got, torch.view_as_real(z * turn).reshape(6, 16), rtol=0, atol=1e-12)
    neox = exact.rope(x, pos, inv, 1.0, 2, 8, style="neox").value
    assert not torch.allclose(got, neox)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float, window: int | None = None):
    t, s = q.shape[0], k.shape[0]
    d = q.shape[1] // heads
    kvh = k.shape[1] // d
    qh = q.reshape(1, t, heads, d).transpose(1, 2)
    kh = k.reshape(1, s, kvh, d).transpose(1, 2).repeat_interleave(heads // kvh, 1)
    vh = v.reshape(1, s, kvh, d).transpose(1, 2).repeat_interleave(heads // kvh, 1)
    mask = torch.ones(t, s, dtype=torch.bool).tril()
    if window:
        mask &= ~torch.ones(t, s, dtype=torch.bool).tril(-window)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(t, -1)


def _qkv(t: int = 24, heads: int = 4, kv_heads: int = 2, d: int = 16) -> tuple[torch.Tensor, ...]:
    q = (torch.randn(t, heads * d, generator=_gen()) * 2).bfloat16()
    k = (torch.randn(t, kv_heads * d, generator=_gen(1)) * 2).bfloat16()
    v = torch.randn(t, kv_heads * d, generator=_gen(2)).bfloat16()
    return q, k, v


def test_attention_within_and_each_dropped_feature_outside() -> None:
    q, k, v = _qkv()
    pos = torch.arange(q.shape[0])
    ex = exact.attention(q, k, v, pos, 4, 0.25, None, None)
    err, bound = units(_sdpa(q, k, v, 4, 0.25), ex)
    assert err <= bound
    # a soft cap the implementation drops
    err, bound = units(_sdpa(q, k, v, 4, 0.25), exact.attention(q, k, v, pos, 4, 0.25, 2.0, None))
    assert err > 4 * bound
    # a window it ignores
    err, bound = units(_sdpa(q, k, v, 4, 0.25), exact.attention(q, k, v, pos, 4, 0.25, None, 4))
    assert err > 4 * bound
    err, bound = units(_sdpa(q, k, v, 4, 0.25, window=4), exact.attention(q, k, v, pos, 4, 0.25, None, 4))
    assert err <= bound
    # a scale it ignores (the default 1/sqrt(d) instead of the configured 1/sqrt(64), Gemma's query_pre_attn_scalar)
    configured = exact.attention(q, k, v, pos, 4, 64**-0.5, None, None)
    err, bound = units(_sdpa(q, k, v, 4, 64**-0.5), configured)
    assert err <= bound
    err, bound = units(_sdpa(q, k, v, 4, 16**-0.5), configured)
    assert err > 4 * bound


def test_attention_queries_at_later_positions_see_every_earlier_key() -> None:
    q, k, v = _qkv(t=12)
    full = exact.attention(q, k, v, torch.arange(12), 4, 0.25, None, None).value
    tail = exact.attention(q[8:], k, v, torch.arange(8, 12), 4, 0.25, None, None).value
    assert torch.equal(full[8:], tail)


def test_log_softmax_and_a_temperature_applied_on_one_side() -> None:
    z = (torch.randn(16, 512, generator=_gen()) * 4).bfloat16()
    err, bound = units(torch.log_softmax(z.float(), -1), exact.log_softmax(z, 1.0))
    assert err <= bound
    err, bound = units(torch.log_softmax(z.float() / 0.7, -1), exact.log_softmax(z, 1.0))
    assert err > 4 * bound


def test_conformance_decision() -> None:
    inside = SideCheck(0.8, 3.0, 10, "f")
    outside = SideCheck(30.0, 3.0, 10, "f")
    both = Conformance({"train": inside, "infer": inside})
    assert both.decided and both.outside == []
    one = Conformance({"train": inside, "infer": outside})
    assert one.outside == ["infer"]
    assert Conformance({"train": inside}, unchecked="why").decided is False
    lines = one.evidence({"train": "hf", "infer": "vllm"})
    assert "OUTSIDE" in lines[1] and "vllm" in lines[1]
    assert one.to_dict()["infer"] == {"error": 30.0, "bound": 3.0, "rows": 10, "function": "f"}


# --- the classification rule on conformance, without engines -----------------------------------

PATHS = {"train": "hf", "infer": "vllm"}
INSIDE, OUTSIDE = SideCheck(0.8, 3.0, 10, "f"), SideCheck(40.0, 3.0, 10, "f")


def _contracts(unverified: list[str] | None = None, **sides: dict) -> dict:
    same = {"rms_norm_eps": 1e-6, "attn_logit_softcapping": 50.0}
    return {"train": {**same, **sides.get("train", {})}, "infer": {**same, **sides.get("infer", {})},
            "differs": [k for k in sides.get("differs", [])], "weights": {"differs": [], "unverified": unverified or []}}


def _op(conf: Conformance, vanished: bool | None = None, boundary: str = "model.layers.1.input_layernorm",
        kind: str = "norm"):  # fmt: skip
    from logdiff.diagnosis.classify import OpEvidence

    return OpEvidence(boundary, kind, 1, 1e-3, 5.0, vanished, conf, PATHS)


def test_both_sides_within_is_operator_path_without_a_rerun() -> None:
    from logdiff.diagnosis.classify import classify_op

    c = classify_op(_op(Conformance({"train": INSIDE, "infer": INSIDE})), _contracts(), fused_add_norm=True)
    assert (c.class_, c.kind) == ("operator_path", "fused_vs_unfused")
    assert c.conformance["train"]["error"] == 0.8 and "within" in " ".join(c.evidence)


@pytest.mark.parametrize(("boundary", "kind", "own", "foreign"), [
    ("model.layers.1.self_attn.rope_q", "rope", "logdiff.kernels.rope", ("silu", "act(gate)", "GEMM")),
    ("model.layers.1.mlp.act_mul", "act", "logdiff.kernels.silu_and_mul", ("RoPE", "cos/sin", "GEMM")),
    ("model.layers.1.mlp.down_proj", "linear", "logdiff.kernels.linear", ("RoPE", "silu", "norm")),
    ("model.layers.1.input_layernorm", "norm", "logdiff.kernels.rms_norm", ("RoPE", "silu", "GEMM")),
    ("model.embed_tokens", "embed", "embed_scale", ("RoPE", "silu", "GEMM")),
])  # fmt: skip
def test_an_operator_path_cause_carries_its_own_ops_fix(boundary: str, kind: str, own: str, foreign: tuple) -> None:
    """Issue 52: the RoPE cause's fix talked about silu*up. Each op's fix names its own kernel and no other
    family's step (an unfused norm: its sum of squares, not a GEMM)."""
    from logdiff.diagnosis.classify import classify_op

    c = classify_op(_op(Conformance({"train": INSIDE, "infer": INSIDE}), boundary=boundary, kind=kind), _contracts(),
                    fused_add_norm=False)
    assert c.class_ == "operator_path" and own in c.fix, c.fix
    assert not any(word in c.fix for word in foreign), c.fix


def test_every_ops_own_fix_names_only_kernels_of_its_family() -> None:
    """The negative control over the whole table: a ``logdiff.kernels.X`` in an op's fix is X of that op's family
    (the router's GEMM is the moe family's router kernel, logdiff.kernels.linear inside it)."""
    import re

    from logdiff.comparison.cause import FAMILY
    from logdiff.diagnosis.fixes import OP_FIX

    own = {"rms_norm": {"rms_norm"}, "rope": {"rope"}, "silu_and_mul": {"silu_and_mul"}, "log_softmax": {"log_softmax"},
           "moe": {"linear", "moe_route", "moe_combine"}, None: set()}
    for (kind, op_kind), text in OP_FIX.items():
        named = set(re.findall(r"logdiff\.kernels\.(\w+)", text))
        assert named <= own[FAMILY.get(op_kind)], (kind, op_kind, named)


def test_one_side_outside_is_semantic_and_names_it_even_if_the_rerun_would_close_it() -> None:
    from logdiff.diagnosis.classify import classify_op

    for side, path in (("train", "hf"), ("infer", "vllm")):
        sides = {"train": INSIDE, "infer": INSIDE, side: OUTSIDE}
        c = classify_op(_op(Conformance(sides), vanished=True), _contracts(), fused_add_norm=True)
        assert (c.class_, c.kind, c.paths) == ("framework_difference", "semantic", [path])
        assert "no kernel change" in c.fix


def test_outside_reading_an_unverified_weight_is_a_possible_weights_cause() -> None:
    from logdiff.diagnosis.classify import classify_op

    w = "model.layers.1.mlp.down_proj.weight"
    conf = Conformance({"train": INSIDE, "infer": OUTSIDE})
    c = classify_op(_op(conf, boundary="model.layers.1.mlp.down_proj", kind="linear"), _contracts([w]), True)
    assert (c.class_, c.kind, c.differs) == ("framework_difference", "weights", [w])


def test_both_outside_is_not_conclusive_and_not_judged() -> None:
    """The rerun's answer goes into the evidence, never into the class."""
    from logdiff.diagnosis.classify import classify_op

    conf = Conformance({"train": OUTSIDE, "infer": OUTSIDE})
    assert conf.decided and not conf.conclusive
    c = classify_op(_op(conf, vanished=True), _contracts(), fused_add_norm=True)
    assert (c.class_, c.kind) == ("not_judged", "not_judged")
    assert "not conclusive" in " ".join(c.evidence) and "vanishes with the reference kernel" in " ".join(c.evidence)


def test_a_feature_the_implementation_drops_is_semantic_from_the_contract() -> None:
    from logdiff.diagnosis.classify import classify_op
    from logdiff.diagnosis.preflight import compare_contracts
    from logdiff.probes.contracts import effective

    train = effective({"attn_logit_softcapping": 50.0, "attention_scale": 0.125}, {"attn_logit_softcapping": "sdpa drops it"})
    infer = {"attn_logit_softcapping": 50.0, "attention_scale": 0.125}
    contracts = compare_contracts(train, infer)
    assert contracts["differs"] == ["attn_logit_softcapping"] and contracts["unknown"] == []
    conf = Conformance({"train": INSIDE, "infer": INSIDE})
    ev = _op(conf, boundary="model.layers.0.self_attn.attn_core", kind="attn")
    c = classify_op(ev, {**contracts, "weights": None}, fused_add_norm=True, adapter=_gemma2())
    assert (c.class_, c.kind, c.paths) == ("framework_difference", "semantic", ["hf"])
    assert any("sdpa drops it" in line for line in c.evidence)


def test_a_key_read_on_one_side_only_is_unknown_never_equal() -> None:
    from logdiff.diagnosis.preflight import compare_contracts

    out = compare_contracts({"a": 1, "b": None, "attn_implementation": "sdpa"}, {"a": 1, "b": 2, "attn_implementation": "X"})
    assert out["differs"] == [] and out["unknown"] == ["b"]


def _gemma2():
    from logdiff.probes.arch import adapter_for

    return adapter_for("Gemma2ForCausalLM")
