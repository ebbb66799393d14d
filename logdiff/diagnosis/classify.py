"""Classify every op that introduces error: operator path or framework difference.

Three kinds of evidence per introducing op (docs/causes.md):

1. **Contract.** The semantic preflight (``preflight.py``) compares what each
   engine actually runs with. A differing value *that this op reads* (its
   weight, its eps, the RoPE theta, the attention scale, the temperature) is
   a ``framework_difference`` on its own; a feature one side's implementation
   is known to drop (HF's sdpa and a soft cap) is one of kind ``semantic``.
2. **Conformance** (``conformance.py``). Each side's recorded output against the
   exact (fp64) function its own contract names, on its own recorded inputs,
   within a rounding bound derived from the op. Both sides within: the same
   function computed two ways, ``operator_path``. A side outside computes
   another function although its contract reads the same: a
   ``framework_difference`` of kind ``semantic`` that names the side.
3. **Nothing else decides.** An op that conformance could not measure (no
   exact function for it here, or the contract as read describes neither
   side) and that reads no differing contract key or weight is ``not_judged``:
   the reference-kernel rerun (both engines with the consistent kernels) and
   the noise floor go into its evidence, never into a class, because the
   reference kernel computes the contracted function and so also repairs a
   side that computes another one.

A fused operator (vLLM's residual add + RMSNorm in one kernel) is one
operator: its residual-add boundary and its norm boundary form one cause,
named after the norm.

What an op reads and which norm an add fuses into are architecture facts:
every function takes the scan's adapter (``logdiff.probes.arch``); without
one, the plain Llama-like layout that every registered adapter shares.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from logdiff.comparison.cause import FAMILY, Cause
from logdiff.diagnosis.contract_effect import (
    contract_cross_lines,
    difference_at,
    disagreement,
    inert_window,
    layer_differs,
    layer_view,
)
from logdiff.diagnosis.fixes import FIX, SEMANTIC_FIX, fix_text  # noqa: F401 - FIX is public here too
from logdiff.diagnosis.preflight import difference_line, one_sided
from logdiff.probes.contracts import WINDOW_KEYS

if TYPE_CHECKING:
    from logdiff.diagnosis.conformance import Conformance
    from logdiff.probes.arch import ArchAdapter

#: contract keys a config sets inside ``rope_parameters`` (transformers 5)
ROPE_KEYS = {"rope_theta", "rope_type", "rope_local_base_freq"}
# Beyond this many units of the output dtype's spacing, a local error is not reordering noise.
NOISE_ULPS = 64.0

@dataclass
class OpEvidence:
    """What is known about one introducing op."""

    boundary: str
    kind: str
    layer: int | None
    local_max_abs_diff: float | None  # None: the inputs differed and the op could not be replayed
    ulps: float | None
    vanished_under_reference: bool | None
    conformance: Conformance | None = None
    paths: dict[str, str] | None = None  # side -> path name ({"train": "hf", "infer": "vllm"})
    #: side -> over how many ranks that side summed the op's reduction (captured sharded sides; absent: 1)
    reduction_ranks: dict[str, int] | None = None
    #: tokens of the longest sequence scanned (prompt and response): a window no shorter hides no key
    longest: int | None = None


def adapter_or_default(adapter: ArchAdapter | None) -> ArchAdapter:
    """The scan's architecture adapter; without one, the plain Llama-like layout every adapter shares."""
    from logdiff.probes.arch import adapter_for

    return adapter if adapter is not None else adapter_for("LlamaForCausalLM")


def contract_keys(boundary: str, kind: str, adapter: ArchAdapter | None = None) -> tuple[list[str], list[str]]:
    """(contract keys, weight names) that the op at ``boundary`` reads (the adapter knows)."""
    return adapter_or_default(adapter).contract_keys(boundary, kind)


def _framework_kind(keys: list[str], weights: list[str]) -> str:
    if weights:
        return "weights"
    if any(k in ("temperature", "logprobs_mode") for k in keys):
        return "sampling_semantics"
    from logdiff.diagnosis.routing import ROUTER_KEYS  # top-k, renormalisation, scoring, groups, scaling

    if any(k in ROUTER_KEYS for k in keys):
        return "moe_routing"
    if any(k in WINDOW_KEYS for k in keys):
        return "mask"
    return "config_contract"


