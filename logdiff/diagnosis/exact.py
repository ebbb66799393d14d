"""The exact functions ops are contracted to compute, in fp64, with each op's rounding bound.

Each function takes one side's recorded inputs (rows as the probes store them)
and the parameters that side's effective contract names, and returns an
``Exact``: the fp64 value of the function, its magnitude ``scale`` (the sum of
the absolute terms the op adds up, so that cancellation never shrinks the
bound; docs/causes.md) and the ``OpBound`` of a stock implementation.

These are the contracted functions, written from their definitions, not the
engines' code: a side that drops a soft cap or ignores its eps differs from
them by more than rounding, whatever its own module would compute in fp64.
(The kernels' fp64 references follow HF's steps instead, casts included; the
RoPE tables do come from ``logdiff.kernels.rope``, the one definition of every
table.) Each function evaluates its magnitude scale alongside, which the
kernels' references have no use for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from logdiff.diagnosis.spacing import EPS32, OpBound

#: float32 roundings of a RoPE angle (inv_freq's power and division, the product with the position), doubled
ANGLE_ROUNDINGS = 8.0
#: elements of the ``|v_j - o_t|`` temporary of one attention chunk (fp64: 32 MiB)
ATTENTION_CHUNK = 1 << 22


def _f64(x: Any) -> Any:
    import torch

    return x.detach().to(torch.float64)


@dataclass
class Exact:
    """The exact value of one op on one side's inputs, its magnitude scale and its rounding bound."""

    value: Any  # fp64 tensor, the output rows' shape
    scale: Any  # fp64 tensor, same shape, >= 0
    bound: OpBound
    function: str  # the function computed, for the evidence (``rms_norm(eps=1e-06)``)
    #: an absolute error every implementation may add before the bound counts, or None (RoPE's angle, computed
    #: in float32 whatever the dtype: its rounding grows with the position, not with the output's scale)
    allowance: Any = None


def linear(x: Any, weight: Any, bias: Any | None = None, softcap: float | None = None) -> Exact:
    """``x @ W.T + b`` (then ``cap * tanh(z / cap)`` for soft-capped logits)."""
    return linear_of(weight, bias, softcap)(x)


def linear_of(weight: Any, bias: Any | None = None, softcap: float | None = None) -> Callable[[Any], Exact]:
    """``linear`` with the weight widened once, for many calls on the same weight (both sides' rows)."""
    import torch

    # |W| in fp32 made in place on its own copy (``float()`` alone would return an fp32 weight itself)
    w64, w_abs = _f64(weight), weight.detach().to(torch.float32, copy=True).abs_()
    b64 = _f64(bias) if bias is not None else None
    k = int(w64.shape[1])

    def exact_linear(x: Any) -> Exact:
        z = _f64(x) @ w64.T
        scale = (x.detach().float().abs() @ w_abs.T).double()  # a magnitude: fp32 will do
        if b64 is not None:
            z = z + b64
            scale = scale + b64.abs()
        what = f"linear(K={k})"
        roundings = 3.0  # a split-K GEMM may round each partial sum to the output dtype, then their sum
        if softcap:
            z = softcap * torch.tanh(z / softcap)  # derivative <= 1: the GEMM's scale still bounds its error
            scale = scale + z.abs()
            roundings, what = roundings + 1, f"{what} soft-capped at {softcap:g}"
        return Exact(z, scale, OpBound(roundings, k), what)

    return exact_linear


def rms_norm(x: Any, weight: Any, eps: float, offset: bool) -> Exact:
    """``x / sqrt(mean(x^2) + eps) * w`` (``* (1 + w)`` for Gemma), over groups of ``weight``'s width
    (a q/k norm normalizes each head of a ``[rows, heads * head_dim]`` row)."""
    import torch

    width = int(weight.shape[-1])
    x64 = _f64(x)
    groups = x64.reshape(*x64.shape[:-1], -1, width)
    normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    w = _f64(weight) + (1.0 if offset else 0.0)
    y = (normed * w).reshape(x64.shape)
    # a fused add+norm normalizes the unrounded sum (its recorded input is rounded), HF rounds the
    # normalized value, then its product with the weight: up to three roundings at |y|
    return Exact(y, y.abs(), OpBound(3.0, width), f"rms_norm(eps={eps:g}{', 1 + w' if offset else ''})")


