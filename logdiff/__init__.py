"""logdiff: find where and why training and inference logprobs differ.

The Python API mirrors ``logdiff scan``::

    import logdiff
    result = logdiff.scan("path/to/model", infer=["vllm"], num_sequences=8)
    result["logprobs"]["abs_diff_max"], result["verdict"]

Heavy dependencies (torch, transformers, vLLM) load on first use, not on import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from logdiff.version import __version__  # noqa: F401 - logdiff.__version__


def scan(model: str | Path, ckpt: str | Path | None = None, **options: Any) -> dict[str, Any]:
    """Run a scan and return the result dict (docs/result-schema.md): ``result.json``'s content.

    (``logdiff.commands.scan.scan`` returns the typed ``logdiff.comparison.result.ScanResult`` it serializes.)

    ``options`` are ``ScanConfig`` fields: ``train``, ``infer`` (list), ``dtype``,
    ``sequences`` (a JSONL path), ``num_sequences``, ``prompt_len``, ``response_len``,
    ``seed``, ``infer_ckpt``, ``train_set``/``infer_set`` (dicts), ``depth``, ``consistent``.
    """
    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import scan as run

    for key in ("sequences", "prompts", "infer_ckpt"):
        if options.get(key) is not None:
            options[key] = Path(options[key])
    return run(ScanConfig(model=Path(model), ckpt=Path(ckpt) if ckpt else None, **options)).to_dict()


def quantize(model: str | Path, out: str | Path, scheme: str = "int8-w8a8", trust_remote_code: bool = False) -> Path:
    """Write a quantized compressed-tensors checkpoint of the bf16 model ``model`` at ``out`` (``logdiff quantize``;
    logdiff/commands/quantize.py): ``scheme`` is ``int8-w8a8``, ``fp8-block`` or ``fp8-tensor``. Scan it as the
    inference side with ``infer_ckpt=out``: the trainer stays bf16."""
    from logdiff.commands.quantize import quantize_checkpoint

    return quantize_checkpoint(model, out, scheme, trust_remote_code)


def __getattr__(name: str) -> Any:
    """``logdiff.consistent_training`` and ``logdiff.sync_vllm_weights`` (logdiff/integrations/training.py) and
    ``logdiff.capture`` (logdiff/sources/hf/capture.py), loaded on use."""
    if name in ("consistent_training", "sync_vllm_weights"):
        from logdiff.integrations import training

        return getattr(training, name)
    if name == "capture":
        from logdiff.sources.hf.capture import capture

        return capture
    raise AttributeError(f"module 'logdiff' has no attribute {name!r}")
