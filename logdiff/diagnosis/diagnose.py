"""Turn a localized scan into causes: preflight, conformance, classification, attribution.

Runs after ``locate`` at ``--depth modules|ops``, on the primary pair (the
training path against the first inference path):

1. the semantic preflight of the two engines (``contracts`` in result.json);
2. the conformance of every introducing op (``conformance.py``): each side's
   recorded output against the exact function its own contract names, a local
   check on the rows the probes kept;
3. only for ops that check could not decide (and that read no differing
   contract): one rescan with the reference kernels of their families on both
   sides, at logprobs depth first (bitwise-equal logprobs there mean no op
   introduces error any more), else at module depth;
4. ``classify.classify_op`` per introducing op, fused add+norm merged;
5. ``attribute.attribute``: Shapley shares, by default from patched training
   forwards on the recorded rows and one confirming rescan
   (``attribute_patched.py``), else from rescans at logprobs depth.

Every rerun goes through a ``Rescanner`` (``rescan.py``), which remembers each
configuration's result so that attribution reuses the reference rescan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from logdiff.comparison.cause import FAMILY, Findings
from logdiff.comparison.result import ScanResult
from logdiff.diagnosis import (
    attribute,
    classify,
    contract_effect,
    quantization,
    spacing,
)
from logdiff.diagnosis.conformance import Conformance, ConformanceCheck
from logdiff.diagnosis.preflight import preflight
from logdiff.diagnosis.rescan import Rescanner
from logdiff.diagnosis.settings import KERNEL_FAMILIES, RunSettings
from logdiff.phases import Phases, silent
from logdiff.probes.arch import find as find_adapter
from logdiff.sources.base import Engine


def reference_rerun(
    cfg: RunSettings, rescanner: Rescanner, families: set[str], warnings: list[str]
) -> Callable[[str], bool | None] | None:
    """Whether each op still introduces error with the reference kernels on both sides.

    Only the kernel families of the introducing ops are swapped in (every family
    when an op has none): an op's own kernel is what decides whether it still
    introduces error, and the same configuration is attribution's "every cause
    neutralised" when every cause is operator-path, and "this cause alone" when
    one family holds them all, so those rescans are not run twice.
    The rerun keeps every framework difference (overrides, weights), so ops
    downstream of one see different inputs; what counts is whether the op
    itself still *introduces* error (replay, or equal inputs), not whether
    its output is equal.
    """
    reference = attribute.apply_levers(cfg, {("kernel", f) for f in families})
    try:
        if rescanner.logdiff(reference) == 0.0:
            return lambda boundary: True  # bitwise-equal logprobs: no op introduces error any more
        ref = rescanner.rescan(replace(reference, depth="modules"))
    except Exception as e:  # noqa: BLE001 - a path without consistent mode still gets classified
        warnings.append(f"reference-kernel rerun unavailable ({type(e).__name__}: {e}); classified by contract and noise floor")
        return None
    still = {op["boundary"] for op in ref.located.introducing_ops}
    rows = {r["boundary"]: r for r in ref.primary.boundaries or []}

    def vanished(boundary: str) -> bool | None:
        if boundary in still:
            return False
        row = rows.get(boundary)
        if row is None:
            return None
        # Judged only where the rerun could judge: equal output, or a replay that found no local error.
        return True if row.get("max_abs_diff") == 0.0 or row.get("local") is not None else None

    return vanished


def diagnose(
    result: ScanResult,
    cfg: RunSettings,
    train: Engine,
    infer: Engine,
    rescanner: Rescanner,
    progress: Callable[..., None] = silent,
    record: Any = None,
) -> Findings:
    """The contracts, causes and attribution of a measured scan's primary pair.

    ``record``: the primary pair's probes (``probes.session.PairRecord``) with both
    sides' rows still on disk, for the conformance check; without it every op is
    classified by the reference rerun.
    """
    progress = Phases.of(progress)
    progress("semantic preflight: contracts and weight fingerprints", phase="preflight")
    found = Findings()
    held = any(((result.non_finite or {}).get("weights") or {}).values())
    if held:  # hashes of NaN-holding tensors say nothing (and vLLM's CPU weights cannot be recovered)
        found.warnings.append("weight fingerprints skipped: the weights hold NaN/inf (see non_finite)")
    contracts = found.contracts = preflight(train, infer, weights=not held)
    arch = scan_adapter(result.architecture, train)  # what each op reads (None: the plain decoder layout)
    longest = _longest(result)
    inert = contract_effect.inert_differences(contracts, longest)  # e.g. a window no sequence reaches
    found.warnings += list(dict.fromkeys(inert.values()))
    if result.non_finite:  # no op's arithmetic can be judged on NaN/inf: the finding is the cause
        found.causes = classify.preflight_only_causes(contracts, result.causes, arch, inert=inert)
        return found
    pair, ops = result.primary, result.located.introducing_ops
    if pair.bitwise_equal:
        if contracts["differs"] or (contracts["weights"] or {}).get("differs"):
            found.warnings.append("the contracts differ although the logprobs are bitwise equal: see contracts")
        return found
    if not ops:
        found.warnings.append("the logprobs differ but no op was found to introduce the error")
    if record is not None:  # the rows of ops beyond a --window, fetched
        from logdiff.diagnosis.beyond_window import for_conformance

        record = for_conformance(record, [op["boundary"] for op in ops], train, infer, cfg, found.warnings, progress)
    progress(f"checking {len(ops)} ops that introduce error against their exact functions", phase="conformance")
    check = _checker(record, (train, infer), arch, contracts, cfg.dtype) if ops or result.located.unresolved else None
    conformance = _conformance(ops, check)
    # the reference rerun only where the local check could not decide and no contract already does
    undecided = [
        op for op in ops
        if not conformance[op["boundary"]].conclusive and not _reads_a_difference(op, contracts, arch, longest)
    ]
    reference = None
    if undecided:
        progress("rerunning both paths with the reference kernels", phase="reference_rerun")
        # every introducing op's family, not only the undecided ones': an op may compute through another
        # family's kernel (MLA's latent attention applies RoPE inside)
        families = {FAMILY.get(op.get("kind") or "module") for op in ops}
        families = set(KERNEL_FAMILIES) if None in families else families
        reference = reference_rerun(cfg, rescanner, families, found.warnings)
    progress(f"classifying {len(ops)} ops that introduce error", phase="classify")
    causes = []
    # evidence names each side by its path, and a path named by its role (compare's) by its engine: infer (vllm)
    engines = {p.name: p.engine for p in result.paths if p.name in ("train", "infer")}
    paths = {"train": engines.get(pair.train, pair.train), "infer": engines.get(pair.infer, pair.infer)}
    for op in ops:
        rel = op.get("local_rel")
        vanished = reference(op["boundary"]) if reference is not None and op in undecided else None
        ev = classify.OpEvidence(
            boundary=op["boundary"],
            kind=op.get("kind") or "module",
            layer=op.get("layer"),
            local_max_abs_diff=float(op["local_max_abs_diff"]),
            ulps=spacing.spacing_units(rel, cfg.dtype) if rel is not None else None,
            vanished_under_reference=vanished,
            conformance=conformance[op["boundary"]],
            paths=paths,
            reduction_ranks=_reduction_ranks(record, op["boundary"]),
            longest=longest,
        )
        causes.append(classify.classify_op(ev, contracts, infer.fuses_add_norm, arch))
    # a boundary locate could not judge (inputs differ, no replay) is an introducing op after all when a
    # side computes another function there, or it reads a contract key that differs (a one-sided soft cap)
    unresolved = result.located.unresolved
    checked = _conformance(unresolved, check)
    for u in unresolved:
        conf = checked[u["boundary"]]
        if (conf.conclusive and conf.outside) or _reads_a_difference(u, contracts, arch, longest):
            kind = u.get("kind") or "module"
            ev = classify.OpEvidence(u["boundary"], kind, u.get("layer"), None, None, None, conf, paths,
                                     longest=longest)  # fmt: skip
            causes.append(classify.classify_op(ev, contracts, infer.fuses_add_norm, arch))
    causes = classify.merge_fused(causes, arch)
    causes += classify.preflight_only_causes(contracts, causes, arch, paths, inert=inert)
    causes = quantization.fold_into_cause(causes, contracts)  # a quantized linear's own side: the quantization
    quantization.add_where(causes, ops, contracts)  # per layer, where it enters
    found.warnings += _disagreements(causes)
    progress("attributing the logdiff to its causes", phase="attribute")
    rescanner.remember(cfg, pair.metrics)  # the empty set of levers is this scan itself
    try:
        if cfg.attribute:
            found.attribution = attribute.attribute(causes, cfg, rescanner.metrics, progress, rescanner.knows,
                                                     rescanner.patched)
    except Exception as e:  # noqa: BLE001 - classification stands without attribution
        found.warnings.append(f"attribution skipped ({type(e).__name__}: {e})")
    causes.sort(key=lambda c: (-(c.share if c.share is not None else -1.0), c.boundary))
    found.causes = causes
    return found


def scan_adapter(architecture: str | None, train: Engine) -> Any:
    """The scan's adapter in the training model's layout (``configured``: e.g. the first MoE layer, where the
    routing keys are read first); None for an architecture without one."""
    arch = find_adapter(architecture)
    try:
        config = train.loaded_config()
    except (NotImplementedError, AttributeError):  # an engine that cannot say: the adapter's default layout
        return arch
    return arch.configured(config) if arch is not None else None


def _checker(record: Any, sides: tuple[Engine, Engine], arch: Any, contracts: dict[str, Any],
             dtype: str) -> ConformanceCheck | None:
    """The conformance check of the primary pair, or None where the probes kept no training-path rows. Each side
    is judged under the contract it read, or, where it read none, the one it declares (``judged_contract``)."""
    if record is None or record.train_store is None:
        return None
    train, infer = sides
    judged = {side: contracts[side] or engine.judged_contract() for side, engine in zip(("train", "infer"), sides)}
    adapter = classify.adapter_or_default(arch)
    return ConformanceCheck(record, train.module(), adapter, {**contracts, **judged}, dtype, train.rope_params())


def _conformance(ops: list[dict[str, Any]], check: ConformanceCheck | None) -> dict[str, Conformance]:
    """Each op's conformance (``conformance.py``); unchecked where the rows were not kept or could not be read."""
    if check is None:
        return {op["boundary"]: Conformance(unchecked="the probes kept no rows of the training path") for op in ops}
    out = {}
    for op in ops:
        try:
            out[op["boundary"]] = check.check(op["boundary"])
        except Exception as e:  # noqa: BLE001 - an op the check cannot read is classified by the rerun
            out[op["boundary"]] = Conformance(unchecked=f"{type(e).__name__}: {e}")
    return out


