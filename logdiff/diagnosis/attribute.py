"""Attribute the logdiff to its causes: Shapley shares that add up, and necessity.

Each cause has a *lever* that neutralises it (``lever_of``):

* an operator-path cause: install the reference kernel of its op family
  (``attention``, ``rms_norm``, ``linear``, ...) on both sides;
* a weight difference from ``--infer-ckpt``: load the training checkpoint on
  the inference side too;
* a quantized ``--infer-ckpt`` (``quantization``): the same, the inference side then runs the trainer's
  weights unquantized. Where a stale weight sits inside the quantized checkpoint too, both levers are
  the same action, and their joint share is split equally between them;
* a contract difference from ``--set``: drop the overrides behind it (``CONFIG_KEYS``: a RoPE key is
  set through ``rope_parameters`` too, a window through the keys that decide its layers).

One lever often neutralises many causes (every layer's attention is one
kernel family). The levers are the players of a cooperative game measured by
real rescans at ``--depth logprobs``: ``D(S)`` is the primary pair's mean
|Δ logprob| (``abs_diff_mean``, stable where the max jumps from token to
token) with the levers of ``S`` applied, and ``v(S) = D(∅) - D(S)`` is the
part of the gap they close. Divergence amplifies through the layers, so
levers interact: fixing one alone can even widen the gap. The Shapley value
of a lever (its marginal effect averaged over every order of applying the
levers) splits ``v(all)`` among them so that the shares add up:

* ``share = φ / D(∅)``: the lever's part of the baseline gap; the shares sum
  to ``closed = (D(∅) - D(all)) / D(∅)``, what all levers together close.
  A negative share: on average, applying the lever widens the gap.
* ``interaction = Σ alone - closed``, where ``alone = (D(∅) - D({lever})) / D(∅)``:
  0 when the levers add up, otherwise how far from additive they are.
* ``share_k3_kl``: the same game on the k3 KL (``k3_kl``).

Exact over every order when there are at most ``EXACT_UP_TO`` levers: one
rescan per subset of levers (2^n configurations; the empty set is the scan
itself). Beyond that, ``PERMUTATIONS`` orders sampled at the fixed seed
``SEED``, in antithetic pairs (an order and its reverse); each order's
marginal effects still telescope to ``closed``, so the shares add up exactly.
Every configuration goes through the caller's cached ``metrics``, so none is
scanned twice. A lever's share is split equally among the causes it
neutralises, so the causes' shares also sum to ``closed``.

``necessity``: with every *other* lever applied, does the gap stay open (max
|Δ logprob| > 0)? A necessary cause must be fixed to reach logdiff = 0.

``--attribution patched`` (``RunSettings.attribution``, the default) measures the same game
without rescans where every player is a kernel lever whose family the recorded
inference rows cover: ``D(S)`` from one training forward in which the ops of
the families of ``S`` compute like the inference side's (the error each
introduced there, measured on its recorded inputs, added; ``attribute_patched.py``
explains the game and where it differs from rescans), then
ONE end-to-end rescan with every lever applied confirms it (``confirmed``: both
closed fractions). Otherwise it falls back to rescans and says why
(``fallback``). ``game`` names the game that ran.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from logdiff.comparison.cause import Cause
from logdiff.diagnosis.attribute_patched import PATCHED, RESCAN
from logdiff.diagnosis.settings import KERNEL_FAMILIES, RunSettings
from logdiff.errors import InputError
from logdiff.phases import silent

Lever = tuple[str, str]  # ("kernel", family) | ("weights", "") | ("quantization", "") | ("config", key) | ...
Coalition = frozenset  # a set of levers

#: contract key -> the config keys an override may set it through: transformers 5 keeps RoPE in
#: ``rope_parameters`` (a whole one given with ``--set``, or one of its keys), and which layers a window acts on
#: follows ``use_sliding_window``, ``max_window_layers`` and ``layer_types`` as much as ``sliding_window``
_WINDOW = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
CONFIG_KEYS = {
    "qk_norm_eps": ("rms_norm_eps",),
    "final_norm_eps": ("rms_norm_eps",),
    "rope_theta": ("rope_theta", "rope_parameters"),
    "rope_type": ("rope_type", "rope_parameters"),
    "rope_local_base_freq": ("rope_local_base_freq", "rope_parameters"),
    "sliding_window": _WINDOW,
    "layer_types": _WINDOW,
}
#: the attributed metric, and the other metric whose shares are reported per lever
METRIC, ALSO = "abs_diff_mean", "k3_kl"
#: exact Shapley values (every subset rescanned) up to this many levers; sampled orders beyond
EXACT_UP_TO = 4
#: orders sampled beyond EXACT_UP_TO levers (antithetic pairs), and their fixed seed
PERMUTATIONS, SEED = 16, 0


def lever_of(cause: Cause, cfg: RunSettings) -> Lever | None:
    """The action that neutralises ``cause``, or None when no rescan can."""
    if cause.class_ in ("operator_path", "not_judged"):  # not judged: what its kernel swap closes is still measured
        return ("kernel", cause.family) if cause.family else None
    if cause.kind == "weights":
        return ("weights", "") if cfg.infer_ckpt is not None else None
    if cause.kind == "quantization" and cfg.infer_ckpt is not None:  # the inference side unquantized, on the
        return ("quantization", "")  # trainer's weights (diagnosis/quantization.py); online: drop --set quantization
    overridden = set(cfg.train_set) | set(cfg.infer_set)
    keys = {k for key in cause.differs for k in CONFIG_KEYS.get(key, (key,)) if k in overridden}
    return ("config", "+".join(sorted(keys))) if keys else None  # every override behind the difference, dropped


def apply_levers(cfg: RunSettings, levers: set[Lever]) -> RunSettings:
    """``cfg`` with ``levers`` applied, at ``--depth logprobs``."""
    # A scan already in consistent mode keeps its kernels; levers add families to them.
    base = set(cfg.consistent_kernels or KERNEL_FAMILIES) if cfg.consistent else set()
    families = base | {f for kind, f in levers if kind == "kernel"}
    drop = {k for kind, keys in levers if kind == "config" for k in keys.split("+")}
    return replace(
        cfg,
        depth="logprobs",
        drill=None,
        window=None,
        consistent=bool(families),
        consistent_kernels=None if families >= set(KERNEL_FAMILIES) or not families else tuple(sorted(families)),
        infer_ckpt=None if levers & {("weights", ""), ("quantization", "")} else cfg.infer_ckpt,
        train_set={k: v for k, v in cfg.train_set.items() if k not in drop},
        infer_set={k: v for k, v in cfg.infer_set.items() if k not in drop},
    )


def lever_name(lever: Lever) -> str:
    """``kernel:attention``, ``weights``, ``config:rms_norm_eps``."""
    return f"{lever[0]}:{lever[1]}" if lever[1] else lever[0]


def orders_of(players: list[Lever]) -> tuple[list[tuple[Lever, ...]], str]:
    """The orders of applying the levers that the Shapley values average over, and the method."""
    if len(players) <= EXACT_UP_TO:
        return list(itertools.permutations(players)), "exact"
    rng, out = random.Random(SEED), []
    for _ in range(PERMUTATIONS // 2):
        order = list(players)
        rng.shuffle(order)
        out += [tuple(order), tuple(reversed(order))]
    return out, "sampled"


def coalitions(players: list[Lever], orders: Iterable[tuple[Lever, ...]]) -> list[Coalition]:
    """Every set of levers to measure: each order's prefixes, each lever alone, all but each, all."""
    every = frozenset(players)
    wanted = {frozenset(), every} | {frozenset([p]) for p in players} | {every - {p} for p in players}
    wanted |= {frozenset(order[:k]) for order in orders for k in range(1, len(order))}
    return sorted(wanted, key=lambda s: (len(s), sorted(s)))


