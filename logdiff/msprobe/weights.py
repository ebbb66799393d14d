"""Weight fingerprints from the parameters an HF dump kept, as a logdiff capture hashes them.

msprobe dumps every module call's own parameters in tensor mode (``parameters.{name}``), under the module's
path: ``{path}.{name}`` is the HF state-dict name. Those whose files were kept are hashed
(``probes.contracts.fingerprint``, in the model's dtype where the tensor holds it exactly); the modules the
dump left out have none. vLLM's parameters are not read (its packed weights need their own names, and the
CPU build dumps its parallel linears' weights empty).
"""

from __future__ import annotations

from typing import Any

from logdiff.msprobe.layout import ENTRY, RankDump


def hf_fingerprints(steps: list[RankDump], config: dict[str, Any]) -> dict[str, str]:
    """``{state-dict name: fingerprint}`` of the parameters the dump kept (each module's first call)."""
    import torch

    from logdiff.probes.contracts import fingerprint, narrowest

    named = str(config.get("dtype") or config.get("torch_dtype") or "")
    dtype = getattr(torch, named, None) if named else None
    out: dict[str, str] = {}
    for rank in steps:
        for name, entry in rank.data.items():
            m = ENTRY.match(name)
            if not m:
                continue
            for param, desc in (entry.get("parameters") or {}).items():
                key = f"{m.group('path')}.{param}"
                if key in out:
                    continue
                t = rank.load(desc)
                if t is not None:
                    out[key] = fingerprint(narrowest(t, dtype) if isinstance(dtype, torch.dtype) else t)
    return out
