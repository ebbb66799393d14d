"""The semantic preflight: do both engines compute the same function of the same inputs?

Before any numerics, compare what each engine actually runs with: the
effective contract (eps, RoPE theta and style, attention scale, sliding
window, tied head, MoE routing settings, temperature, logprobs mode, and the
sampler's temperature, top-k and top-p) and a fingerprint of every loaded
weight under its HF name. Any difference here is by itself enough for a
``framework_difference`` verdict: no kernel can make two different functions
agree, and a trainer scoring tokens under another distribution than the one
they were drawn from computes a wrong ratio (``logdiff.sampling``).

A feature switched off on a side (no window, no soft cap, one its
implementation drops) reads ``OFF`` there (``probes.contracts``): a value, so
off on one side and on on the other is listed under ``differs``, and
``one_sided`` names the side that applies it. ``unknown`` is only for a key a
side could not read at all (None): unknown, never equal.
"""

from __future__ import annotations

import hashlib
from typing import Any

from logdiff.probes.contracts import IMPLEMENTATION_KEYS, is_off, same_hash
from logdiff.sources.base import Engine


def _differs(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a != b


def _dropped(key: str, *contracts: dict[str, Any]) -> bool:
    """One side drops ``key``'s feature (a result written before off was a value read it as None)."""
    return any(key in (c.get("dropped") or {}) for c in contracts)


def _dropped_by_one(key: str, ct: dict[str, Any], ci: dict[str, Any]) -> bool:
    """One side's implementation drops a feature the other side applies."""
    return _dropped(key, ct, ci) and (ct.get(key) is not None or ci.get(key) is not None)


def preflight(train: Engine, infer: Engine, *, weights: bool = True) -> dict[str, Any]:
    """The ``contracts`` block of result.json for one (train, infer) engine pair."""
    ct, ci = train.contract(), infer.contract()
    out = compare_contracts(ct, ci)
    out["weights"] = None
    if weights:
        from logdiff.diagnosis.quantization import through_scheme

        ft, fi = _fingerprints_at_narrower(train, infer, ct, ci)
        # a side's quantized weights against the other side's quantized under the same scheme (quantization.py)
        both = through_scheme({"train": train, "infer": infer}, {"train": ft, "infer": fi}, {"train": ct, "infer": ci})
        out["weights"] = compare_fingerprints(both["train"], both["infer"])
    return out


#: bytes per element of the floating dtypes a side computes in
WIDTH = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def narrower_dtype(a: str | None, b: str | None) -> str | None:
    """The narrower of two sides' dtypes where one is strictly narrower (an fp32 trainer, a bf16 engine), else None."""
    wa, wb = WIDTH.get(str(a)), WIDTH.get(str(b))
    if wa is None or wb is None or wa == wb:
        return None
    return str(a) if wa < wb else str(b)


def _fingerprints_at_narrower(
    train: Engine, infer: Engine, ct: dict[str, Any], ci: dict[str, Any]
) -> tuple[dict, dict]:
    """Both sides' fingerprints, the wider side's hashed at the narrower dtype (rounded): weights equal after
    rounding are equal, and the dtype itself is a cause of its own (``classify.preflight_only_causes``)."""
    at = narrower_dtype(ct.get("dtype"), ci.get("dtype"))

    def of(engine: Engine, contract: dict[str, Any]) -> dict:
        if at and at != contract.get("dtype"):
            try:
                return engine.fingerprints(at)
            except (TypeError, NotImplementedError):  # an engine that hashes only its own dtype (vLLM)
                pass
        return engine.fingerprints()

    return of(train, ct), of(infer, ci)


def compare_contracts(ct: dict[str, Any], ci: dict[str, Any]) -> dict[str, Any]:
    """The contracts block without weights: both sides, the keys that differ (off against a value included) and
    those read on one side only."""
    keys = [k for k in dict.fromkeys([*ct, *ci]) if k not in IMPLEMENTATION_KEYS]
    return {
        "train": ct,
        "infer": ci,
        "differs": [k for k in keys if _differs(ct.get(k), ci.get(k)) or _dropped_by_one(k, ct, ci)],
        # read on one side only: unknown, never equal (a dropped feature is known: its effective value is none)
        "unknown": [k for k in keys if (ct.get(k) is None) != (ci.get(k) is None) and not _dropped(k, ct, ci)],
    }


def one_sided(keys: list[str], contracts: dict[str, Any] | None) -> list[str]:
    """The sides that apply a feature of ``keys`` where the other side has it off (``["infer"]``), else [].

    Which side is wrong the contracts cannot tell; the one that applies a
    feature the other does not is the one whose function has the extra step.
    """
    sides: list[str] = []
    for key in keys:
        values = {side: ((contracts or {}).get(side) or {}).get(key) for side in ("train", "infer")}
        on = [side for side, v in values.items() if v is not None and not is_off(v)]
        if len(on) == 1 and any(is_off(v) for v in values.values()) and on[0] not in sides:
            sides += on
    return sides


def difference_line(key: str, contracts: dict[str, Any]) -> str:
    """The evidence line of a differing contract key, saying which side applies a feature the other has off."""
    train, infer = contracts["train"].get(key), contracts["infer"].get(key)
    line = f"contract differs: {key} = {train!r} (train) vs {infer!r} (infer)"
    for side in one_sided([key], contracts):
        line += f": only the {side} side applies {key}, the other has it off"
    return line


def compare_fingerprints(ft: dict[str, str | None], fi: dict[str, str | None]) -> dict[str, Any]:
    """The ``contracts.weights`` block: which tensors differ, which could not be read back.

    The two combined fingerprints cover exactly the tensors verified on both
    sides, so they differ if and only if ``differs`` names a tensor; what could
    not be compared is listed in ``unverified`` instead of hiding in a hash.
    """
    from logdiff.diagnosis.quantization import is_quantized_print

    # a quantized tensor is compared only with a quantized one (the other side's weight through the scheme), and a
    # fingerprint only with one of the same hash (an older bundle's: unverified)
    verified = [k for k in ft if ft[k] is not None and fi.get(k) is not None
                and is_quantized_print(ft[k]) == is_quantized_print(fi[k]) and same_hash(ft[k], fi[k])]
    out = {
        "fingerprint_train": _combined({k: ft[k] for k in verified}),
        "fingerprint_infer": _combined({k: fi[k] for k in verified}),
        "verified": len(verified),
        "differs": [k for k in verified if ft[k] != fi[k]],
        "unverified": [k for k in ft if k not in verified],
    }
    quantized = [k for k in verified if is_quantized_print(ft[k])]
    unread = [k for k in ft if k not in verified and (is_quantized_print(ft[k]) or is_quantized_print(fi.get(k)))]
    if quantized or unread:
        stale = [k for k in quantized if ft[k] != fi[k]]
        out["through_quantization"] = (
            f"weights compared through the quantization scheme: {len(quantized)} quantized weights against the "
            f"other side's quantized under the same scheme, {len(quantized) - len(stale)} equal"
            + (f", {len(stale)} differ (stale or wrong weights)" if stale else " (no stale weight)")
            + (f"; {len(unread)} could not be re-quantized here (unverified)" if unread else ""))
    return out


def _combined(prints: dict[str, str | None]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(prints):
        h.update(f"{name}={prints[name]};".encode())
    return h.hexdigest()