def _split_reduction(ev: OpEvidence) -> str | None:
    """Evidence that the two sides split the op's reduction over different numbers of ranks, or None."""
    ranks = {side: (ev.reduction_ranks or {}).get(side, 1) for side in ("train", "infer")}
    if ranks["train"] == ranks["infer"]:
        return None
    return ("the train side sums this op over {train} rank(s), the infer side over {infer}: each rank reduces its "
            "slice of the input and an all-reduce adds the partial sums, so the same sum is taken in another "
            "order").format(**ranks)


def _path_kind(ev: OpEvidence, fused_add_norm: bool, evidence: list[str]) -> str:
    """The operator-path kind of an op: ``collective_order`` where the sides split its sum over different
    numbers of ranks (its evidence appended), else by what the op is."""
    split = _split_reduction(ev)
    if split is not None:
        evidence.append(split)
        return "collective_order"
    return _operator_kind(ev.kind, fused_add_norm)


def _operator_kind(kind: str, fused_add_norm: bool) -> str:
    if kind == "attn":
        return "online_softmax_block_size"
    if kind in ("norm", "add") and fused_add_norm:
        return "fused_vs_unfused"
    if kind in ("rope", "act", "embed"):  # an embedding sums nothing: its rows differ by the weights' precision
        return "intermediate_precision"
    return "reduction_order"


def classify_op(
    ev: OpEvidence, contracts: dict[str, Any] | None, fused_add_norm: bool, adapter: ArchAdapter | None = None
) -> Cause:
    """One cause: class, kind, evidence lines and a fix.

    ``fused_add_norm``: the inference engine adds the residual inside its norm kernel.
    ``adapter``: the scan's architecture (which contract keys and weights each op reads).
    """
    keys, weights = contract_keys(ev.boundary, ev.kind, adapter)
    evidence: list[str] = []
    # the keys as the op's layer computes with them (its window, its RoPE base), and whether they change it here
    here = layer_view(contracts, ev.layer)
    c_diff = layer_differs(keys, contracts, ev.layer)
    inert = inert_window(c_diff, contracts, ev.layer, ev.longest)
    if inert:
        evidence.append(inert)
        c_diff = []
    w_block = (contracts or {}).get("weights") or {}
    w_diff = [w for w in weights if w in w_block.get("differs", [])]
    disagrees = disagreement(ev.conformance, ev.paths or {}) if c_diff and not w_diff else None
    if disagrees is not None and disagrees[1]:  # both sides compute one function: the contract alone decides nothing
        return _disagreeing(ev, evidence, c_diff, contracts, disagrees[0])
    if ev.local_max_abs_diff is None:
        local = "the inputs differed and the op could not be replayed: its own part is known from conformance alone"
    else:
        local = f"local error {ev.local_max_abs_diff:.3g} with both sides fed the same inputs"
    if ev.ulps is not None:
        local += f" ({ev.ulps:.3g} units of the output dtype's spacing)"
    if c_diff or w_diff:
        for k in c_diff:
            evidence.append(difference_at(k, here, ev.layer, contracts))
        for w in w_diff:
            evidence.append(f"weight differs: {w} has different fingerprints on the two sides")
        evidence.append(local)
        if ev.conformance is not None:
            evidence += ev.conformance.evidence(ev.paths or {"train": "train", "infer": "infer"})
            evidence += contract_cross_lines(ev.conformance)
        if disagrees is not None:
            evidence.append(disagrees[0])
        if ev.vanished_under_reference is False:
            evidence.append("the divergence persists with the reference kernel on both sides")
        dropped = _dropped(c_diff, contracts)
        if dropped:
            evidence += [f"{side}: {why}" for side, why in dropped]
            side = dropped[0][0]
            return _cause(ev, "framework_difference", "semantic", evidence, _semantic_fix(ev, side),
                          c_diff + w_diff, sides=[s for s, _ in dropped])  # fmt: skip
        kind = _framework_kind(c_diff, w_diff)
        fix = {
            "weights": f"reload or resync {', '.join(w_diff)} on the inference engine (stale or mis-loaded weights)",
            "sampling_semantics": "compute both sides' logprobs with the same temperature and logprobs mode "
            "(vLLM: logprobs_mode; trainer: divide logits by the rollout temperature only if the engine did)",
            "moe_routing": "align the router settings (top-k, renormalisation, scoring, expert groups, scaling) and "
            "compute router logits in fp32 on both sides",
            "mask": "align the attention mask / sliding window between the engines",
            "config_contract": f"set {', '.join(c_diff)} to the same value in both engines' configs"
            + (" (transformers 5 and vLLM read it from rope_parameters)" if set(c_diff) & ROPE_KEYS else ""),
        }[kind]
        # the side applying a feature the other has off, else the side conformance puts outside its bound
        conf = ev.conformance
        sides = one_sided(c_diff, here) or (conf.outside if conf is not None and conf.conclusive else None)
        return _cause(ev, "framework_difference", kind, evidence, fix, c_diff + w_diff, sides=sides)
    evidence.append(local)
    unverified = [w for w in weights if w in w_block.get("unverified", [])]
    unread = [side for side in ("train", "infer") if contracts is not None and not contracts.get(side)]
    checked = [*([] if unread else keys), *(w for w in weights if w not in unverified)]
    what = f"{'' if unread else 'contract or '}weight this op reads differs"
    if inert:
        what = "weight this op reads differs, and no contract difference it reads changes it on these inputs"
    evidence.append(f"no {what} ({', '.join(checked) or 'none'})")
    if unread:  # a foreign dump's side: judged under the contract its config declares, never compared
        evidence.append(f"no contract was read on the {' and '.join(unread)} side{'s' if len(unread) > 1 else ''} "
                        "(a dump holds none): "
                        f"{', '.join(keys) or 'its settings'} could not be compared")
    conf = ev.conformance
    if conf is not None:
        evidence += conf.evidence(ev.paths or {"train": "train", "infer": "infer"})
    if conf is not None and conf.decided and not conf.conclusive:
        evidence.append("both sides are outside their bounds of the function their contracts name: the contract "
                        "as read describes neither, so the check is not conclusive here")
    if conf is not None and conf.conclusive:
        if conf.outside:
            sides = conf.outside
            if unverified and sides == ["infer"]:  # the likeliest other function: a weight nobody could compare
                return _unverified_weights(ev, evidence, unverified, sides)
            evidence.append(f"the {sides[0]} side computes another function than its contract names, "
                            + ("which its config declares" if unread else "although the contracts read the same"))
            return _cause(ev, "framework_difference", "semantic", evidence, _semantic_fix(ev, sides[0]),
                          sides=sides)  # fmt: skip
        functions = {side: c.function for side, c in conf.sides.items()}
        if len(set(functions.values())) > 1:  # a side's contract names a quantization scheme at this linear
            named = "; ".join(f"{side}: {f}" for side, f in functions.items())
            evidence.append(f"both sides are within their rounding bounds of the exact functions their own contracts "
                            f"name ({named}): they differ by the quantization scheme alone, which is the quantization "
                            "cause's; what is left here is each side's rounding, in a different order or precision")
        else:
            evidence.append("both sides are within their rounding bounds of the exact function: the same function, "
                            "computed in a different order or precision")  # fmt: skip
        kind = _path_kind(ev, fused_add_norm, evidence)
        return _cause(ev, "operator_path", kind, evidence, fix_text(kind, ev.kind))
    return _not_judged(ev, evidence, unverified)