def add(a: Any, b: Any) -> Exact:
    """The residual add."""
    a64, b64 = _f64(a), _f64(b)
    return Exact(a64 + b64, a64.abs() + b64.abs(), OpBound(1.0), "add")


#: the gated MLP activations ``act_mul`` knows, by HF config name (``ACT2FN``'s keys): their definitions
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu", "gelu_python": "gelu",  # erf
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "relu": "relu",
}  # fmt: skip


def act_mul(gate: Any, up: Any, activation: str) -> Exact:
    """``act(gate) * up`` for one of ``ACTIVATIONS``."""
    import torch.nn.functional as F

    g, u = _f64(gate), _f64(up)
    function = ACTIVATIONS[activation]
    if function == "silu":
        a = F.silu(g)
    elif function == "relu":
        a = F.relu(g)
    else:
        a = F.gelu(g, approximate="tanh" if function == "gelu_tanh" else "none")
    y = a * u
    return Exact(y, y.abs(), OpBound(2.0), f"{activation}(gate) * up")  # act rounded, then the product


def rope(
    x: Any, positions: Any, inv_freq: Any, factor: float, heads: int, rotary_dim: int, style: str = "neox"
) -> Exact:
    """RoPE of ``[rows, heads * head_dim]`` rows at ``positions`` over the first ``rotary_dim`` dims of each
    head, with cos/sin from ``inv_freq`` (fp64) times ``factor`` (yarn's attention factor). ``neox``
    rotates the two halves against each other, ``gptj`` interleaved pairs."""
    import torch

    x64 = _f64(x)
    rows = x64.reshape(x64.shape[0], heads, -1)
    angle = positions.to(torch.float64)[:, None] * _f64(inv_freq)[None, :]  # [rows, rotary_dim / 2]
    cos, sin = (t[:, None, :] * factor for t in (torch.cos(angle), torch.sin(angle)))
    rot, rest = rows[..., :rotary_dim], rows[..., rotary_dim:]
    if style == "neox":
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    sa, sb = (a * cos).abs() + (b * sin).abs(), (b * cos).abs() + (a * sin).abs()
    if style == "neox":
        y, scale = torch.cat([ya, yb], -1), torch.cat([sa, sb], -1)
    else:
        y, scale = torch.stack([ya, yb], -1).flatten(-2), torch.stack([sa, sb], -1).flatten(-2)
    y = torch.cat([y, rest], -1).reshape(x64.shape)
    scale = torch.cat([scale, rest.abs()], -1).reshape(x64.shape)
    # the angle: engines compute position * inv_freq in float32 (inv_freq's own roundings, the product's), an
    # error of up to ANGLE_ROUNDINGS float32 spacings of the angle, which moves each output by |a| + |b| times it
    moved = (a.abs() + b.abs()) * angle.abs()[:, None, :] * abs(factor) * ANGLE_ROUNDINGS * EPS32
    moved = torch.cat([moved, moved], -1) if style == "neox" else torch.stack([moved, moved], -1).flatten(-2)
    allowance = torch.cat([moved, torch.zeros_like(rest)], -1).reshape(x64.shape)
    # cos and sin rounded to the dtype, both products and their sum rounded
    return Exact(y, scale, OpBound(4.0), f"rope(rotary_dim={rotary_dim}, style={style})", allowance)


def embedding(weight: Any, tokens: Any, scale: float | None = None) -> Exact:
    """The rows of ``weight`` at ``tokens`` (times ``scale``: Gemma's embedding multiplier): a side in another dtype
    than the weight rounds each value once, a scaled one twice (the multiplier and the product)."""
    rows = _f64(weight[tokens])
    value = rows if scale is None else rows * scale
    return Exact(value, value.abs(), OpBound(1.0 if scale is None else 2.0), "embedding" + (
        f"(scale={scale:.6g})" if scale is not None else ""))


def deinterleaved(ex: Exact, heads: int) -> Exact:
    """``ex`` with each head's lanes reordered even first, then odd (HF's ``rope_interleave`` output)."""
    import torch

    def lanes(t: Any) -> Any:
        h = t.reshape(t.shape[0], heads, -1)
        return torch.cat([h[..., 0::2], h[..., 1::2]], -1).reshape(t.shape)

    allowance = None if ex.allowance is None else lanes(ex.allowance)
    return Exact(lanes(ex.value), lanes(ex.scale), ex.bound, ex.function + ", de-interleaved", allowance)


