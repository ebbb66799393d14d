"""Which truncation processed logprobs were renormalised over: the sampler and its parameters, or none named.

Processed logprobs (vLLM ``logprobs_mode=processed_logprobs``) are taken after
the sampler's processing: the temperature, then a truncation, then the
renormalisation over the tokens it kept. Against the training model's
distribution at the same temperature each kept token's logprob rises by one
offset per position, ``-log(kept mass)``, the kept mass being the probability
of the support the sampler kept. That offset (``rest``, per scored position)
is all a truncation leaves in the numbers; this module asks which support
produced it. ``sampling.truncation`` calls it; it imports nothing of logdiff.

**Columns.** The training model's distribution arrives compressed
(``distribution.Reference``): per position the largest log-probabilities one token
per column, then bins of many tokens, each column covering the log-probability
interval ``[top - width, top]`` (width 0 for one token). At a temperature T
each column's mass ``p`` and the cumulative mass of every prefix follow
(``Columns``). Every sampler below keeps, per position, a set whose mass these
give exactly for single-token columns, and for a bin that is cut, in proportion
to the part of its interval kept (top-p: the target mass itself).

**Candidates**, with vLLM 0.32's definitions and order (vllm/v1/sample/sampler.py:
temperature, then the argmax-invariant logits processors, min-p among them
(logits_processor/builtin.py), then top-k, then top-p
(ops/topk_topp_sampler.py)):

* top-k: the k most probable tokens (k up to the reference's single-token columns);
* top-p: the smallest most-probable prefix whose mass reaches p;
* min-p: every token with ``p >= min_p * p_max``;
* top-k then top-p: top-p applied to the renormalised top-k distribution, so the
  kept prefix is the smallest whose mass reaches ``p * mass(top-k)``;
* typical-p (transformers' ``TypicalLogitsWarper``; vLLM has none): tokens in
  order of ``|-log p - H|`` (H the entropy) until their mass reaches p.

Each is tried over a grid of its parameters; its error is the mean
``|rest + log(kept mass)|`` over the positions (its misses). Among parameters
within ``TIE`` of the best error the roundest value is named (min-p 0.1, not
0.095, where the data cannot tell them apart). The one-parameter samplers
compete on their error; top-k then top-p contains top-k (p = 1) and top-p
(k = vocab), so it is named only when it fits *clearly* better than the best of
them: smaller misses by ``DISTINCT`` nats and ``SIGNIFICANT`` standard errors of
the per-position difference (kernel noise on both sides of the comparison does
not make a second parameter). Samplers that do not fit clearly worse than the
named one are listed beside it (``also``). A fit is named when it leaves at
most ``accept``, and either at most ``IDENTIFIES`` of the offsets' own spread
or no other sampler fits about as well: where the kept mass is nearly the same
at every position (a flat distribution, a random half of the vocabulary) every
sampler reproduces it roughly, and none is named.

**Not identified.** When no candidate leaves at most the caller's ``accept``
(a fraction of the gap), the offsets may still be a renormalisation over some
support none of them describes (a user's logits processor, a banned-token
list): any kept mass between the token's own probability and 1 is one some
support has, so the error of "some support" is how far the offsets fall outside
``[0, -log p(token)]`` (a negative offset, or a logprob above 0), and no offset
may fall below 0 by more than ``NOISE_BELOW`` of the median positive one. Kernel
noise is symmetric, half of it negative, so it never passes; nor does another
distribution (a BOS on one side, other weights), whose offsets are positive on
average when the tokens were drawn from it, but negative at some positions by as
much as they are positive at others. A real renormalisation does, and is
reported as ``renormalised over a truncated support, sampler not identified``
with the kept mass per position. One limit: a distribution unrelated to the
trainer's, whose tokens the trainer finds orders of magnitude less likely at
nearly every position, reads the same way (its kept mass per token is then tiny).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from logdiff.diagnosis.distribution import Reference

#: the top-p and typical-p values tried
TOP_P_GRID = np.round(np.arange(0.1, 0.9951, 0.005), 3)
#: the min-p values tried
MIN_P_GRID = np.round(np.concatenate([np.arange(0.005, 0.3001, 0.005), np.arange(0.35, 0.951, 0.05)]), 3)
#: a parameter whose error is within this fraction of the best one's ties with it: the roundest value is named
TIE = 0.05
#: one sampler fits clearly better than another when it misses the offsets less by this many nats (mean) ...
DISTINCT = 1e-3
#: ... and by this many standard errors of the per-position difference (top-k then top-p, the richer sampler,
#: must fit clearly better than every one-parameter one; those that do not fit clearly worse are listed beside it)
SIGNIFICANT = 3.0
#: offsets of a renormalisation no sampler describes fall below 0 by this fraction of the median positive one at
#: most: kernel noise around a small offset; another distribution (a BOS, other weights) falls below by as much
#: as it rises above
NOISE_BELOW = 0.25
#: a fit leaving at most this fraction of the offsets' spread (mean |offset - median|) identifies its sampler
#: even where another fits almost as well; a looser one only when no other does
IDENTIFIES = 0.25

LABEL = {"top_k": "top-k", "top_p": "top-p", "min_p": "min-p", "typical_p": "typical-p"}
#: every parameter a support may carry (each null where its sampler is not the named one)
PARAMETERS = ("top_k", "top_p", "min_p", "typical_p")


@dataclass
class Support:
    """A sampler (None: not identified) with its parameters, and its error: mean |rest + log(kept mass)|."""

    sampler: str | None  # top_k | top_p | min_p | typical_p | top_k_top_p
    params: dict[str, Any]
    error: float
    also: list[str] = field(default_factory=list)  # samplers that fit about as well (labels)
    misses: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # |rest + log(kept)| per position
    closest: float = math.inf  # the least error of any sampler tried (the named one's; where none is named, still)

    def label(self) -> str:
        """``min-p = 0.1``, ``top-k = 20, then top-p = 0.9``."""
        parts = [f"{LABEL[k]} = {v:g}" for k, v in self.params.items()]
        return ", then ".join(parts) if parts else "sampler not identified"


@dataclass
class Columns:
    """A compressed reference at one temperature: each column's mass and cumulative mass, and its interval."""

    p: np.ndarray  # [N, M] each column's probability mass (columns by descending log-probability)
    cum: np.ndarray  # [N, M] the mass of each prefix of columns
    tops: np.ndarray  # [N, M] the largest T = 1 log-probability a column covers
    widths: np.ndarray  # [N, M] the width of its interval (0: one token)
    weights: np.ndarray  # [N, M] its number of tokens
    exact: int  # the leading columns that hold one token in every row

    @classmethod
    def of(cls, ref: Reference, temperature: float) -> Columns:
        z = ref.values / temperature
        p = ref.weights * np.exp(z - z[:, :1])
        p /= p.sum(-1, keepdims=True)
        tops, widths = ref.intervals()
        split = np.any(ref.weights != 1, axis=0)
        exact = int(np.argmax(split)) if split.any() else ref.weights.shape[1]
        return cls(p, np.cumsum(p, -1), tops, widths, ref.weights, exact)


