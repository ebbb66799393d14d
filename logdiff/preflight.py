"""The semantic preflight: do both engines compute the same function of the same inputs?

Before any numerics, compare what each engine actually runs with: the
effective contract (eps, RoPE theta and style, attention scale, sliding
window, tied head, MoE routing settings, temperature, logprobs mode) and a
fingerprint of every loaded weight under its HF name. Any difference here is
by itself enough for a ``framework_difference`` verdict: no kernel can make two
different functions agree.
"""

from __future__ import annotations

import hashlib
from typing import Any

from logdiff.probes.engines.base import Engine


def _differs(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a != b


def preflight(train: Engine, infer: Engine, *, weights: bool = True) -> dict[str, Any]:
    """The ``contracts`` block of result.json for one (train, infer) engine pair."""
    ct, ci = train.contract(), infer.contract()
    out: dict[str, Any] = {
        "train": ct,
        "infer": ci,
        "differs": [k for k in ct if _differs(ct[k], ci.get(k))],
        "weights": None,
    }
    if weights:
        ft, fi = train.fingerprints(), infer.fingerprints()
        out["weights"] = {
            "fingerprint_train": _combined(ft),
            "fingerprint_infer": _combined(fi),
            "differs": [k for k in ft if _differs(ft[k], fi.get(k))],
            "unverified": [k for k in ft if fi.get(k) is None],
        }
    return out


def _combined(prints: dict[str, str | None]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(prints):
        h.update(f"{name}={prints[name]};".encode())
    return h.hexdigest()