def attention(
    q: Any, k: Any, v: Any, q_positions: Any, heads: int, scale: float, softcap: float | None, window: int | None,
    sinks: Any = None,
) -> Exact:
    """Causal softmax attention of one sequence: ``[T, heads * D]`` queries at ``q_positions`` against
    ``[S, kv_heads * D]`` keys and ``[S, kv_heads * Dv]`` values at positions ``0..S-1``.

    The scale of output element (t, h, d) bounds what rounding the scores and
    probabilities to the dtype can move it by (first order):
    ``sum_j p_j |v_jd| + sum_j p_j |s_j| |v_jd - o_td|``. ``sinks`` (gpt-oss, one logit per head) join the
    softmax as a key whose value is zero: its term in the bound is ``p_sink |sink| |o_td|``.
    """
    import torch

    q64, k64, v64 = _f64(q), _f64(k), _f64(v)
    t, s = q64.shape[0], k64.shape[0]
    d = q64.shape[1] // heads
    kv_heads = k64.shape[1] // d
    dv = v64.shape[1] // kv_heads
    qh = q64.reshape(t, heads, d)
    g = heads // kv_heads
    kh = k64.reshape(s, kv_heads, d).repeat_interleave(g, dim=1)
    vh = v64.reshape(s, kv_heads, dv).repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,shd->hts", qh, kh) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = q_positions.long()
    keys = torch.arange(s)
    visible = keys[None, :] <= pos[:, None]
    if window:
        visible &= keys[None, :] > pos[:, None] - window
    masked = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:  # one more column, dropped after the softmax (HF's formula)
        sink = _f64(sinks).reshape(heads)
        full = torch.softmax(torch.cat([masked, sink[:, None, None].expand(heads, t, 1)], dim=-1), dim=-1)
        p, p_sink = full[..., :-1], full[..., -1]  # [H, T, S], [H, T]
    else:
        p = torch.softmax(masked, dim=-1)  # [H, T, S]
    out = torch.einsum("hts,shd->thd", p, vh)
    ps = p * scores.abs().masked_fill(~visible[None], 0.0)
    scale_t = torch.einsum("hts,shd->thd", p, vh.abs())
    step = max(1, ATTENTION_CHUNK // max(1, heads * s * dv))
    for a in range(0, t, step):  # sum_j p_j |s_j| |v_j - o_t|, a chunk of queries at a time
        spread = (vh.transpose(0, 1)[None] - out[a : a + step, :, None, :]).abs()  # [t, H, S, Dv]
        scale_t[a : a + step] += torch.einsum("hts,thsd->thd", ps[:, a : a + step], spread)
    if sinks is not None:
        scale_t += (p_sink * sink.abs()[:, None]).transpose(0, 1)[..., None] * out.abs()
    what = f"attention(scale={scale:.6g}" + (f", softcap={softcap:g}" if softcap else "") + (
        f", window={window}" if window else "") + (", sinks" if sinks is not None else "") + ")"  # fmt: skip
    # scores, probabilities and the output each rounded once; the p @ v reduction over S keys
    return Exact(out.reshape(t, heads * dv), scale_t.reshape(t, heads * dv), OpBound(3.0, s), what)


def log_softmax(logits: Any, temperature: float) -> Exact:
    """``log_softmax(logits / T)`` over the vocabulary."""
    import torch

    z = _f64(logits) / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    y = z - lse
    what = "log_softmax" + (f"(logits / {temperature:g})" if temperature != 1.0 else "")
    return Exact(y, z.abs() + lse.abs(), OpBound(2.0, int(z.shape[-1])), what)


def error_units(actual: Any, exact: Exact, eps: float) -> float:
    """``max |actual - exact| / (eps * scale)`` over the elements with a nonzero scale."""
    import torch

    diff = (_f64(actual) - exact.value).abs()
    if exact.allowance is not None:
        diff = (diff - exact.allowance).clamp_min(0.0)
    scale = exact.scale
    live = scale > 0
    if not bool(live.any()):
        return 0.0 if float(diff.max()) == 0.0 else float("inf")
    worst = torch.where(live, diff / (eps * scale.clamp_min(1e-300)), torch.where(diff > 0, float("inf"), 0.0))
    return float(worst.max())
