"""A quantized side: its weights compared through the scheme, and the quantization as a cause of its own.

An INT8 or FP8 rollout engine against a bf16 trainer computes another function on purpose: every
quantized linear multiplies by the quantized weight and (W8A8) quantizes its input per token. That
is a ``framework_difference`` of kind ``quantization`` (docs/causes.md), one cause for the model
(like ``dtype``): it names the scheme, the layers it covers and those it leaves out, and attribution
gives its share of the gap (its lever: the inference side without the quantization, i.e. running the
trainer's weights unquantized). It is never a weight cause.

**Weights through the scheme.** The engine's quantized weights hash as it holds them, values and
scales together (``probes/quantization.quantized_fingerprint``). The trainer's weight of the same
name is quantized under the engine's scheme (``kernels/int8.quantize_weight`` for INT8 W8A8) and
hashed the same way, so a correctly quantized checkpoint of the trainer's weights matches tensor for
tensor and a stale or wrong weight inside it is still named (``weights`` cause). Where the trainer's
weights are not at hand (a bundle, ``logdiff compare``) or the scheme has no exact re-quantization
here (FP8), the quantized tensors are ``unverified``, never compared across representations.
"""

from __future__ import annotations

from typing import Any

from logdiff.comparison.cause import Cause
from logdiff.probes.contracts import OFF, is_off
from logdiff.probes.quantization import QUANTIZATION_KEYS, SCHEMES, fingerprint_through

#: the prefix of a quantized weight's fingerprint (values and scales hashed together)
QUANTIZED = "q:"


