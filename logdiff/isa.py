"""Which CPU this is, which kernels the engines pick on it, and how to run as a smaller one.

CPU numerics are a property of the instruction set: torch, oneDNN and vLLM's
CPU build each choose their kernels from what the processor offers. On an
AVX-512 BF16 machine vLLM loads its ``_C`` kernels, hands each linear layer's
weight to a oneDNN GEMM and drops the plain tensor; on an AVX2-only machine it
loads ``_C_AVX2``, oneDNN cannot build a bf16 matmul, and the layer keeps its
weight and calls ``torch.nn.functional.linear``. Two machines can therefore
give different logprobs, different baselines, and different answers to "does
this stock op vary with the batch size?".

``LOGDIFF_EMULATE_ISA=avx2`` runs a bigger x86 machine as an AVX2-only one, so
a developer can reproduce the other machines' *kernel choices* without owning
one. It works at three levels, because each library reads the ISA its own way:

* torch: ``ATEN_CPU_CAPABILITY=avx2`` caps ATen's vectorised kernels, and
  ``torch.backends.mkldnn`` is switched off, because on a real AVX2 machine
  torch's bf16 GEMM finds no oneDNN bf16 support and uses its own fallback;
* oneDNN: ``ONEDNN_MAX_CPU_ISA=AVX2`` (vLLM's ``create_onednn_mm`` then fails
  for bf16, exactly as on AVX2 hardware);
* vLLM: ``torch.cpu._is_avx512_supported``, ``_is_avx512_bf16_supported``,
  ``_is_amx_tile_supported`` and ``_is_amx_fp16_supported`` answer False, so
  vLLM imports ``_C_AVX2`` and picks its AVX2 attention and MoE kernels.

The environment variables must be in place before torch starts, so
``emulation_env`` gives them for a child process; ``apply_emulation`` (called
before torch or vLLM is used, from ``logdiff/__init__.py``) installs the rest.
What it reproduces is the *dispatch*; whether every kernel then rounds bit for
bit as on AVX2 silicon is not measured (docs/portability.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from logdiff.errors import InputError

ENV = "LOGDIFF_EMULATE_ISA"
#: Widest first: the first of these flags that /proc/cpuinfo lists names the ISA.
ISAS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "asimd", "sve")
#: ISAs that can be emulated, with the environment each needs before torch loads.
EMULATIONS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
_CAPABILITY_CHECKS = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                      "_is_amx_fp16_supported")


def host_isa() -> str:
    """The widest vector/matrix extension the processor reports (``unknown`` off Linux)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return next((isa for isa in ISAS if isa in flags), "unknown")


def emulated_isa() -> str | None:
    """The ISA this process emulates, or None."""
    value = os.environ.get(ENV, "").strip().lower()
    return value or None


def cpu_isa() -> str:
    """The ISA whose kernels this process runs: the emulated one, else the host's."""
    return emulated_isa() or host_isa()


def can_emulate(isa: str) -> bool:
    """Only a smaller x86 ISA can be emulated, on an x86 machine that has more."""
    host = host_isa()
    return isa in EMULATIONS and host in ISAS[: ISAS.index(isa) + 1]


def emulation_env(isa: str) -> dict[str, str]:
    """The environment a child process needs to run as ``isa`` (merge into ``os.environ``)."""
    return {ENV: isa, **EMULATIONS[isa]}


def apply_emulation() -> None:
    """Install the emulation that ``LOGDIFF_EMULATE_ISA`` asks for (idempotent; no-op without it)."""
    isa = emulated_isa()
    if isa is None:
        return
    if not can_emulate(isa):
        raise InputError(f"{ENV}={isa!r}: this {host_isa()} machine can emulate {', '.join(EMULATIONS)} only")
    for key, value in EMULATIONS[isa].items():
        os.environ.setdefault(key, value)
    import torch

    capability = str(torch.backends.cpu.get_cpu_capability()).lower()
    if capability != os.environ["ATEN_CPU_CAPABILITY"]:
        raise InputError(f"{ENV}={isa}: torch already runs {capability} kernels; set {ENV} before Python "
                         "starts (ATEN_CPU_CAPABILITY is read when torch loads)")
    torch.backends.mkldnn.enabled = False
    for name in _CAPABILITY_CHECKS:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, _false)


def _false() -> bool:
    return False
