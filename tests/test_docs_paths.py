"""The docs stay inside the repository: no link or named path leaves it (issue 52, item 6).

A reader of README.md, SKILL.md or docs/*.md has the repository and nothing else, so a
`../shared/notes/...` path names a file they do not have. A Markdown link that starts with `../` is
resolved from the file that holds it and must stay inside the repository; a `../` path named in prose
(read from the repository root, as the docs name paths) always leaves it. Every relative Markdown link
must name a file that exists, and one of its headings where it names an anchor. Each rule has a planted
violation that it must catch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "SKILL.md", *(ROOT / "docs").glob("*.md")])

# `../x`, `../../x` wherever it appears: in a link target, in backticks, in prose.
_UP_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[^\s)`'\"<>\],;]*[^\s)`'\"<>\],;.:])")
# [text](target) and ![alt](target); the target up to a space (a title) or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def paths_leaving_the_repository(doc: Path, text: str) -> list[str]:
    """Every `../` path in `text` that leaves the repository.

    A Markdown link's target is resolved from `doc`'s folder, as a viewer resolves it: docs/x.md may link
    `../README.md`. A path named in prose is read from the repository root, as the docs write paths
    (`tests/test_x.py`, `logdiff/...`), so a `../` there always leaves it.
    """
    link_targets = {m.span(1): m.group(1) for m in _LINK.finditer(text)}
    leaving = []
    for m in _UP_PATH.finditer(text):
        in_link = any(start <= m.start(1) < end for start, end in link_targets)
        if not in_link or not (doc.parent / m.group(1)).resolve().is_relative_to(ROOT):
            leaving.append(m.group(1))
    return leaving


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    return {_slug(line.lstrip("#")) for line in markdown.splitlines() if line.startswith("#")}


def broken_relative_links(doc: Path, text: str) -> list[str]:
    """Every relative Markdown link in `text` whose file does not exist, or whose `#anchor` is no heading of
    the Markdown file it names (this one for a bare `#anchor`)."""
    broken = []
    for m in _LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue                                         # https:, mailto:
        file, _, anchor = target.partition("#")
        path = doc.parent / file if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md":
            markdown = text if path == doc else path.read_text(encoding="utf-8")
            if anchor not in _anchors(markdown):
                broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_names_a_path_outside_the_repository(doc: Path) -> None:
    assert paths_leaving_the_repository(doc, doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_of_the_repository(doc: Path) -> None:
    assert broken_relative_links(doc, doc.read_text(encoding="utf-8")) == []


def test_planted_paths_outside_the_repository_are_caught() -> None:
    readme, doc = ROOT / "README.md", ROOT / "docs" / "cli.md"
    text = "see (../shared/notes/vllm-cpu.md) and [notes](../notes/x.md), `../../etc/passwd`"
    assert paths_leaving_the_repository(readme, text) == ["../shared/notes/vllm-cpu.md", "../notes/x.md",
                                                          "../../etc/passwd"]
    assert paths_leaving_the_repository(doc, "[shared](../../shared/notes/vllm-cpu.md)") == [
        "../../shared/notes/vllm-cpu.md"]
    # docs/architectures.md named it in prose: read from the repository root, as prose paths are
    assert paths_leaving_the_repository(doc, "measured outside (../shared/notes/vllm-cpu.md, tiny)") == [
        "../shared/notes/vllm-cpu.md"]
    # controls: a doc's link up to the README stays inside; `./` and plain relative paths are not `../`
    assert paths_leaving_the_repository(doc, "[readme](../README.md), kernels/matmul.py, ./x") == []


def test_planted_broken_links_are_caught() -> None:
    doc = ROOT / "docs" / "cli.md"
    text = "# Depth\n[a](missing.md) [b](ci.md#gates) [c](https://example.com/x) [d](#depth) ![e](img/nope.png)"
    assert broken_relative_links(doc, text) == ["missing.md", "img/nope.png"]
    # an anchor that is no heading there, in another file or in this one
    assert broken_relative_links(doc, "# Depth\n[a](ci.md#no-such-gate) [b](#window) [c](glossary.md#lever)") == [
        "ci.md#no-such-gate", "#window"]
