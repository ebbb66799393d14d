"""MoE routing diagnostics: expert flips per layer, routing replay, and what caused them.

For every router boundary (``kind == "router"`` in the correspondence) both paths' router
logits are recorded per token (``probes/routing.py``). Each side's expert set
is recomputed from *its own* logits with *its own* routing rule (``routing_rules``:
the side's effective contract, as its engine's code applies it), so a flip
means the two engines really sent the token to different experts.

Grouped and sigmoid routing (DeepSeek-V2's ``group_limited_greedy``, vLLM's
DeepSeek-V2 whatever ``topk_method`` says, GLM-4.5, DeepSeek-V3: contract keys
``scoring_func``, ``n_group``, ``topk_group``, ``routed_scaling_factor``)
follows ``kernels.moe_route_grouped``: the best ``topk_group`` groups first,
then the experts within them, ranked on ``sigmoid(logits) +
e_score_correction_bias`` where the layer has a bias (each side's own, read
from its engine: ``Engine.router_biases``), and weighted by the unbiased scores,
renormalized, times the scaling.

Per layer: the flip rate (tokens whose expert set differs whichever way each
engine breaks an exact tie; tokens that differ only through such a tie are
counted apart, ``tied_tokens``), at each flip the decision that flipped (the
group choice, ``group_flips``, or the expert choice) and its margin (the gap
between the last chosen and the first unchosen group or expert, the larger of
the two sides', in what the decision ranks and in units of the logits' dtype
spacing there), the largest routing-weight difference where the sets agree,
and which class the routing differences belong to:

* ``framework_difference`` when the router itself computes something else on
  the two sides: a router setting differs in the contracts (``ROUTER_KEYS``:
  top-k, renormalisation, scoring, groups, scaling; kind ``moe_routing``, its
  evidence naming both sides' rules), the layer's router weight differs
  (``weights``), or the classifier found this layer's router op to compute a
  different function (its cause's kind). A flip downstream of another
  framework difference is one too (kind ``upstream_difference``).
* ``operator_path`` (kind ``near_tie_flip``) otherwise: the routers agree and
  the tokens flipped because numeric noise broke a near-tie.

**Routing replay** forces the inference path's expert choice on the training
path at the flipped tokens (weights recomputed as normal), all layers at once
and then one layer at a time, and reruns the training path: how much of the
final logprob gap the flips explain (``share``: the drop of the mean abs
logprob difference, as a fraction of it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from logdiff.comparison.cause import Cause, Json
from logdiff.diagnosis import spacing
from logdiff.diagnosis.routing_rules import Rule, compare, decide, route, rule_of

__all__ = ["Rule", "route", "rule_of", "analyze", "compare_layer", "classify_layer", "moe_section", "replay"]

if TYPE_CHECKING:
    from logdiff.comparison.result import ScanResult

#: at most this many flips are listed per layer (the nearest ties first)
MAX_FLIPS_LISTED = 8
#: at most this many layers are replayed one at a time (those with the most flips)
MAX_LAYER_REPLAYS = 8
#: router settings whose difference makes every router a framework difference
ROUTER_KEYS = ("num_experts_per_tok", "norm_topk_prob", "scoring_func", "n_group", "topk_group", "routed_scaling_factor")
#: the expert-choice correction bias, a router weight beside ``{router}.weight``
BIAS = "e_score_correction_bias"


def compare_layer(
    train: Any, infer: Any, rule_train: Rule, rule_infer: Rule, biases: tuple[Any, Any] = (None, None)
) -> tuple[dict[str, Any], np.ndarray]:
    """One router boundary's flip statistics, and the infer ids to force ``[S, P, k]`` (-1: keep).

    ``biases``: each side's correction bias of this layer (sigmoid grouped routing), or None.
    """
    both = train.present & infer.present
    seq, pos = np.nonzero(both)
    lt, li = train.values[seq, pos], infer.values[seq, pos]
    dt, di = decide(lt, rule_train, biases[0]), decide(li, rule_infer, biases[1])
    found = compare(dt, di)
    flipped, margin = found.certain, found.margin
    with np.errstate(divide="ignore", invalid="ignore"):
        margin_ulps = margin / spacing.ulp_at(np.where(np.isfinite(found.value), found.value, 0.0), train.dtype)
    agree = ~found.differ
    weight_diff = 0.0
    if rule_train.top_k == rule_infer.top_k and agree.any():
        # compare each expert's weight: order both sides' weights by expert id
        wt = np.take_along_axis(dt.weights, np.argsort(dt.ids, -1), -1)[agree]
        wi = np.take_along_axis(di.weights, np.argsort(di.ids, -1), -1)[agree]
        weight_diff = float(np.abs(wt - wi).max())
    listed = np.nonzero(flipped)[0]
    listed = listed[np.argsort(margin[listed], kind="stable")][:MAX_FLIPS_LISTED]
    flips = [
        {
            "sequence": int(seq[j]),
            "position": int(pos[j]),
            "train_experts": sorted(int(e) for e in dt.ids[j]),
            "infer_experts": sorted(int(e) for e in di.ids[j]),
            "decision": "group" if found.at_group[j] else "expert",
            "margin": float(margin[j]),
            "margin_ulps": float(margin_ulps[j]),
        }
        for j in listed
    ]
    n_flips = int(flipped.sum())
    stats = {
        "boundary": train.boundary,
        "layer": train.layer,
        "tokens": int(len(seq)),
        "flips": n_flips,
        "group_flips": int(found.at_group.sum()),
        "tied_tokens": int((found.differ & ~flipped).sum()),
        "flip_rate": n_flips / len(seq) if len(seq) else 0.0,
        "margin_max": float(margin[flipped].max()) if n_flips else None,
        "margin_ulps_max": float(margin_ulps[flipped].max()) if n_flips else None,
        "logit_max_abs_diff": float(np.abs(lt - li).max()) if len(seq) else 0.0,
        "weight_max_abs_diff": weight_diff,
        "flipped": flips,
        "replay_share": None,
    }
    forced = np.full((*train.present.shape, rule_infer.top_k), -1, dtype=np.int64)
    forced[seq[flipped], pos[flipped]] = di.ids[flipped]
    return stats, forced


def flipped_tokens(forced: Mapping[int, np.ndarray]) -> np.ndarray | None:
    """``[S, P]``: tokens flipped in at least one layer."""
    masks = [(f >= 0).any(-1) for f in forced.values()]
    return np.logical_or.reduce(masks) if masks else None


def classify_layer(
    stats: dict[str, Any], contracts: dict[str, Any] | None, causes: list[Cause], rules: tuple[Rule, Rule] | None = None
) -> tuple[str | None, str | None, list[str]]:
    """(class, kind, evidence) of one layer's routing differences; (None, None, []) when there are none.

    ``rules``: both sides' rules, named in the evidence where a router setting differs."""
    contracts = contracts or {}
    n, boundary = stats["layer"], stats["boundary"]
    flips, wdiff = stats["flips"], stats["weight_max_abs_diff"]
    seen = f"{flips} of {stats['tokens']} tokens routed to a different expert set"
    if wdiff > 0:
        seen += f"; routing weights differ by up to {wdiff:.3g} where the sets agree"
    keys = [k for k in ROUTER_KEYS if k in contracts.get("differs", [])]
    router_weights = (f"{boundary}.weight", f"{boundary}.{BIAS}")
    weights = [w for w in (contracts.get("weights") or {}).get("differs", []) if w in router_weights]
    if keys or weights:
        evidence = [seen]
        evidence += [f"router setting differs: {k} = {contracts['train'][k]!r} (train) vs "
                     f"{contracts['infer'][k]!r} (infer)" for k in keys]  # fmt: skip
        if keys and rules is not None and rules[0] != rules[1]:
            evidence.append(f"the routing rules differ: train routes {rules[0].describe()}; "
                            f"infer routes {rules[1].describe()}")  # fmt: skip
        evidence += [f"router weight differs: {w}" for w in weights]
        return "framework_difference", "weights" if weights else "moe_routing", evidence  # the layer's own first
    local = next((c for c in causes if c.boundary == boundary and c.class_ == "framework_difference"), None)
    if local is not None:
        return "framework_difference", local.kind, [seen, f"the router op itself differs: {local.kind}"]
    if flips == 0:
        return None, None, []
    upstream = [c for c in causes if c.class_ == "framework_difference" and (c.layer is None or c.layer <= n)
                and c.boundary != boundary]  # fmt: skip
    if upstream:
        names = ", ".join(sorted({c.boundary for c in upstream})[:3])
        return "framework_difference", "upstream_difference", [
            seen, f"the router computes the same function on both sides; its inputs already differ "
            f"because of a framework difference upstream ({names})"]  # fmt: skip
    at_group = stats.get("group_flips") or 0
    decisions = (f"{at_group} at the group choice, {flips - at_group} at the expert choice" if at_group
                 else "all at the expert choice")  # fmt: skip
    return "operator_path", "near_tie_flip", [
        seen,
        f"no router setting or weight differs; every flip is at a margin of at most {stats['margin_max']:.3g} "
        f"({stats['margin_ulps_max']:.3g} units of the logits' spacing) on the decision that flipped "
        f"({decisions}): numeric differences moved the router logits across a near-tie",
    ]


