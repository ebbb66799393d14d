"""The semantic preflight: do both engines compute the same function of the same inputs?

Before any numerics, compare what each engine actually runs with: the
effective contract (eps, RoPE theta and style, attention scale, sliding
window, tied head, MoE routing settings, temperature, logprobs mode, and the
sampler's temperature, top-k and top-p) and a fingerprint of every loaded
weight under its HF name. Any difference here is by itself enough for a
``framework_difference`` verdict: no kernel can make two different functions
agree, and a trainer scoring tokens under another distribution than the one
they were drawn from computes a wrong ratio (``logdiff.sampling``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from logdiff.engines.base import Engine
from logdiff.probes.contracts import IMPLEMENTATION_KEYS


def _differs(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a != b


def _dropped(key: str, *contracts: dict[str, Any]) -> bool:
    return any(key in (c.get("dropped") or {}) for c in contracts)


def _dropped_by_one(key: str, ct: dict[str, Any], ci: dict[str, Any]) -> bool:
    """One side's implementation drops a feature the other side applies."""
    return _dropped(key, ct, ci) and (ct.get(key) is not None or ci.get(key) is not None)


def preflight(train: Engine, infer: Engine, *, weights: bool = True) -> dict[str, Any]:
    """The ``contracts`` block of result.json for one (train, infer) engine pair."""
    out = compare_contracts(train.contract(), infer.contract())
    out["weights"] = compare_fingerprints(train.fingerprints(), infer.fingerprints()) if weights else None
    return out


def compare_contracts(ct: dict[str, Any], ci: dict[str, Any]) -> dict[str, Any]:
    """The contracts block without weights: both sides, the keys that differ and those known on one side only."""
    keys = [k for k in dict.fromkeys([*ct, *ci]) if k not in IMPLEMENTATION_KEYS]
    return {
        "train": ct,
        "infer": ci,
        "differs": [k for k in keys if _differs(ct.get(k), ci.get(k)) or _dropped_by_one(k, ct, ci)],
        # read on one side only: unknown, never equal (a dropped feature is known: its effective value is none)
        "unknown": [k for k in keys if (ct.get(k) is None) != (ci.get(k) is None) and not _dropped(k, ct, ci)],
    }


def compare_fingerprints(ft: dict[str, str | None], fi: dict[str, str | None]) -> dict[str, Any]:
    """The ``contracts.weights`` block: which tensors differ, which could not be read back.

    The two combined fingerprints cover exactly the tensors verified on both
    sides, so they differ if and only if ``differs`` names a tensor; what could
    not be compared is listed in ``unverified`` instead of hiding in a hash.
    """
    verified = [k for k in ft if ft[k] is not None and fi.get(k) is not None]
    return {
        "fingerprint_train": _combined({k: ft[k] for k in verified}),
        "fingerprint_infer": _combined({k: fi[k] for k in verified}),
        "verified": len(verified),
        "differs": [k for k in verified if ft[k] != fi[k]],
        "unverified": [k for k in ft if k not in verified],
    }


def _combined(prints: dict[str, str | None]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(prints):
        h.update(f"{name}={prints[name]};".encode())
    return h.hexdigest()