def _reduction_ranks(record: Any, boundary: str) -> dict[str, int] | None:
    """Over how many ranks each side summed ``boundary`` (a captured sharded side's row-parallel op), or None."""
    reductions = getattr(record, "reductions", None) or {}
    found = {side: r[boundary] for side, r in reductions.items() if boundary in r}
    return found or None


def _reads_a_difference(op: dict[str, Any], contracts: dict[str, Any], arch: Any, longest: int | None) -> bool:
    """Whether the op reads a contract key that differs at its layer in a way that can change it on these inputs,
    or a weight that differs (then the contract alone classifies it)."""
    keys, weights = classify.contract_keys(op["boundary"], op.get("kind") or "module", arch)
    w_diff = set((contracts.get("weights") or {}).get("differs", []))
    return contract_effect.reads_a_difference(keys, contracts, op.get("layer"), longest) or bool(set(weights) & w_diff)


def _longest(result: ScanResult) -> int | None:
    """Tokens of the longest sequence scanned (prompt and response), or None where the lengths are not known."""
    seqs = result.sequences
    lengths = [p + r for p, r in zip(seqs.prompt_lens or [], seqs.response_lens or [])]
    return max(lengths) if lengths else None


def _disagreements(causes: list[Any]) -> list[str]:
    """One warning per op whose contract difference the conformance measurement contradicts."""
    out = []
    for c in causes:
        line = next((e for e in c.evidence if e.startswith(contract_effect.DISAGREE)), None)
        if line is not None:
            out.append(f"{c.boundary}: {line}; see its cause's evidence")
    return out
