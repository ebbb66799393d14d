"""Teacher-forced replay: run one path's op on the other path's captured inputs.

A boundary's output difference mixes two things: error the op *introduces*
(it computes differently from the other engine's op on the same inputs) and
error it only *propagates* (its inputs already differed). Replay separates
them. While the second path runs (the live path, normally the HF training
path), each of its ops is called a second time, right where it ran, with the
inputs the first path (the stored path) fed its own version of that op, in the
live call's own shape (batch size and layout matter for some kernels). The
op's *local error* is then ``|live_op(stored_inputs) - stored_op(stored_inputs)|``
(``summary.PathComparer`` does the comparing).

A ``ReplaySpec`` says how to rebuild the live op's inputs (for each input
boundary: the live tensor used as a shape template and its row layout) and how
to call the op. Builders exist for every op HF exposes standalone:

* ``module``: linear layers, RMSNorm (q/k-norm included), the MoE router and
  block, ``lm_head`` -- ``module.forward`` on the rebuilt input;
* ``add``: the residual adds (``a + b``, as HF writes them);
* ``act_mul``: ``act_fn(gate) * up``;
* ``rope``: the modeling file's ``apply_rotary_pos_emb`` (the adapter's
  ``rope_function``) with the live call's ``cos``/``sin`` (or complex ``freqs``);
* ``attention``: the model's attention function (eager/sdpa) on replaced
  q/k/v with the live mask, only where the call sees the whole context (a full
  forward, not a KV-cache step). Decode-side attention cannot be replayed this
  way; its introduced error comes from equal-inputs evidence instead;
* ``function``: an engine-level function such as the log_softmax.

Rows the stored path did not produce keep their live values and are left out
of the local error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from logdiff.probes.align import HEADS_FIRST, PLAIN, Layout


@dataclass
class ReplaySpec:
    """How to re-run one live op on substituted inputs."""

    inputs: list[tuple[str, Any, Layout]]  # (input boundary, live tensor as template, its layout)
    run: Callable[[list[Any]], Any]
    out_layout: Layout = PLAIN
    causal: bool = False  # the op reads its inputs at every earlier position too
    method: str = "module"


def module(
    mod: Any, input_name: str, template: Any, select: Callable[[Any], Any], layout: Layout = PLAIN
) -> ReplaySpec:
    """``select(mod.forward(x))`` with ``x`` rebuilt from ``input_name``; ``layout``: how input and output
    hold token rows (``HEADS_FIRST`` for a per-head norm on ``[B, heads, L, D]``, Gemma 3's q/k norms)."""
    spec = ReplaySpec([(input_name, template, layout)], lambda xs: select(mod.forward(xs[0])), method="module")
    spec.out_layout = layout
    return spec


def add(names: Sequence[str], live: Sequence[Any]) -> ReplaySpec:
    """A residual add, ``a + b``."""
    return ReplaySpec([(n, t, PLAIN) for n, t in zip(names, live)], lambda xs: xs[0] + xs[1], method="add")


def act_mul(act: Any, names: Sequence[str], live: Sequence[Any]) -> ReplaySpec:
    """``act(gate) * up``."""
    return ReplaySpec([(n, t, PLAIN) for n, t in zip(names, live)], lambda xs: act(xs[0]) * xs[1], method="act_mul")


def rope(
    fn: Callable[..., Any], names: Sequence[str], q: Any, k: Any, tables: tuple, which: int, **kw: Any
) -> ReplaySpec:
    """``fn(q, k, *tables)[which]`` with q and k (``[B, heads, L, D]``) rebuilt; ``tables``: the live
    call's position tables (``cos, sin``; DeepSeek's complex ``freqs_cis``)."""
    return ReplaySpec(
        [(names[0], q, HEADS_FIRST), (names[1], k, HEADS_FIRST)],
        lambda xs: fn(xs[0], xs[1], *tables, **kw)[which],
        out_layout=HEADS_FIRST,
        method="rope",
    )


def attention(
    fn: Callable[..., Any], owner: Any, names: Sequence[str], q: Any, k: Any, v: Any, args: tuple, kwargs: dict
) -> ReplaySpec:
    """The attention function on rebuilt q/k/v (``[B, heads, L, D]``); output ``[B, L, heads, D]``."""
    return ReplaySpec(
        [(names[0], q, HEADS_FIRST), (names[1], k, HEADS_FIRST), (names[2], v, HEADS_FIRST)],
        lambda xs: fn(owner, xs[0], xs[1], xs[2], *args, **kwargs)[0],
        causal=True,
        method="attention",
    )


def function(fn: Callable[[Any], Any], input_name: str, template: Any) -> ReplaySpec:
    """A one-input function (the engine's log_softmax)."""
    return ReplaySpec([(input_name, template, PLAIN)], lambda xs: fn(xs[0]), method="function")


@dataclass
class StoredInput:
    """One input of a replayed op: its live rows, and the stored path's rows at ``rows`` (None: none stored)."""

    template: Any
    layout: Layout
    live: Any  # [n, width] the live input's rows
    rows: Any  # the row ids the stored path has (numpy)
    stored: Any  # the stored path's values there, on the live rows' device and dtype, or None

    def tensor(self) -> Any:
        """The live input with the stored rows put over the live ones, in the live call's shape."""
        rows = self.live.clone()
        if self.stored is not None:
            rows[row_index(self.rows, rows.device)] = self.stored
        return self.layout.from_rows(rows, like=self.template)


def stored_inputs(spec: ReplaySpec, store: Any, rmap: Any) -> tuple[list[StoredInput], Any] | str:
    """The inputs of ``spec``'s op rebuilt from the stored path's rows (``store.get(name)``) at the rows of ``rmap``,
    and the mask of rows whose every input the stored path has; or, where an input was not recorded there, its
    name. A causal op (attention) needs each input at every earlier position too."""
    import numpy as np

    n = len(rmap)
    ok = rmap.valid.copy()
    inputs = []
    for in_name, template, layout in spec.inputs:
        source = store.get(in_name)
        if source is None:
            return in_name
        have = rmap.valid & (source.has_prefix if spec.causal else source.has)(rmap.seq, rmap.pos)
        hidx = np.nonzero(have)[0]
        live = layout.to_rows(template, n)
        sub = source.read(rmap.seq[hidx], rmap.pos[hidx]).to(live.device, live.dtype) if len(hidx) else None
        inputs.append(StoredInput(template, layout, live, hidx, sub))
        ok &= have
    return inputs, ok


def row_index(idx: Any, device: Any) -> Any:
    """Numpy row ids as a torch index on ``device`` (torch indexes with a numpy array element by element)."""
    import torch

    return torch.as_tensor(idx, device=device)