def analyze(
    train: Mapping[str, Any],
    infer: Mapping[str, Any],
    rule_train: Rule,
    rule_infer: Rule,
    contracts: dict[str, Any] | None = None,
    causes: list[Cause] | None = None,
    biases: Mapping[str, Mapping[int, np.ndarray]] | None = None,
) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The ``moe`` section (without the replay) and the forced ids per layer for the replay.

    ``biases``: ``{"train": {layer: bias}, "infer": {...}}``, each side's correction biases (``Engine.router_biases``).
    """
    layers, forced = [], {}
    biases = biases or {}
    earlier = None  # tokens flipped at an earlier router
    for name, t in sorted(train.items(), key=lambda item: item[1].layer or 0):
        i = infer.get(name)
        if i is None:
            continue
        pair = tuple((biases.get(role) or {}).get(t.layer) for role in ("train", "infer"))
        stats, ids = compare_layer(t, i, rule_train, rule_infer, pair)
        cls, kind, evidence = classify_layer(stats, contracts, causes or [], (rule_train, rule_infer))
        here = (ids >= 0).all(-1)
        if earlier is not None and cls == "operator_path" and (here & earlier).any():
            evidence.append(f"{int((here & earlier).sum())} of these tokens flipped at an earlier router already: "
                            "their inputs differ by a different expert mix, so their margins can be wider")  # fmt: skip
        earlier = here if earlier is None else earlier | here
        stats.update({"class": cls, "kind": kind, "evidence": evidence})
        layers.append(stats)
        if stats["flips"]:
            forced[t.layer] = ids
    any_flip = flipped_tokens(forced)
    tokens = max((s["tokens"] for s in layers), default=0)
    found = [s for s in layers if s["class"] is not None]
    cls = None
    if found:
        classes = {s["class"] for s in found}
        cls = "framework_difference" if "framework_difference" in classes else "operator_path"
    section = {
        "router_flip_rate": {s["boundary"]: s["flip_rate"] for s in layers},
        "rules": {"train": rule_train.summary(), "infer": rule_infer.summary()},
        "tokens": tokens,
        "tokens_flipped_any_layer": float(any_flip.sum()) / tokens if any_flip is not None and tokens else 0.0,
        "layers": layers,
        "class": cls,
        "kinds": sorted({s["kind"] for s in found if s["class"] == cls}),
        "replay": None,
    }
    return section, forced


def _gap(train: list[np.ndarray], infer: list[np.ndarray], masks: list[Any]) -> dict[str, float]:
    from logdiff.comparison import metrics as compare

    m = compare.token_metrics(train, infer, masks=masks)
    return {"abs_diff_mean": float(m["abs_diff_mean"]), "abs_diff_max": float(m["abs_diff_max"])}


def _share(before: float, after: float) -> float | None:
    return (before - after) / before if before > 0 else None


def replay(
    section: dict[str, Any],
    forced: dict[int, np.ndarray],
    engine: Any,
    seqs: list[Any],
    infer_logprobs: list[np.ndarray],
    metrics: Mapping[str, Any],
    consistent: Any = None,
) -> None:
    """Routing replay on the training ``engine``: fill ``section["replay"]`` and each layer's share.

    ``metrics``: the pair's logprob metrics before the replay; ``consistent``: a context
    factory to rerun under (the scan's consistent mode), or None.
    """
    from logdiff.probes.routing import ForcedIds

    masks = [s.response_mask for s in seqs]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in seqs]

    def rescore(ids: dict[int, np.ndarray]) -> tuple[dict[str, float], int]:
        with contextlib.ExitStack() as stack:
            if consistent is not None:
                stack.enter_context(consistent())
            counts = stack.enter_context(engine.forced_routing(ForcedIds(ids, lengths)))
            scores = engine.score(seqs)[0]
        return _gap(scores.logprobs, infer_logprobs, masks), counts["forced"]

    before = {"abs_diff_mean": float(metrics["abs_diff_mean"]), "abs_diff_max": float(metrics["abs_diff_max"])}
    after, n_forced = rescore(forced)
    section["replay"] = {
        "forced_tokens": n_forced,
        "before": before,
        "after": after,
        "share": _share(before["abs_diff_mean"], after["abs_diff_mean"]),
    }
    by_layer = {s["layer"]: s for s in section["layers"]}
    busiest = sorted(forced, key=lambda n: -by_layer[n]["flips"])[:MAX_LAYER_REPLAYS]
    if len(forced) > 1:
        for n in busiest:
            gap, _ = rescore({n: forced[n]})
            by_layer[n]["replay_share"] = _share(before["abs_diff_mean"], gap["abs_diff_mean"])
    elif busiest:
        by_layer[busiest[0]]["replay_share"] = section["replay"]["share"]


def moe_section(
    routers: Mapping[str, Any],
    paths: tuple[str, str],
    contracts: dict[str, Any] | None,
    causes: list[Cause],
    config: Mapping[str, Any],
    family_renormalizes: bool | None,
    biases: Mapping[str, Mapping[int, np.ndarray]] | None = None,
) -> tuple[dict[str, Any], dict[int, np.ndarray]] | None:
    """The ``moe`` section of the (train, infer) ``paths`` from the router sinks by (role, path), or None."""
    train, infer = routers.get(("train", paths[0])), routers.get(("infer", paths[1]))
    if train is None or infer is None or not train.logits or not infer.logits:
        return None
    contracts = contracts or {}
    rule_t = rule_of(contracts.get("train"), config, family_renormalizes)
    rule_i = rule_of(contracts.get("infer"), config, family_renormalizes)
    section, forced = analyze(train.logits, infer.logits, rule_t, rule_i, contracts, causes, biases)
    section["train"], section["infer"] = paths
    return section, forced


def diagnose_routing(result: ScanResult, run: Any, cfg: Any, progress: Any) -> Json | None:
    """The ``moe`` section of the primary pair of a probed scan of an MoE model; None for a dense one.

    None with NaN/inf on a path (``non_finite``): router logits that are not numbers rank nothing.
    """
    from logdiff.probes.arch import find

    if result.non_finite:
        return None
    routers = getattr(run.probes, "routers", None) or {}
    pair = result.primary
    arch = find(run.architecture)
    config = run.train_engine.loaded_config().to_dict()
    family = getattr(arch, "router_renormalizes", None)
    infer_engine = run.engine_of(pair.infer) if run.infer_engines else None
    biases = {side: engine.router_biases() if engine is not None else {}
              for side, engine in (("train", run.train_engine), ("infer", infer_engine))}
    found = moe_section(routers, (pair.train, pair.infer), result.contracts, result.causes, config, family, biases)
    if found is None:
        return None
    section, forced = found
    if forced and "forced_routing" in run.train_engine.capabilities:
        progress(f"routing replay: forcing {pair.infer}'s expert choice on {pair.train}", phase="routing_replay")
        infer = next(p for p in run.infers if p.path == pair.infer)
        consistent = (lambda: run.train_engine.consistent(cfg.consistent_kernels)) if cfg.consistent else None
        replay(section, forced, run.train_engine, run.sequences, infer.logprobs, pair.metrics, consistent)
    return section
