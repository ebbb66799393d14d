"""The demo models' training text: the Python standard library's own source.

Every Python install ships it, so nothing is copied into this repository and
nothing is downloaded. The choice is deterministic: the top-level ``*.py``
files of ``sysconfig.get_paths()["stdlib"]``, sorted by name, minus the
install-specific ``_sysconfigdata_*`` module (generated paths and compiler
flags). Files are split by position in that sorted list: every tenth file
(index % 10 == 7) is held out for evaluation, the rest trains both the
tokenizer and the model.

The text therefore depends on the Python version that builds the model; the
build records the file count and a SHA-256 of the text in ``logdiff_demo.json``.

Each file becomes one chat-formatted document, so that the chat tokens mean
something to the trained model and a chat prompt gets a Python-looking
answer::

    <|im_start|>user
    argparse<|im_end|>
    <|im_start|>assistant
    ...source of argparse.py...<|im_end|>
    <|endoftext|>
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_EVERY = 10
HELDOUT_OFFSET = 7
MIN_FILES = 20


@dataclass(frozen=True)
class SourceFile:
    """One standard-library module: its name and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The deterministic train / held-out split of the standard library's source."""

    stdlib_dir: str
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]

    def sha256(self) -> str:
        """A fingerprint of every file name and text, in order (train, then held-out)."""
        h = hashlib.sha256()
        for f in self.train + self.heldout:
            h.update(f.name.encode() + b"\0" + f.text.encode("utf-8") + b"\0")
        return h.hexdigest()


def stdlib_dir() -> Path:
    """The directory of the running Python's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(directory: Path | None = None) -> list[Path]:
    """The stdlib's top-level ``*.py`` files, sorted by name, excluding generated ones."""
    directory = stdlib_dir() if directory is None else directory
    files = sorted(
        (p for p in directory.glob("*.py") if p.is_file() and not p.name.startswith("_sysconfigdata")),
        key=lambda p: p.name,
    )
    return files


def load_corpus(directory: Path | None = None) -> Corpus:
    """Read the standard library's source and split it into train and held-out files."""
    directory = stdlib_dir() if directory is None else directory
    files = stdlib_files(directory)
    if len(files) < MIN_FILES:
        raise RuntimeError(
            f"found only {len(files)} .py files in {directory}; the demo model trains on the "
            "standard library's source, which this Python install does not ship"
        )
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    for index, path in enumerate(files):
        text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
        item = SourceFile(name=path.stem, text=text)
        (heldout if index % HELDOUT_EVERY == HELDOUT_OFFSET else train).append(item)
    return Corpus(stdlib_dir=str(directory), train=tuple(train), heldout=tuple(heldout))
