"""``logdiff doctor`` separates the engines installed here from those logdiff knows but cannot run (issue 52)."""

from __future__ import annotations

from typing import Any

import pytest

from logdiff.commands.doctor import engine_status, render
from logdiff.sources import registry
from logdiff.sources.hf import HFForward


class Absent(HFForward):
    """An engine whose package is not installed (``versions`` finds no metadata for it)."""

    name = "absent-engine"
    install_hint = "pip install absent-engine"

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {"transformers": "5", "absent_engine_pkg": None}


class Present(HFForward):
    """Negative control: every package it names is installed."""

    name = "present-engine"

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {"transformers": "5"}


def test_engines_installed_and_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.ENGINES, Absent.name, Absent)
    monkeypatch.setitem(registry.ENGINES, Present.name, Present)
    installed, missing = engine_status(["hf", Absent.name, Present.name])
    assert installed == ["hf", Present.name]  # transformers is installed wherever the suite runs
    assert missing == {Absent.name: (["absent_engine_pkg"], "pip install absent-engine")}


def test_the_table_names_both_rows() -> None:
    from io import StringIO

    from rich.console import Console

    info: dict[str, Any] = {"engines installed": ["hf", "vllm"], "engines not installed": ["vllm-ascend (needs x)"]}
    out = StringIO()
    render(info, Console(file=out, width=100))
    text = out.getvalue()
    assert "engines installed" in text and "hf, vllm" in text and "vllm-ascend (needs x)" in text
