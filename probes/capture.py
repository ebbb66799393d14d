"""Capture a model's boundaries in the user's own process, on any rank, into a bundle.

``Capture`` is a context manager around the user's forward passes on an
``nn.Module`` (an HF model as it is, or wrapped with FSDP2 (``fully_shard``) or
DTensor tensor parallel (``parallelize_module``); a vLLM worker's model). It runs
the same ``Recorder`` a scan runs on logdiff's own engines, through a *view* of
the engine that owns the model (``module()``, ``probes()``: the engine's taps and
rows; ``logdiff.engines.hf.capture``, ``logdiff.engines.vllm.capture``), and
sends what it records to a ``BundleSink`` instead of a store or a comparer:

* every top-level forward is a *step*; each of its batch rows becomes a new
  capture sequence (alignment across bundles is by token ids, later);
* the step's token ids, positions, sequence ids and row validity (the attention
  mask) go to the step's file; each record stores its valid rows and their
  indices into that table, so records computed on a subset of rows (logits)
  keep their rows;
* each record's ``Placement`` across the ``tp`` group is read from the module
  that produced it: a DTensor weight's global width against the local output
  width (sharded when the output holds a slice, replicated when it holds all:
  column-parallel, row-parallel, gathered ``colwise_rep``). A record of a module
  without a DTensor weight (a norm, RoPE, attention, the activation) is placed
  like the first of its inputs the adapter names (local heads stay local), and
  is replicated when it has none. FSDP2 gathers its parameters before each
  forward, so its records are replicated within the rank and its ranks differ by
  data: each rank is its own ``tp`` group of one. A record that arrives as a
  DTensor (a row-parallel layer's input) states its own placement.

Records outside the capture's ``Window`` (by default every layer past the second)
keep one sketch per row instead of the row (``sketch.py``), computed on this rank's
slice with its logical columns.

Placements are read across the ``tp`` group only: on a 2-D mesh (FSDP2 x TP) the
FSDP2 dimension gathers weights before each forward, so records are whole along it
and its ranks differ by data. Nothing here gathers an activation while the model runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.probes.bundle import BundleWriter
from logdiff.probes.layout import REPLICATE, ParallelLayout, Placement, placement_of, shard
from logdiff.probes.sketch import Window, local_columns

PATH = "capture"


class _Sequence:
    """A capture sequence as the recorder reads one: the ids per position (-1 where none was fed)."""

    def __init__(self, ids: list[int]):
        self.prompt_ids, self.response_ids = ids, []


class BundleSink:
    """Receives the recorder's rows of one step and writes them with their placements."""

    wants_replay = False

    def __init__(self, capture: Capture):
        self.capture = capture

    def emit(self, name: str, rows: Any, rmap: Any, replay_spec: Any = None) -> None:
        placement = None
        if hasattr(rows, "to_local"):  # a DTensor (a row-parallel layer's input, say): it states its placement
            placement, rows = placement_of(rows), rows.to_local()
        idx = np.nonzero(rmap.valid)[0]
        if len(idx):
            self.capture._record(name, rows[idx], rmap.seq[idx], rmap.pos[idx], placement)


