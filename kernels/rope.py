"""Rotary position embedding computed once, at one precision, with one rounding.

``rope(x, positions, theta, style, rotary_dim)`` rotates the first
``rotary_dim`` features of every head of ``x`` by the angles
``positions * inv_freq``. ``theta`` is a base (default RoPE,
``inv_freq[i] = theta ** (-2i / rotary_dim)``) or a :class:`RopeParams`: a
rope type (HF's ``rope_type``: ``default``, ``llama3``), its base, width and
scaling fields, which define the inverse frequencies (and, for types that have
one, the factor on cos/sin) in one place, :func:`rope_inv_freq` and
:func:`rope_attention_scaling`.

Why it is invariant and engine-independent:

* **cos/sin come from one table.** The inverse frequencies, the angles and
  their cos/sin are evaluated in fp64 (times the type's attention scaling, in
  fp64) and rounded once to fp32, for blocks of :data:`TABLE_BLOCK_ELEMENTS`
  elements at a time, every block with the same call shape (and under the serial
  threshold of every elementwise op), so the entry for position ``p`` has the
  same bits however many positions a call asks for, in prefill or in decode.
  Tables are cached per ``(RopeParams, device)`` in the ``kernel_caches()``
  block and grown block by block, so a model with a base per layer type
  (Gemma 3: 10k on sliding layers, 1M on full ones) passes each layer's
  parameters and reads that rope's own table; the kernel keeps no per-model
  state. HF computes cos/sin in fp32 from its fp32 ``inv_freq`` buffer then
  rounds them to the model dtype; vLLM keeps its own cache; both installers
  read the rope's parameters from their module, check them against the
  module's own frequencies (:func:`inv_freq_matches`), and then both sides read
  identical numbers from this table.
* **The rotation is fp32 and rounded once.** ``o1 = x1*c - x2*s``,
  ``o2 = x2*c + x1*s`` as four multiplies and two adds (separate, correctly
  rounded ops: no fused multiply-add whose use could depend on the code path),
  then one rounding to ``x.dtype``.

``style="neox"`` pairs feature ``i`` with ``i + rotary_dim/2`` (HF
``rotate_half``; Llama, Qwen); ``style="gptj"`` pairs ``2i`` with ``2i+1``.
Features past ``rotary_dim`` pass through unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .caches import active
from .differentiable import needs_grad

TABLE_BLOCK_ELEMENTS = 1024
"""Upper bound on the elements of one table-block call (below every serial threshold)."""

#: the rope types whose tables the kernel builds (HF's ``rope_type`` names)
ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeParams:
    """Everything that defines one RoPE table: the type, the base, the rotated width and the type's scaling.

    ``rope_type`` is HF's name. ``default``: ``inv_freq[i] = theta ** (-2i / rotary_dim)``. ``llama3``
    (HF ``_compute_llama3_parameters``, vLLM ``Llama3RotaryEmbedding``): the default frequencies whose
    wavelength ``2 pi / f`` is above ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, those below ``original_max_position_embeddings / high_freq_factor`` are kept, and those
    between are interpolated, ``(1 - s) f / factor + s f`` with
    ``s = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    ``linear`` (HF ``_compute_linear_scaling_rope_parameters``, vLLM ``LinearScalingRotaryEmbedding``): the
    default frequencies divided by ``factor``. ``yarn`` (HF ``_compute_yarn_parameters``, vLLM
    ``YaRNScalingRotaryEmbedding``): the default frequencies ("extrapolation") and those divided by
    ``factor`` ("interpolation") mixed by a linear ramp over the frequency index between the correction
    dimensions of ``beta_fast`` and ``beta_slow`` rotations in ``original_max_position_embeddings``
    (floored and ceiled when ``truncate``), and cos/sin multiplied by ``attention_factor`` (HF's
    ``attention_scaling``, vLLM's ``mscale``: resolved by the engine from ``factor``, ``mscale``,
    ``mscale_all_dim`` or the config's ``attention_factor``; read from the module, which is what runs).
    DeepSeek-V2/V3's YaRN (vLLM ``DeepseekScalingRotaryEmbedding``) is this type: the same frequencies
    (truncated) and ``attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``
    (:func:`yarn_attention_factor`); its softmax-scale factor is the attention's, not the rope's.
    The scaling fields a type does not use are left at their defaults (they take part in the cache key).
    Frozen and hashable: a table is cached per ``(params, device)``.
    """

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("rotary_dim", "original_max_position_embeddings"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "truncate", bool(self.truncate))
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r}: the kernel builds tables for {ROPE_TYPES} only")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and positive, got {self.rotary_dim}")
        unused = {
            "default": _SCALING_FIELDS,
            "llama3": ("beta_fast", "beta_slow", "truncate", "attention_factor"),
            "linear": tuple(f for f in _SCALING_FIELDS if f != "factor"),
            "yarn": ("low_freq_factor", "high_freq_factor"),
        }[self.rope_type]
        defaults = RopeParams.__dataclass_fields__
        if any(getattr(self, f) != defaults[f].default for f in unused):
            raise ValueError(f"{self.rope_type} RoPE takes none of {', '.join(unused)}")
        if self.factor <= 0 or self.attention_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"RoPE factor, attention_factor and original_max_position_embeddings must be positive: {self}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 RoPE needs 0 < low_freq_factor < high_freq_factor: {self}")


_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                   "beta_slow", "truncate", "attention_factor")


def yarn_ramp_bounds(params: RopeParams) -> tuple[float, float]:
    """``(low, high)`` of yarn's ramp over the frequency index: the correction dimensions of ``beta_fast`` and
    ``beta_slow`` rotations (HF ``find_correction_range``, vLLM ``yarn_find_correction_range``: Python floats),
    ``high`` nudged by 0.001 where they meet (both engines' singularity guard)."""
    d, base, old = params.rotary_dim, params.theta, params.original_max_position_embeddings

    def dim(rotations: float) -> float:
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim(params.beta_fast), dim(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    return low, (high + 0.001 if low == high else high)


def rope_params(theta: float | RopeParams, rotary_dim: int | None = None) -> RopeParams:
    """``theta`` as :class:`RopeParams`: a bare base is default RoPE over ``rotary_dim`` features."""
    if isinstance(theta, RopeParams):
        if rotary_dim is not None and rotary_dim != theta.rotary_dim:
            raise ValueError(f"rotary_dim {rotary_dim} disagrees with the rope parameters' {theta.rotary_dim}")
        return theta
    if rotary_dim is None:
        raise ValueError("rope: a bare theta needs rotary_dim")
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    return RopeParams(float(theta), int(rotary_dim))


def rope_inv_freq(params: RopeParams, device: torch.device | str | None = None) -> torch.Tensor:
    """The fp64 inverse frequencies ``[rotary_dim // 2]`` of ``params``: the one definition of every table.

    Default RoPE is ``1 / theta ** (2i / d)`` evaluated in fp64 on ``device``; the other types rescale
    those fp64 values with fp64 elementwise ops (correctly rounded, so the same bits on every path).
    """
    d = params.rotary_dim
    inv_freq = 1.0 / params.theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    if params.rope_type == "llama3":
        old = float(params.original_max_position_embeddings)
        low, high, factor = params.low_freq_factor, params.high_freq_factor, params.factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen < old / high, inv_freq, torch.where(wavelen > old / low, inv_freq / factor, smoothed)
        )
    elif params.rope_type == "linear":
        inv_freq = inv_freq / params.factor
    elif params.rope_type == "yarn":
        pos_freqs = params.theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
        interpolation = 1.0 / (params.factor * pos_freqs)
        low, high = yarn_ramp_bounds(params)
        ramp = ((torch.arange(d // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolation_factor = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_factor) + inv_freq * extrapolation_factor
    return inv_freq


def rope_attention_scaling(params: RopeParams) -> float:
    """The factor that multiplies cos and sin (HF's ``attention_scaling``, vLLM's yarn ``mscale``): yarn's
    ``attention_factor``, 1 for the other types."""
    return params.attention_factor if params.rope_type == "yarn" else 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """yarn's default ``attention_factor`` (no explicit one in the config), as HF and vLLM compute it:
    ``0.1 * m * ln(factor) + 1`` (1 for ``factor <= 1``), with ``m = mscale`` over ``m = mscale_all_dim``
    where both are given (DeepSeek), ``m = 1`` otherwise."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return float(get_mscale(factor))


def _yarn_amplification(params: RopeParams) -> float:
    """How much yarn's mix ``interp * ramp + extrap * (1 - ramp)`` amplifies the fp32 error of the ramp.

    The ramp ``(i - low) / (high - low)`` is off by up to ``u * (i + |low|) / (high - low)`` in fp32 (``u``
    = eps / 2: ``low`` rounded to fp32 when it is not an integer, and the division); the result moves by
    ``(extrap - interp)`` times that, relative to ``interp * (1 + (factor - 1) * (1 - ramp))``. Frequencies
    off the ramp (0 or 1 exactly) take no such error.
    """
    low, high = yarn_ramp_bounds(params)
    i = torch.arange(params.rotary_dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    inside = (ramp > 0) & (ramp < 1)
    if not bool(inside.any()):
        return 0.0
    k = abs(params.factor - 1)
    return float((k * (i + abs(low)) / (high - low) / (1 + k * (1 - ramp)))[inside].max())


def inv_freq_rtol(params: RopeParams, dtype: torch.dtype = torch.float32) -> float:
    """How far (relatively) an engine's ``inv_freq`` of ``dtype`` may sit from ``rope_inv_freq(params)`` and still
    be the same rope: HF and vLLM evaluate the same formulas in fp32.

    Default: ``theta ** (2i/d)`` and a division in fp32 stay within 2 eps (``torch.finfo(dtype).eps``, that
    of fp32 or of the buffer's lower precision if the model was cast) of
    the fp64 value. llama3 adds a few roundings (the wavelength, a division by ``factor``: about 2 eps
    more), and in the interpolated band the error of ``s`` (from ``old / wavelength``, about 2 eps
    relative) reaches the result multiplied by ``A = max(low, high / factor) * |factor - 1| / (high - low)``
    (the largest ``(old / wavelength) * (factor - 1) / ((high - low) * (1 + s * (factor - 1)))`` over the
    band, at one of its ends). So the bound is ``2 eps * (2 + A)``: 8.7 eps for the llama3 demo (factor 8,
    low 1, high 4), where HF's buffer measures 1.7 eps; 24.7 eps at factor 32, measured 3.4. linear: the
    default's 2 eps and one division, 3 eps. yarn: ``eps * (4 + A)``, the default frequencies', the
    interpolated ones' and the mix's roundings (4 eps) and the ramp's error amplified by the mix
    (:func:`_yarn_amplification`, counted at twice its size). A wrong scaling field moves the affected
    frequencies by a factor, far outside every bound.
    """
    eps = max(torch.finfo(torch.float32).eps, torch.finfo(dtype).eps)
    if params.rope_type == "default":
        return 2 * eps
    if params.rope_type == "linear":  # one more rounding: the division by factor
        return 3 * eps
    if params.rope_type == "yarn":
        return eps * (4 + _yarn_amplification(params))
    low, high, factor = params.low_freq_factor, params.high_freq_factor, params.factor
    amplification = max(low, high / factor) * abs(factor - 1) / (high - low)
    return 2 * eps * (2 + amplification)


def inv_freq_matches(params: RopeParams, inv_freq: torch.Tensor) -> bool:
    """Whether an engine's ``inv_freq`` (any float dtype, any device) is ``params``' within :func:`inv_freq_rtol`."""
    ours = rope_inv_freq(params, "cpu")
    theirs = inv_freq.detach().double().cpu().reshape(-1)
    rtol = inv_freq_rtol(params, inv_freq.dtype)
    return theirs.shape == ours.shape and torch.allclose(ours, theirs, rtol=rtol, atol=0)


def block_positions(half: int) -> int:
    """Positions per table block: blocks of a fixed size, so a table's bits never depend on how long it grew."""
    return max(1, TABLE_BLOCK_ELEMENTS // half)


def table_block(block: int, params: RopeParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of block number ``block`` of the table (``block_positions`` positions)."""
    rows = block_positions(params.rotary_dim // 2)
    inv_freq = rope_inv_freq(params, device)
    pos = torch.arange(block * rows, (block + 1) * rows, dtype=torch.float64, device=device)
    angles = pos[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    scaling = rope_attention_scaling(params)
    if scaling != 1.0:  # in fp64, before the one rounding
        cos, sin = cos * scaling, sin * scaling
    return cos.float(), sin.float()


def _table(params: RopeParams, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (params, str(device))
    caches = active()
    tables = caches.rope_tables if caches is not None else {}
    cos, sin = tables.get(key, (None, None))
    have = 0 if cos is None else cos.shape[0]
    if have < length:
        rows = block_positions(params.rotary_dim // 2)
        blocks = [table_block(b, params, device) for b in range(have // rows, -(-length // rows))]
        new_cos = [c for c, _ in blocks]
        new_sin = [s for _, s in blocks]
        cos = torch.cat(([cos] if cos is not None else []) + new_cos)
        sin = torch.cat(([sin] if sin is not None else []) + new_sin)
        tables[key] = (cos, sin)
    return cos, sin


def rope_cos_sin(
    positions: torch.Tensor, theta: float | RopeParams, rotary_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[*positions.shape, rotary_dim // 2]`` from the shared table.

    ``theta`` is a base (default RoPE over ``rotary_dim`` features) or a :class:`RopeParams`.
    """
    params = rope_params(theta, rotary_dim)
    positions = positions.long()
    length = int(positions.max()) + 1 if positions.numel() else 0
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("rope: negative position")
    cos, sin = _table(params, length, positions.device)
    return cos[positions], sin[positions]


def _pairs(x32: torch.Tensor, rotary_dim: int, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    if style == "neox":
        half = rotary_dim // 2
        return x32[..., :half], x32[..., half:rotary_dim]
    if style == "gptj":
        return x32[..., 0:rotary_dim:2], x32[..., 1:rotary_dim:2]
    raise ValueError(f"rope style must be 'neox' or 'gptj', got {style!r}")


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    """Rotate ``x`` (``[..., D]``) by fp32 ``cos``/``sin`` (``[..., rotary_dim/2]``, broadcastable).

    The rotation is fp32 and rounded once to ``x.dtype``. Differentiable in ``x``
    (cos/sin are constants: a table lookup); the gradient is the inverse rotation.
    """
    if needs_grad(x):
        if cos.requires_grad or sin.requires_grad:
            raise ValueError("rope_apply: cos/sin come from the table and take no gradient")
        return _RopeApply.apply(x, cos, sin, style)
    return _rope_apply(x, cos, sin, style)


def _rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    x32 = x.float()
    x1, x2 = _pairs(x32, rotary_dim, style)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if style == "neox":
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat([rotated, x32[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)


class _RopeApply(torch.autograd.Function):
    """The transpose of a rotation is the rotation by ``-angle``: ``dx = rope_apply(dy, cos, -sin)``."""

    @staticmethod
    def forward(ctx, x, cos, sin, style):  # noqa: ANN001, ANN205
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _rope_apply(x, cos, sin, style)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        cos, sin = ctx.saved_tensors
        return _rope_apply(dy, cos, -sin, ctx.style), None, None, None


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float | RopeParams,
    style: str = "neox",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """RoPE on x ``[..., T, H, D]`` at absolute int positions ``[T]``; ``theta`` a base or :class:`RopeParams`."""
    if rotary_dim is None and not isinstance(theta, RopeParams):
        rotary_dim = x.shape[-1]
    cos, sin = rope_cos_sin(positions, theta, rotary_dim)
    return rope_apply(x, cos.unsqueeze(-2), sin.unsqueeze(-2), style)


def rope_inv_freq_reference(params: RopeParams, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """HF's inverse frequencies, its own formulas transcribed, evaluated in ``dtype`` on the CPU.

    ``default``: ``compute_default_rope_parameters``; ``llama3``: ``_compute_llama3_parameters``
    (transformers 5.x ``modeling_rope_utils``), in HF's order of operations and masks. In fp32 this is
    how HF fills the rotary module's ``inv_freq`` buffer; in fp64 it is what :func:`rope_inv_freq`
    must equal bit for bit (HF's ``where``/mask form against the kernel's nested ``where``, vLLM's).
    """
    d = params.rotary_dim
    inv_freq = 1.0 / (params.theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=dtype) / d))
    if params.rope_type == "default":
        return inv_freq
    if params.rope_type == "linear":
        inv_freq /= params.factor
        return inv_freq
    if params.rope_type == "yarn":
        return _yarn_inv_freq_reference(params, dtype)
    if params.rope_type != "llama3":
        raise ValueError(f"rope_inv_freq_reference: rope_type {params.rope_type!r}")
    factor = params.factor
    low_freq_factor, high_freq_factor = params.low_freq_factor, params.high_freq_factor
    old_context_len = params.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq_reference(params: RopeParams, dtype: torch.dtype) -> torch.Tensor:
    """HF's ``_compute_yarn_parameters`` (its inverse frequencies) transcribed, in ``dtype``."""
    base, dim, factor = params.theta, params.rotary_dim, params.factor

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):  # noqa: ANN001, ANN202
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):  # noqa: ANN001, ANN202
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):  # noqa: A002, ANN001, ANN202
        if min == max:
            max += 0.001
        linear_func = (torch.arange(dim, dtype=dtype) - min) / (max - min)
        return torch.clamp(linear_func, 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=dtype) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    low, high = find_correction_range(
        params.beta_fast, params.beta_slow, dim, base, params.original_max_position_embeddings, params.truncate
    )
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2).to(dtype=dtype)
    return (
        inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
        + inv_freq_extrapolation * inv_freq_extrapolation_factor
    )


def rope_table_reference(positions: torch.Tensor, params: RopeParams) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[len(positions), rotary_dim // 2]`` in one unblocked evaluation: fp64 angles
    from :func:`rope_inv_freq_reference`, fp64 cos/sin times the attention scaling, one rounding."""
    inv_freq = rope_inv_freq_reference(params, torch.float64)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    scaling = rope_attention_scaling(params)
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.float(), sin.float()


def rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float | RopeParams,
    style: str = "neox",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """HF's ``rotate_half`` formula (or the interleaved one) in fp32, fp64 for fp64 input."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if rotary_dim is None and not isinstance(theta, RopeParams):
        rotary_dim = x.shape[-1]
    params = rope_params(theta, rotary_dim)
    rotary_dim = params.rotary_dim
    inv_freq = rope_inv_freq_reference(params, dtype)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    scaling = rope_attention_scaling(params)
    cos, sin = angles.cos()[:, None, :] * scaling, angles.sin()[:, None, :] * scaling
    xr, rest = x.to(dtype)[..., :rotary_dim], x.to(dtype)[..., rotary_dim:]
    if style == "neox":
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1).to(x.dtype)
