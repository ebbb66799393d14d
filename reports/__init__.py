"""Reports: render a result.json dict as an HTML page, a terminal summary, or check it.

Everything here takes the plain result dict documented in docs/result-schema.md,
so a live scan and ``logdiff report RESULT.json`` render through the same code.
This package imports nothing else of logdiff and never torch or an engine.
Submodules load lazily, so importing ``logdiff.reports`` costs nothing until a
function is used (the HTML side needs jinja2, the terminal side rich, the
validator jsonschema).
"""

from __future__ import annotations

from typing import Any

__all__ = ["explain", "render_html", "print_summary", "validate_result", "load_result",
           "PhaseProgress", "SCHEMA_VERSION"]

_WHERE = {"explain": "narrative", "render_html": "html", "print_summary": "terminal",
          "PhaseProgress": "progress", "validate_result": "schema", "load_result": "schema",
          "SCHEMA_VERSION": "schema"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
