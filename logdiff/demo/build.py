"""Build a demo model directory: tokenizer, tiny config, short training, bf16 save.

The output is an ordinary Hugging Face model directory::

    config.json  generation_config.json  model.safetensors   (bf16, save_pretrained)
    tokenizer.json  tokenizer_config.json  chat_template.jinja
    logdiff_demo.json   how it was built: arch, seed, steps, losses, held-out stats

The directory is written under a temporary name next to ``path`` and renamed
at the end, so an interrupted build never leaves a half-written model.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdiff.demo.configs import check_arch
from logdiff.demo.corpus import Corpus, load_corpus
from logdiff.demo.tokenizer import (
    DEMO_VOCAB_SIZE,
    encode_chat_document,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)
from logdiff.demo.train import TrainSettings, chunk_stream, evaluate, spread_rows, train
from logdiff.errors import InputError
from logdiff.records.bundle_writer import usual_modes

METADATA_FILE = "logdiff_demo.json"
METADATA_FORMAT = "logdiff-demo/1"
DEFAULT_TRAIN_SECONDS = 90.0


def corpus_token_streams(tokenizer, corpus: Corpus) -> tuple[list[int], list[int]]:
    """The train and held-out token streams: chat-formatted documents, concatenated in order."""
    def stream(files) -> list[int]:
        ids: list[int] = []
        for f in files:
            ids += encode_chat_document(tokenizer, f.name, f.text)
        return ids
    return stream(corpus.train), stream(corpus.heldout)


class DemoTargetError(InputError, FileExistsError):
    """The output path exists and is not a previous demo model (exit code 2 in the CLI)."""


@dataclass(frozen=True)
class _PreparedData:
    tokenizer: Any
    special: dict[str, int]
    train_ids: tuple[int, ...]
    heldout_ids: tuple[int, ...]


_PREPARED: dict[str, _PreparedData] = {}


def _prepare_data(corpus: Corpus) -> _PreparedData:
    """Train the tokenizer and tokenize the corpus; memoised per corpus fingerprint.

    Both steps are deterministic functions of the corpus text (the tests check
    the tokenizer's determinism on its own), so building several models in one
    process (the test suite) tokenizes once.
    """
    key = corpus.sha256()
    if key not in _PREPARED:
        tokenizer = train_tokenizer([f.text for f in corpus.train], vocab_size=DEMO_VOCAB_SIZE)
        train_ids, heldout_ids = corpus_token_streams(tokenizer, corpus)
        _PREPARED.clear()
        _PREPARED[key] = _PreparedData(tokenizer, special_token_ids(tokenizer), tuple(train_ids), tuple(heldout_ids))
    return _PREPARED[key]


def _check_target(path: Path) -> None:
    """Refuse to overwrite a directory that is not empty and is not a previous demo model."""
    if path.exists() and not path.is_dir():
        raise DemoTargetError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / METADATA_FILE).is_file():
        raise DemoTargetError(f"{path} is not empty and is not a logdiff demo model; choose another path")


def build_demo_model(
    path: Path,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    train_seconds: float = DEFAULT_TRAIN_SECONDS,
    max_steps: int | None = None,
    progress: Callable[[str], None] | None = None,
    settings: TrainSettings | None = None,
) -> Path:
    """Build the demo model for ``arch`` in ``path`` and return ``path``.

    Trains for ``train_seconds`` of wall clock, or, when ``max_steps`` is given,
    for exactly that many steps (reproducible: same seed and max_steps give the
    same safetensors bytes on the same machine and software). ``max_steps=0``
    saves the untrained, seeded initialisation.
    """
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from logdiff.demo.configs import tiny_config
    from logdiff.sources.hf.loading import supports_sdpa

    check_arch(arch)
    moe = _is_moe(arch)
    if max_steps is not None and max_steps < 0:
        raise ValueError("max_steps must be >= 0")
    if max_steps is None and not train_seconds > 0:
        raise ValueError("train_seconds must be > 0 when max_steps is not given")
    path = Path(path).expanduser().absolute()
    _check_target(path)
    settings = settings or TrainSettings()
    say = progress or (lambda _msg: None)
    t_start = time.monotonic()

    corpus = load_corpus()
    say(f"tokenizer: byte-level BPE, {DEMO_VOCAB_SIZE} ids, on {len(corpus.train)} stdlib files")
    prepared = _prepare_data(corpus)
    tokenizer, special = prepared.tokenizer, prepared.special
    train_chunks = chunk_stream(prepared.train_ids, settings.seq_len)
    eval_chunks = spread_rows(chunk_stream(prepared.heldout_ids, settings.seq_len), settings.eval_sequences)

    config = tiny_config(
        arch, tokenizer.get_vocab_size(),
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"],
    )
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    previous_threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = "sdpa" if supports_sdpa(config) else "eager"  # gpt-oss's sinks have no sdpa path
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    try:
        torch.use_deterministic_algorithms(True)
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        threads_used = torch.get_num_threads()
        eval_before = evaluate(model, eval_chunks)
        say(f"model: {arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; "
            f"held-out loss {eval_before.loss:.3f} before training")
        budget = "exactly %d steps" % max_steps if max_steps is not None else f"{train_seconds:g} s"
        say(f"training on {train_chunks.numel()} tokens for {budget}")
        result = train(
            model, train_chunks, seed=seed, settings=settings,
            train_seconds=None if max_steps is not None else train_seconds, max_steps=max_steps,
            moe_aux_loss=moe, progress=say,
        )
        model.to(torch.bfloat16)
        # held-out stats of the weights as saved (bf16), computed in fp32
        eval_after = evaluate(model.float(), eval_chunks)
        model.to(torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(previous_deterministic)
        torch.set_num_threads(previous_threads)
    say(f"trained {result.steps} steps in {result.seconds:.0f} s; held-out loss {eval_after.loss:.3f}, "
        f"mean argmax prob {eval_before.mean_max_prob:.4f} -> {eval_after.mean_max_prob:.3f}")

    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=special["bos"], eos_token_id=[special["im_end"], special["eot"]],
        pad_token_id=special["pad"],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(str(staging))
        save_tokenizer(tokenizer, staging, model_max_length=config.max_position_embeddings)
        tail = result.losses[-10:]
        metadata: dict[str, Any] = {
            "format": METADATA_FORMAT,
            "arch": arch,
            "architectures": list(model.config.architectures or []),
            "seed": seed,
            "steps": result.steps,
            "stopped_by": result.stopped_by,
            "max_steps": max_steps,
            "train_seconds_budget": None if max_steps is not None else train_seconds,
            "train_wall_seconds": round(result.seconds, 2),
            "train_cpu_seconds": round(result.cpu_seconds, 2),
            "build_wall_seconds": round(time.monotonic() - t_start, 2),
            "final_loss": round(sum(tail) / len(tail), 5) if tail else None,
            "final_loss_note": "mean next-token training loss of the last 10 steps (nats/token)",
            "loss_curve": result.losses,
            "heldout_before": eval_before.as_dict(),
            "heldout_after": eval_after.as_dict(),
            "heldout_note": "fp32 compute; 'after' uses the saved bf16 weights",
            "training": {**settings.as_dict(), "optimizer": "AdamW", "schedule": "linear warm-up, then inverse-sqrt",
                         "weights_dtype": "float32", "saved_dtype": "bfloat16",
                         "router_aux_loss": moe},
            "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tokenizer.get_vocab_size(),
                          "training_files": len(corpus.train), "special_tokens": special},
            "corpus": {"source": "Python standard library source (top-level Lib/*.py)",
                       "stdlib_dir": corpus.stdlib_dir, "python_version": platform.python_version(),
                       "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                       "heldout_file_names": [f.name for f in corpus.heldout],
                       "train_tokens": len(prepared.train_ids), "heldout_tokens": len(prepared.heldout_ids),
                       "sha256": corpus.sha256()},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__, "torch_threads": threads_used},
            "reproduce": f"logdiff demo-model PATH --arch {arch} --seed {seed} --max-steps {result.steps}",
        }
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")
        usual_modes(staging)
        _swap_in(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"saved {arch} demo model to {path}")
    return path


def _swap_in(staging: Path, path: Path) -> None:
    """Put the finished ``staging`` directory at ``path``: an earlier model there is moved aside first and deleted
    only once the new one is in place (put back if the rename fails), so it is never lost to a failed build."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.previous") if path.exists() else None
    if aside is not None:
        path.rename(aside)
    try:
        staging.rename(path)
    except BaseException:
        if aside is not None:
            aside.rename(path)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _is_moe(arch: str) -> bool:
    """Whether the demo architecture routes tokens to experts (then training adds the router's aux loss)."""
    from logdiff.probes.arch import demo

    entry = demo(arch)
    return bool(entry is not None and entry.adapter.moe)


def read_demo_metadata(path: Path) -> dict[str, Any] | None:
    """The ``logdiff_demo.json`` of a demo model directory, or None if it has none."""
    meta = Path(path) / METADATA_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None