def _disagreeing(ev: OpEvidence, evidence: list[str], c_diff: list[str], contracts: dict[str, Any] | None,
                 line: str) -> Cause:
    """A ``not_judged`` cause where the contracts differ at the op but both sides' outputs are within their
    bounds of one function, the one a contract names for the other side (``contract_effect.disagreement``):
    the contract and the measurement say different things, and neither decides alone."""
    here = layer_view(contracts, ev.layer)
    evidence += [difference_at(k, here, ev.layer, contracts) for k in c_diff]
    if ev.local_max_abs_diff is not None:
        evidence.append(f"local error {ev.local_max_abs_diff:.3g} with both sides fed the same inputs")
    evidence += ev.conformance.evidence(ev.paths or {"train": "train", "infer": "infer"}) + [line]
    fix = ("not judged: check which value each side really computes with at this op (the contract reader, or a "
           "setting that another one switches off), then rescan")
    return _cause(ev, "not_judged", "not_judged", evidence, fix, c_diff)


def _not_judged(ev: OpEvidence, evidence: list[str], unverified: list[str]) -> Cause:
    """A ``not_judged`` cause: no contract or weight it reads differs, and no side could be measured against
    the exact function (none here for this op, or the contract as read describes neither side). The
    reference rerun and the noise floor are evidence, never a verdict: the reference kernel computes the
    contracted function, so it also repairs a side that computes another one."""
    if ev.vanished_under_reference is None:
        evidence.append("the reference-kernel rerun was not available")
    else:
        verb = "vanishes" if ev.vanished_under_reference else "persists"
        evidence.append(f"evidence only: the divergence {verb} with the reference kernel on both sides")
    if ev.ulps is not None and ev.ulps > NOISE_ULPS:
        evidence.append(f"evidence only: more than {NOISE_ULPS:g} units of the output dtype's spacing, more than "
                        "reordering noise usually gives")  # fmt: skip
    if unverified:
        evidence.append(f"weight unverified: {', '.join(unverified)} could not be read back from the inference "
                        "engine, so a stale or mis-loaded copy cannot be ruled out")  # fmt: skip
    fix = ("not judged: no side could be measured against this op's exact function; compare its implementations "
           "on both sides (docs/causes.md lists the ops with an exact function)")
    return _cause(ev, "not_judged", "not_judged", evidence, fix)


