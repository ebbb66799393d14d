"""Write a quantized checkpoint of a bf16 model: what a quantized rollout engine loads (``logdiff quantize``).

The output is a compressed-tensors checkpoint as llm-compressor writes it and vLLM's
``compressed_tensors`` loader reads it (vLLM 0.32, ``CompressedTensorsConfig.from_config``):

* ``config.json``: MODEL's config plus ``quantization_config`` (``probes/quantization.py``:
  ``quant_method: compressed-tensors``, one config group targeting ``Linear``, ``lm_head`` ignored);
* for every quantized linear, ``NAME.weight`` in the scheme's dtype and ``NAME.weight_scale`` in fp32:
  ``[out, 1]`` per channel (INT8), ``[1]`` per tensor, ``[ceil(out/128), ceil(in/128)]`` per block (FP8);
  every other tensor (embeddings, norms, ``lm_head``) unchanged;
* the tokenizer and generation files copied; the weights split into the same files as MODEL's (its
  ``model.safetensors.index.json`` rewritten to list the scales).

Which tensors are quantized is read from the model built on the meta device: the weight of each
``nn.Linear`` but the LM head. The INT8 rounding is ``kernels/int8.quantize_weight``, the one definition
the weight check shares; FP8 is ``amax / 448`` per tensor or per 128 x 128 block, cast to
``float8_e4m3fn`` (written here: vLLM's CPU build runs FP8 only with AMX tiles, so on other hosts the
checkpoint is written but no engine here can load it). In a mixture-of-experts model the router and
the routed experts stay bf16 and are listed in ``ignore`` (``probes/quantization.MOE_IGNORE``): vLLM's
CPU build has no INT8 fused-MoE kernel here, and HF's experts are not ``nn.Linear`` layers; its
attention and dense (shared-expert) linears are quantized.

The directory is built under a hidden name beside OUT and renamed into place at the end, so a failure
leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.records.bundle_writer import usual_modes
from logdiff.probes.arch import adapter_for
from logdiff.probes.quantization import FP8_BLOCK, FP8_MAX, SCHEMES, quantization_config

#: files of MODEL never copied: the weights (rewritten), its config (rewritten), a demo model's metadata
_NOT_COPIED = ("config.json", "logdiff_demo.json")


def quantize_checkpoint(model: str | os.PathLike, out: str | os.PathLike, scheme: str = "int8-w8a8",
                        trust_remote_code: bool = False) -> Path:
    """Write ``scheme``'s quantized checkpoint of the bf16 model directory ``model`` at ``out``; returns ``out``.

    ``out`` must not exist or be an empty directory (``InputError`` otherwise, as for every bad input)."""
    from logdiff.sources.checkpoint import read_config

    model, out = Path(model), Path(out)
    if scheme not in SCHEMES:
        raise InputError(f"unknown --scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    cfg = read_config(model, trust_remote_code)
    if cfg.get("quantization_config"):
        raise InputError(f"{model} is already quantized (its config.json has a quantization_config)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not an empty directory; choose another path")
    if model.resolve() == out.resolve():
        raise InputError("OUT must be another directory than MODEL")
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors weights in {model}")
    targets = linear_weights(model, cfg, trust_remote_code)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        written = {f.name: _quantize_file(f, staging / f.name, targets, scheme) for f in files}
        _write_index(model, staging, written)
        for f in sorted(model.iterdir()):
            if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith((".safetensors", ".index.json")):
                shutil.copy(f, staging / f.name)
        qcfg = quantization_config(scheme, moe=bool(getattr(adapter_for(cfg["architectures"][0]), "moe", False)))
        (staging / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}, indent=2) + "\n")
        usual_modes(staging)
        if out.exists():
            out.rmdir()  # an empty directory: replaced by the finished one
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def linear_weights(model: Path, cfg: dict[str, Any], trust_remote_code: bool = False) -> set[str]:
    """The HF names of the weights the scheme quantizes: each ``nn.Linear``'s but the LM head's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    head = meta.get_output_embeddings()
    moe = bool(getattr(adapter_for(cfg["architectures"][0]), "moe", False))
    return {f"{name}.weight" for name, m in meta.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head
            and not (moe and re.search(r"mlp\.(gate$|experts\.)", name))}


def quantize_tensor(weight: Any, scheme: str) -> tuple[Any, Any]:
    """(quantized weight, fp32 scale) of one ``[out, in]`` weight under ``scheme``."""
    if scheme == "int8-w8a8":
        from logdiff.kernels.int8 import quantize_weight

        return quantize_weight(weight)
    import torch

    w = weight.detach().to(torch.float32)
    if scheme == "fp8-tensor":
        scale = (w.abs().amax() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(br * FP8_BLOCK, bc * FP8_BLOCK)
    return q[:rows, :cols].contiguous().to(torch.float8_e4m3fn), scale


def _quantize_file(src: Path, dst: Path, targets: set[str], scheme: str) -> list[str]:
    """Write ``src``'s tensors to ``dst``, the targets quantized (each with its ``weight_scale``); returns the
    names written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out: dict[str, Any] = {}
    try:
        with safe_open(str(src), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                tensor = st.get_tensor(name)
                if name in targets and tensor.dim() == 2:
                    q, scale = quantize_tensor(tensor, scheme)
                    out[name], out[name[: -len("weight")] + "weight_scale"] = q.contiguous(), scale.contiguous()
                else:
                    out[name] = tensor.contiguous()
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError for a corrupt file
        raise InputError(f"corrupt safetensors file {src}: {e}") from None
    save_file(out, str(dst), metadata={"format": "pt"})
    return list(out)


def _write_index(model: Path, staging: Path, written: dict[str, list[str]]) -> None:
    """MODEL's safetensors index, if it has one, listing every tensor written (the scales too)."""
    for index in sorted(model.glob("*.safetensors.index.json")):
        data = json.loads(index.read_text())
        data["weight_map"] = {name: file for file, names in written.items() for name in names}
        (staging / index.name).write_text(json.dumps(data, indent=2) + "\n")
