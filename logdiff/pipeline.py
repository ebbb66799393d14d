"""Orchestrate one scan: stage weights, build sequences, run every path, compare.

The flow follows docs (../shared/design.md): token sequences -> paths ->
compare -> (locate -> classify -> attribute) -> the result dict of
docs/result-schema.md. Engines come from a process-wide pool, so repeated
scans in one process (tests, a training loop calling ``logdiff.scan``) load
each engine once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import platform
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

import numpy as np

from logdiff import compare, sequences
from logdiff.config import ScanConfig
from logdiff.errors import InputError
from logdiff.probes import checkpoint
from logdiff.probes.engines.base import Engine, EngineSpec, PathScores, acquire, get_engine

SCHEMA_VERSION = 1
Progress = Callable[[str], None]


def _split_settings(engine: str, settings: dict[str, Any]) -> tuple[tuple, tuple]:
    """(config overrides, engine options) for one side's ``--set`` items."""
    known = get_engine(engine).options
    overrides = tuple(sorted((k, v) for k, v in settings.items() if k not in known))
    options = tuple(sorted((k, v) for k, v in settings.items() if k in known))
    return overrides, options


def _spec(engine: str, staged: checkpoint.StagedModel, cfg: ScanConfig, settings: dict[str, Any]) -> EngineSpec:
    overrides, options = _split_settings(engine, settings)
    return EngineSpec(str(staged.path), cfg.dtype, overrides, options, cfg.seed)


def _load_sequences(cfg: ScanConfig, staged: checkpoint.StagedModel) -> tuple[list[sequences.Sequence], str]:
    if cfg.sequences is not None:
        seqs, source = sequences.load_jsonl(cfg.sequences), "jsonl"
    elif cfg.prompts is not None:
        seqs, source = sequences.load_text_prompts(cfg.prompts, cfg.model), "prompts"
    else:
        seqs = sequences.random_prompts(cfg.num_sequences, cfg.prompt_len, staged.vocab_size, cfg.seed)
        source = "probe"
    sequences.validate(seqs, staged.vocab_size, staged.max_len, cfg.response_len)
    return seqs, source


def _sampler(engines: list[Engine]) -> Engine:
    """The inference engine that samples responses: vLLM when present, else the first."""
    return next((e for e in engines if e.name == "vllm"), engines[0])


def run_paths(
    cfg: ScanConfig, progress: Progress = lambda _msg: None
) -> tuple[list[sequences.Sequence], str, PathScores, list[PathScores], dict[str, Any]]:
    """Run the training path and every inference path over the same ids."""
    staged = checkpoint.stage(cfg.model, cfg.ckpt)
    staged_infer = checkpoint.stage(cfg.model, cfg.infer_ckpt) if cfg.infer_ckpt else staged
    seqs, source = _load_sequences(cfg, staged)

    progress(f"loading {cfg.train} (training path)")
    train = acquire(cfg.train, _spec(cfg.train, staged, cfg, cfg.train_set))
    infers = []
    for name in dict.fromkeys(cfg.infer):
        progress(f"loading {name} (inference path)")
        infers.append(acquire(name, _spec(name, staged_infer, cfg, cfg.infer_set)))

    owners: dict[str, Engine | None] = {}  # path name -> the engine that produced it
    infer_scores: list[PathScores] = []

    def add(engine: Engine | None, scores: list[PathScores]) -> None:
        for p in scores:
            owners[p.path] = engine
            infer_scores.append(p)

    with contextlib.ExitStack() as stack:
        if cfg.consistent:
            for engine in dict.fromkeys([train, *infers]):
                stack.enter_context(engine.consistent())
        if not all(s.response_ids for s in seqs):
            sampler = _sampler(infers)
            progress(f"sampling {cfg.response_len} response tokens per sequence with {sampler.name}")
            sampled = sampler.sample([s.prompt_ids for s in seqs], cfg.response_len, cfg.seed)
            for s, r in zip(seqs, sampled.response_ids):
                s.response_ids = r
            add(sampler, sampled.scores)
            if sampled.scores and hasattr(sampler, "prefill_scores"):
                add(sampler, [sampler.prefill_scores(seqs)])
        for engine in infers:
            if engine in owners.values():
                continue
            progress(f"scoring with {engine.name}")
            add(engine, engine.score(seqs))
        progress(f"scoring with {train.name} (training path)")
        train_scores = train.score(seqs)[0]
    if all(s.rollout_logprobs is not None for s in seqs):
        add(None, [PathScores("rollout", "recorded", [np.asarray(s.rollout_logprobs, np.float32) for s in seqs])])
    paths = [_path_info(train, train_scores, "train")]
    paths += [_path_info(owners[p.path], p, "infer") for p in infer_scores]
    return seqs, source, train_scores, infer_scores, {"paths": paths, "architecture": staged.architecture}