def _cause(
    ev: OpEvidence, cls: str, kind: str, evidence: list[str], fix: str, differs: list[str] | None = None,
    sides: list[str] | None = None,
) -> Cause:
    cause = Cause(ev.boundary, ev.layer, ev.kind, FAMILY.get(ev.kind), cls, kind, evidence, fix, differs=differs or [])
    if ev.conformance is not None and ev.conformance.sides:
        cause.conformance = ev.conformance.to_dict()
    if sides:
        names = ev.paths or {}
        cause.paths = [names.get(s, s) for s in sides]
    return cause


def _unverified_weights(
    ev: OpEvidence, evidence: list[str], unverified: list[str], sides: list[str] | None = None
) -> Cause:
    """A ``weights`` cause for an op computing another function while reading weights nobody could compare."""
    evidence.append(f"weight unverified: {', '.join(unverified)} could not be read back from the inference "
                    "engine, so a stale or mis-loaded copy cannot be ruled out")  # fmt: skip
    fix = f"check {', '.join(unverified)} on the inference engine against the checkpoint (stale or mis-loaded weights)"
    return _cause(ev, "framework_difference", "weights", evidence, fix, unverified, sides=sides)


def _semantic_fix(ev: OpEvidence, side: str) -> str:
    """The fix of a ``semantic`` cause, naming the side by its path (``vllm (infer)``)."""
    path = (ev.paths or {}).get(side)
    return SEMANTIC_FIX.format(side=f"{path} ({side})" if path else side)


