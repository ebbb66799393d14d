"""Orchestrate one scan: stage weights, build sequences, run every path, compare.

The flow follows docs (../shared/design.md): token sequences -> paths ->
compare -> (locate -> classify -> attribute) -> a ``ScanResult``
(logdiff/comparison/result.py), whose ``to_dict()`` is docs/result-schema.md.
The comparison it runs (``compare.compare_pair``, ``locate.localize``,
``nonfinite.add_non_finite``, ``bundle_feed`` for a path captured elsewhere,
``diagnosis``) is the one ``logdiff compare`` runs on bundles (``offline``): it
sits below this module and never imports it back.
``measure`` is the undiagnosed first half, and what diagnosis rescans run.
Engines come from a process-wide pool, so repeated scans in one process
(tests, a training loop calling ``logdiff.scan``) load each engine once.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from logdiff.commands.config import ScanConfig
from logdiff.commands.options import is_option
from logdiff.commands.reproduce import rollout_replay
from logdiff.comparison.environment import environment
from logdiff.comparison.metrics import compare_pair
from logdiff.comparison.result import Located, PathInfo, ScanResult, ScanSettings, SequencesInfo
from logdiff.errors import InputError
from logdiff.phases import Phases, peak_rss_bytes, silent
from logdiff.records import sequences
from logdiff.sources import checkpoint
from logdiff.sources.base import Engine, EngineSpec, PathScores
from logdiff.sources.pool import acquire
from logdiff.sources.registry import get_engine

Progress = Callable[[str], None]


def split_settings(engine: str, settings: dict[str, Any]) -> tuple[tuple, tuple]:
    """(config overrides, engine options) for one side's ``--set`` items.

    An option of another engine on the same side (``max_model_len`` with both
    vLLM and hf-decode) is that engine's, never a config override here.
    """
    known = get_engine(engine).options
    overrides = tuple(sorted((k, v) for k, v in settings.items() if not is_option(k)))
    options = tuple(sorted((k, v) for k, v in settings.items() if k in known))
    return overrides, options


def engine_spec(engine: str, staged: checkpoint.StagedModel, cfg: ScanConfig, settings: dict[str, Any]) -> EngineSpec:
    """What ``acquire`` loads for ``engine`` on one side of a scan of ``cfg``."""
    overrides, options = split_settings(engine, settings)
    return EngineSpec(str(staged.path), cfg.dtype, overrides, options, cfg.seed, cfg.trust_remote_code, cfg.device)


def _load_sequences(cfg: ScanConfig, staged: checkpoint.StagedModel) -> tuple[list[sequences.Sequence], str]:
    if cfg.replay is not None:  # a rescan: the first scan's tokens, validated then
        return [copy.deepcopy(s) for s in cfg.replay], "replay"
    if cfg.sequences is not None:
        from logdiff.sources import dumps

        seqs, layout = dumps.load(cfg.sequences)
        source = "jsonl" if layout == "logdiff" and cfg.sequences.suffix == ".jsonl" else f"dump:{layout}"
    elif cfg.prompts is not None:
        seqs, source = sequences.load_text_prompts(cfg.prompts, cfg.model, cfg.trust_remote_code), "prompts"
    else:
        seqs = sequences.random_prompts(cfg.num_sequences, cfg.prompt_len, staged.vocab_size, cfg.seed)
        source = "probe"
    limit, what = staged.max_len, "max_position_embeddings"
    readers = [n for n in cfg.infer if "max_model_len" in get_engine(n).options]  # else a config key of that name
    max_model_len = cfg.infer_set.get("max_model_len") if readers else None
    if max_model_len is not None:
        if max_model_len > staged.max_len:
            raise InputError(
                f"--set infer.max_model_len={max_model_len} exceeds the model's context of {staged.max_len} "
                "(max_position_embeddings)"
            )
        limit, what = max_model_len, "--set infer.max_model_len"
    sequences.validate(seqs, staged.vocab_size, limit, cfg.response_len, what)
    return seqs, source


def _sampler(engines: list[Engine]) -> Engine:
    """The inference engine that samples responses: the first serving engine (its sampling is a rollout's), else
    the first."""
    return next((e for e in engines if e.serves_rollouts), engines[0])


@dataclass
class PathRun:
    """What running every path over the same ids produced (``run_paths``)."""

    sequences: list[sequences.Sequence]
    source: str  # probe | jsonl | prompts | dump:<layout> (logdiff.sources.dumps)
    train: PathScores
    infers: list[PathScores]
    paths: list[PathInfo]  # result.json's "paths": one entry per path, with its engine's info
    architecture: str
    train_engine: Engine
    infer_engines: list[Engine]
    probes: Any = None  # the ProbeSession at --depth modules|ops (the caller closes it)
    batch_invariance: dict[str, Any] | None = None
    nonfinite_weights: dict[str, list[str]] = field(default_factory=dict)

    def engine_of(self, path: str) -> Engine:
        """The inference engine that produced ``path`` (the first one for a recorded path)."""
        name = next((p.engine for p in self.paths[1:] if p.name == path), None)
        return next((e for e in self.infer_engines if e.name == name), self.infer_engines[0])


def run_paths(cfg: ScanConfig, progress: Progress = silent, conformance_sequences: int = 0) -> PathRun:
    """Run the training path and every inference path over the same ids.

    At ``--depth modules|ops`` the inference paths are recorded while they run
    (to disk) and the training path is compared against them as it runs;
    ``PathRun.probes`` is then the ``ProbeSession`` (the caller closes it).
    ``conformance_sequences``: keep the training path's own rows of that many
    sequences too, for the diagnosis's conformance check.
    """
    from logdiff.commands import overrides
    from logdiff.sources import nonfinite_weights as nonfinite

    progress = Phases.of(progress)
    progress("staging the checkpoint and the sequences", phase="stage")
    staged = checkpoint.stage(cfg.model, cfg.ckpt, cfg.trust_remote_code)
    staged_infer = (checkpoint.stage(cfg.model, cfg.infer_ckpt, cfg.trust_remote_code, quantized=True) if cfg.infer_ckpt
                     else staged)
    seqs, source = _load_sequences(cfg, staged)
    _consistent_with_quantized_rollout(cfg, staged_infer)
    for side, where, settings in (("train", staged, cfg.train_set), ("infer", staged_infer, cfg.infer_set)):
        config_keys = {k: v for k, v in settings.items() if not is_option(k)}
        overrides.check_before_load(where, side, config_keys, cfg.trust_remote_code)
        settings.update(config_keys)  # ints given for float fields become floats
    progress("checking the weights for NaN/inf", phase="check_weights")
    weights = {"train": nonfinite.checkpoint_nonfinite(staged.path, cfg.dtype)}
    weights["infer"] = nonfinite.checkpoint_nonfinite(staged_infer.path, cfg.dtype)
    probes = None
    if cfg.depth != "logprobs":
        from logdiff.probes.session import ProbeSession
        from logdiff.records.sketch import Window

        probes = ProbeSession(
            seqs,
            cfg.response_len,
            staged.architecture,
            staged.config,
            ops=cfg.depth == "ops",
            drill=cfg.drill,
            conformance_sequences=conformance_sequences,
            window=Window(cfg.window) if cfg.window is not None else None,
        )

    def recording(engine: Engine, role: str) -> Any:
        return probes.record(engine, role) if probes is not None else contextlib.nullcontext()

    try:
        run = _run(cfg, progress, staged, staged_infer, seqs, source, recording, probes)
        run.nonfinite_weights = weights
        return run
    except BaseException:
        if probes is not None:
            probes.close()
        raise


def _consistent_with_quantized_rollout(cfg: ScanConfig, staged_infer: checkpoint.StagedModel) -> None:
    """``--consistent`` against a quantized inference checkpoint: the trainer applies the rollout's own
    quantization (its ``quantization_config``, ignore list included) with the same kernels
    (``sources/hf/consistent_quant.py``), unless ``--set train.consistent_quantization`` says otherwise;
    a training engine without that option keeps its unquantized forward (the quantization cause stays)."""
    quant = staged_infer.config.get("quantization_config")
    if (cfg.consistent and quant and "consistent_quantization" not in cfg.train_set
            and "consistent_quantization" in get_engine(cfg.train).options):
        cfg.train_set["consistent_quantization"] = quant


def _run(
    cfg: ScanConfig,
    progress: Progress,
    staged: checkpoint.StagedModel,
    staged_infer: checkpoint.StagedModel,
    seqs: list[sequences.Sequence],
    source: str,
    recording: Callable[[Engine, str], Any],
    probes: Any,
) -> PathRun:
    """Load the engines and run every path (recording where ``recording`` says)."""
    from logdiff.commands.overrides import check_applied

    progress(f"loading {cfg.train} (training path)", phase="load")
    train = acquire(cfg.train, engine_spec(cfg.train, staged, cfg, cfg.train_set))
    check_applied(train, "train", cfg.train_set)
    infers = []
    for name in dict.fromkeys(cfg.infer):
        progress(f"loading {name} (inference path)", phase="load")
        infers.append(acquire(name, engine_spec(name, staged_infer, cfg, cfg.infer_set)))
        check_applied(infers[-1], "infer", cfg.infer_set)

    rec = ", recording its modules" if probes is not None else ""
    owners: dict[str, Engine | None] = {}  # path name -> the engine that produced it
    infer_scores: list[PathScores] = []

    def add(engine: Engine | None, scores: list[PathScores]) -> None:
        for p in scores:
            owners[p.path] = engine
            infer_scores.append(p)

    with contextlib.ExitStack() as stack:
        if cfg.consistent:
            engines = list(dict.fromkeys([train, *infers]))
            # a tensor-parallel side sums its row-parallel products in fixed K-chunks: every side then does
            rows = any(e.tensor_parallel_size > 1 for e in engines)
            for engine in engines:
                stack.enter_context(engine.consistent(cfg.consistent_kernels, fixed_order_rows=rows))
        if not all(s.response_ids for s in seqs):
            sampler = _sampler(infers)
            progress(f"sampling {cfg.response_len} response tokens per sequence with {sampler.name}{rec}", phase="sample")
            with recording(sampler, "infer"):
                sampled = sampler.sample([s.prompt_ids for s in seqs], cfg.response_len, cfg.seed)
                for s, r in zip(seqs, sampled.response_ids):
                    s.response_ids = r
                add(sampler, sampled.scores)
                if sampled.scores and hasattr(sampler, "prefill_scores") and not cfg.primary_path_only:
                    add(sampler, [sampler.prefill_scores(seqs)])
        for engine in infers:
            if engine in owners.values():
                continue
            progress(f"scoring with {engine.name}{rec}", phase=f"score:{engine.name}")
            add(engine, _score(engine, "infer", seqs, recording, probes, cfg.primary_path_only))
        if probes is not None and not cfg.replay_all_paths:
            probes.replay_paths = {infer_scores[0].path}  # the primary pair's: the one the diagnosis reads
        progress(f"scoring with {train.name} (training path){rec}", phase=f"score:{train.name}")
        train_scores = _score(train, "train", seqs, recording, probes)[0]
        batch_invariance = None
        if cfg.batch_sizes:
            from logdiff.commands import batch_probe

            progress(f"batch-invariance probe: {infers[0].name} at batch sizes {cfg.batch_sizes}", phase="batch_probe")
            batch_invariance = batch_probe.probe(infers[0], seqs, cfg.batch_sizes)
    if all(s.rollout_logprobs is not None for s in seqs):
        add(None, [PathScores("rollout", "recorded", [np.asarray(s.rollout_logprobs, np.float32) for s in seqs])])
    paths = [_path_info(train, train_scores, "train")]
    paths += [_path_info(owners[p.path], p, "infer") for p in infer_scores]
    return PathRun(seqs, source, train_scores, infer_scores, paths, staged.architecture, train, infers, probes,
                   batch_invariance)  # fmt: skip


def _score(engine: Engine, role: str, seqs: list[sequences.Sequence], recording: Callable[[Engine, str], Any],
           probes: Any, primary_only: bool = False) -> list[PathScores]:
    """``engine``'s scores as ``role``'s paths, recorded live in this process; or, where the engine scores
    elsewhere (a sharded path on ranks of its own), captured there and fed from its bundle into the same probes.
    ``primary_only``: the engine's first path alone (``Engine.score_primary``)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="logdiff-capture-") as tmp:
        bundle = engine.score_captured(seqs, Path(tmp) / "bundle")
        if bundle is None:
            with recording(engine, role):
                return [engine.score_primary(seqs)] if primary_only else engine.score(seqs)
        from logdiff.comparison.bundle_feed import scores_of_capture
        from logdiff.records.bundle import Bundle

        return [scores_of_capture(Bundle(bundle), seqs, probes, role, engine.name, live=engine)]


def _path_info(engine: Engine | None, scores: PathScores, role: str) -> PathInfo:
    info = engine.info() if engine is not None else {"engine": "recorded", "version": None, "settings": {}}
    return PathInfo.of(scores.path, role, scores.mode, info)


def _tokenizer(cfg: ScanConfig) -> Any:
    if not any((cfg.model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(cfg.model), trust_remote_code=cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 - token text is a nicety; ids are the truth
        return None


@dataclass
class Measured:
    """An undiagnosed scan (``measure``): its result so far, and the run behind it."""

    result: ScanResult
    run: PathRun


def measure(
    cfg: ScanConfig, progress: Progress = silent, tables: dict[str, Any] | None = None, diagnosing: bool = False
) -> Measured:
    """Run every path, compare them and locate the divergence; no diagnosis.

    This is what a diagnosis rescan runs (``diagnosis.rescan.Rescanner``), and the first
    half of ``scan``. ``tables`` receives the boundary x position DataFrames.
    ``diagnosing``: a diagnosis follows, so the probes keep both sides' rows for its
    conformance check and stay open (``run.probes``; the caller closes them).
    """
    from logdiff.comparison.locate import localize
    from logdiff.diagnosis.nonfinite import add_non_finite
    from logdiff.probes.session import CONFORMANCE_SEQUENCES

    progress = Phases.of(progress)
    run = run_paths(cfg, progress, CONFORMANCE_SEQUENCES if diagnosing else 0)
    seqs, train, infers = run.sequences, run.train, run.infers
    progress("comparing the logprobs", phase="compare")
    tok = _tokenizer(cfg)
    pairs = [compare_pair(train, p, seqs, tok, cfg.is_threshold) for p in infers]
    source, _, layout = run.source.partition(":")  # dump:<layout> -> dump, <layout>
    layout = layout or ("logdiff" if source == "jsonl" else None)
    located = Located()
    if run.probes is not None:
        try:
            located = localize(pairs, run.probes, progress, tables if tables is not None else {})
        finally:
            if not diagnosing:
                run.probes.close()
    settings = ScanSettings(cfg.seed, cfg.depth, cfg.consistent, {"train": cfg.train_set, "infer": cfg.infer_set},
                            source, cfg.trust_remote_code, cfg.is_threshold)  # fmt: skip
    result = ScanResult(
        model=str(cfg.model),
        checkpoint=str(cfg.ckpt) if cfg.ckpt else None,
        infer_checkpoint=str(cfg.infer_ckpt) if cfg.infer_ckpt else None,
        architecture=run.architecture,
        dtype=cfg.dtype,
        settings=settings,
        environment=environment(),
        paths=run.paths,
        sequences=SequencesInfo(len(seqs), source, layout, [len(s.prompt_ids) for s in seqs],
                                [len(s.response_ids) for s in seqs]),  # fmt: skip
        pairs=pairs,
        located=located,
        warnings=list(located.warnings),
        batch_invariance=run.batch_invariance,
        rollout_replay=rollout_replay(infers, [s.response_mask for s in seqs], layout),
    )
    add_non_finite(result, cfg, [train, *infers], run.nonfinite_weights)
    return Measured(result, run)


def scan(cfg: ScanConfig, progress: Progress = silent, tables: dict[str, Any] | None = None) -> ScanResult:
    """Run one scan: ``measure``, then at ``--depth modules|ops`` diagnose it (docs/result-schema.md).

    At ``--depth modules|ops``, pass a dict as ``tables`` to receive the
    boundary x position DataFrames (``"divergence_table"`` for the primary
    pair, ``"divergence_table_<infer path>"`` for the others); write them with
    ``logdiff.comparison.locate.write_tables(tables, out_dir)``.
    """
    progress = Phases.of(progress)  # times each phase: result.timings
    measured = measure(cfg, progress, tables, diagnosing=cfg.depth != "logprobs")
    result, run = measured.result, measured.run
    try:
        if cfg.depth != "logprobs":
            _diagnose(result, run, cfg, progress)
    finally:
        if run.probes is not None:
            run.probes.close()
    _close(result, run)
    result.conclude()
    result.timings, result.peak_rss_bytes = progress.close(), peak_rss_bytes()
    result.scratch_bytes = run.probes.scratch_bytes if run.probes is not None else None
    return result


def _close(result: ScanResult, run: PathRun) -> None:
    """The closure of the gap (logdiff/diagnosis/closure.py), with the training model's head for the final-norm
    bound where the logits were not compared."""
    from logdiff.diagnosis.closure import close

    try:
        module = run.train_engine.module()
    except (NotImplementedError, AttributeError):  # an engine without an in-process model
        module = None
    close(result, module)


def _diagnose(result: ScanResult, run: PathRun, cfg: ScanConfig, progress: Progress) -> None:
    """The diagnosis of a measured scan: causes, attribution, routing, sampling semantics."""
    from logdiff.diagnosis import sampling
    from logdiff.diagnosis.diagnose import diagnose
    from logdiff.diagnosis.rescan import Rescanner
    from logdiff.diagnosis.routing import diagnose_routing

    owner = run.engine_of(result.primary.infer)
    # Rescans score the primary pair only, on this scan's tokens where the engine can replay them as it
    # sampled them (a lever changes numbers, never the tokens); else they sample again with the same seed.
    same_tokens = {"infer": [owner.name], "replay": tuple(run.sequences) if owner.replays_as_sampled else None,
                   "primary_path_only": True}
    record = run.probes.pair(result.primary.train, result.primary.infer) if run.probes is not None else None
    patched = None
    if cfg.attribute and cfg.attribution == "patched":  # attribution's game on the recorded rows
        from logdiff.diagnosis.attribute_patched import of_run

        patched = of_run(run, result, cfg, record)
    rescanner = Rescanner(lambda c: measure(replace(c, **same_tokens)).result, patched)
    result.classified = True
    result.add(diagnose(result, cfg, run.train_engine, owner, rescanner, progress, record))
    result.moe = diagnose_routing(result, run, cfg, progress)
    if result.non_finite is None:  # contract and numbers (logdiff/diagnosis/sampling.py)
        progress("checking the sampling semantics (temperature, truncation, alignment, BOS)", phase="sampling")
        result.add(sampling.diagnose(result, run, owner))