def shapley(orders: list[tuple[Lever, ...]], cost: Callable[[Coalition], float]) -> dict[Lever, float]:
    """Each lever's marginal ``cost(before) - cost(after)`` averaged over ``orders``."""
    total: dict[Lever, float] = {}
    for order in orders:
        for k, lever in enumerate(order):
            gain = cost(frozenset(order[:k])) - cost(frozenset(order[: k + 1]))
            total[lever] = total.get(lever, 0.0) + gain
    return {lever: gain / len(orders) for lever, gain in total.items()}


def _describe(s: Coalition, players: list[Lever]) -> str:
    if not s:
        return "no lever (the scan itself)"
    if len(s) == len(players):
        return "every lever applied"
    if len(s) == 1:
        return f"only {lever_name(next(iter(s)))} fixed"
    if len(s) == len(players) - 1:
        return f"all but {lever_name(next(p for p in players if p not in s))} fixed"
    return " + ".join(lever_name(p) for p in sorted(s)) + " fixed"


def _number(m: dict[str, Any], key: str) -> float:
    v = m.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _finite(v: float | None) -> float | None:
    """``v`` for result.json: None where it is not a finite number."""
    return v if v is not None and math.isfinite(v) else None


def _fractions(measured: dict[Coalition, dict], key: str, orders: list, players: list[Lever]) -> dict[str, Any]:
    """The game on ``key``: baseline, residual, closed, interaction and each lever's share (fractions)."""
    every = frozenset(players)
    d = {s: _number(m, key) for s, m in measured.items()}
    base = d[frozenset()]
    if not all(math.isfinite(v) for v in d.values()):
        return {"baseline": None, "residual": None, "closed": None, "interaction": None,
                "share": dict.fromkeys(players)}
    if base <= 0:
        return {"baseline": base, "residual": d[every], "closed": 0.0, "interaction": 0.0,
                "share": dict.fromkeys(players, 0.0)}
    phi = shapley(orders, d.__getitem__) if players else {}
    closed = (base - d[every]) / base
    alone = sum((base - d[frozenset([p])]) / base for p in players)
    return {"baseline": base, "residual": d[every], "closed": closed, "interaction": alone - closed,
            "share": {p: phi[p] / base for p in players}}


