"""Session-wide fixtures: demo models built once, engines pooled once.

Loading is the slow part, so every model here is built once per session (a
short, seeded training run: peaked distributions, not a random init), and the
engines that scans acquire stay in ``probes.engines.base``'s process pool
across tests. Tests that need vLLM use the ``vllm`` marker and are skipped,
with the reason, when vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Steps of demo training for test models: enough for peaked distributions, seconds per model.
TEST_TRAIN_STEPS = int(os.environ.get("LOGDIFF_TEST_TRAIN_STEPS", "60"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install 'logdiff[cpu]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``demo_model("qwen3")`` -> a trained bf16 demo model directory, built once per arch."""
    from logdiff.demo import build_demo_model

    built: dict[str, Path] = {}

    def get(arch: str = "qwen3") -> Path:
        if arch not in built:
            path = tmp_path_factory.mktemp(f"demo-{arch}")
            built[arch] = build_demo_model(path, arch, seed=0, max_steps=TEST_TRAIN_STEPS)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def qwen3(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3")