def _misses(rest: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """|rest + log(kept)| per position (axis 0) and parameter: how far each offset is from the kept mass's."""
    shape = (-1,) + (1,) * (kept.ndim - 1)
    return np.abs(rest.reshape(shape) + np.log(np.clip(kept, 1e-300, 1.0)))


def _roundest(grid: np.ndarray, errs: np.ndarray) -> int:
    """The index of the roundest grid value among those within ``TIE`` of the best error."""
    best = float(errs.min())
    near = np.flatnonzero(errs <= best * (1 + TIE) + 1e-12)

    def digits(v: float) -> int:
        return next(d for d in range(7) if abs(round(v, d) - v) < 1e-9)

    return int(min(near, key=lambda i: (digits(float(grid[i])), errs[i])))


def _searchsorted_rows(a: np.ndarray, v: np.ndarray, side: str = "left") -> np.ndarray:
    """``np.searchsorted(a[i], v[i])`` for every row i of ascending rows ``a`` [N, M], queries ``v`` [N, G]."""
    lo, hi = min(a.min(), v.min()), max(a.max(), v.max())
    step = (hi - lo + 1.0) * np.arange(len(a))[:, None]
    j = np.searchsorted((a - lo + step).ravel(), (v - lo + step).ravel(), side=side).reshape(v.shape)
    return j - a.shape[1] * np.arange(len(a))[:, None]


def _prefix_reaching(cum: np.ndarray, mass: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Per row, the kept mass of the smallest prefix whose mass reaches ``mass`` [N, G]; a bin cut at that mass."""
    j = _searchsorted_rows(cum, mass).clip(0, cum.shape[1] - 1)
    reached = np.take_along_axis(cum, j, 1)
    return np.where(np.take_along_axis(widths, j, 1) > 0, np.minimum(mass, reached), reached)


# ----------------------------------------------------------------------------- each sampler's kept mass [N, G]


def top_k_kept(cols: Columns) -> np.ndarray:
    """The mass top-k keeps, for k = 1 .. the single-token columns."""
    return cols.cum[:, : cols.exact]


def top_p_kept(cols: Columns, grid: np.ndarray = TOP_P_GRID) -> np.ndarray:
    return _prefix_reaching(cols.cum, np.broadcast_to(grid, (len(cols.cum), len(grid))), cols.widths)


def min_p_kept(cols: Columns, temperature: float, grid: np.ndarray = MIN_P_GRID) -> np.ndarray:
    """The mass min-p keeps: tokens with log p >= log p_max + log(min_p) at T (in T = 1 units: times T)."""
    thr = cols.tops[:, :1] + temperature * np.log(grid)[None, :]  # [N, G]
    j = _searchsorted_rows(-cols.tops, -thr, side="right").clip(1, cols.tops.shape[1]) - 1  # the last column kept
    top, width = np.take_along_axis(cols.tops, j, 1), np.take_along_axis(cols.widths, j, 1)
    frac = np.where(width > 0, np.clip((top - thr) / np.where(width > 0, width, 1.0), 0.0, 1.0), 1.0)
    return np.take_along_axis(cols.cum, j, 1) - np.take_along_axis(cols.p, j, 1) * (1.0 - frac)


def typical_p_kept(cols: Columns, grid: np.ndarray = TOP_P_GRID) -> np.ndarray:
    """The mass typical-p keeps: tokens by |-log p - H| ascending until their mass reaches p."""
    full = cols.weights > 0
    per_token = np.where(full, np.log(np.clip(cols.p, 1e-300, None) / np.where(full, cols.weights, 1.0)), 0.0)
    entropy = -(cols.p * per_token).sum(-1, keepdims=True)
    order = np.argsort(np.where(full, np.abs(-per_token - entropy), np.inf), axis=-1, kind="stable")
    cum = np.cumsum(np.take_along_axis(cols.p, order, 1), -1)
    return _prefix_reaching(cum, np.broadcast_to(grid, (len(cum), len(grid))), np.take_along_axis(cols.widths, order, 1))


def top_k_top_p_errors(cols: Columns, rest: np.ndarray, grid: np.ndarray = TOP_P_GRID) -> np.ndarray:
    """[K, P] mean miss of top-k then top-p (vLLM's order): the smallest prefix reaching p * mass(top-k)."""
    k = cols.exact
    err = np.zeros((k, len(grid)))
    for i in range(len(rest)):  # a row at a time: [K, P] each, where all rows at once would hold [N, K, P]
        cum = cols.cum[i, :k]
        j = np.searchsorted(cum, cum[:, None] * grid[None, :]).clip(0, k - 1)
        err += np.abs(rest[i] + np.log(np.clip(cum[j], 1e-300, 1.0)))
    return err / max(len(rest), 1)


def top_k_top_p_kept(cols: Columns, k: int, p: float) -> np.ndarray:
    cum = cols.cum[:, :k]
    j = _searchsorted_rows(cum, cum[:, -1:] * p).clip(0, k - 1)
    return np.take_along_axis(cum, j, 1)[:, 0]


# ----------------------------------------------------------------------------- naming


def _fit(name: str, grid: np.ndarray, misses: np.ndarray) -> Support:
    """The best parameter of one sampler from its misses [N, G] (the roundest among near ties)."""
    errs = misses.mean(0)
    i = int(np.argmin(errs)) if name == "top_k" else _roundest(grid, errs)
    return Support(name, {name: int(grid[i]) if name == "top_k" else float(grid[i])}, float(errs[i]), misses=misses[:, i])


def _one_parameter(cols: Columns, rest: np.ndarray, temperature: float) -> list[Support]:
    """The best parameter of each one-parameter sampler."""
    return [
        _fit("top_k", np.arange(1, cols.exact + 1), _misses(rest, top_k_kept(cols))),
        _fit("top_p", TOP_P_GRID, _misses(rest, top_p_kept(cols))),
        _fit("min_p", MIN_P_GRID, _misses(rest, min_p_kept(cols, temperature))),
        _fit("typical_p", TOP_P_GRID, _misses(rest, typical_p_kept(cols))),
    ]


def _combined(cols: Columns, rest: np.ndarray) -> Support:
    by_kp = top_k_top_p_errors(cols, rest)
    k = int(np.argmin(by_kp.min(1)))
    p = float(TOP_P_GRID[_roundest(TOP_P_GRID, by_kp[k])])
    misses = _misses(rest, top_k_top_p_kept(cols, k + 1, p))
    return Support("top_k_top_p", {"top_k": k + 1, "top_p": p}, float(misses.mean()), misses=misses)


def clearly_better(a: Support, b: Support) -> bool:
    """Whether ``a`` misses the offsets less than ``b`` by ``DISTINCT`` nats and ``SIGNIFICANT`` standard errors."""
    d = b.misses - a.misses
    mean = float(d.mean()) if len(d) else 0.0
    return mean >= DISTINCT and mean >= SIGNIFICANT * float(d.std()) / math.sqrt(len(d))


def cheapest_error(ref: Reference, observed: np.ndarray, temperature: float) -> float:
    """The least error of top-k, top-p and min-p at T: the objective a temperature is fitted jointly with."""
    rest = np.asarray(observed, np.float64) - ref.tempered(temperature)
    cols = Columns.of(ref, temperature)
    return float(min(_misses(rest, k).mean(0).min()
                     for k in (top_k_kept(cols), top_p_kept(cols), min_p_kept(cols, temperature))))  # fmt: skip


def identify(ref: Reference, observed: np.ndarray, temperature: float, accept: float) -> Support | None:
    """The truncation ``observed`` was renormalised over at T: a named sampler, one not identified, or None.

    ``accept``: the largest error that counts as reproducing the offsets.
    """
    observed = np.asarray(observed, np.float64)
    rest = observed - ref.tempered(temperature)
    cols = Columns.of(ref, temperature)
    singles = _one_parameter(cols, rest, temperature)
    best = min(singles, key=lambda s: s.error)
    fits = list(singles)
    if best.error >= DISTINCT:  # else no combination can be better by DISTINCT
        combined = _combined(cols, rest)
        fits.append(combined)
        best = combined if clearly_better(combined, best) else best
    loose = [s.label() for s in singles if s is not best and s.error <= accept and not clearly_better(best, s)]
    spread = float(np.mean(np.abs(rest - np.median(rest)))) if len(rest) else 0.0
    if best.error <= accept and (best.error <= IDENTIFIES * spread or not loose):
        best.also, best.closest = loose, best.error
        return best
    outside = np.maximum(-rest, 0.0) + np.maximum(observed, 0.0)  # no support explains these
    some = float(outside.mean()) if len(rest) else 0.0
    below, above = -rest[rest < 0], rest[rest > 0]
    if some > accept or not len(above) or (len(below) and below.max() > NOISE_BELOW * np.median(above)):
        return None
    near = [s.label() for s in sorted(fits, key=lambda s: s.error) if s.error <= accept and not clearly_better(best, s)]
    return Support(None, {}, some, near, closest=best.error)

