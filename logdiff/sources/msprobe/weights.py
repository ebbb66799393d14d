"""Weight fingerprints from the parameters an HF dump kept, as a logdiff capture hashes them.

msprobe dumps every module call's own parameters in tensor mode (``parameters.{name}``), under the module's
path: ``{path}.{name}`` is the HF state-dict name. Those whose files were kept are hashed exactly as the HF
capture hashes a live model (``sources.hf.capture``): in the run's own dtype (``probes.contracts.fingerprint``,
a tensor the run kept wider than its dtype but holding its values exactly hashed narrow, ``narrowest``), and,
for a run wider than 16 bits, rounded to bfloat16 and float16 too (``fingerprints_at``), so that an fp32
trainer's dump verifies a bf16 engine's weights and ``--model`` loaded in either dtype. The modules the dump
left out have none. vLLM's parameters are not read (its packed weights need their own names, and the CPU
build dumps its parallel linears' weights empty). A tensor-parallel dump's pieces are joined into whole
parameters first (``placements.gathered_parameters``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from logdiff.sources.msprobe.layout import ENTRY, RankDump

NARROWER = ("bfloat16", "float16")  # what an HF capture also keeps a wide model's weights rounded to


def kept_parameters(steps: list[RankDump]) -> dict[str, Any]:
    """``{state-dict name: tensor}`` of the parameters the dump kept (each module's first call)."""
    out: dict[str, Any] = {}
    for rank in steps:
        for name, entry in rank.data.items():
            m = ENTRY.match(name)
            for param, desc in ((entry.get("parameters") or {}).items() if m else ()):
                key = f"{m.group('path')}.{param}"
                if key not in out and (t := rank.load(desc)) is not None:
                    out[key] = t
    return out


def fingerprint_sets(params: dict[str, Any]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(fingerprints, fingerprints_at)`` of whole parameters, as the HF capture writes them into a bundle: the
    run's dtype is its parameters' commonest floating dtype."""
    from logdiff.probes.contracts import fingerprint, narrowest

    floats = Counter(t.dtype for t in params.values() if t.is_floating_point())
    if not floats:
        return {}, {}
    import torch

    dtype = floats.most_common(1)[0][0]
    own = {k: fingerprint(narrowest(t, dtype)) for k, t in params.items()}
    if dtype.itemsize <= 2:
        return own, {}
    rounded = {at: {k: fingerprint(t.to(getattr(torch, at)) if t.is_floating_point() and t.element_size() > 2
                                   else narrowest(t, dtype)) for k, t in params.items()} for at in NARROWER}
    return own, rounded


def hf_fingerprints(steps: list[RankDump]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``fingerprint_sets`` of the parameters one rank's dump kept."""
    return fingerprint_sets(kept_parameters(steps))
