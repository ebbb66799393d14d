"""Dtype spacing and the rounding bounds every numeric check of the diagnosis measures in.

Two units, one place:

* ``eps(dtype)``: the dtype's machine epsilon, the spacing of its values in
  [1, 2). ``rel / eps(dtype)`` is a relative error in units of the spacing at
  the value's magnitude (what the noise floor and the routing margins count).
* ``OpBound``: a first-order rounding bound for one op (``conformance``). An
  implementation that computes the exact function with every intermediate
  rounded at most to the output dtype, and its reductions accumulated in at
  least fp32, has per element

      |y - exact(x)| <= (roundings * eps / 2 + length * eps32) * scale

  where ``scale`` is the op's magnitude scale at that element (the sum of the
  absolute terms it adds up, not the output: cancellation must not shrink the
  bound), ``roundings`` how many times a stock implementation may round an
  intermediate to the output dtype on the way (HF's eager attention rounds its
  scores, its probabilities and its output), and ``length`` the reduction
  length. The check reports ``error = max |y - exact| / (eps * scale)`` in units
  of the dtype's spacing at the op's scale, against ``bound = roundings / 2 +
  length * eps32 / eps`` in the same units. An implementation of the same
  function stays inside; one that computes another function (a dropped soft
  cap, an eps it ignores) does not, once its effect exceeds the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23, "float64": 2.0**-52}
EPS32 = EPS["float32"]


def eps(dtype: str) -> float:
    """Machine epsilon of a dtype name (``"bfloat16"``); unknown names count as fp32."""
    return EPS.get(str(dtype).replace("torch.", ""), EPS32)


def ulp_at(x: Any, dtype: str) -> Any:
    """The dtype's spacing (one unit in the last place) at the magnitude of each value of ``x`` (numpy)."""
    import numpy as np

    mag = np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    return np.ldexp(eps(dtype), np.floor(np.log2(mag)).astype(np.int64))


def spacing_units(rel: float, dtype: str) -> float:
    """A relative error in units of ``dtype``'s spacing at the value's magnitude."""
    return rel / eps(dtype)


@dataclass(frozen=True)
class OpBound:
    """The rounding bound of one op (see the module docstring)."""

    roundings: float  # intermediate roundings to the output dtype a stock implementation may do
    length: int = 1  # reduction length (K of a GEMM, keys of an attention row, width of a norm)
    slack: float = 2.0  # second-order terms and the accumulation order's constant, as a factor

    def units(self, dtype: str) -> float:
        """The bound in units of ``dtype``'s spacing at the op's scale."""
        return self.slack * (self.roundings / 2 + self.length * EPS32 / eps(dtype))