class Capture:
    """``with Capture(model, out_dir, role, layout): model(ids)`` records every forward into a bundle."""

    def __init__(self, model: Any, view: Any, out_dir: str | Path, role: str, layout: ParallelLayout | None = None,
                 meta: dict[str, Any] | None = None, window: Window | None = None):
        from logdiff.probes.arch import adapter_of

        self.model = model
        self.adapter = adapter_of(model)
        self.cmap = self.adapter.correspondence(model.config.to_dict())
        self.layout = layout or ParallelLayout()
        self.window = window or Window()
        #: each forward's row map where the recorder cannot make it from known sequences (a serving engine's)
        self.rows: Callable[[tuple, dict], Any] | None = None
        self.writer = BundleWriter(out_dir, role, self.layout, meta)
        self.view = view  # the engine as the recorder asks it: module(), probes(), listener (and _logprobs)
        self.sequences: list[Any] = []
        self.modules = dict(model.named_modules())
        self._placements: dict[str, Placement] = {}
        self._keys = self._order = np.zeros(0, dtype=np.int64)  # the step's rows by (sequence, position)
        self._recorder: Any = None
        self._hook: Any = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        from logdiff.probes.record import Recorder

        # registered before the recorder's own hooks, so each step is announced before it aligns
        self._hook = self.model.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        self._recorder = Recorder(self.view, self.cmap, lambda path: [BundleSink(self)] if path == PATH else [],
                                  self.sequences, response_len=0, rows=self.rows)
        try:
            self._recorder.__enter__()
        except BaseException:
            self._hook.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._recorder.__exit__(*exc)
        finally:
            self._hook.remove()
            self.writer.meta_update({"warnings": list(self._recorder.warnings), "owners": dict(self._recorder.owners)})
            self.writer.close()

    def logprobs(self, logits: Any) -> Any:
        """The trainer's ``log_softmax`` (``log_softmax=``; float32 ``torch.log_softmax`` by default) of the model's
        last logits ``[..., V]``, recorded as the ``log_softmax`` boundary (route the trainer's through it). The
        recorder takes it as rows of those logits."""
        rows = logits.reshape(-1, logits.shape[-1])  # a view of the logits' rows, as the engines pass them
        return self.view._logprobs(rows).reshape(*logits.shape[:-1], -1)

    # ---- steps ----------------------------------------------------------------------------------

    def _begin_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        ids = ids.detach().cpu()  # token ids only: the step's row table lives on the host
        batch, length = ids.shape
        pos = kwargs.get("position_ids")
        pos = torch.arange(length)[None].expand(batch, -1) if pos is None else pos.detach().cpu().expand(batch, -1)
        mask = kwargs.get("attention_mask")
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask[:, -length:].detach().cpu().bool()
        first = len(self.sequences)
        for row in range(batch):  # the ids each position of the row was fed (-1: none), for the recorder's check
            p, t = pos[row][valid[row]], ids[row][valid[row]]
            known = torch.full((int(p.max()) + 1 if len(p) else 0,), -1, dtype=torch.long)
            known[p] = t
            self.sequences.append(_Sequence(known.tolist()))
        seq = torch.arange(first, first + batch)[:, None].expand(batch, length)
        self.writer.begin_step(ids.reshape(-1), pos.reshape(-1), seq.reshape(-1), valid.reshape(-1))
        keys = row_keys(seq.reshape(-1).numpy(), pos.reshape(-1).numpy())
        self._order = np.argsort(keys, kind="stable")
        self._keys = keys[self._order]
        self._placements = {}
        self._recorder.begin_pass(PATH, list(range(first, first + batch)))

    def _record(self, name: str, rows: Any, seq: np.ndarray, pos: np.ndarray, placement: Placement | None) -> None:
        index = self._order[np.searchsorted(self._keys, row_keys(seq, pos))]  # each row's place in the step
        placement = placement or self._placement(name, rows.shape[-1])
        self._placements[name] = placement
        self.writer.record(name, rows, placement, rows=index, sketch_columns=self._sketched(name, placement, rows))

    def _sketched(self, name: str, placement: Placement, rows: Any) -> np.ndarray | None:
        """Each local column's logical column when ``name`` is outside the full window (only its row sketches
        are kept), else None; a record whose slices cannot be sketched apart (a partial sum) is kept whole."""
        boundary = self.cmap.get(name)
        if self.window.full(boundary.layer if boundary is not None else None):
            return None
        group = self.layout.group("tp")
        return local_columns(placement, self.layout.index_in("tp"), len(group), int(rows.shape[-1]))

    def _placement(self, name: str, width: int) -> Placement:
        owner = self.modules.get(self._recorder.owners.get(name, name))
        weight = getattr(owner, "weight", None)
        if weight is not None and hasattr(weight, "placements"):
            full = weight.shape[1] if type(owner).__name__.endswith("Embedding") else weight.shape[0]
            return REPLICATE if width == full else shard(-1, size=full)
        boundary = self.cmap.get(name)
        for source in boundary.inputs if boundary is not None else ():
            if source in self._placements:
                return self._placements[source]
        return REPLICATE


def row_keys(seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """One int64 key per (sequence, position) row."""
    return np.asarray(seq, dtype=np.int64) * (1 << 32) + np.asarray(pos, dtype=np.int64)