def choose_game(cfg: RunSettings, players: list[Lever], patched: Any) -> tuple[str, str | None]:
    """The game to measure (``rescan`` or ``patched``), and why ``patched`` was asked for but not used."""
    if cfg.attribution != PATCHED:
        return RESCAN, None
    if patched is None:
        return RESCAN, "the primary pair's inference rows were not kept (no probes, or a path scored elsewhere)"
    others = [lever_name(p) for p in players if p[0] != "kernel"]
    if others:
        return RESCAN, f"{', '.join(others)}: no recorded op output neutralises a weight or config lever"
    uncovered = patched.prepare({p[1] for p in players})
    if uncovered:
        return RESCAN, "; ".join(f"{f}: {why}" for f, why in uncovered.items())
    return PATCHED, None


def _rescans(wanted: list[Coalition], players: list[Lever], cfg: RunSettings, metrics: Callable, known: Callable,
             progress: Callable[..., None]) -> dict[Coalition, dict]:
    """Each coalition's metrics by an end-to-end rescan (cached: the empty set is the scan itself)."""
    plan = _by_engines({s: cfg if not s else apply_levers(cfg, set(s)) for s in wanted}, cfg)
    total, done, measured = sum(not known(c) for c in plan.values()), 0, {}
    for s, c in plan.items():
        if not known(c):
            done += 1
            progress(f"attribution rescan {done} of {total}: {_describe(s, players)}", phase="attribute",
                     step=(done, total))
        measured[s] = metrics(c)
    return measured


def _engines(cfg: RunSettings) -> tuple:
    """What decides the engines a rescan of ``cfg`` loads (``commands.scan.engine_spec``) that a lever changes: the
    inference checkpoint and each side's ``--set`` (kernel levers patch the loaded engines)."""
    from logdiff.sources.base import hashable

    return cfg.infer_ckpt, hashable(cfg.train_set), hashable(cfg.infer_set)


