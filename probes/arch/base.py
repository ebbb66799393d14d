"""The adapter interface and the registry: one adapter per HF ``architectures`` string.

An adapter is everything logdiff knows about one model family but its taps, in one place:

* **correspondence**: the boundaries in semantic order, each with its inputs,
  and the ones HF computes in plain functions (``correspondence(config)``);
* **classification**: which contract keys and weights each boundary reads
  (``contract_keys``), which norm a residual add is classified with and which
  one it fuses into (``residual_norm``, ``fused_norm``), where a contract key
  is read first (``key_boundary``), which boundary owns a weight
  (``weight_boundary``);
* **contract readers**: where eps, RoPE, attention and experts sit in each
  engine's module (``layers``, ``attention``, ``input_norm``, ``final_norm``,
  ``embed``, ``lm_head``, ``sliding_window``, ``rope_type_of``);
* **weights**: vLLM's packed parameters (``packed``: ``qkv_proj`` -> its HF
  parts) and MoE layout (``moe_params``, ``per_expert_stored``);
* **consistent mode**: which HF module classes and attributes the HF installer
  may replace (``hf_norm_classes``, ``mlp_parts``, ``experts_parts``,
  ``is_attention``);
* **demo models**: tiny configs, registered separately as ``Demo`` entries
  because one architecture can have several (``llama`` and ``llama3``).

An adapter holds no taps: where each engine's modules expose the boundaries
lives in that engine's folder (``logdiff/sources/<engine>/taps.py``: a
``correspondence.TapMapping`` with a default builder for ``DecoderAdapter`` and
one builder per adapter ``name`` whose modules differ), so adding an engine
changes no adapter, and an adapter whose modules differ from the Llama-like
layout gets an entry in each engine's ``taps.py``. Likewise the contract keys
only some families have (soft caps, routing rules, per-layer RoPE bases) are
read by each engine's ``contract_extras.py`` (a ``contracts.ContractExtras``:
one reader per adapter ``name``), which calls the adapter's engine-neutral
helpers above (``layers``, ``attention``, ``embed``, ...).

Family modules (``qwen3.py``, ``llama.py``, ...) register their adapters on
import; ``FAMILIES`` fixes the import order, which is also the order demo
names are listed in. Lookups never import torch.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from logdiff.errors import InputError

DOCS = "docs/architectures.md"

#: family modules under probes/arch/, imported in this order on the first lookup
FAMILIES = ("qwen3", "llama", "qwen3_moe", "qwen2", "mistral", "llama3", "mixtral", "phi3", "gemma2", "gemma3",
            "glm4_moe", "deepseek_v2", "gpt_oss")

_ADAPTERS: dict[str, ArchAdapter] = {}
_DEMOS: dict[str, Demo] = {}
_loaded = False


class ArchAdapter:
    """The interface every adapter implements (``decoder.DecoderAdapter`` is the Llama-like one)."""

    architecture: str  # the HF ``architectures`` string, e.g. "Qwen3ForCausalLM"
    name: str  # short name, e.g. "qwen3"
    moe: bool

    def correspondence(self, config: Mapping[str, Any]) -> Any:
        """The ``correspondence.CorrespondenceMap`` of a model with this (HF) config (its boundaries; each
        engine's ``TapMapping`` finds them)."""
        raise NotImplementedError

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        """(contract keys, weight names) that the op at ``boundary`` reads."""
        raise NotImplementedError

    def configured(self, config: Any) -> ArchAdapter:
        """This adapter for one model's config (a dict or an HF config): where a contract key is read
        first can depend on the layout (``key_boundary``: the first MoE layer). Default: nothing to configure."""
        return self


def first_router_layer(adapter: ArchAdapter, config: Any, default: int) -> int:
    """The first layer holding a router in ``config``'s layout (the adapter's correspondence), else ``default``."""
    config = config.to_dict() if hasattr(config, "to_dict") else config
    try:
        boundaries = adapter.correspondence(config).boundaries
    except (AttributeError, KeyError, TypeError, ValueError):  # not a whole model config: the default layout
        return default
    return next((b.layer for b in boundaries if b.kind == "router" and b.layer is not None), default)


@dataclass(frozen=True)
class Demo:
    """A tiny demo config: ``logdiff demo-model --arch NAME``."""

    name: str  # the --arch value: HF model_type with '-' for '_' (or a variant: llama3)
    architecture: str  # the adapter it belongs to
    config_class: str  # transformers config class
    settings: Mapping[str, Any] = field(default_factory=dict)  # on top of demo/configs.py's common shape
    summary: str = ""  # one line for docs and --help

    @property
    def adapter(self) -> ArchAdapter:
        return adapter_for(self.architecture)


def register(adapter: ArchAdapter, *demos: Demo) -> ArchAdapter:
    """Add ``adapter`` (and its demo configs) to the registry; returns it."""
    _ADAPTERS[adapter.architecture] = adapter
    for demo in demos:
        register_demo(demo)
    return adapter


def register_demo(demo: Demo) -> Demo:
    _DEMOS[demo.name] = demo
    return demo


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for family in FAMILIES:
            importlib.import_module(f"logdiff.probes.arch.{family}")


def adapters() -> dict[str, ArchAdapter]:
    """Every registered adapter, by HF architecture string."""
    _load()
    return dict(_ADAPTERS)


def supported() -> list[str]:
    """The supported HF architecture strings, in registration order."""
    return list(adapters())


def find(architecture: str | None) -> ArchAdapter | None:
    """The adapter for ``architecture``, or None."""
    _load()
    return _ADAPTERS.get(architecture or "")


def adapter_for(architecture: str | None, where: str = "") -> ArchAdapter:
    """The adapter for ``architecture``; an ``InputError`` (exit 2) naming the nearest one otherwise."""
    found = find(architecture)
    if found is not None:
        return found
    names = supported()
    nearest = difflib.get_close_matches(str(architecture), names, n=1, cutoff=0.0)
    hint = f"; nearest supported: {nearest[0]}" if nearest else ""
    place = f" in {where}" if where else ""
    raise InputError(
        f"unsupported architecture {architecture!r}{place}{hint}; supported: {', '.join(names)}; "
        f"see {DOCS} to add one"
    )


def adapter_of(model: Any) -> ArchAdapter:
    """The adapter of a loaded model (HF or vLLM): its config's ``architectures``, else its class name."""
    archs = list(getattr(getattr(model, "config", None), "architectures", None) or [])
    for arch in [*archs, type(model).__name__]:
        found = find(arch)
        if found is not None:
            return found
    return adapter_for(archs[0] if archs else type(model).__name__)


def demos() -> dict[str, Demo]:
    """Every demo config, by ``--arch`` name, in registration order."""
    _load()
    return dict(_DEMOS)


def demo(name: str) -> Demo | None:
    _load()
    return _DEMOS.get(name)


def router_biases(model: Any) -> dict[int, Any]:
    """``{layer: correction bias}`` (float32 numpy) of a loaded model's routers (HF or vLLM layout, through the
    adapter's ``router_bias``); empty for a model without."""
    arch = adapter_of(model)
    reader = getattr(arch, "router_bias", None)
    if reader is None:
        return {}
    out = {}
    for n, layer in enumerate(arch.layers(model)):
        bias = reader(layer)
        if bias is not None:
            out[n] = bias.detach().float().cpu().numpy()
    return out
