"""The exact function of multi-head latent attention (DeepSeek-V2/V3 MLA), in fp64, with its rounding bound.

MLA, as the DeepSeek-V2 paper defines it (section 2.1), caches per token one
normed latent ``c`` (``kv_lora_rank`` wide, ``R``) and one RoPE'd key
``k_rope`` shared by every head. The up-projection ``W = kv_b_proj.weight``
(``[heads * (nope + v), R]``) gives each head its no-position key and its
value, ``[k_nope_h | v_h] = c W_h^T``; per head

    q_h = [q_nope_h | q_rope_h]        k_h = [k_nope_h | k_rope]
    o_h = softmax_causal(scale * q_h . k_h) @ v_h

and the output is ``[T, heads * v_head_dim]`` (before ``o_proj``). ``scale``
is the softmax scale the side's contract names: ``qk_head_dim ** -0.5``, times
yarn's ``mscale(factor, mscale_all_dim) ** 2`` where the config's RoPE is a
yarn with ``mscale_all_dim`` (``softmax_scale`` writes the definition; both
engines fold it into their own scale, which is what the contract reads).

The op's boundary (``self_attn.latent_attn``, probes/arch/mla.py) has
four recorded inputs, each side's own: the query's no-position part
(``q_proj.nope`` / ``q_b_proj.nope``), the RoPE'd query part (``rope_q``), the
normed latent (``kv_a_layernorm``) and the RoPE'd shared key (``rope_k``). The
RoPE part enters as recorded (RoPE is its own op, judged there); where a
side's rows hold the rotated pairs de-interleaved (V3's ``rope_interleave``),
``rope_q`` and ``rope_k`` are permuted alike per head, which leaves every
``q_rope . k_rope`` unchanged. The weight is the training model's ``kv_b_proj``
(both sides were fingerprinted to share it): a side that up-projects with
another (a stale sync) computes another function.

**Two associations.** HF (and vLLM's prefill) forms ``k_nope`` and ``v``
explicitly. vLLM's decode never does: it absorbs ``W_UK`` into the query
(``q_lat = q_nope W_UK``, scored against the latent) and ``W_UV`` into the
output (``o = (p @ c) W_UV^T``). Both are the same sums, so the exact value is
one; where the roundings fall differs, and the bound takes, per output
element, the larger of the two associations' first-order errors (each row of
an engine is computed wholly one way; which impl the CPU picks does not enter).

**The bound**, in units of the dtype's spacing ``eps`` with ``r = eps32 / eps``
(``fp32_units``), each GEMM accumulating in fp32 and rounding its output once
(``exact_moe``'s convention; ``G = |c| @ |W|^T``, ``o`` the exact output,
``p`` the exact probabilities):

* the attention itself on exact ``k`` and ``v`` (``exact.attention``'s scale
  and bound: scores, probabilities, output rounded): ``(roundings / 2 + S r) * scale_att``;
* explicit: ``e_kv = |kv| / 2 + R r G`` moves ``v`` and ``k_nope``, hence the
  scores by ``sigma_j = |scale| sum_e |q_nope_e| e_k,je`` and the output by
  ``sum_j p_j (e_v,jd + sigma_j |v_jd - o_td|)`` (``do = sum_j p_j ds_j (v_jd - o_td)``);
* absorbed: ``e_lat = |q_lat| / 2 + nope r (|q_nope| @ |W_UK|)`` plus the
  score's fp32 reduction over ``L = R + rope`` give
  ``sigma_j = |scale| (sum_r (e_lat,r + L r |q_lat,r|) |c_jr| + L r sum_e |q_rope,e| |k_rope,je|)``;
  ``p @ c`` rounded and reduced over ``S`` keys, then ``W_UV`` reduced over
  ``R``: ``sum_r |W_UV,dr| (|o_lat,r| / 2 + S r (p @ |c|)_r + R r |o_lat,r|)``;
  the output moves by ``sum_j p_j sigma_j |v_jd - o_td|`` plus that.

``Exact.scale`` is the first-order error in units of ``eps`` and the bound one
rounding's worth with the usual slack (as ``exact_moe``). A stock kernel that
rounded a GEMM's partial sums to the dtype would not be covered (split-K with
bf16 partials); both engines' up-projections reduce in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from logdiff.diagnosis import exact
from logdiff.diagnosis.exact import Exact, _f64
from logdiff.diagnosis.spacing import EPS32, OpBound


@dataclass(frozen=True)
class LatentUp:
    """``kv_b_proj``'s weight widened once (fp64 and its magnitude), with the per-head split it is read in."""

    w64: Any  # [heads * (nope + v), R], fp64
    heads: int
    nope: int  # qk_nope_head_dim
    v_dim: int  # v_head_dim
    fp32_units: float = EPS32 / 2.0**-7  # fp32's spacing in units of the output dtype's (bf16 by default)

    @classmethod
    def of(cls, weight: Any, nope: int, v_dim: int, fp32_units: float = EPS32 / 2.0**-7) -> LatentUp:
        per_head = nope + v_dim
        rows = int(weight.shape[0])
        if rows % per_head:
            raise ValueError(f"kv_b_proj has {rows} rows, not a multiple of qk_nope_head_dim + v_head_dim = {per_head}")
        return cls(_f64(weight), rows // per_head, nope, v_dim, fp32_units)

    @classmethod
    def of_module(cls, attention: Any, fp32_units: float = EPS32 / 2.0**-7) -> LatentUp:
        """From an HF ``DeepseekV2Attention``/``DeepseekV3Attention`` (its ``kv_b_proj`` and head sizes)."""
        return cls.of(attention.kv_b_proj.weight, int(attention.qk_nope_head_dim), int(attention.v_head_dim),
                      fp32_units)  # fmt: skip

    @property
    def rank(self) -> int:
        return int(self.w64.shape[1])

    def per_head(self) -> tuple[Any, Any]:
        """``(W_UK [H, nope, R], W_UV [H, v, R])``."""
        w = self.w64.reshape(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]


def softmax_scale(config: Mapping[str, Any]) -> float:
    """The MLA softmax scale a config defines: ``(qk_nope + qk_rope) ** -0.5``, times ``mscale ** 2`` with
    ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` for a yarn RoPE with ``mscale_all_dim`` and factor > 1."""
    scale = (int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])) ** -0.5
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor, all_dim = float(rope.get("factor") or 1.0), rope.get("mscale_all_dim")
    if kind != "default" and all_dim and factor > 1:
        m = 0.1 * float(all_dim) * math.log(factor) + 1.0
        scale *= m * m
    return scale


