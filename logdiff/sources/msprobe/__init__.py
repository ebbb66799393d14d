"""msprobe (mindstudio-probe) dumps as a ``logdiff compare`` source: docs/msprobe.md.

A tensor-mode msprobe dump of one side (HF transformers or vLLM, one rank, level ``L0`` or ``mix``) is
converted into a logdiff capture bundle (``convert.convert``) and compared as bundles are. ``layout`` reads
the dump's directories and files, ``names`` maps its entries to logdiff boundaries, ``rows`` rebuilds the
row table (token ids, positions, sequences) a dump does not write. A dump of a tensor-parallel run (several ranks
per step, ``--tp N``) is grouped by ``ranks`` and placed by ``placements``, one bundle rank per dump rank.
"""

from __future__ import annotations

from logdiff.sources.msprobe.convert import convert
from logdiff.sources.msprobe.layout import is_dump

__all__ = ["convert", "is_dump"]
