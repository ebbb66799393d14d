"""``logdiff compare``'s sources: a capture bundle as it is, an msprobe dump converted into a temporary one.

An msprobe dump holds no model config, so one is converted only with ``--model`` (its config.json gives the
architecture, the split sizes of packed projections and the shapes the comparison checks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from logdiff.msprobe.layout import is_dump
from logdiff.probes.errors import InputError


def model_config(model: Path | None, dump: Path) -> dict[str, Any]:
    """``--model``'s config.json, which an msprobe dump needs; a one-line InputError without it."""
    if model is None:
        raise InputError(f"{dump} is an msprobe dump, which holds no model config: give --model MODEL (the HF model "
                         "directory it ran)")
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--model {model}: no readable config.json ({type(e).__name__})") from None
    if not isinstance(config, dict) or "num_attention_heads" not in config:
        raise InputError(f"--model {model}: its config.json is not a transformers model config")
    return config


def as_bundle(path: Path, role: str, model: Path | None, scratch: Path) -> Path:
    """``path`` as a bundle directory: itself, or the msprobe dump under it converted into ``scratch/role``."""
    path = Path(path)
    if not path.is_dir() or (path / "bundle.json").exists():
        return path  # a bundle, or what ``Bundle`` says is none
    if not is_dump(path):
        raise InputError(f"{path} is not a capture bundle (no bundle.json) nor an msprobe dump (no dump.json "
                         "under it)")
    from logdiff.msprobe.convert import convert

    return convert(path, Path(scratch) / role, role, model_config(model, path), str(model))


def live_model(model: Path | None, bundles: tuple[Path, ...], given: tuple[Path, ...]) -> Path | None:
    """``--model`` for the comparison's replay and conformance: None where only a dump needed it, for its config
    (a directory with no weight files)."""
    if model is None or all(Path(b) == Path(g) for b, g in zip(bundles, given)):
        return model
    weights = [f for pattern in ("*.safetensors", "*.bin", "*.pt") for f in Path(model).glob(pattern)]
    return model if weights else None
