"""Which value in each engine is which boundary, per architecture, in semantic order.

A *boundary* is one value both paths compute, named after the HF module that
computes it or, for the ops HF calls as plain functions (RoPE, the attention
core), a documented synthetic name (docs/result-schema.md); the residual
adds are ``model.layers.N.residual_attn``/``residual_mlp``, the gated
activation ``model.layers.N.mlp.act_mul``, then ``logits`` and ``log_softmax``.

A ``CorrespondenceMap`` lists the boundaries in *semantic execution order*
(the order the math happens in one token's forward, not the order hooks fire
in, and never alphabetical), each with the boundaries that feed it; that is what
"first divergence" and "inputs equal" are measured against. It also holds
``functions`` (the boundaries HF computes in plain functions the recorder wraps)
and the config it was built from. It names no engine.

The boundaries come from the architecture adapters (probes/arch/); *where* an
engine's modules expose them (its ``Tap``s) is the engine's own knowledge: each
engine folder's ``taps.py`` (``logdiff/sources/hf/taps.py``,
``logdiff/sources/vllm/taps.py``) holds one ``TapMapping``, a default builder for
the Llama-like ``DecoderAdapter`` plus one builder per adapter ``name`` that
differs, each called with the adapter and the map's config. A new engine brings
its own mapping (or extends its parent's: ``TapMapping.extended``) and changes no
adapter. For an architecture without an adapter, ``fallback`` builds an unmapped
map and every ``TapMapping`` hooks every leaf module under its own name;
boundaries whose names exist on only one side are reported as unaligned and the
order is the observed execution order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: kinds of boundary; replay in replay.py dispatches on them
KINDS = ("embed", "linear", "norm", "rope", "attn", "act", "add", "router", "moe", "logits", "log_softmax", "module")


@dataclass(frozen=True)
class Boundary:
    """One value both paths compute."""

    name: str
    kind: str
    layer: int | None
    inputs: tuple[str, ...] = ()  # the boundaries this one is computed from
    causal: bool = False  # also reads its inputs at every earlier position (attention)


@dataclass(frozen=True)
class Tap:
    """Where one engine exposes boundaries.

    ``pattern`` matches the module's call-stack name (``N`` captures the layer).
    ``source`` is ``output`` (forward hook) or ``input`` (first positional
    argument, pre-hook). ``select`` says how to pull tensors out of that value:
    ``tensor``, ``first`` (element 0 of a tuple), ``pair`` (both elements of a
    2-tuple), ``norm_pair`` (a tensor, or ``(normed, residual)``),
    ``split_qkv`` (q/k/v sizes from the attention module), ``split_half``,
    ``split:a,b`` (the last dim in parts sized by the calling module's attributes
    ``a``, ``b``: MLA's ``kv_lora_rank``, ``qk_rope_head_dim``), ``split_heads:a,b``
    (each head's slice in such parts: MLA's no-position and RoPE parts of q),
    ``pair_deinterleaved`` (a pair, each with its even lanes then its odd lanes:
    vLLM's GPT-J RoPE output in the layout HF's DeepSeek-V3 ``rope_interleave`` returns),
    ``logits_field`` (the ``logits`` of a model output), ``heads_first`` (a
    tensor in HF's attention layout ``[B, heads, L, D]``: Gemma 3's q/k norms).
    ``names`` are format strings (``{N}``, ``{RES_IN}``: the residual stream
    entering layer N, ``{PREV_RES}``: layer N-1's ``residual_mlp`` or nothing
    for N = 0, ``{LAST_RES}``: the last layer's). ``emit=False`` keeps the
    value only as context for replays in the same layer.
    """

    pattern: str
    source: str
    select: str
    names: tuple[str, ...]
    emit: bool = True

    def regex(self) -> re.Pattern[str]:
        return re.compile("^" + self.pattern.replace("{N}", r"(?P<N>\d+)") + "$")


@dataclass
class CorrespondenceMap:
    """Boundaries in semantic order, for one model config (engines find them with their ``TapMapping``)."""

    architecture: str
    boundaries: list[Boundary]
    num_layers: int
    mapped: bool = True  # False for the name-matching fallback
    config: Mapping[str, Any] = field(default_factory=dict)  # the HF config the map was built from
    functions: dict[str, str] = field(default_factory=dict)  # role (rope_q, rope_k, attn_core) -> "...{N}..."
    rope_function: str = "apply_rotary_pos_emb"  # the modeling module's RoPE function the HF recorder wraps
    #: the adapter's replay of an attention core not fed by q/k/v boundaries (MLA), or None;
    #: called as ``(fn, owner, inputs, q, k, v, args, kwargs, live)`` (``live``: this layer's HF values)
    attention_replay: Callable[..., Any] | None = None
    _index: dict[str, Boundary] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {b.name: b for b in self.boundaries}

    def get(self, name: str) -> Boundary | None:
        return self._index.get(name)

    def function_boundary(self, role: str, layer: int) -> str | None:
        """The boundary HF's wrapped function ``role`` yields in ``layer``, or None when unmapped."""
        template = self.functions.get(role)
        return template.format(N=layer) if template is not None else None

    @property
    def order(self) -> list[str]:
        return [b.name for b in self.boundaries]

    def names_for(self, tap: Tap, layer: int | None, name: str = "") -> list[str | None]:
        """The boundary names a tap yields for a call in ``layer`` (``name``: the module's name)."""
        out: list[str | None] = []
        for template in tap.names:
            if "{PREV_RES}" in template:
                out.append(None if not layer else f"model.layers.{layer - 1}.residual_mlp")
            elif "{RES_IN}" in template:
                embed = next(b.name for b in self.boundaries if b.kind == "embed")  # the adapter's name for it
                out.append(embed if not layer else f"model.layers.{layer - 1}.residual_mlp")
            elif "{LAST_RES}" in template:
                out.append(f"model.layers.{self.num_layers - 1}.residual_mlp")
            elif "{name}" in template:
                out.append(FALLBACK_RENAMES.get(name, name))
            else:
                out.append(template.format(N=layer))
        return out


#: the fallback names HF's ``lm_head`` output like the synthetic boundary vLLM's logits processor feeds
FALLBACK_RENAMES = {"lm_head": "logits"}

#: an unmapped map's taps on every engine: each module's (first) output under the module's own name
LEAF_TAPS = (Tap(r"(?P<name>.+)", "output", "first", ("{name}",)),)

#: an engine's taps for one adapter and one model config: ``(adapter, config) -> taps``
TapBuilder = Callable[[Any, Mapping[str, Any]], Sequence[Tap]]


@dataclass(frozen=True)
class TapMapping:
    """Where one engine's modules expose the adapters' boundaries.

    ``default`` builds the taps of an adapter with no entry in ``builders`` (the
    Llama-like ``DecoderAdapter``); ``builders`` maps an adapter's ``name``
    (``gemma2``, ``deepseek-v3``) to its own builder. Builders read only the
    adapter's engine-neutral attributes (``moe_block``, ...) and the config.
    """

    default: TapBuilder
    builders: Mapping[str, TapBuilder] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "builders", MappingProxyType(dict(self.builders)))

    def taps(self, cmap: CorrespondenceMap) -> list[Tap]:
        """This engine's taps for ``cmap``: the leaf taps for an unmapped map, else its adapter's builder's."""
        if not cmap.mapped:
            return list(LEAF_TAPS)
        from logdiff.probes.arch import find

        adapter = find(cmap.architecture)
        if adapter is None:
            raise LookupError(f"no adapter registered for {cmap.architecture!r}: its taps are unknown")
        return list(self.builder_for(adapter.name)(adapter, cmap.config))

    def builder_for(self, name: str) -> TapBuilder:
        """The builder of the adapter called ``name`` (the default where it has none of its own)."""
        return self.builders.get(name, self.default)

    def extended(self, builders: Mapping[str, TapBuilder], default: TapBuilder | None = None) -> TapMapping:
        """This mapping with ``builders`` added or replaced (and another ``default``): a derived engine's mapping."""
        return TapMapping(default or self.default, {**self.builders, **builders})


class _AdapterMaps(Mapping[str, Callable[[str, dict[str, Any]], CorrespondenceMap]]):
    """HF architecture -> map builder, read from the registered adapters (probes/arch/) on use."""

    def _builders(self) -> dict[str, Callable[[str, dict[str, Any]], CorrespondenceMap]]:
        from logdiff.probes.arch import adapters

        return {arch: (lambda _a, c, ad=ad: ad.correspondence(c)) for arch, ad in adapters().items()}

    def __getitem__(self, architecture: str) -> Callable[[str, dict[str, Any]], CorrespondenceMap]:
        return self._builders()[architecture]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders())

    def __len__(self) -> int:
        return len(self._builders())


MAPS: Mapping[str, Callable[[str, dict[str, Any]], CorrespondenceMap]] = _AdapterMaps()


def build(architecture: str, config: dict[str, Any]) -> CorrespondenceMap | None:
    """The map for an HF architecture class, or None when there is none."""
    builder = MAPS.get(architecture)
    return builder(architecture, config) if builder is not None else None


def fallback(architecture: str, config: dict[str, Any]) -> CorrespondenceMap:
    """Name-matching map: every leaf module's (first) output under its own name.

    The boundary list starts empty; the recorder adds names in the order it
    observes them. The map holds no taps: every engine's ``TapMapping`` gives an
    unmapped map ``LEAF_TAPS``. ``log_softmax`` and ``logits`` keep their engine-level taps.
    """
    n_layers = int(config.get("num_hidden_layers", 0) or 0)
    return CorrespondenceMap(architecture, [], n_layers, mapped=False, config=config)


def layer_of(name: str) -> int | None:
    """The decoder layer index in a boundary name, or None."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None