def _by_engines(plan: dict[Coalition, RunSettings], cfg: RunSettings) -> dict[Coalition, RunSettings]:
    """``plan`` with the rescans that load the same engines next to each other, those of ``cfg``'s engines (loaded
    already) first. vLLM keeps one engine per process: a rescan on another checkpoint or ``--set`` evicts it, and
    the next one on the first reloads it, so coalitions taken in size order (a weight or config lever in every
    other one) reloaded the engine at nearly every rescan. A coalition's metrics do not depend on the order."""
    groups = {_engines(cfg): 0}
    for c in plan.values():
        groups.setdefault(_engines(c), len(groups))
    return dict(sorted(plan.items(), key=lambda item: groups[_engines(item[1])]))  # stable: size order in a group


def _patched(wanted: list[Coalition], players: list[Lever], game: Any,
             progress: Callable[..., None]) -> dict[Coalition, dict]:
    """Each coalition's metrics from one patched training forward (``attribute_patched.PatchedGame``)."""
    measured = {}
    for k, s in enumerate(wanted, 1):
        progress(f"attribution forward {k} of {len(wanted)}: {_describe(s, players)}", phase="attribute",
                 step=(k, len(wanted)))
        measured[s] = game.metrics(frozenset(f for _, f in s))
    return measured


def _confirm(cfg: RunSettings, players: list[Lever], metrics: Callable, known: Callable,
             progress: Callable[..., None], patched_base: dict) -> dict[str, Any]:
    """The one end-to-end rescan that confirms a patched game: every lever applied (often cached already)."""
    every = apply_levers(cfg, set(players))
    if not known(every):
        progress("attribution rescan 1 of 1: every lever applied (confirming the patched game)", phase="attribute",
                 step=(1, 1))
    base, rest = _number(metrics(cfg), METRIC), metrics(every)
    residual = _number(rest, METRIC)
    closed = (base - residual) / base if base > 0 else 0.0
    return {"baseline": _finite(base), "residual": _finite(residual), "closed": _finite(closed),
            "residual_abs_diff_max": _finite(_number(rest, "abs_diff_max")),
            "baseline_reproduced": _number(patched_base, METRIC) == base}


def _quantized_kernels(players: list[Lever]) -> bool:
    """Whether the game holds kernel levers beside a quantized inference side's lever (``quantization``)."""
    return ("quantization", "") in players and any(p[0] == "kernel" for p in players)