def _path_info(engine: Engine | None, scores: PathScores, role: str) -> dict[str, Any]:
    info = engine.info() if engine is not None else {"engine": "recorded", "version": None, "settings": {}}
    return {"name": scores.path, "role": role, "mode": scores.mode, **info}


def _pair(train: PathScores, infer: PathScores, seqs: list[sequences.Sequence], tok: Any) -> dict[str, Any]:
    w = compare.worst(train.logprobs, infer.logprobs)
    w["token_id"] = int(seqs[w["sequence"]].response_ids[w["position"]])
    w["token_text"] = tok.decode([w["token_id"]]) if tok is not None else None
    return {
        "train": train.path,
        "infer": infer.path,
        "metrics": compare.token_metrics(train.logprobs, infer.logprobs, train.top1, infer.top1),
        "per_position": compare.per_position(train.logprobs, infer.logprobs),
        "histogram": compare.histogram(train.logprobs, infer.logprobs),
        "worst": w,
    }


def _tokenizer(cfg: ScanConfig) -> Any:
    if not any((cfg.model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(cfg.model))
    except Exception:  # noqa: BLE001 - token text is a nicety; ids are the truth
        return None


def environment() -> dict[str, Any]:
    """Versions and the device, for the report."""

    def version(pkg: str) -> str | None:
        for name in (pkg, f"{pkg}-cpu"):
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    import torch

    device = "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "vllm": version("vllm"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": device,
    }


def scan(cfg: ScanConfig, progress: Progress = lambda _msg: None) -> dict[str, Any]:
    """Run one scan and return the result dict (docs/result-schema.md)."""
    if cfg.depth != "logprobs":
        raise InputError(f"--depth {cfg.depth} is not available yet; use --depth logprobs")
    seqs, source, train, infers, meta = run_paths(cfg, progress)
    tok = _tokenizer(cfg)
    pairs = [_pair(train, p, seqs, tok) for p in infers]
    consistent = all(p["metrics"]["bitwise_equal_fraction"] == 1.0 for p in pairs)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "logdiff", "version": metadata.version("logdiff")},
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "complete": True,
        "warnings": [],
        "model": str(cfg.model),
        "checkpoint": str(cfg.ckpt) if cfg.ckpt else None,
        "infer_checkpoint": str(cfg.infer_ckpt) if cfg.infer_ckpt else None,
        "architecture": meta["architecture"],
        "dtype": cfg.dtype,
        "settings": {
            "seed": cfg.seed,
            "depth": cfg.depth,
            "consistent": cfg.consistent,
            "overrides": {"train": cfg.train_set, "infer": cfg.infer_set},
            "sequence_source": source,
        },
        "environment": environment(),
        "paths": meta["paths"],
        "sequences": {
            "count": len(seqs),
            "source": source,
            "prompt_lens": [len(s.prompt_ids) for s in seqs],
            "response_lens": [len(s.response_ids) for s in seqs],
        },
        "pairs": pairs,
        "logprobs": pairs[0]["metrics"],
        "first_divergence": None,
        "introducing_ops": [],
        "causes": [],
        "verdict": "consistent" if consistent else "divergent",
        "divergence_table": None,
        "contracts": None,
        "moe": None,
        "batch_invariance": None,
    }
