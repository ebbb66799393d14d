"""Attribute the final logdiff to its causes: share and necessity.

Each cause has a *lever* that neutralises it:

* an operator-path cause: install the reference kernel of its op family
  (``attention``, ``rms_norm``, ``linear``, ...) on both sides;
* a weight difference from ``--infer-ckpt``: load the training checkpoint on
  the inference side too;
* a contract difference from ``--set``: drop the override.

Divergence amplifies chaotically through the layers, so causes do not add up.
Two numbers per lever, both from real rescans at ``--depth logprobs``:

* ``share = 1 - D(this lever alone) / D(nothing)``: how much of the final
  ``abs_diff_max`` disappears when only this cause is neutralised. It can be
  small even for a real cause (the others still open the gap) and can be
  negative (fixing one op alone can make the gap larger).
* ``necessity``: with every *other* lever applied, does the gap stay open
  (``D > 0``)? A necessary cause must be fixed to reach logdiff = 0.

``residual`` is ``D(every lever)``: what is left when every cause is
neutralised (0 when the causes found explain the whole logdiff).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from logdiff.config import KERNEL_FAMILIES, ScanConfig
from logdiff.phases import silent
from logdiff.diagnosis.cause import Cause

Lever = tuple[str, str]  # ("kernel", family) | ("weights", "") | ("config", key)

# contract key -> the config key an override sets it through
CONFIG_KEY = {"qk_norm_eps": "rms_norm_eps", "final_norm_eps": "rms_norm_eps"}


def lever_of(cause: Cause, cfg: ScanConfig) -> Lever | None:
    """The action that neutralises ``cause``, or None when no rescan can."""
    if cause.class_ == "operator_path":
        return ("kernel", cause.family) if cause.family else None
    if cause.kind == "weights":
        return ("weights", "") if cfg.infer_ckpt is not None else None
    overridden = set(cfg.train_set) | set(cfg.infer_set)
    for key in cause.differs:
        config_key = CONFIG_KEY.get(key, key)
        if config_key in overridden:
            return ("config", config_key)
    return None


def apply_levers(cfg: ScanConfig, levers: set[Lever]) -> ScanConfig:
    """``cfg`` with ``levers`` applied, at ``--depth logprobs``."""
    # A scan already in consistent mode keeps its kernels; levers add families to them.
    base = set(cfg.consistent_kernels or KERNEL_FAMILIES) if cfg.consistent else set()
    families = base | {f for kind, f in levers if kind == "kernel"}
    drop = {k for kind, k in levers if kind == "config"}
    return replace(
        cfg,
        depth="logprobs",
        drill=None,
        consistent=bool(families),
        consistent_kernels=None if families >= set(KERNEL_FAMILIES) or not families else tuple(sorted(families)),
        infer_ckpt=None if ("weights", "") in levers else cfg.infer_ckpt,
        train_set={k: v for k, v in cfg.train_set.items() if k not in drop},
        infer_set={k: v for k, v in cfg.infer_set.items() if k not in drop},
    )


def attribute(
    causes: list[Cause],
    cfg: ScanConfig,
    baseline: float,
    measure: Callable[[ScanConfig], float],
    progress: Callable[..., None] = silent,
) -> dict[str, Any]:
    """Fill each cause's ``share`` and ``necessity``; return the attribution summary.

    ``progress`` hears of each rescan as step k of n (logdiff/phases.py).
    """
    levers = {id(c): lever_of(c, cfg) for c in causes}
    distinct = sorted({lv for lv in levers.values() if lv is not None})
    total, done = 2 * len(distinct) + bool(distinct), [0]

    def rescan(c: ScanConfig, what: str) -> float:
        done[0] += 1
        progress(f"attribution rescan {done[0]} of {total}: {what}", phase="attribute", step=(done[0], total))
        return measure(c)

    alone = {lv: rescan(apply_levers(cfg, {lv}), f"only {':'.join(lv).rstrip(':')} fixed") for lv in distinct}
    # A framework cause's op may also compute differently (a norm with another eps *and* a fused
    # add): "everything neutralised" also swaps in the kernels of those ops' families.
    everything = set(distinct) | {("kernel", c.family) for c in causes if c.family}
    others = {lv: rescan(apply_levers(cfg, everything - {lv}), f"all but {':'.join(lv).rstrip(':')} fixed")
              for lv in distinct}
    residual = rescan(apply_levers(cfg, everything), "everything fixed") if distinct else baseline
    for c in causes:
        lv = levers[id(c)]
        if lv is None:
            c.evidence.append("no rescan can neutralise this cause alone; share not measured")
            continue
        c.share = 1.0 - alone[lv] / baseline if baseline > 0 else 0.0
        c.necessity = others[lv] > 0
        what = f"the {lv[1]} reference kernel on both sides" if lv[0] == "kernel" else (
            "the training weights on the inference side" if lv[0] == "weights" else f"no override of {lv[1]}"
        )  # fmt: skip
        c.evidence.append(f"with {what} alone, max |Δ logprob| goes from {baseline:.3g} to {alone[lv]:.3g}")
        c.evidence.append(f"with every other cause neutralised, it is {others[lv]:.3g}")
    return {
        "baseline_abs_diff_max": baseline,
        "levers": [
            {"lever": f"{k}:{v}" if v else k, "alone": alone[(k, v)], "all_others": others[(k, v)]}
            for k, v in distinct
        ],
        "residual_abs_diff_max": residual,
    }