def is_quantized_print(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(QUANTIZED)


def scheme_of(contract: dict[str, Any] | None) -> str | None:
    """The scheme name (one of ``SCHEMES``) a side's ``quantization`` key reads, or None."""
    values = (contract or {}).get("quantization")
    values = values if isinstance(values, list) else [values]
    names = {str(v).split(":", 1)[0] for v in values if v is not None and not is_off(v)}
    return next(iter(names)) if len(names) == 1 and next(iter(names)) in SCHEMES else None


def through_scheme(engines: dict[str, Any], prints: dict[str, dict[str, str | None]],
                   contracts: dict[str, dict[str, Any]]) -> dict[str, dict[str, str | None]]:
    """``prints`` (side -> name -> fingerprint) with each unquantized side's copy of a weight the other side holds
    quantized re-hashed through that side's scheme (None where it cannot be: unverified)."""
    out = {side: dict(p) for side, p in prints.items()}
    for side, other in (("train", "infer"), ("infer", "train")):
        names = [n for n, v in prints[other].items() if is_quantized_print(v) and not is_quantized_print(
            prints[side].get(n))]
        if not names:
            continue
        params = _parameters(engines[side])
        scheme = scheme_of(contracts.get(other))
        for name in names:
            weight = params.get(name)
            out[side][name] = fingerprint_through(weight, scheme) if weight is not None else None
    return out


def _parameters(engine: Any) -> dict[str, Any]:
    """The engine's parameters by HF name (an in-process HF model), else none (a bundle: unverified)."""
    try:
        module = engine.module()
    except (NotImplementedError, AttributeError):
        return {}
    try:
        return dict(module.named_parameters())
    except Exception:  # noqa: BLE001 - an engine whose module is not a torch module
        return {}


def differing_keys(contracts: dict[str, Any] | None) -> list[str]:
    return [k for k in (contracts or {}).get("differs", []) if k in QUANTIZATION_KEYS]


def quantization_cause(contracts: dict[str, Any], paths: dict[str, str] | None = None) -> Cause | None:
    """The ``framework_difference``/``quantization`` cause where the sides' quantization differs, else None."""
    keys = differing_keys(contracts)
    if not keys:
        return None
    sides = [s for s in ("train", "infer") if not is_off((contracts.get(s) or {}).get("quantization", OFF))]
    evidence = []
    for side in sides:
        c = contracts[side]
        name = (paths or {}).get(side, side)
        evidence.append(f"{name} ({side}) computes quantized: {_scheme_line(c.get('quantization'))}")
        evidence.append(f"quantized linears: {_layers_line(c.get('quantized_linears'))}; left unquantized: "
                        f"{_plain(c.get('quantization_ignored'))}")
        if not is_off(c.get("kv_cache_quantization", OFF)) and c.get("kv_cache_quantization") is not None:
            evidence.append(f"KV cache quantized: {c['kv_cache_quantization']}")
    unquantized = [s for s in ("train", "infer") if s not in sides]
    if unquantized:
        evidence.append(f"the {' and '.join(unquantized)} side computes with its weights unquantized")
    weights = contracts.get("weights") or {}
    through = weights.get("through_quantization")
    if through:
        evidence.append(through)
    evidence.append("quantization changes every quantized linear's function (rounded weights, and W8A8's "
                    "per-token rounded inputs): an expected difference of a quantized rollout, not a kernel's "
                    "or a sync's")
    fix = ("expected of a quantized rollout; to remove or correct it: (1) correct for it in the trainer's loss "
           "(importance sampling on the rollout logprobs: verl's rollout_correction, TRL's vLLM IS correction), "
           "no extra forward, keeps the quantized speed; (2) run the trainer's forward through the same "
           "quantization (a consistent quantized forward: logdiff --consistent; costs the fake-quantization in "
           "every training forward, gradients through a straight-through estimator); (3) finer or calibrated "
           "scales (per-group or per-block weights, static activation scales), which shrink it but do not "
           "remove it")
    cause = Cause("model", None, "module", None, "framework_difference", "quantization", evidence, fix, differs=keys)
    cause.paths = [(paths or {}).get(s, s) for s in sides] or None
    return cause


def _scheme_line(value: Any) -> str:
    if isinstance(value, list):
        on = [i for i, v in enumerate(value) if not is_off(v)]
        lines = {str(value[i]) for i in on}
        return f"{' / '.join(sorted(lines))} (layers {_ranges(on)})"
    return str(value)


def _layers_line(value: Any) -> str:
    if isinstance(value, list):
        groups: dict[str, list[int]] = {}
        for i, v in enumerate(value):
            groups.setdefault(str(v), []).append(i)
        return "; ".join(f"layers {_ranges(idx)}: {v}" for v, idx in groups.items() if not is_off(v)) or "none"
    return f"every decoder layer: {value}" if value is not None and not is_off(value) else "none"


def _plain(value: Any) -> str:
    return "nothing" if value is None or is_off(value) else str(value)


def _ranges(idx: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            out.append(f"{start}-{i}" if i != start else f"{i}")
            start = None
    return ", ".join(out)


def _quantized_at(contract: dict[str, Any] | None, layer: int | None, boundary: str) -> bool:
    """Whether the linear at ``boundary`` (in decoder ``layer``) computes quantized on a side (its contract's
    ``quantized_linears``: per layer, HF names within the layer)."""
    value = (contract or {}).get("quantized_linears")
    if isinstance(value, list):
        value = value[layer] if layer is not None and 0 <= layer < len(value) else None
    if value is None or is_off(value):
        return False
    if value == "every Linear":  # read from a config only (a bundle's declared contract)
        return True
    return any(boundary.endswith("." + name) for name in str(value).split(","))


def _judged_quantized(cause: Cause) -> bool:
    """Whether conformance judged the op against a quantized exact function (its ``function`` names the
    quantization): then outside is a fault of the quantized kernel itself, never folded."""
    sides = [v for k, v in (cause.conformance or {}).items() if k in ("train", "infer") and isinstance(v, dict)]
    return any(any(w in str(v.get("function") or "").lower() for w in ("int8", "quantiz", "fp8")) for v in sides)


def fold_into_cause(causes: list[Cause], contracts: dict[str, Any] | None) -> list[Cause]:
    """Fold each quantized linear that conformance puts outside the unquantized function on its quantized side
    into the ``quantization`` cause: that side computes the quantized function its contract names, so it is the
    quantization, not a ``semantic`` fault (a quantized linear's own exact function judges its kernel)."""
    cause = next((c for c in causes if c.kind == "quantization"), None)
    if cause is None or not contracts:
        return causes
    folded, out = [], []
    for c in causes:
        quantized = any(_quantized_at(contracts.get(s), c.layer, c.boundary) for s in ("train", "infer"))
        if (c.op_kind == "linear" and c.class_ == "framework_difference" and c.kind == "semantic" and quantized
                and set(c.paths or []) & set(cause.paths or []) and not _judged_quantized(c)):
            folded.append(c.boundary)
            continue
        out.append(c)
    if folded:
        cause.evidence.append(f"{len(folded)} quantized linear(s) whose output lies outside the unquantized "
                              f"function on the quantized side, as its quantization makes it: {', '.join(folded)}")
    return out


def add_where(causes: list[Cause], ops: list[dict[str, Any]], contracts: dict[str, Any] | None) -> None:
    """Say where the quantization enters, per decoder layer: the largest local error (both sides fed the same
    inputs) of the quantized linears among the introducing ops, and which linear."""
    cause = next((c for c in causes if c.kind == "quantization"), None)
    if cause is None or not contracts:
        return
    worst: dict[int, tuple[float, str]] = {}
    for op in ops:
        layer, local = op.get("layer"), op.get("local_max_abs_diff")
        if layer is None or local is None or op.get("kind") != "linear":
            continue
        if not any(_quantized_at(contracts.get(s), layer, op["boundary"]) for s in ("train", "infer")):
            continue
        if float(local) > worst.get(layer, (-1.0, ""))[0]:
            worst[layer] = (float(local), op["boundary"].rsplit(".", 2)[-2] + "." + op["boundary"].rsplit(".", 1)[-1])
    if worst:
        cause.evidence.append("where it enters, per layer (the largest local error of a quantized linear fed the same "
                              "inputs on both sides): " + "; ".join(f"layer {n}: {v:.3g} ({name})"
                                                                    for n, (v, name) in sorted(worst.items())))