@dataclass
class _Parts:
    """One sequence's fp64 operands, per head: ``q [T, H, nope + rope]``, ``k [S, H, nope + rope]``,
    ``v [S, H, Dv]``, the latent ``c [S, R]``, the exact output ``o [T, H, Dv]`` and probabilities ``p [H, T, S]``."""

    q: Any
    k: Any
    v: Any
    c: Any
    o: Any
    p: Any
    scale: float


def latent_attention(
    q_nope: Any, q_rope: Any, latent: Any, k_rope: Any, up: LatentUp, q_positions: Any, scale: float
) -> Exact:
    """Causal MLA of one sequence: queries ``[T, heads * nope]`` and ``[T, heads * rope]`` at ``q_positions``
    against the latent ``[S, R]`` and shared RoPE'd key ``[S, rope]`` at positions ``0..S-1``
    -> ``[T, heads * v_head_dim]`` (see the module docstring for the function and its bound)."""
    import torch

    h, nope, dv, r = up.heads, up.nope, up.v_dim, up.fp32_units
    t, s = int(q_nope.shape[0]), int(latent.shape[0])
    rope = int(k_rope.shape[-1])
    c = _f64(latent)
    kv = (c @ up.w64.T).reshape(s, h, nope + dv)
    k = torch.cat([kv[..., :nope], _f64(k_rope).reshape(s, 1, rope).expand(s, h, rope)], -1)
    q = torch.cat([_f64(q_nope).reshape(t, h, nope), _f64(q_rope).reshape(t, h, rope)], -1)
    v = kv[..., nope:]
    att = exact.attention(q.reshape(t, -1), k.reshape(s, -1), v.reshape(s, -1), q_positions, h, scale, None, None)
    parts = _Parts(q, k, v, c, att.value.reshape(t, h, dv), _probabilities(q, k, q_positions, scale), scale)
    (values_x, scores_x), (values_a, scores_a) = _explicit(parts, up, kv), _absorbed(parts, up)
    through_x, through_a = _through_scores(parts, [scores_x, scores_a])
    up_projection = torch.maximum(values_x + through_x, values_a + through_a)
    first_order = (att.bound.roundings / 2 + att.bound.length * r) * att.scale + up_projection.reshape(t, h * dv)
    what = f"latent_attention(scale={scale:.6g}, heads={h}, kv_lora_rank={up.rank})"
    # ``first_order`` is the error in units of eps, every rounding counted in it: one rounding's bound
    return Exact(att.value, first_order, OpBound(2.0), what)


