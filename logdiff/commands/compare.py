"""``logdiff compare TRAIN_BUNDLE INFER_BUNDLE``: a scan's comparison and diagnosis of two capture bundles.

The bundles were recorded apart (``logdiff.capture`` in a trainer, the vLLM
worker plugin in a rollout engine, an msprobe dump read by ``logdiff.sources.msprobe``;
docs/capture.md), on any ranks, in any batching. Nothing here imports an engine's
folder or a source (``sources.base``, the interface, is all it names): the bundles are read with numpy and safetensors, and the rest is the
comparison a scan runs too (``compare.compare_pair``, ``locate.localize``,
``nonfinite.add_non_finite``, ``bundle_feed``, ``diagnosis``), on CPU tensors. This
module and those sit below the scan (``pipeline``), which imports them and is
never imported back; ``--model`` asks the engine registry for the training engine
by name (``registry.get_engine``), never an engine module:

1. both bundles must describe one model (architecture and shape-defining
   config keys), else one line and exit 2;
2. their sequences are joined by token ids (``probes.feed.match_sequences``), whatever model position
   each side fed their first token at; those without a partner are counted in one warning line, and
   a shift one side applied (a left-padded row without ``position_ids``: ``position_offsets`` in its
   metadata) is a ``position_ids`` warning, and a cause where the logprobs differ;
3. each bundle is un-sharded record by record and fed into a ``ProbeSession``'s
   sinks, the inference side into stores, the training side into comparers
   (``probes.feed.feed``): the same sinks a live scan's recorders feed;
4. token logprobs come from each side's own ``token_logprobs`` (a fused head's,
   ``Capture.token_logprobs``), else its ``log_softmax`` (or logits) rows; a side
   that ran compiled (its module hooks never fired) is one warning line with the fix;
   the metrics, ``locate`` and ``diagnose`` are the scan's, and so is a NaN or inf in a record or a logprob
   (``nonfinite.py``: the ``non_finite`` block and cause, the first boundary holding it and on which side).

What needs the live engines is said in the result's warnings rather than
guessed: the reference-kernel rerun, attribution and the routing checks. The
sampling checks run from the bundles' records (``diagnosis/sampling_records.py``:
the engine's per-request sampling settings and logits rows, the trainer's declared
processing); a record that is missing is one warning. The conformance check (each side against the exact function)
needs the weights: ``--model MODEL`` loads them (transformers, on the CPU);
without it, ops are classified by contract and the noise floor. Where a side
summed an op across ranks (a row-parallel output) and the other did not sum
it the same way, the error that op introduces is ``collective_order``.

Weights are judged by the fingerprints of the weight versions the matched
sequences' steps ran with (a rollout engine synced during its capture), an fp32
trainer's rounded to the engine's narrower dtype where its capture kept them
(``logdiff.comparison.bundle_weights``); ``--model`` is used only where its weights are the
training bundle's, else one warning line says so.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdiff.commands.config import ScanConfig
from logdiff.comparison.bundle_checks import (
    add_offset_findings,
    compiled_warning,
    dump_warning,
    matching_warning,
    position_offsets,
)
from logdiff.comparison.bundle_feed import (
    CapturedCall,
    feed_side,
    replay,
    response_scores,
)
from logdiff.comparison.bundle_shards import add_shard_evidence
from logdiff.comparison.bundle_weights import SideWeights, model_warning
from logdiff.comparison.environment import environment
from logdiff.comparison.metrics import compare_pair
from logdiff.comparison.result import PathInfo, ScanResult, ScanSettings, SequencesInfo
from logdiff.errors import InputError
from logdiff.phases import Phases, peak_rss_bytes, silent
from logdiff.records.bundle import Bundle
from logdiff.records.sequences import Sequence
from logdiff.sources.base import PathScores

Progress = Callable[..., None]

#: config keys that fix the model's shapes: bundles that differ on one recorded different models
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "head_dim")
#: what an offline comparison cannot do, said in every result it writes (the sampling checks run from the bundles'
#: records: ``diagnosis/sampling_records.py``)
NEEDS_ENGINES = ("the reference-kernel rerun, attribution and the routing checks need the live engines: run "
                 "`logdiff scan` for them")


@dataclass
class BundleSide:
    """One side of the comparison as the diagnosis reads an engine: what its bundle says, nothing live."""

    bundle: Bundle
    role: str
    engine: Any = None  # the HF path of ``--model``: its weights for conformance, its ops for replay; or None
    weights: SideWeights | None = None  # the weight versions the matched sequences ran with (None: version 0)
    capabilities = frozenset()  # nothing live: no sampling, full logprobs or forced routing from a bundle

    @property
    def meta(self) -> dict[str, Any]:
        return self.bundle.meta

    @property
    def name(self) -> str:
        """The side's path name: its role, ``train`` or ``infer``. Both bundles may come from one engine (two HF
        captures), so the engine that recorded a side is what ``info()`` reports, never its name."""
        return self.role

    @property
    def engine_name(self) -> str:
        """The engine that recorded the bundle (``meta["engine"]``: hf, vllm, megatron; msprobe's the one it read)."""
        return str(self.meta.get("engine") or "unknown")

    @property
    def fuses_add_norm(self) -> bool:
        return bool(self.meta.get("fuses_add_norm", False))

    @property
    def tp_size(self) -> int:
        return max(len(g) for g in self.bundle.groups())

    def contract(self) -> dict[str, Any]:
        return dict(self.meta.get("contract") or {})

    def judged_contract(self) -> dict[str, Any]:
        """The contract read at capture, else the one a foreign dump's source declared from the config."""
        return self.contract() or dict(self.meta.get("declared_contract") or {})

    def fingerprints(self, at: str | None = None) -> dict[str, str | None]:
        """The fingerprints of the weights the matched sequences ran with (``bundle_weights``), taken at capture:
        at ``at`` where the capture kept them rounded (``fingerprints_at``), else in the side's own dtype."""
        if self.weights is None:
            self.weights = SideWeights(self.bundle, [], self.role)
        return self.weights.fingerprints(at)

    def loaded_config(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(**(self.meta.get("config") or {}))

    def module(self) -> Any:
        return self.engine.module() if self.engine is not None else None

    def rope_params(self) -> dict[str | None, Any]:
        return self.engine.rope_params() if self.engine is not None else {}

    def router_biases(self) -> dict[int, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        layout = {"ranks": self.bundle.world_size, "tensor_parallel_size": self.tp_size}
        return {"engine": self.engine_name, "version": self.meta.get("version"),
                "settings": {**layout, "bundle": str(self.meta.get("joined_from") or self.bundle.root)}}


def open_bundles(train_dir: Path | Bundle, infer_dir: Path | Bundle) -> tuple[Bundle, Bundle]:
    """Both bundles (each opened here unless given open), recorded from one model (and, where both sketched records,
    with one sketch digest). Their places say which side each is, whatever role they were
    captured with (a TP=2 trainer against an unsharded one is two ``train`` captures); swapped roles are warned."""
    train, infer = (d if isinstance(d, Bundle) else Bundle(d) for d in (train_dir, infer_dir))
    train_dir, infer_dir = train.root, infer.root
    ct, ci = train.meta.get("config") or {}, infer.meta.get("config") or {}
    differs = [k for k in SHAPE_KEYS if k in ct and k in ci and ct[k] != ci[k]]
    if train.meta.get("architecture") != infer.meta.get("architecture"):
        differs.insert(0, "architecture")
        ct, ci = train.meta, infer.meta
    if differs:
        k = differs[0]
        raise InputError(f"the bundles recorded different models: {k} = {ct.get(k)!r} (train) vs {ci.get(k)!r} "
                         "(infer)")
    wt, wi = train.widths(), infer.widths()  # partners must be of one width per row, else none compares
    name = next((n for n in wt if n in wi and wt[n] != wi[n]), None)
    if name is not None:
        raise InputError(f"record {name!r} holds {wt[name]} values a row in {train_dir} but {wi[name]} in "
                         f"{infer_dir}: its partners cannot be compared")
    from logdiff.comparison.pairing import sketched

    if train.sketch_digest != infer.sketch_digest and sketched(train) and sketched(infer):
        raise InputError(f"the bundles' row sketches hold different digests ({train.sketch_digest} in {train_dir}, "
                         f"{infer.sketch_digest} in {infer_dir}: written by different logdiff versions) and cannot "
                         "be compared; capture both sides with one version")
    return train, infer


def compare_bundles(train_dir: Path, infer_dir: Path, *, model: Path | None = None, is_threshold: float = 2.0,
                    progress: Progress = silent, tables: dict[str, Any] | None = None,
                    live: Any = None, rerun: Callable[[], Any] | None = None,
                    rescans: Callable[[list[Sequence]], Any] | None = None) -> ScanResult:
    """The scan result of two capture bundles (docs/result-schema.md), computed offline. ``live``: the training
    side's model itself, in this process (an RL framework's, inside its step), used as ``--model``'s would be:
    its weights for the conformance check, and one no-grad forward over the common sequences for the replay
    (nothing that trains: no gradient, no mode change, dropout must be off for it to reproduce the capture).
    ``rerun`` (with ``live``): the captured step's own call, run again as that forward (``bundle_feed.CapturedCall``:
    the trainer's padding, positions, autocast and head, which logdiff's own batch would not repeat).
    ``rescans``: where live engines are at hand (an RL framework's colocated ones), a ``Rescanner`` over them for
    the common sequences (``integrations.live.LiveRescans``): the reference-kernel rerun and attribution then run.
    A pipeline-parallel capture's stages are joined first (``probes.stages``)."""
    with tempfile.TemporaryDirectory(prefix="logdiff-stages-") as scratch:  # pipeline stages joined, then gone
        train_dir, infer_dir = (joined(Path(d), Path(scratch) / role) for d, role in ((train_dir, "train"),
                                                                                   (infer_dir, "infer")))
        return _compare(train_dir, infer_dir, model=model, is_threshold=is_threshold, progress=progress,
                        tables=tables, live=live, rerun=rerun, rescans=rescans)


def joined(bundle_dir: Path, scratch: Path) -> Bundle | Path:
    """The bundle at ``bundle_dir``, opened (once: ``open_bundles`` takes it as it is), or, for a pipeline-parallel
    capture, its stages joined into one bundle under ``scratch``; what is not a directory as it is (``open_bundles``
    says why it is no bundle)."""
    from logdiff.records.stages import has_stages, join_stages

    if not bundle_dir.is_dir():
        return bundle_dir
    bundle = Bundle(bundle_dir)
    return Bundle(join_stages(bundle, scratch)) if has_stages(bundle) else bundle


def _compare(train_dir: Path | Bundle, infer_dir: Path | Bundle, *, model: Path | None, is_threshold: float, progress: Progress,
             tables: dict[str, Any] | None, live: Any, rerun: Callable[[], Any] | None = None,
             rescans: Callable[[list[Sequence]], Any] | None = None) -> ScanResult:
    from logdiff.comparison.locate import localize
    from logdiff.comparison.pairing import match_sequences, sketched
    from logdiff.diagnosis.closure import close
    from logdiff.diagnosis.nonfinite import add_non_finite
    from logdiff.probes.session import CONFORMANCE_SEQUENCES, ProbeSession

    progress = Phases.of(progress)
    progress("reading the bundles and matching their sequences by token ids", phase="stage")
    tb, ib = open_bundles(train_dir, infer_dir)
    train_dir = tb.root
    train_table, infer_table = tb.sequence_table(), ib.sequence_table()
    _check_vocabulary(tb, ib, {"train": train_table, "infer": infer_table})
    matching = match_sequences(train_table, infer_table)
    seqs = _sequences(matching.ids, _prompt_lens(ib, matching.infer) or _prompt_lens(tb, matching.train))
    train_weights, infer_weights = SideWeights(tb, matching.train, "train"), SideWeights(ib, matching.infer, "infer")
    engine = _training_engine(model, tb, live) if model is not None or live is not None else None
    rejected = (model_warning(engine.fingerprints(), train_weights.fingerprints(_dtype(tb)))
                if engine is not None else None)  # the live model in the dtype it was loaded in: the bundle's
    loaded = engine  # --model's weights name a sharded side's differing pieces, even where rejected for replay
    if rejected:
        engine = None  # its ops and weights are not the captured step's: no replay, no conformance from them
    train = BundleSide(tb, "train", engine, train_weights)
    infer = BundleSide(ib, "infer", None, infer_weights)
    architecture, config = str(tb.meta.get("architecture")), dict(tb.meta.get("config") or {})
    session = ProbeSession(seqs, 0, architecture, config,
                           conformance_sequences=CONFORMANCE_SEQUENCES if engine is not None else 0)
    offsets = position_offsets(tb, ib, matching)  # where a side fed a sequence at shifted positions (RoPE's input)
    session.position_offsets = {side: {c: o[side] for c, o in offsets.items() if o.get(side)} for side in ("train", "infer")}
    from logdiff.diagnosis.sampling_records import RowSink

    lengths = [len(s) for s in seqs]
    rows = {role: RowSink([len(s.prompt_ids) for s in seqs], lengths) for role in ("train", "infer")}
    try:
        scores, windows = {}, {"train": sketched(tb), "infer": sketched(ib)}
        for side, common in ((infer, matching.infer), (train, matching.train)):  # stored first, then compared
            progress(f"un-sharding and comparing the {side.role} bundle ({side.bundle.world_size} ranks)",
                     phase=f"feed:{side.role}")
            extra = (session.keep_rows(side.name),) if engine is not None and side is train else ()
            extra = (*extra, rows[side.role])  # the rows the sampling checks replay (``sampling_records``)
            other = windows["infer" if side is train else "train"]
            scores[side.role], misaligned = feed_side(side.bundle, common, matching.ids, session, side.role,
                                                       side.name, extra, other - windows[side.role],
                                                       (ib if side is train else tb).sketch_digest)
            if misaligned:
                session.warnings.append(f"{side.role} bundle: {misaligned} rows held another token id than the "
                                        "matched sequence at their position; they were left out")
        if engine is not None:
            progress("replaying the training side's ops on the inference side's inputs", phase="replay")
            replay(engine, session, train.name, seqs,
                   CapturedCall(rerun, tb, matching.train) if rerun is not None and live is not None else None)
        train_scores, infer_scores = _path_scores(train, infer, scores, seqs)
        progress("comparing the logprobs", phase="compare")
        pairs = [compare_pair(train_scores, infer_scores, seqs, None, is_threshold)]
        located = localize(pairs, session, progress, tables if tables is not None else {})
        rescanner = rescans(seqs) if rescans is not None else None
        cfg = ScanConfig(model=Path(model or train_dir), dtype=_dtype(tb), depth="modules",
                         attribute=rescans is not None, attribution="rescan", is_threshold=is_threshold,
                         infer_ckpt=getattr(rescanner, "infer_checkpoint", None))  # live: a quantized engine's
        result = ScanResult(
            model=str(model) if model else str(tb.meta.get("model") or train_dir),
            checkpoint=None,
            infer_checkpoint=None,
            architecture=architecture,
            dtype=cfg.dtype,
            settings=ScanSettings(0, "modules", False, {"train": {}, "infer": {}}, "bundle", False, is_threshold),
            environment=environment(),
            paths=[PathInfo.of(train.name, "train", "forward", train.info()),
                   PathInfo.of(infer.name, "infer", str(ib.meta.get("mode") or "forward"), infer.info())],
            sequences=SequencesInfo(len(seqs), "bundle", None, [len(s.prompt_ids) for s in seqs],
                                    [len(s.response_ids) for s in seqs]),
            pairs=pairs,
            located=located,
            warnings=list(located.warnings),
        )
        add_non_finite(result, cfg, [train_scores, infer_scores], {})  # NaN/inf in a record: a finding
        matching_warning(result, matching.unmatched, {"train": len(train_table), "infer": len(infer_table)})
        for line in (rejected, train_weights.warning(), infer_weights.warning()):
            if line:
                result.warn(line)
        dumps = dump_warning({"train": tb, "infer": ib})  # a side read from an msprobe dump: what it lacks
        if dumps:
            result.warn(dumps)
        compiled = compiled_warning({"train": tb, "infer": ib})
        if compiled:
            result.warn(compiled)
        if (tb.role, ib.role) == ("infer", "train"):
            result.warn("the first bundle was captured as the inference side and the second as the training side: "
                        "logdiff compare takes TRAIN_BUNDLE first")
        _diagnose(result, cfg, train, infer, session, progress, model_rejected=bool(rejected), rescanner=rescanner)
        if result.non_finite is None:
            from logdiff.diagnosis import sampling_records

            progress("replaying each side's recorded sampling processing", phase="sampling")
            result.add(sampling_records.diagnose(tb, ib, matching, seqs, train_scores.logprobs,
                                                 infer_scores.logprobs, rows["infer"], rows["train"]))
        differs = ((result.contracts or {}).get("weights") or {}).get("differs") or []
        if loaded is not None and differs:
            add_shard_evidence(result.causes, differs, [tb, ib], loaded.module().state_dict())
        add_offset_findings(result, tb, ib, matching, session.cmap)
    finally:
        session.close()
    result.warn(NEEDS_ENGINES if rescanner is None else _live_note(rescanner, result, session.cmap))
    close(result, train.module())  # the closure of the gap (logdiff/diagnosis/closure.py)
    result.conclude()
    result.timings, result.peak_rss_bytes = progress.close(), peak_rss_bytes()
    result.scratch_bytes = session.scratch_bytes
    return result


def _diagnose(result: ScanResult, cfg: ScanConfig, train: BundleSide, infer: BundleSide, session: Any,
              progress: Progress, model_rejected: bool = False, rescanner: Any = None) -> None:
    """``diagnose`` as a scan runs it, with a rescanner that cannot rescan (the reference rerun is then skipped,
    with its reason in the warnings) and attribution off, or ``rescanner`` (live engines: both run, and what they
    could not do is said). ``model_rejected``: ``--model`` was given but holds other weights (its own warning
    says so)."""
    from logdiff.diagnosis.diagnose import diagnose
    from logdiff.diagnosis.rescan import Rescanner

    def no_rescan(_cfg: Any) -> Any:
        raise RuntimeError("an offline comparison has no engines to rerun")

    result.classified = True
    record = session.pair(result.primary.train, result.primary.infer)
    found = diagnose(result, cfg, train, infer, rescanner or Rescanner(no_rescan), progress, record)
    if rescanner is None:
        found.warnings = [w for w in found.warnings if not w.startswith("reference-kernel rerun unavailable")]
    if train.engine is None and not model_rejected:
        found.warnings.append("conformance not checked: give --model MODEL (the checkpoint both sides ran) so each "
                              "side's ops can be measured against their exact functions")
    for side in (train, infer):
        if not any(side.fingerprints().values()):
            why = side.meta.get("fingerprints_error") or "a sharded capture cannot hash the logical weights on one rank"
            found.warnings.append(f"{side.role} weights unverified: its bundle holds no weight fingerprints ({why})")
    result.add(found)


def _live_note(rescanner: Any, result: ScanResult, cmap: Any) -> str:
    """What the live engines ran (``rescanner.note``), and the check they did not: the routing replay of an MoE
    model, which forces the rollout's expert choices into the trainer's model (``logdiff scan`` does it)."""
    line = rescanner.note(result.primary.metrics) if hasattr(rescanner, "note") else ""
    if any(b.kind == "router" for b in cmap.boundaries):
        line += ("; the routing replay did not run: forcing the rollout's expert choices into the trainer's model "
                 "is a scan's (logdiff scan)")
    return line


def _sequences(ids: list[list[int]], prompt_lens: list[int] | None) -> list[Sequence]:
    """The common sequences, split into prompt and response where a bundle says; else every token after the
    first is scored."""
    out = []
    for c, s in enumerate(ids):
        n = prompt_lens[c] if prompt_lens and prompt_lens[c] else 1
        n = min(max(n, 1), max(len(s) - 1, 1))
        out.append(Sequence(list(s[:n]), list(s[n:])))
    return out


def _prompt_lens(bundle: Bundle, common: dict[Any, int]) -> list[int] | None:
    """Each common sequence's prompt length as the bundle's ranks recorded it (``prompt_lens`` in their
    metadata, keyed by their own sequence ids), or None when it has none."""
    found: dict[int, int] = {}
    for (group, seq), c in common.items():
        lens = bundle.part_of(group).meta.get("prompt_lens") or {}
        if str(seq) in lens:
            found[c] = int(lens[str(seq)])
    if not found:
        return None
    return [found.get(c, 0) for c in range(max(common.values()) + 1)]


def _check_vocabulary(tb: Bundle, ib: Bundle, tables: dict[str, dict[Any, list[int]]]) -> None:
    """Every token id of every sequence on both sides, paired or not, inside the vocabulary both models share
    (the smaller ``vocab_size`` the bundles state): an id outside it is bad input, never an unpaired sequence
    that a verdict of ``consistent`` would pass over. -1 marks a position no row fed."""
    sizes = [(b.meta.get("config") or {}).get("vocab_size") for b in (tb, ib)]
    size = min((s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0), default=0)
    for side, bundle in (("train", tb), ("infer", ib)):
        for key, ids in tables[side].items():
            bad = next(((p, t) for p, t in enumerate(ids) if t < -1 or (size and t >= size)), None)
            if bad is not None:
                group, seq = key
                raise InputError(f"{bundle.root}: the {side} bundle's sequence {seq} (tp group {list(group)}) has "
                                 f"token id {bad[1]:,} at position {bad[0]}, outside the vocabulary of {size:,}"
                                 f"{'' if bad[1] >= 0 else ' (ids are non-negative)'}: another tokenizer, or a "
                                 "corrupt step file")


def _dtype(bundle: Bundle) -> str:
    """The dtype the side computed in: its first record's (the embeddings; not the logits, which vLLM returns in
    float32 for a bf16 model), else the config's."""
    for part in bundle.ranks:
        for step in part.steps:
            for entry in step["records"].values():
                if entry["dtype"] in ("bfloat16", "float16", "float32"):
                    return str(entry["dtype"])
    config = bundle.meta.get("config") or {}
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"


def _path_scores(train: BundleSide, infer: BundleSide, scores: dict[str, Any],
                 seqs: list[Sequence]) -> tuple[PathScores, PathScores]:
    """Each side's logprobs of the response tokens; a token is scored where both sides have one (the
    response mask says which)."""
    t, i = scores["train"], scores["infer"]
    for c, s in enumerate(seqs):
        n = len(s.prompt_ids)
        s.response_mask = (t.has[c][n:] & i.has[c][n:]).astype(int).tolist()
    if not any(any(s.response_mask) for s in seqs):
        raise InputError("no token has a logprob on both sides: the bundles hold no common logits rows")
    return (response_scores(t, seqs, train.name, "forward"),
            response_scores(i, seqs, infer.name, str(infer.meta.get("mode") or "forward")))


def _training_engine(model: Path | None, bundle: Bundle, live: Any = None) -> Any:
    """The default training engine on ``model``, on the CPU, in the bundle's dtype (or around ``live``, the
    trainer's own model, loading nothing): the weights the conformance check reads, and the live ops the
    replay re-runs."""
    from logdiff.sources import DEFAULT_TRAIN
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.registry import get_engine

    if live is not None:
        name = str(getattr(live.config, "_name_or_path", "") or "live model")
        return get_engine(DEFAULT_TRAIN)(EngineSpec(name, _dtype(bundle), (), (), 0, False, "cpu"), live)
    from logdiff.records.untrusted import model_files

    if Path(model) / "config.json" not in model_files(model):  # every file a loader reads: inside, regular
        raise InputError(f"--model {model}: not a model directory (no config.json)")
    return get_engine(DEFAULT_TRAIN)(EngineSpec(str(model), _dtype(bundle), (), (), 0, False, "cpu"))