def attribute(
    causes: list[Cause],
    cfg: RunSettings,
    metrics: Callable[[RunSettings], dict[str, Any]],
    progress: Callable[..., None] = silent,
    known: Callable[[RunSettings], bool] = lambda c: False,
    patched: Any = None,
) -> dict[str, Any]:
    """Fill each cause's ``share`` and ``necessity``; return the attribution summary.

    ``metrics(cfg)`` is the primary pair's metrics under ``cfg``, cached
    (``Rescanner.metrics``; ``cfg`` itself, the empty set of levers, is the
    scan being diagnosed); ``known(cfg)`` whether that costs no rescan.
    ``progress`` hears of each rescan as step k of n (logdiff/phases.py).
    ``patched``: the patched game (``attribute_patched.PatchedGame``, the
    ``Rescanner``'s) for ``cfg.attribution == "patched"``; a patched forward that
    fails falls back to rescans, saying why.
    """
    levers = {id(c): lever_of(c, cfg) for c in causes}
    players = sorted({lv for lv in levers.values() if lv is not None})
    orders, method = orders_of(players)
    wanted = coalitions(players, orders)
    game_name, fallback = choose_game(cfg, players, patched)
    if game_name == PATCHED:
        try:
            measured = _patched(wanted, players, patched, progress)
        except (RuntimeError, ValueError, IndexError) as e:  # a recorded row that does not fit its live op
            game_name, fallback = RESCAN, f"a patched forward failed ({type(e).__name__}: {e})"
    if game_name != PATCHED:
        try:
            measured = _rescans(wanted, players, cfg, metrics, known, progress)
        except InputError as e:
            if not _quantized_kernels(players):
                raise
            # consistent mode cannot run the quantized engine's linears: the game without the kernel levers
            refused = str(e).count("quantized:")
            why = f"it has no kernel for its {refused} quantized linears" if refused else str(e)
            fallback = (f"the kernel levers were left out: their rescans run consistent mode on the quantized "
                        f"inference engine, and {why}; their causes' shares are not measured")
            levers = {k: (lv if lv is not None and lv[0] != "kernel" else None) for k, lv in levers.items()}
            players = [p for p in players if p[0] != "kernel"]
            orders, method = orders_of(players)
            wanted = coalitions(players, orders)
            measured = _rescans(wanted, players, cfg, metrics, known, progress)
    game, kl = _fractions(measured, METRIC, orders, players), _fractions(measured, ALSO, orders, players)
    every = frozenset(players)
    maxed = {s: _number(m, "abs_diff_max") for s, m in measured.items()}
    counts = {p: sum(lv == p for lv in levers.values()) for p in players}
    for c in causes:
        _explain(c, levers[id(c)], counts, game, measured, maxed, players, game_name)
    return {
        "metric": METRIC,
        "method": method,
        "game": game_name,
        **({"fallback": fallback} if fallback else {}),
        **({"permutations": len(orders)} if method == "sampled" else {}),
        "configurations": len(wanted),
        "baseline": game["baseline"],
        "residual": game["residual"],
        "closed": game["closed"],
        "interaction": game["interaction"],
        "closed_k3_kl": kl["closed"],
        "baseline_abs_diff_max": _finite(maxed[frozenset()]),
        "residual_abs_diff_max": _finite(maxed[every]),
        **({"confirmed": _confirm(cfg, players, metrics, known, progress, measured[frozenset()]),
            "patched": patched.report()} if game_name == PATCHED else {}),
        "levers": [
            {"lever": lever_name(p), "causes": counts[p],
             "share": game["share"][p], "share_k3_kl": kl["share"][p],
             "alone": _finite(maxed[frozenset([p])]), "all_others": _finite(maxed[every - {p}]),
             "alone_abs_diff_mean": _finite(_number(measured[frozenset([p])], METRIC)),
             "all_others_abs_diff_mean": _finite(_number(measured[every - {p}], METRIC))}
            for p in players
        ],
    }


def _explain(c: Cause, lever: Lever | None, counts: dict[Lever, int], game: dict[str, Any],
             measured: dict[Coalition, dict], maxed: dict[Coalition, float], players: list[Lever],
             game_name: str = RESCAN) -> None:
    """Fill one cause's share, necessity and evidence from the measured game."""
    if lever is None:
        c.evidence.append("no rescan can neutralise this cause alone; share not measured")
        return
    share, n = game["share"][lever], counts[lever]
    others = maxed[frozenset(players) - {lever}]
    c.share = share / n if share is not None else None
    c.necessity = others > 0
    what = f"the {lever[1]} reference kernel on both sides" if lever[0] == "kernel" else (
        "the training weights on the inference side" if lever[0] == "weights" else
        "the inference side unquantized, on the training weights" if lever[0] == "quantization" else
        f"no override of {lever[1]}"
    )  # fmt: skip
    if game_name == PATCHED:
        what = f"the inference side's recorded {lever[1]} outputs fed to the training forward"
    if share is not None:
        split = f", split equally among the {n} causes it neutralises: {share / n:.1%} each" if n > 1 else ""
        c.evidence.append(f"{lever_name(lever)} ({what}): Shapley share {share:.1%} "
                          f"of the mean |Δ logprob| gap{split}")
        if share < 0:
            c.evidence.append("negative: on average, fixing this widens the gap; it interacts with the other causes")
    alone, base = frozenset([lever]), frozenset()
    c.evidence.append(f"with {what} alone, mean |Δ logprob| goes from {_number(measured[base], METRIC):.3g} to "
                      f"{_number(measured[alone], METRIC):.3g} (max from {maxed[base]:.3g} to {maxed[alone]:.3g})")
    c.evidence.append(f"with every other cause neutralised, max |Δ logprob| is {others:.3g}")
