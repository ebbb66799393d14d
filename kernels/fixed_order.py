"""Position-independent elementwise math and fixed-order reductions.

Every consistent kernel is built from two kinds of pieces, and this module
holds the ones torch does not give us with a guarantee:

* **Elementwise transcendental functions whose bits depend only on the input
  value.** ``torch.exp``, ``torch.sigmoid`` or ``F.silu`` may compute an
  element in a vectorised body or in a scalar tail, depending on where it lands
  in the tensor (and on where the thread split falls). The two paths can differ
  in the last bit, so a token's activations would depend on the batch it sits
  in. :func:`exp` and :func:`log` (and :func:`tanh`, built on :func:`exp`) are written only with IEEE-754 basic
  operations (``+ - * /``, ``floor``/``round``, comparisons, integer bit
  manipulation), each a separate torch op. Each of those is correctly rounded
  in every code path (vector or scalar, any CPU, CUDA), so the result for an
  element is a function of its value alone. Accuracy: about 1 ulp in fp32
  (Cephes ``expf``/``logf`` polynomials).
* **Reductions with one fixed order.** ``torch.sum`` picks its order from the
  tensor's shape, strides and thread count. :func:`halving_sum` and
  :func:`pairwise_sum` are trees of elementwise adds, so the order is fixed by
  the length of the reduced dimension alone.

  - :func:`halving_sum` adds the two contiguous halves, level by level. Use it
    where the reduced length is fixed by the model (hidden size, vocabulary,
    block size).
  - :func:`pairwise_sum` adds neighbours ``(0,1), (2,3), ...``, level by level.
    Its value for the first ``n`` elements does not change when exact zeros are
    appended (only the sign of an all-zero sum can), so it serves a dimension
    whose length varies between calls while the extra entries are zeros
    (attention's KV blocks: prefill vs decode).

No module of ours is imported here; only torch.
"""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634
# ln 2 split in two so that n * _LN2_HI is exact for |n| < 2^15 (Cody-Waite).
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
# Cephes expf: exp(r) ~= 1 + r + r^2 * P(r) on |r| <= ln2 / 2.
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
# Cephes logf: log(1 + f) ~= f - f^2/2 + f^3 * Q(f) on sqrt(1/2) - 1 <= f < sqrt(2) - 1.
_LOG_Q = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)
_SQRT_HALF = 0.707106781186547524


def _require_fp32(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"{name} works on float32 tensors, got {x.dtype}")


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in fp32 whose bits depend only on each element's value.

    Range: results below about ``exp(-87.3)`` flush to exactly ``0.0`` (so a
    masked score of ``-1e30`` contributes an exact zero) and above about
    ``exp(88.7)`` give ``inf``. NaN inputs are not supported.
    """
    _require_fp32(x, "exp")
    xc = x.clamp(-88.0, 89.0)
    n = xc.mul(_LOG2E).round_()
    r = xc.sub_(n.mul(_LN2_HI))
    r.sub_(n.mul(_LN2_LO))
    y = r.mul(_EXP_P[0]).add_(_EXP_P[1])
    for c in _EXP_P[2:]:
        y.mul_(r).add_(c)
    y.mul_(r * r).add_(r).add_(1.0)
    # 2^n built from its bit pattern: biased exponent 0 gives 0.0, 255 gives inf.
    two_n = n.add_(127.0).clamp_(0.0, 255.0).to(torch.int32).bitwise_left_shift_(23).view(torch.float32)
    return y.mul_(two_n)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in fp32 of positive normal numbers, bits a function of the value alone."""
    _require_fp32(x, "log")
    bits = x.contiguous().view(torch.int32)
    e = bits.bitwise_right_shift(23).sub_(126).to(torch.float32)  # x = m * 2^e with m in [0.5, 1)
    m = bits.bitwise_and(0x007FFFFF).bitwise_or_(0x3F000000).view(torch.float32)
    small = m < _SQRT_HALF
    e = torch.where(small, e - 1.0, e)
    f = torch.where(small, m + m, m).sub_(1.0)
    z = f * f
    y = f.mul(_LOG_Q[0]).add_(_LOG_Q[1])
    for c in _LOG_Q[2:]:
        y.mul_(f).add_(c)
    y.mul_(f).mul_(z)
    y.add_(e.mul(_LN2_LO))
    y.sub_(z.mul(0.5))
    return f.add_(y).add_(e.mul(_LN2_HI))


def tanh(x: torch.Tensor) -> torch.Tensor:
    """``tanh(x)`` in fp32 from :func:`exp`, bits a function of the value alone.

    ``sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)``: never overflows;
    the absolute error stays within a few fp32 ulps of 1 (the relative error
    grows for ``|x|`` far below 1, where ``1 - e`` cancels). NaN is not supported.
    """
    _require_fp32(x, "tanh")
    e = exp(x.abs().mul_(-2.0))
    return (1.0 - e).div_(e.add_(1.0)).copysign_(x)


def halving_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by adding contiguous halves; the order depends only on the length."""
    x = x.movedim(dim, -1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = (n + 1) // 2
        paired = x[..., : n - half] + x[..., half:]
        x = paired if n % 2 == 0 else torch.cat([paired, x[..., n - half : half]], dim=-1)
    return x[..., 0]


def pairwise_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by adding neighbours ``(0,1), (2,3), ...`` level by level.

    An odd element out is carried to the next level unchanged (as adding an
    exact zero would leave it). Appending exact zeros to the reduced dimension
    therefore never changes the value of the result, which makes it safe for
    dimensions whose length varies between calls.
    """
    dim = dim % x.dim()
    while x.shape[dim] > 1:
        n = x.shape[dim]
        half = n // 2
        pairs = x.narrow(dim, 0, 2 * half).unflatten(dim, (half, 2))
        out = x.new_empty(x.shape[:dim] + ((n + 1) // 2,) + x.shape[dim + 1 :])
        torch.add(pairs.select(dim + 1, 0), pairs.select(dim + 1, 1), out=out.narrow(dim, 0, half))
        if n % 2:
            out.narrow(dim, half, 1).copy_(x.narrow(dim, n - 1, 1))
        x = out
    return x.squeeze(dim)
