"""Stage MODEL's config and CKPT's weights as one HF directory both engines load.

Every engine loads weights through its own real loading code
(``from_pretrained`` for transformers, the model loader for vLLM), and both
expect an HF directory: ``config.json`` plus safetensors. Staging builds that
directory once per (MODEL, CKPT) pair:

* safetensors already on disk (an HF directory, or one ``.safetensors`` file)
  are symlinked, never copied;
* a ``.pt``/``.bin`` state dict or a ``torch.distributed.checkpoint``
  directory is converted once to ``model.safetensors``.

Before anything loads, the weights are checked against the shapes the config
implies (a model built on the meta device), so a config/weights mismatch or a
corrupt file is a one-line error rather than a deep engine traceback.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdiff.errors import InputError, WorkspaceError
from logdiff.probes.arch import adapter_for

_STAGE_ROOT: Path | None = None


@dataclass(frozen=True)
class StagedModel:
    """An HF directory ready to load, and the facts read from its config."""

    path: Path
    architecture: str
    config: dict[str, Any]
    trust_remote_code: bool = False

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_len(self) -> int:
        return int(self.config.get("max_position_embeddings", 2048))


def read_config(model_dir: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """MODEL's ``config.json``, with one-line errors for the usual mistakes.

    A model that needs its own Python code (an ``auto_map``, or a ``model_type``
    transformers does not know) is refused unless ``trust_remote_code``.
    """
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise InputError(f"model directory not found: {model_dir}")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{model_dir} is not an HF model directory (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{cfg_path}: not valid JSON ({e.msg})") from None
    archs = cfg.get("architectures") or []
    adapter_for(archs[0] if archs else None, where=str(cfg_path))  # an adapter, or a one-line error
    why = remote_code_reason(cfg)
    if why and not trust_remote_code:
        raise InputError(f"{model_dir} needs custom code ({why}); pass --trust-remote-code to run it")
    return cfg


def remote_code_reason(cfg: dict[str, Any]) -> str | None:
    """Why loading this config would run code shipped with the model, or None."""
    if cfg.get("auto_map"):
        return "auto_map in config.json"
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return f"model_type {model_type!r} is not one transformers knows"
    return None


def stage(model_dir: Path, ckpt: Path | None = None, trust_remote_code: bool = False,
          quantized: bool = False) -> StagedModel:
    """Return a staged HF directory with MODEL's config and CKPT's (or MODEL's) weights.

    With ``trust_remote_code`` the model's ``*.py`` files are staged too, so its own code loads.
    ``quantized``: CKPT may be a quantized checkpoint (the inference side's); elsewhere one is refused.
    """
    model_dir = Path(model_dir).resolve()
    cfg = read_config(model_dir, trust_remote_code)
    source = Path(ckpt).resolve() if ckpt is not None else model_dir
    if not source.exists():
        raise InputError(f"checkpoint not found: {source}")
    if cfg.get("quantization_config"):
        raise InputError(f"{model_dir} is a quantized checkpoint: MODEL is the trainer's bf16 model; pass the "
                         "quantized one as --infer-ckpt")
    quant = ckpt_quantization(source) if source != model_dir else None
    if quant is not None and not quantized:
        raise InputError(f"{source} is a quantized checkpoint: the trainer computes with bf16 weights; pass it "
                         "as --infer-ckpt (the inference side)")
    out = _stage_dir(model_dir, source, trust_remote_code)
    if not (out / ".complete").exists():
        try:
            _build(out, model_dir, source, trust_remote_code)
        except OSError as e:
            shutil.rmtree(out, ignore_errors=True)  # never a half-staged directory for the next run
            if e.filename is not None and not str(e.filename).startswith(str(out)):
                raise InputError(f"cannot read {e.filename}: {e.strerror or e}") from None
            raise WorkspaceError(out.parent, e.strerror or str(e)) from None
    if quant is not None:
        cfg = {**cfg, "quantization_config": quant}
    staged = StagedModel(out, cfg["architectures"][0], cfg, trust_remote_code)
    check_weights(staged)
    return staged


def _stage_dir(model_dir: Path, source: Path, trust_remote_code: bool = False) -> Path:
    global _STAGE_ROOT
    if _STAGE_ROOT is None:
        _STAGE_ROOT = Path(tempfile.mkdtemp(prefix="logdiff-stage-"))
        atexit.register(shutil.rmtree, _STAGE_ROOT, ignore_errors=True)
    h = hashlib.sha256(b"code" if trust_remote_code else b"")
    for p in (model_dir, source):
        h.update(str(p).encode())
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return _STAGE_ROOT / h.hexdigest()[:16]


def _build(out: Path, model_dir: Path, source: Path, trust_remote_code: bool = False) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    code = sorted(f.name for f in model_dir.glob("*.py")) if trust_remote_code else []
    for name in ("config.json", "generation_config.json", *code):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    quant = ckpt_quantization(source) if source != model_dir else None
    if quant is not None:  # a quantized checkpoint's weights are read through its scheme: the engine must see it
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    if source.is_dir() and (source / ".metadata").is_file():
        _save(_load_dcp(source), out)
    elif source.is_dir():
        files = sorted(source.glob("*.safetensors"))
        if not files:
            raise InputError(f"no *.safetensors weights in {source}")
        for f in files + sorted(source.glob("*.safetensors.index.json")):
            (out / f.name).symlink_to(f)
    elif source.suffix == ".safetensors":
        (out / "model.safetensors").symlink_to(source)
    elif source.suffix in (".pt", ".pth", ".bin"):
        _save(_load_torch(source), out)
    else:
        raise InputError(
            f"unrecognised checkpoint {source}: expected an HF directory, a .safetensors or .pt "
            "state dict, or a torch.distributed.checkpoint directory"
        )
    (out / ".complete").touch()


def ckpt_quantization(source: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint directory's own ``config.json`` (a quantized checkpoint:
    ``logdiff quantize``, llm-compressor), else None.

    ``--infer-ckpt`` keeps its meaning, "these weights under MODEL's config": the quantization config is how
    those weights are stored, not a model setting, so it is the one key staged from the checkpoint's config
    (docs/capture.md, *Quantized rollouts*). The trainer's side never stages it: it stays bf16."""
    path = source / "config.json" if source.is_dir() else None
    if path is None or not path.is_file():
        return None
    try:
        quant = json.loads(path.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError):
        raise InputError(f"{path}: not a valid config.json") from None
    if quant is not None and not isinstance(quant, dict):
        raise InputError(f"{path}: quantization_config is not an object")
    return quant or None


def _unwrap(obj: Any, where: Path) -> dict:
    """Accept ``{"model": sd}`` / ``{"state_dict": sd}`` wrappers around a flat state dict."""
    import torch

    while isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), dict):
        obj = next(iter(obj.values()))
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(f"{where}: not a state dict of tensors")
    return obj


