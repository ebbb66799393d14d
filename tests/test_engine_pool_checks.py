"""An engine's environment check runs on every ``acquire``, a pooled engine's too (sources/pool.py).

A scan refuses to run vLLM under the capture plugin's variable (``LOGDIFF_CAPTURE``). The check used to run
only when an engine was built, so a scan after another one in the same process (the pool reuses engines) ran
its vLLM under the plugin anyway.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest

from logdiff.errors import InputError
from logdiff.sources import registry
from logdiff.sources.base import EngineSpec
from logdiff.sources.pool import EnginePool


class Checked:
    """An engine that cannot run while ``LOGDIFF_TEST_FORBID`` is set; it counts how often it is built."""

    exclusive: ClassVar[bool] = False
    built: ClassVar[int] = 0

    @classmethod
    def check_available(cls) -> None:
        if os.environ.get("LOGDIFF_TEST_FORBID"):
            raise InputError("LOGDIFF_TEST_FORBID is set")

    def __init__(self, spec: Any):
        type(self).built += 1

    def close(self) -> None:
        pass


def test_a_pooled_engine_is_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.ENGINES, "checked", Checked)
    monkeypatch.delenv("LOGDIFF_TEST_FORBID", raising=False)
    pool, spec = EnginePool(), EngineSpec("model")
    first = pool.acquire("checked", spec)
    assert pool.acquire("checked", spec) is first and Checked.built == 1  # reused, not rebuilt
    monkeypatch.setenv("LOGDIFF_TEST_FORBID", "1")
    with pytest.raises(InputError, match="LOGDIFF_TEST_FORBID"):
        pool.acquire("checked", spec)
    monkeypatch.delenv("LOGDIFF_TEST_FORBID")
    assert pool.acquire("checked", spec) is first


def test_the_vllm_engine_refuses_the_capture_plugins_variable_before_importing_anything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from logdiff.sources.vllm import VLLMEngine

    monkeypatch.setenv("LOGDIFF_CAPTURE", "/tmp/bundle")
    with pytest.raises(InputError, match="LOGDIFF_CAPTURE"):
        VLLMEngine.check_available()
