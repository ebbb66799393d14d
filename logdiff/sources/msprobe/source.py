"""``logdiff compare``'s sources: a capture bundle as it is, an msprobe dump converted into a temporary one.

An msprobe dump holds no model config, so one is converted only with ``--model`` (its config.json gives the
architecture, the split sizes of packed projections and the shapes the comparison checks). A statistics dump
(no tensors) is not converted: the comparison is then statistics only (``statistics.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.sources.msprobe.layout import is_dump


def model_config(model: Path | None, dump: Path) -> dict[str, Any]:
    """``--model``'s config.json, which an msprobe dump needs; a one-line InputError without it."""
    if model is None:
        raise InputError(f"{dump} is an msprobe dump, which holds no model config: give --model MODEL (the HF model "
                         "directory it ran)")
    from logdiff.records.untrusted import InputRoot

    source = InputRoot(model, "model directory (--model)")
    if not os.path.lexists(source / "config.json"):
        raise InputError(f"--model {model}: no config.json")
    config = source.read_json(source / "config.json", "config.json")
    if not isinstance(config, dict) or "num_attention_heads" not in config:
        raise InputError(f"--model {model}: its config.json is not a transformers model config")
    return config


def as_bundle(path: Path, role: str, model: Path | None, scratch: Path, parallel: Any = None) -> Path:
    """``path`` as a bundle directory: itself, or the msprobe dump under it converted into ``scratch/role``
    (``parallel``: the sizes ``--tp`` gives a multi-rank dump, ``ranks.py``)."""
    path = Path(path)
    if not path.is_dir() or (path / "bundle.json").exists():
        return path  # a bundle, or what ``Bundle`` says is none
    if not is_dump(path):
        raise InputError(f"{path} is not a capture bundle (no bundle.json) nor an msprobe dump (no dump.json "
                         "under it)")
    from logdiff.sources.msprobe.ranks import convert_parallel

    return convert_parallel(path, Path(scratch) / role, role, model_config(model, path), str(model), parallel)


def live_model(model: Path | None, bundles: tuple[Path, ...], given: tuple[Path, ...]) -> Path | None:
    """``--model`` for the comparison's replay and conformance: None where only a dump needed it, for its config
    (a directory with no weight files)."""
    if model is None or all(Path(b) == Path(g) for b, g in zip(bundles, given)):
        return model
    weights = [f for pattern in ("*.safetensors", "*.bin", "*.pt") for f in Path(model).glob(pattern)]
    return model if weights else None


def statistics_only(train: Path, infer: Path) -> bool:
    """Whether the comparison is statistics only: one side is a ``statistics`` msprobe dump. The other must be an
    msprobe dump too (a tensor dump's statistics are compared), else a one-line InputError."""
    from logdiff.sources.msprobe.layout import read_dump
    from logdiff.sources.msprobe.statistics import TASKS, dump_task

    tasks = []
    for p in (Path(train), Path(infer)):
        task = dump_task(p) if is_dump(p) else None
        if is_dump(p) and task is None:
            read_dump(p, TASKS)  # its own one-line error: unreadable, not msprobe's
        tasks.append(task)
    if "statistics" not in tasks:
        return False
    if None in tasks:
        stats, other = (train, infer) if tasks[0] == "statistics" else (infer, train)
        raise InputError(f"{stats} is a statistics msprobe dump (no tensors): it compares only against another "
                         f"msprobe dump (statistics or tensor), not {other} (docs/msprobe.md)")
    return True


def statistics_result(train: Path, infer: Path, model: Path | None, environment: dict[str, Any]) -> dict[str, Any]:
    """The result.json dict of a statistics-only comparison of two msprobe dumps (``statistics.result``);
    ``--model``'s config, where given, names the architecture and the layers."""
    from logdiff.sources.msprobe.statistics import result

    config = model_config(model, Path(train)) if model is not None else None
    return result(Path(train), Path(infer), model, config, environment)