def _load_torch(path: Path) -> dict:
    import torch

    try:
        return _unwrap(torch.load(path, map_location="cpu", weights_only=True), path)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise InputError(f"cannot read {path} as a torch state dict: {type(e).__name__}") from None


def _load_dcp(path: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        try:
            dcp_to_torch_save(str(path), f"{tmp}/sd.pt")
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the scratch copy, not the checkpoint
                raise WorkspaceError(Path(tmp), e.strerror) from None
            raise InputError(f"cannot read distributed checkpoint {path}: {type(e).__name__}: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise InputError(f"cannot read distributed checkpoint {path}: {type(e).__name__}: {e}") from None
        sd = torch.load(f"{tmp}/sd.pt", map_location="cpu", weights_only=True)
    return _unwrap(sd, path)


def _save(sd: dict, out: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))


def _expected_shapes(cfg_dir: Path, config: Any = None, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if config is None:
        config = AutoConfig.from_pretrained(str(cfg_dir), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from safetensors headers, without reading the data."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError/OSError
            raise InputError(f"corrupt safetensors file {f.resolve()}: {e}") from None
    return shapes


def check_weights(staged: StagedModel, config: Any = None) -> None:
    """Refuse weights whose names or shapes do not fit the config (``config``: an overridden one).

    transformers 5 fuses MoE experts in memory but saves and loads one tensor
    per expert; its loader converts, so a fused expert tensor counts as present
    when the adapter finds its per-expert tensors (``per_expert_stored``).
    """
    adapter = adapter_for(staged.architecture)
    expected = _expected_shapes(staged.path, config, staged.trust_remote_code)
    stored = stored_shapes(staged.path)
    missing = sorted(n for n in set(expected) - set(stored) if not adapter.per_expert_stored(n, stored))
    if missing:
        raise InputError(
            f"config/weights mismatch: {len(missing)} tensors the config needs are missing "
            f"from the checkpoint, e.g. {missing[0]}"
        )
    for name, shape in expected.items():
        if name in stored and stored[name] != shape:
            raise InputError(
                f"config/weights mismatch: {name} has shape {list(stored[name])} in the "
                f"checkpoint but the config implies {list(shape)}"
            )
