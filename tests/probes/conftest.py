"""Fixtures for the probe tests: a tiny random bf16 Qwen3 (built in about a second).

The demo Qwen3 (``qwen3`` in tests/conftest.py) is what the end-to-end
localization tests use; the recorder's own tests only need some real HF model
with the Qwen3 layout, initialised with std 0.2 so its distributions are
peaked (with the default 0.02 every logprob is about -log(vocab) and
differences look tiny).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import build_tiny


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3"))
