"""The bundled demo models: tiny Qwen3, Llama, Qwen3-MoE, Qwen2, Mistral, Llama 3, Mixtral,
trained briefly on CPU.

``logdiff demo-model PATH --arch ARCH`` calls :func:`build_demo_model`.
Tests that only need an untrained model use :func:`tiny_config`.

Importing this package is cheap: torch, transformers and tokenizers are
imported only when a model or tokenizer is built.

Modules: ``corpus`` (the training text: the Python stdlib's source),
``tokenizer`` (byte-level BPE + ChatML template), ``configs`` (tiny configs; each
architecture's own settings come from its adapter in ``logdiff.probes.arch``),
``train`` (deterministic CPU training loop), ``build`` (the whole pipeline).
See docs/demo-model.md for the choices and the measured numbers.
"""

from __future__ import annotations

from logdiff.demo.build import METADATA_FILE, build_demo_model, read_demo_metadata
from logdiff.demo.configs import SUPPORTED_DEMO_ARCHS, tiny_config
from logdiff.demo.tokenizer import DEMO_VOCAB_SIZE
from logdiff.demo.untrained import build_random_model

__all__ = [
    "DEMO_VOCAB_SIZE",
    "METADATA_FILE",
    "SUPPORTED_DEMO_ARCHS",
    "build_demo_model",
    "build_random_model",
    "read_demo_metadata",
    "tiny_config",
]
