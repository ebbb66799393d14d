"""Which weights hold NaN or inf, read from the staged checkpoint both engines load.

The check reads the safetensors files of a staged directory (HF tensor names,
whatever layout an engine repacks them into) and casts each tensor to the
scan's dtype first, so a float32 value that overflows bfloat16 or float16
counts too. It runs once per staged directory and dtype in a process; the
answer is the list of tensor names that hold a non-finite value.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CACHE: dict[tuple[str, str], list[str]] = {}


def nonfinite_names(named: Iterable[tuple[str, Any]], dtype: Any = None) -> list[str]:
    """Names of the tensors in ``named`` (cast to ``dtype`` when given) that hold NaN or inf."""
    import torch

    bad = []
    for name, tensor in named:
        if not tensor.is_floating_point():
            continue
        t = tensor.to(dtype) if dtype is not None else tensor
        if not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def checkpoint_nonfinite(model_dir: Path, dtype: str) -> list[str]:
    """Tensors of the staged directory ``model_dir`` that are not finite in ``dtype``."""
    import torch
    from safetensors import safe_open

    key = (str(model_dir), dtype)
    if key not in _CACHE:
        found: list[str] = []
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                found += nonfinite_names(((k, st.get_tensor(k)) for k in st.keys()), getattr(torch, dtype))
        _CACHE[key] = sorted(found)
    return list(_CACHE[key])
