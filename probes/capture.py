"""Capture a model's boundaries in the user's own process, on any rank, into a bundle.

``Capture`` is a context manager around the user's forward passes on an
``nn.Module`` (an HF model as it is, or wrapped with FSDP2 (``fully_shard``) or
DTensor tensor parallel (``parallelize_module``); a vLLM worker's model). It runs
the same ``Recorder`` a scan runs on logdiff's own engines, through a *view* of
the engine that owns the model (``module()``, ``probes()``: the engine's taps and
rows; ``logdiff.sources.hf.capture``, ``logdiff.sources.vllm.capture``), and
sends what it records to a ``BundleSink`` instead of a store or a comparer:

* every top-level forward is a *step*; each sequence its batch holds becomes a
  new capture sequence (``batching.py``: a padded row is one, its pads invalid; a
  packed row is one per segment), its tokens numbered from 0, and the model
  position of its first token, where not 0 (left padding without
  ``position_ids``), kept in the metadata's ``position_offsets`` (alignment across
  bundles is by token ids, later);
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

``Capture.token_logprobs`` takes the trainer's own per-token logprobs instead, for a head
that never calls ``lm_head`` (a fused or chunked log-prob kernel: TRL's ``chunked_logprob``,
verl's fused kernels): the logprob of the token at column ``c`` of the step's ``input_ids`` is
recorded as a one-column ``token_logprobs`` row at the row of column ``c - 1``, where a
``log_softmax`` row predicting that token would be (HF's causal shift). ``logdiff compare``
reads a side's token logprobs from that record first, so no logits are needed.

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

from logdiff.probes.replay import row_index
from logdiff.records.bundle_writer import BundleWriter
from logdiff.records.layout import REPLICATE, ParallelLayout, Placement, placement_of, shard
from logdiff.records.sketch import Window, local_columns

PATH = "capture"
TOKEN_LOGPROBS = "token_logprobs"  # the trainer's own logprob of each next token, one column (``token_logprobs``)


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
        kept = self.capture._kept_rows(rmap)
        if kept is None:
            return
        # a run of rows is a view (the writer copies or sketches it at once); a gather (a left-padded batch's valid
        # rows) is a copy already: the writer keeps it, no second copy
        run = isinstance(kept.rows, slice)
        taken = rows[kept.rows] if run else rows[row_index(kept.rows, rows.device)]
        self.capture._private = None if run else taken
        self.capture._record(name, taken, kept.seq, kept.pos, placement, kept.index)
        self.capture._private = None


class _KeptRows:
    """Which rows of a forward's tensors a capture keeps (its row map's valid ones) and their places in the step:
    the same for every boundary of the forward, so found once per row map (``Capture._kept_rows``)."""

    def __init__(self, rmap: Any, capture: Capture):
        idx = np.nonzero(rmap.valid)[0]
        first, last = int(idx[0]), int(idx[-1])
        # a run of rows (np.nonzero: sorted, unique) as a slice, else the rows to gather
        self.rows: slice | np.ndarray = slice(first, last + 1) if last - first == len(idx) - 1 else idx
        self.seq, self.pos = rmap.seq[idx], rmap.pos[idx]
        self.index = capture._places(self.seq, self.pos)


class Capture:
    """``with Capture(model, out_dir, role, layout): model(ids)`` records every forward into a bundle."""

    #: a forward of the model's decoder alone (``model.base_model``: a fused head's trainer calls it, then its
    #: kernel on ``lm_head.weight``) is a step too, with every boundary but the logits; its ``token_logprobs`` give those
    base_steps = True

    def __init__(self, model: Any, view: Any, out_dir: str | Path, role: str, layout: ParallelLayout | None = None,
                 meta: dict[str, Any] | None = None, window: Window | None = None, wait: bool = True):
        from logdiff.probes.arch import adapter_of

        self.model = model
        self.adapter = adapter_of(model)
        self.cmap = self.adapter.correspondence(model.config.to_dict())
        self.layout = layout or ParallelLayout()
        self.window = window or Window()
        #: whether leaving the block waits for the bundle to be written (else ``wait()`` does, or the process's exit)
        self.wait_on_exit = wait
        #: each forward's row map where the recorder cannot make it from known sequences (a serving engine's)
        self.rows: Callable[[tuple, dict], Any] | None = None
        self.writer = BundleWriter(out_dir, role, self.layout, meta, background=True)
        self.view = view  # the engine as the recorder asks it: module(), probes(), listener (and _logprobs)
        self.sequences: list[Any] = []
        self.modules = dict(model.named_modules())
        self._placements: dict[str, Placement] = {}
        self._columns: dict[tuple[Placement, int], np.ndarray | None] = {}  # ``_sketched``'s, per placement and width
        self._keys = self._order = np.zeros(0, dtype=np.int64)  # the step's rows by (sequence, position)
        self._rows_kept: tuple[Any, np.ndarray, _KeptRows | None] | None = None  # ``_kept_rows``' last
        self._grid: tuple[np.ndarray, ...] | None = None  # the step's (ids, seq, pos, valid) as [batch, length]
        self._batch: Any = None  # the running forward's rows as (sequence, position in it), from ``_begin_step``
        self._recorder: Any = None
        self._private: Any = None  # the record being recorded when it is the capture's own copy (``BundleSink.emit``)
        self._hook: Any = None
        self._base_hook: Any = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        from logdiff.probes.record import Recorder

        # registered before the recorder's own hooks, so each step is announced before it aligns
        self._hook = self.model.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        base = getattr(self.model, "base_model", None) if self.base_steps else None
        if base is not None and base is not self.model and hasattr(base, "register_forward_pre_hook"):
            self._base_hook = base.register_forward_pre_hook(self._begin_base_step, with_kwargs=True)
        self._recorder = Recorder(self.view, self.cmap, lambda path: [BundleSink(self)] if path == PATH else [],
                                  self.sequences, response_len=0,
                                  rows=self.rows if self.rows is not None else self._batch_rows)
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
            if self._base_hook is not None:
                self._base_hook.remove()
            self.writer.meta_update({"warnings": list(self._recorder.warnings), "owners": dict(self._recorder.owners)})
            self.writer.close(wait=self.wait_on_exit)

    def wait(self) -> None:
        """Block until the bundle is written (where the block did not wait); raise what writing failed with."""
        self.writer.wait()

    def applied_processing(self, **settings: Any) -> None:
        """Declare what the trainer did to its logits before its log-softmax, for every step of this capture
        (``meta["applied_processing"]``): ``temperature=`` (TRL and verl divide the logits by the rollout's), and
        any other step of a sampler it applies (``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ...: the
        keys of ``logdiff/records/processing.py``). ``logdiff compare`` checks the rollout's recorded sampling
        against it: a step the engine applied and the trainer did not is a ``sampling_semantics`` cause. Call it
        again to replace the declaration; unknown keys or invalid values raise ``ValueError``."""
        from logdiff.errors import InputError
        from logdiff.records.processing import SETTINGS, clean

        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"applied_processing: unknown setting(s) {', '.join(unknown)} (known: "
                             f"{', '.join(SETTINGS)})")
        try:
            record = clean({k: (float(v) if isinstance(v, int) and not isinstance(v, bool) and k in
                                ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                                 "presence_penalty") else v) for k, v in settings.items()}, "applied_processing")
        except InputError as e:
            raise ValueError(str(e)) from None
        self.writer.meta_update({"applied_processing": record})

    def logprobs(self, logits: Any) -> Any:
        """The trainer's ``log_softmax`` (``log_softmax=``; float32 ``torch.log_softmax`` by default) of the model's
        last logits ``[..., V]``, recorded as the ``log_softmax`` boundary (route the trainer's through it). The
        recorder takes it as rows of those logits."""
        rows = logits.reshape(-1, logits.shape[-1])  # a view of the logits' rows, as the engines pass them
        return self.view._logprobs(rows).reshape(*logits.shape[:-1], -1)

    def token_logprobs(self, logprobs: Any, start: int | None = None, token_ids: Any = None) -> Any:
        """Record the trainer's own logprobs of the tokens it scored in this step (the last forward), for a head
        that never calls ``lm_head`` (a fused or chunked log-prob kernel); returns ``logprobs`` unchanged.

        ``logprobs`` is ``[batch, n]``: column ``k`` is the logprob of the token at column ``start + k`` of the
        step's ``input_ids``, given the tokens before it (HF's causal shift: ``logits[:, t]`` scores
        ``input_ids[:, t + 1]``). ``start`` defaults to ``length - n``, the layouts trainers produce:
        ``[batch, length - 1]`` from ``log_softmax(logits[:, :-1])`` gathered at ``input_ids[:, 1:]``
        (``start=1``), and the response-only ``[batch, response_len]`` of TRL (``logits_to_keep``) and verl
        (``start`` = the padded prompt length). It must be at least 1 (token 0 has no prefix) and the columns
        must end within the step. ``token_ids``: the ids the trainer gathered at (TRL's ``completion_ids``,
        verl's ``responses``); when given they must equal ``input_ids[:, start:start + n]``, which catches an
        off-by-one ``start``. Tokens the attention mask leaves out, or whose previous column it leaves out or
        gives to another sequence (a packed row's segments), are not recorded. Once per step: each forward is
        a step.
        """
        import torch

        if self._grid is None:
            raise RuntimeError("token_logprobs() without a recorded forward: call it after the model's forward "
                               "(or its decoder's), inside the capture")
        ids, seq, pos, valid = self._grid
        lp = logprobs.detach() if isinstance(logprobs, torch.Tensor) else torch.as_tensor(logprobs)
        batch, length = ids.shape
        if lp.dim() != 2 or lp.shape[0] != batch:
            raise ValueError(f"token_logprobs: expected [batch={batch}, n] logprobs, got {list(lp.shape)}")
        n = int(lp.shape[1])
        first = length - n if start is None else int(start)
        if first < 1 or first + n > length:
            raise ValueError(f"token_logprobs: {n} logprobs from column {first} do not fit the step's {length} "
                             "input ids (column 0 has no prefix; pass start=, the column of the first scored token)")
        if token_ids is not None:
            given = (token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else torch.as_tensor(token_ids))
            fed = ids[:, first : first + n]
            if tuple(given.shape) != fed.shape or not np.array_equal(given.numpy(), fed):
                raise ValueError(f"token_logprobs: token_ids are not input_ids[:, {first}:{first + n}]: the "
                                 "logprobs are misaligned with the step (check start=)")
        cols = np.arange(first, first + n)
        ok = valid[:, cols] & valid[:, cols - 1] & (seq[:, cols] == seq[:, cols - 1])  # a packed row's segments
        b, k = np.nonzero(ok)
        rows = lp.float().cpu()[torch.as_tensor(b), torch.as_tensor(k)][:, None].contiguous()
        prev = cols[k] - 1  # the row whose prediction each logprob is
        index = self._places(seq[b, prev], pos[b, prev])
        self.writer.record(TOKEN_LOGPROBS, rows, REPLICATE, rows=index)
        return logprobs

    # ---- steps ----------------------------------------------------------------------------------

    def _begin_base_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The decoder's forward begins a step when the whole model's did not (it is not running)."""
        if not self._recorder.stack:
            self._begin_step(module, args, kwargs)

    def _begin_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Each forward's rows as the sequences they hold (``batching.py``: left or right padding, packed rows
        split where their positions restart or ``cu_seqlens`` starts a segment), numbered from the last; a
        sequence's tokens are numbered from 0, the model position of its first (a left pad's shift) goes to the
        metadata's ``position_offsets``."""
        import torch
        from logdiff.probes.align import RowMap

        from logdiff.records.batching import segment_starts, split_rows

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        ids = ids.detach().cpu()  # token ids only: the step's row table lives on the host
        batch, length = ids.shape
        pos = kwargs.get("position_ids")
        pos = torch.arange(length)[None].expand(batch, -1) if pos is None else pos.detach().cpu().expand(batch, -1)
        mask = kwargs.get("attention_mask")
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask[:, -length:].detach().cpu().bool()
        cu = next((kwargs[k] for k in ("cu_seq_lens_q", "cu_seqlens") if kwargs.get(k) is not None), None)
        first = len(self.sequences)
        split = split_rows(pos.numpy(), valid.numpy(), first, segment_starts(cu))
        self._batch = RowMap(split.seq, split.pos, split.valid)
        self._grid = None  # set below once the step is recorded (for ``token_logprobs``)
        if not split.count:  # padding only: nothing to record
            self._recorder.begin_pass(PATH + ":idle", [])
            return
        flat = ids.reshape(-1).numpy()
        for k in range(split.count):  # the ids each position of the sequence was fed (-1: none), for the recorder
            mine = split.valid & (split.seq == first + k)
            known = np.full(int(split.pos[mine].max()) + 1, -1, dtype=np.int64)
            known[split.pos[mine]] = flat[mine]
            self.sequences.append(_Sequence(known.tolist()))
        shifted = {str(first + k): o for k, o in enumerate(split.offsets) if o}
        if shifted:
            meta = self.writer.manifest["meta"]
            self.writer.meta_update({"position_offsets": {**meta.get("position_offsets", {}), **shifted}})
        self.writer.begin_step(ids.reshape(-1), split.pos, split.seq, split.valid)
        keys = row_keys(split.seq, split.pos)
        self._order = np.argsort(keys, kind="stable")
        self._keys = keys[self._order]
        self._placements = {}
        self._grid = (ids.numpy(), *(np.asarray(a).reshape(batch, length) for a in (split.seq, split.pos, split.valid)))
        self._recorder.begin_pass(PATH, list(range(first, first + split.count)))

    def _batch_rows(self, args: tuple, kwargs: dict) -> Any:
        """The recorder's row map of an HF forward: the one ``_begin_step`` split (a copy: the recorder edits it)."""
        from logdiff.probes.align import RowMap

        rows = self._batch
        if rows is None:
            raise RuntimeError("a forward the capture did not announce")
        return RowMap(rows.seq.copy(), rows.pos.copy(), rows.valid.copy())

    def _places(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Each row ``(seq, pos)``'s place in the step's rows (``_begin_step``'s keys)."""
        return self._order[np.searchsorted(self._keys, row_keys(seq, pos))]

    def _kept_rows(self, rmap: Any) -> _KeptRows | None:
        """The rows of ``rmap`` the capture keeps, or None where it holds no valid row; found once per row map (a
        forward's boundaries share one) and step (``_begin_step`` sets the step's row keys)."""
        cached = self._rows_kept
        if cached is not None and cached[0] is rmap and cached[1] is self._keys:
            return cached[2]
        kept = _KeptRows(rmap, self) if rmap.valid.any() else None
        self._rows_kept = (rmap, self._keys, kept)
        return kept

    def _record(self, name: str, rows: Any, seq: np.ndarray, pos: np.ndarray, placement: Placement | None,
                index: np.ndarray | None = None) -> None:
        """Record ``rows``, the step's rows ``(seq, pos)`` (``index``: their places in the step, where known)."""
        if index is None:
            index = self._places(seq, pos)
        placement = placement or self._placement(name, rows.shape[-1])
        self._placements[name] = placement
        self.writer.record(name, rows, placement, rows=index, sketch_columns=self._sketched(name, placement, rows),
                           private=rows is self._private)

    def _sketched(self, name: str, placement: Placement, rows: Any) -> np.ndarray | None:
        """Each local column's logical column when ``name`` is outside the full window (only its row sketches
        are kept), else None; a record whose slices cannot be sketched apart (a partial sum) is kept whole."""
        boundary = self.cmap.get(name)
        if self.window.full(boundary.layer if boundary is not None else None):
            return None
        key = (placement, int(rows.shape[-1]))
        if key not in self._columns:  # one per placement and width: every step's records share them
            group = self.layout.group("tp")
            self._columns[key] = local_columns(placement, self.layout.index_in("tp"), len(group), key[1])
        return self._columns[key]

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

