"""Dtype names and distances in units in the last place: the leaf both summaries and the row store use.

``ulp_distance`` maps both values' bit patterns to an ordered integer line (``ordered_bits``), so adjacent
floats are 1 apart and +0 == -0. ``summary.DiffSummary`` (on the host), ``device_summary.DeviceChunks`` (on
an accelerator) and ``store.PathStore`` (which names a boundary's dtype) build on this module, which imports
nothing of ours.
"""

from __future__ import annotations

from typing import Any

#: each float dtype's integer view and its width in bits
INT_OF = {"bfloat16": ("int16", 16), "float16": ("int16", 16), "float32": ("int32", 32), "float64": ("int64", 64)}
_PRECISION = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 0}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def coarser(a: str, b: str) -> str:
    """The lower-precision of two float dtype names (ulps are counted in it)."""
    if a not in _PRECISION or b not in _PRECISION:
        return a
    if {a, b} == {"bfloat16", "float16"}:
        return "bfloat16"
    return a if _PRECISION[a] <= _PRECISION[b] else b


def ordered_bits(x: Any, dtype: str) -> Any:
    """Map floats of ``dtype`` to integers so that adjacent representable values differ by 1.

    Sign-magnitude bits to a signed line: ``(raw ^ (sign & magnitude_mask)) - sign``
    with ``sign`` the arithmetic shift of the raw pattern (0 or -1), so +0 and -0
    both map to 0. Computed in the raw width, widened only for 16-bit types
    (int32, so that distances cannot overflow) and float64 (int64 saturates
    nowhere that matters: its distances exceed every ulp count of interest).
    """
    import torch

    int_name, bits = INT_OF[dtype]
    raw = x.to(getattr(torch, dtype)).contiguous().view(getattr(torch, int_name))
    sign = raw >> (bits - 1)
    ordered = (raw ^ (sign & ((1 << (bits - 1)) - 1))) - sign
    return ordered.to(torch.int32 if bits == 16 else torch.int64)


def ulp_distance(a: Any, b: Any, dtype: str) -> Any:
    """Elementwise distance in ulps of ``dtype`` between two tensors (int32 for 16-bit types, else int64)."""
    if dtype not in INT_OF:
        raise ValueError(f"no ulp distance for dtype {dtype}")
    return (ordered_bits(a, dtype) - ordered_bits(b, dtype)).abs_()
