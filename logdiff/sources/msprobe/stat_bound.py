"""A rigorous lower bound on max |a - b| of two same-layout tensors from their msprobe statistics alone.

For tensors ``a``, ``b`` of ``n`` elements (one multiset each, same order or not):

* ``max |a - b| >= |max a - max b|`` and ``>= |min a - min b|``: where ``max a = a_i``, ``max b >= b_i >= a_i - d``;
* ``max |a - b| >= |mean a - mean b|``: ``|mean (a - b)| <= max |a - b|``;
* ``max |a - b| >= | ||a||_2 - ||b||_2 | / sqrt(n)``: ``| ||a|| - ||b|| | <= ||a - b||_2 <= sqrt(n) max |a - b|``.

msprobe writes ``Max`` and ``Min`` exactly (an element of the tensor, ``.item()`` into JSON), but ``Mean`` and
``Norm`` as torch computed them *in the tensor's own dtype* (``torch.mean``/``torch.norm`` of a bf16 tensor
is a bf16 number). Each is therefore widened by its own worst-case rounding error before it bounds anything,
assuming the reduction accumulates in float32 or wider (torch's CPU and CUDA reductions do, for bf16, fp16 and
fp32): with ``u`` float32's unit roundoff, ``u_out`` the dtype's and ``g(k) = k u / (1 - k u)``,

* the mean: ``|mean^ - mean| <= (g(n - 1) (A / n) (1 + c) + c |mean^|) / (1 - c)``, ``A`` a bound on
  ``sum |x|`` (``n max(|Max|, |Min|)``), ``c = (1 + u)^2 (1 + u_out)^2 - 1`` (a division and up to two roundings
  into the dtype);
* the norm: ``|norm^ - norm| <= r norm^ / (1 - r)``, ``r = (1 + g(n))(1 + u)(1 + u_out)^2 - 1`` (the squares and
  sum, the square root, the rounding into the dtype).

The differences are taken exactly (``fractions.Fraction``) and the bound rounded down, so it never exceeds
the true max |a - b|. A statistic that is null (msprobe writes none for integer or float64 tensors' mean
and norm) or not finite bounds nothing.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

#: unit roundoff of the float32 accumulator, and of each dtype a statistic is rounded into
U_ACC = 2.0 ** -24
U_OUT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


def _gamma(k: int) -> float:
    """``k u / (1 - k u)``: the relative error of ``k`` float32 roundings; inf where it is no bound."""
    ku = k * U_ACC
    return ku / (1 - ku) if ku < 1 else math.inf


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _down(q: Fraction) -> float:
    """``q >= 0`` as a float no larger than it."""
    if q <= 0:
        return 0.0
    f = float(q)
    return math.nextafter(f, 0.0) if Fraction(f) > q else f


def _exact_gap(x: float, y: float) -> Fraction:
    return abs(Fraction(x) - Fraction(y))


def mean_slack(stats: dict[str, Any], n: int, dtype: str) -> float | None:
    """How far msprobe's ``Mean`` can lie from the true mean (None: unknown, no bound from it)."""
    mean, hi, lo = stats.get("Mean"), stats.get("Max"), stats.get("Min")
    if dtype not in U_OUT or n < 1 or not all(_finite(v) for v in (mean, hi, lo)):
        return None
    u_out = U_OUT[dtype]
    big = max(abs(hi), abs(lo))  # sum |x| / n <= max |x|
    c = (1 + U_ACC) ** 2 * (1 + u_out) ** 2 - 1
    e = (_gamma(n - 1) * big * (1 + c) + c * abs(mean)) / (1 - c)
    return math.nextafter(e, math.inf) if math.isfinite(e) else None


def norm_slack(stats: dict[str, Any], n: int, dtype: str) -> float | None:
    """How far msprobe's ``Norm`` can lie from the true 2-norm (None: unknown)."""
    norm = stats.get("Norm")
    if dtype not in U_OUT or n < 1 or not _finite(norm):
        return None
    u_out = U_OUT[dtype]
    r = (1 + _gamma(n)) * (1 + U_ACC) * (1 + u_out) ** 2 - 1
    if not r < 1:
        return None
    return math.nextafter(r * abs(norm) / (1 - r), math.inf)


def lower_bound(a: dict[str, Any], b: dict[str, Any], n: int, dtype: str) -> tuple[float, str | None]:
    """The largest of the four lower bounds on max |a - b| (rounded down), and which statistic gave it (None:
    none exceeds 0). ``a``, ``b``: msprobe's ``Max``/``Min``/``Mean``/``Norm`` of two tensors of ``n`` elements
    of ``dtype`` (``bfloat16``, ``float16``, ``float32``; another dtype bounds by Max and Min only)."""
    found: list[tuple[Fraction, str]] = []
    for key in ("Max", "Min"):
        if _finite(a.get(key)) and _finite(b.get(key)):
            found.append((_exact_gap(a[key], b[key]), key))
    sa, sb = mean_slack(a, n, dtype), mean_slack(b, n, dtype)
    if sa is not None and sb is not None:
        found.append((_exact_gap(a["Mean"], b["Mean"]) - Fraction(sa) - Fraction(sb), "Mean"))
    sa, sb = norm_slack(a, n, dtype), norm_slack(b, n, dtype)
    if sa is not None and sb is not None:
        gap = _exact_gap(a["Norm"], b["Norm"]) - Fraction(sa) - Fraction(sb)
        if gap > 0:  # / sqrt(n), rounded up so the quotient stays below the truth
            root = math.nextafter(math.sqrt(n), math.inf)
            found.append((gap / Fraction(root), "Norm"))
    best = max(found, default=(Fraction(0), None), key=lambda t: t[0])
    return (_down(best[0]), best[1]) if best[0] > 0 else (0.0, None)