def _probabilities(q: Any, k: Any, q_positions: Any, scale: float) -> Any:
    """The exact causal softmax ``[H, T, S]`` (the same as ``exact.attention``'s; the bound needs it per key)."""
    import torch

    scores = torch.einsum("thd,shd->hts", q, k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= q_positions.long()[:, None]
    return torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)


def _explicit(x: _Parts, up: LatentUp, kv: Any) -> tuple[Any, Any]:
    """An explicit up-projection (k_nope and v formed, rounded once): its first-order error through the values
    ``[T, H, Dv]`` and its score errors ``[H, T, S]``."""
    import torch

    g = (x.c.abs() @ up.w64.abs().T).reshape(kv.shape)  # G = |c| @ |W|^T
    e_kv = kv.abs() / 2 + up.rank * up.fp32_units * g
    sigma = abs(x.scale) * torch.einsum("thd,shd->hts", x.q[..., : up.nope].abs(), e_kv[..., : up.nope])
    return torch.einsum("hts,shd->thd", x.p, e_kv[..., up.nope :]), sigma


def _absorbed(x: _Parts, up: LatentUp) -> tuple[Any, Any]:
    """The absorbed association (``q_nope W_UK`` against the latent, ``p @ c`` then ``W_UV``): its first-order
    error through the output projection ``[T, H, Dv]`` and its score errors ``[H, T, S]``."""
    import torch

    r, rank, nope = up.fp32_units, up.rank, up.nope
    w_uk, w_uv = up.per_head()
    q_nope, q_rope, k_rope = x.q[..., :nope], x.q[..., nope:], x.k[:, 0, nope:]
    q_lat = torch.einsum("the,her->thr", q_nope, w_uk)
    length = rank + q_rope.shape[-1]  # the score's reduction: latent plus RoPE part
    e_lat = q_lat.abs() * (0.5 + length * r) + nope * r * torch.einsum("the,her->thr", q_nope.abs(), w_uk.abs())
    sigma = torch.einsum("thr,sr->hts", e_lat, x.c.abs())
    sigma += length * r * torch.einsum("the,se->hts", q_rope.abs(), k_rope.abs())
    o_lat = torch.einsum("hts,sr->thr", x.p, x.c)
    e_o_lat = o_lat.abs() * (0.5 + rank * r) + x.c.shape[0] * r * torch.einsum("hts,sr->thr", x.p, x.c.abs())
    return torch.einsum("thr,hvr->thv", e_o_lat, w_uv.abs()), abs(x.scale) * sigma


def _through_scores(x: _Parts, sigmas: list[Any]) -> list[Any]:
    """``sum_j p_j sigma_j |v_jd - o_td|`` ``[T, H, Dv]`` for each of ``sigmas [H, T, S]``: what those score errors
    move the output by, to first order (a chunk of queries at a time, as ``exact.attention`` does)."""
    import torch

    h, t, s = x.p.shape
    dv = x.v.shape[-1]
    weights = [x.p * sigma for sigma in sigmas]
    outs = [torch.zeros(t, h, dv, dtype=torch.float64) for _ in sigmas]
    step = max(1, exact.ATTENTION_CHUNK // max(1, h * s * dv))
    for a in range(0, t, step):
        spread = (x.v.transpose(0, 1)[None] - x.o[a : a + step, :, None, :]).abs()  # [t, H, S, Dv]
        for out, weight in zip(outs, weights):
            out[a : a + step] = torch.einsum("hts,thsd->thd", weight[:, a : a + step], spread)
    return outs