def _dropped(keys: list[str], contracts: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(side, why) for each differing key that a side's implementation is known to drop (``contract["dropped"]``)."""
    out = []
    for side in ("train", "infer"):
        dropped = ((contracts or {}).get(side) or {}).get("dropped") or {}
        out += [(side, f"{k}: {dropped[k]}") for k in keys if k in dropped]
    return out


def merge_fused(causes: list[Cause], adapter: ArchAdapter | None = None) -> list[Cause]:
    """One cause per fused add+norm: a residual add folds into the norm that consumes it (the adapter's ``fused_norm``)."""
    arch = adapter_or_default(adapter)
    by_boundary = {c.boundary: c for c in causes}
    out = []
    for c in causes:
        if c.op_kind == "add":
            norm = arch.fused_norm(c.boundary)
            target = by_boundary.get(norm) if norm else None
            if target is not None and target.class_ == c.class_:
                target.evidence.append(f"fused with {c.boundary} (one add+norm kernel in vLLM)")
                continue
        out.append(c)
    return out


def preflight_only_causes(
    contracts: dict[str, Any] | None, causes: list[Cause], adapter: ArchAdapter | None = None,
    paths: dict[str, str] | None = None, inert: Collection[str] = (),
) -> list[Cause]:
    """Contract or weight differences that no introducing op accounts for (``paths``: side -> path name, to
    name the side applying a feature the other has off; ``inert``: keys whose difference changes no op's
    function on the inputs seen, ``contract_effect.inert_differences``: evidence, not causes).

    The preflight alone is enough for a framework verdict: a stale expert that no
    probe token was routed to, or an eps whose effect hid below the output's
    rounding, still means the two engines compute different functions. A window
    no shorter than every sequence is not: it gives the same function here.
    """
    if not contracts:
        return []
    arch = adapter_or_default(adapter)
    covered = {d for c in causes for d in c.differs} | set(inert)
    out = []
    weights = (contracts.get("weights") or {}).get("differs", [])
    from logdiff.diagnosis import (
        quantization,  # one cause for the scheme (logdiff/diagnosis/quantization.py)
        sampling,  # sampler and scoring keys: one sampling_semantics cause (logdiff/diagnosis/sampling.py)
    )

    items = [*contracts.get("differs", []), *weights]
    window = [k for k in items if k in WINDOW_KEYS and k not in covered]  # one cause: the window and its layers
    for item in items:
        if item in covered or item == "dtype" or item in (*sampling.SAMPLER_KEYS, *sampling.SCORING_KEYS):
            continue
        if item in quantization.QUANTIZATION_KEYS:
            continue
        if item in WINDOW_KEYS and item != window[0]:
            continue
        is_weight = item in weights
        group = window if item in WINDOW_KEYS else [item]
        boundary, kind = arch.weight_boundary(item) if is_weight else arch.key_boundary.get(item, ("model", "module"))
        ev = OpEvidence(boundary, kind, None, 0.0, None, None, paths=paths)
        if is_weight:
            evidence = [f"weight differs: {item} has different fingerprints on the two sides"]
            fix = f"reload or resync {item} on the inference engine (stale or mis-loaded weights)"
        else:
            evidence = [difference_line(k, contracts) for k in group]
            fix = f"set {', '.join(group)} to the same value in both engines' configs"
        evidence.append("found by the semantic preflight; no probed token exercised a difference at this op, "
                        "so it did not show in these logprobs but will on other inputs")
        kind_name = _framework_kind([] if is_weight else group, [item] if is_weight else [])
        sides = None if is_weight else one_sided(group, contracts)
        out.append(_cause(ev, "framework_difference", kind_name, evidence, fix, group, sides=sides))
    if "dtype" in contracts.get("differs", []):
        out.append(dtype_cause(contracts))
    if not covered & set(quantization.differing_keys(contracts)):
        found = quantization.quantization_cause(contracts, paths)
        out += [found] if found is not None else []
    semantics = sampling.contract_cause(contracts)
    if semantics is not None and not any((c.boundary, c.kind) == (semantics.boundary, semantics.kind) for c in causes):
        out.append(semantics)  # else the op's own cause takes this evidence (sampling.diagnose merges it)
    return out


def dtype_cause(contracts: dict[str, Any]) -> Cause:
    """A ``framework_difference``/``dtype`` cause: the sides compute in different dtypes (an fp32 trainer against
    a bf16 engine). Every op differs by the narrower dtype's rounding, so no op is blamed for it, and the
    weights were compared at the narrower dtype (equal after rounding is equal: no stale weight)."""
    dt, di = contracts["train"].get("dtype"), contracts["infer"].get("dtype")
    evidence = [f"contract differs: dtype = {dt!r} (train) vs {di!r} (infer)",
                "each side's ops are judged in its own dtype's spacing, and the weights compared at the narrower "
                "dtype: the gap includes the narrower side's rounding of every op"]  # fmt: skip
    fix = (f"compute both sides in one dtype: load the trainer's model in {di} (e.g. from_pretrained(..., "
           f"dtype=torch.{di}); TRL: GRPOConfig(model_init_kwargs={{'dtype': '{di}'}})) or run the engine in {dt} "
           f"(vLLM: LLM(..., dtype='{dt}'))")  # fmt: skip
    ev = OpEvidence("model", "module", None, 0.0, None, None)
    return _cause(ev, "framework_difference", "dtype", evidence, fix, ["dtype"])


def non_finite_cause(
    first: dict[str, Any] | None, weights: list[str], evidence: list[str], fix: str, adapter: ArchAdapter | None = None
) -> Cause:
    """A ``framework_difference``/``non_finite`` cause: NaN or inf on a path (docs/causes.md).

    Its boundary is the first one that holds the value (``first``, from locate), else
    the module owning the first non-finite weight, else the whole model (not localized).
    """
    if first is not None:
        ev = OpEvidence(first["boundary"], first.get("kind") or "module", first.get("layer"), 0.0, None, None)
    elif weights:
        ev = OpEvidence(*adapter_or_default(adapter).weight_boundary(weights[0]), None, 0.0, None, None)
    else:
        ev = OpEvidence("model", "module", None, 0.0, None, None)
    return _cause(ev, "framework_difference", "non_finite", evidence, fix, list(weights))
