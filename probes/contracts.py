"""What each engine actually computes with: the pieces both engines' contract readers share.

The semantic preflight compares each engine's effective contract and weight
fingerprints before any numerics. The readers live with their engines
(``logdiff/sources/hf/contract.py``, ``logdiff/sources/vllm/contract.py``); what
they share is here: the tensor ``fingerprint`` (dtype-exact), the sampler's
settings, how a norm spells its eps and how vLLM spells "no window", the
dtype a widened tensor is compared at, ``OFF`` (the value of a switched-off
feature) and ``ContractExtras``, the registry type of the keys only some
architectures have.

**Off is a value; None is "not read".** A feature a side switches off (no
sliding window, no soft cap) reads ``OFF`` (the string ``"off"``, so it
serialises into result.json as itself), and compares like any other value: off
on one side and on with a value on the other is a difference the preflight
names (``differs``). None is kept for a key a reader could not read at all
(its module or attribute is not where the engine's code keeps it): unknown,
never equal (``unknown``). Each key's off value, decided once:

* ``OFF``: ``sliding_window`` (HF: the config's active window is None; vLLM: the
  backend's None, -1 or (-1, -1)), ``attn_logit_softcapping`` and
  ``final_logit_softcapping`` (None or 0 on either side), a feature an
  implementation drops (``effective``), and Gemma 3's ``rope_local_base_freq``
  where no layer slides.
* an ordinary value that already means off, read explicitly: ``rope_type``
  ``default`` (no RoPE scaling), ``routed_scaling_factor`` 1.0, ``n_group`` /
  ``topk_group`` 1 / 1 (greedy top-k: ``expert_groups``), ``norm_topk_prob``
  False, ``sampling_top_k`` 0, ``sampling_top_p`` 1.0, ``temperature`` 1.0,
  ``layer_types`` ``full,...`` (no layer slides), ``tie_word_embeddings`` False.
* None on both sides where the model has no such part (``qk_norm_eps`` without
  q/k norms, the routing keys of a dense model, ``q_latent_norm_eps`` without a
  compressed q): equal, since both engines load one architecture.

Consumers that compute with a value (conformance's exact functions, the
override read-back) take ``applied(value)``: None where the feature is off.

**Per layer: what each layer computes, not the config key.** A key's effect
often depends on other keys: Qwen2's ``sliding_window`` acts only where
``use_sliding_window`` is set and only on the layers at or past
``max_window_layers`` (transformers 5 derives ``layer_types`` from the three;
vLLM 0.32 windows every layer only where every layer type is sliding); Gemma's
window only on its ``sliding_attention`` layers; Mistral's on every layer. So
both readers read the window each layer's attention masks (HF: the attention
module's ``sliding_window``, else the family's config rule; vLLM: each layer's
backend) and record it as two keys (``layer_keys``): ``layer_types``
(``sliding``/``full`` per layer) and ``sliding_window`` (the sliding layers'
width, ``OFF`` where no layer slides: a window set in the config but on no
layer is off). A key whose value differs between layers (a window per layer,
vLLM's RoPE base per layer) is a list with one value per layer
(``per_layer``). ``at_layer`` gives the contract as one layer computes with
it: its window (``OFF`` on a full layer), its type, its RoPE base (Gemma 3's
``rope_local_base_freq`` on a sliding layer). An op is compared and judged on
its layer's view, so a window that one side applies on layer 1 only is no
difference at layer 0's attention.

Values are read from the loaded modules, not from config files, because the
module is what runs: an ``hf_overrides`` eps shows up as the norm's
``variance_epsilon``, a weight-sync bug as a different hash of the loaded tensor.
Where the generic values sit in a module tree is the architecture adapter's
knowledge (``logdiff.probes.arch``: ``layers``, ``attention``, ``embed``, ...).
The keys only some architectures have (soft caps, routing rules, per-layer RoPE
bases) sit in places each engine's model code chooses, so each engine folder
holds one ``ContractExtras`` (``logdiff/sources/<engine>/contract_extras.py``):
a reader per adapter ``name``, called with the adapter and the loaded model. A
new engine brings its own registry (or extends its parent's) and changes no adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: one engine's reader of an architecture's own contract keys: ``(adapter, loaded model) -> {key: value}``
ContractReader = Callable[[Any, Any], dict[str, Any]]


@dataclass(frozen=True)
class ContractExtras:
    """The contract keys one engine reads for the architectures that have keys of their own.

    ``readers`` maps an adapter's ``name`` (``gemma2``, ``deepseek-v3``) to its
    reader; an adapter without an entry (every plain ``DecoderAdapter``) has no
    keys beyond the generic ones. A reader may call the adapter's engine-neutral
    helpers (``layers``, ``attention``, ``embed``, ...). Its keys are merged over
    the generic contract, so a reader may also correct a generic key.
    """

    readers: Mapping[str, ContractReader] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "readers", MappingProxyType(dict(self.readers)))

    def read(self, adapter: Any, model: Any) -> dict[str, Any]:
        """The keys of ``adapter``'s own reader on the loaded ``model``; {} for an adapter without one."""
        reader = self.readers.get(adapter.name)
        return dict(reader(adapter, model)) if reader is not None else {}

    def extended(self, readers: Mapping[str, ContractReader]) -> ContractExtras:
        """This registry with ``readers`` added or replaced: a derived engine's registry."""
        return ContractExtras({**self.readers, **readers})


#: the key of a contract a side could not read but declares (an msprobe dump: its config's), naming where from;
#: conformance judges such a side under it and says so, the preflight never compares it
DECLARED = "declared"


def fingerprint(tensor: Any) -> str:
    """A short hash of a tensor's bytes (dtype-exact: a 1-ulp change alters it): XXH3's 128 bits, 32 hex digits.

    A captured RL step hashes every weight of both sides (``sources/hf/capture.py``, ``sources/vllm/weights.py``),
    so the hash runs at memory speed: blake2b, which bundles written before held (16 hex digits), took 0.45 s for
    SmolLM2's 270 MB, XXH3 17 ms (bench/bench_trl_step.py). It guards against stale or wrong weights, not against
    an adversary: a fingerprint is never a proof. Fingerprints of two hashes are not compared (``same_hash``)."""
    import torch
    import xxhash

    raw = tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
    return xxhash.xxh3_128_hexdigest(memoryview(raw.numpy()))  # the bytes in place, not a copy


def same_hash(a: Any, b: Any) -> bool:
    """Whether two fingerprints (or prints made of them: ``q:...;s:...``, ``mixed:a/b``) were made by the same hash,
    read from their last run of hex digits: a bundle written before XXH3 holds blake2b's 16 digits, and its
    weights are then unverified against today's, never called different. What is no string (a damaged bundle's)
    is no fingerprint: unverified too."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False

    def digits(fingerprint: str) -> int:
        return len(fingerprint) - len(fingerprint.rstrip("0123456789abcdef"))

    return digits(a) == digits(b)


#: contract keys that name how a side computes, not what: never compared between engines
IMPLEMENTATION_KEYS = frozenset({"attn_implementation", "dropped"})

#: the value of a contracted feature a side switches off (a value, compared as one; None: not read)
OFF = "off"


def is_off(value: Any) -> bool:
    """Whether a contract value reads "switched off" (``OFF``)."""
    return isinstance(value, str) and value == OFF


def applied(value: Any) -> Any:
    """A contract value as a function takes it: None where the feature is off, else the value itself."""
    return None if is_off(value) else value


def off_if_none(value: Any) -> Any:
    """A feature read where the side's code keeps it, whose absence there means off (HF's config window)."""
    return OFF if value is None else value


def soft_cap(value: Any) -> Any:
    """A soft cap as either engine holds it: None or 0 mean none (``OFF``), else the cap as a float."""
    return float(value) if value else OFF


def effective(contract: dict[str, Any], drops: dict[str, str]) -> dict[str, Any]:
    """``contract`` with each feature the running implementation drops set to ``OFF``, and why under ``dropped``.

    A contracted feature an implementation silently ignores is not part of the
    function that side computes: its effective value is off, and the reason
    travels with the contract so the diagnosis can name it (docs/causes.md).
    """
    gone = {k: why for k, why in drops.items() if applied(contract.get(k)) is not None}
    if not gone:
        return contract
    return {**contract, **dict.fromkeys(gone, OFF), "dropped": gone}


def norm_eps(norm: Any) -> float | None:
    """A norm's eps (HF's Gemma norms call it ``eps``)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0))) if norm is not None else None


def sampler(options: dict[str, Any]) -> dict[str, Any]:
    """The sampler's settings: temperature, top-k (0: off) and top-p (1.0: off), whatever the logprobs mode.

    In RL these define the behaviour policy (the distribution the tokens were
    drawn from); the trainer's ratio is right only if it scores under the same one.
    """
    top_k = int(options.get("top_k", 0))
    return {
        "sampling_temperature": float(options.get("temperature", 1.0)),
        "sampling_top_k": top_k if top_k > 0 else 0,  # vLLM spells "off" as 0 or -1
        "sampling_top_p": float(options.get("top_p", 1.0)),
    }


def window_size(value: Any) -> int | str:
    """A vLLM attention backend's ``sliding_window`` as the number of keys a query sees, or ``OFF``.

    vLLM spells "no window" None, -1 or (-1, -1); the CPU backend holds the
    window itself, FlashAttention-like backends ``(window - 1, 0)`` (the keys
    left of the query's own).
    """
    if isinstance(value, (tuple, list)):
        left = int(value[0])
        return left + 1 if left >= 0 else OFF
    return OFF if value is None or int(value) < 0 else int(value)


def expert_groups(n_group: Any, topk_group: Any) -> tuple[int, int]:
    """``(n_group, topk_group)`` of the expert choice a router makes: ``(1, 1)`` where it keeps every group.

    Grouped top-k that keeps all ``n_group`` groups chooses exactly as greedy
    top-k does, so both engines' routing keys read as one group then, whatever
    their configs spell (vLLM routes DeepSeek-V2 grouped even where HF's
    ``topk_method: greedy`` ignores the groups).
    """
    groups, kept = int(n_group or 1), int(topk_group or 1)
    return (1, 1) if kept >= groups else (groups, kept)


def narrowest(tensor: Any, dtype: Any) -> Any:
    """``tensor`` in the model's ``dtype`` when it is wider and holds values of that dtype exactly.

    Engines keep some tensors in fp32 whatever the model dtype (vLLM's fp32 MoE gate,
    HF's fp32 ``e_score_correction_bias``), each its own choice: the same bf16 values
    read from the checkpoint then hash alike on both sides, while a value the model
    dtype cannot hold keeps its width and its difference.
    """
    if not tensor.is_floating_point() or tensor.dtype == dtype or tensor.element_size() <= dtype.itemsize:
        return tensor
    narrow = tensor.detach().to(dtype)
    return narrow if narrow.to(tensor.dtype).equal(tensor.detach()) else tensor


#: the contract keys read per layer: which layers slide, and how many keys a sliding layer's queries see
WINDOW_KEYS = ("sliding_window", "layer_types")


def per_layer(values: list[Any]) -> Any:
    """One value where every layer reads the same (the usual case), else the list of each layer's value;
    None where any layer could not be read."""
    if not values or any(v is None for v in values):
        return None
    return values[0] if all(v == values[0] for v in values) else list(values)


def layer_keys(windows: list[Any]) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` from the window each layer's attention masks (``OFF``: none, an
    int: the keys a query sees, None: not read): a window on no layer is ``OFF``, whatever the config says."""
    if not windows or any(w is None for w in windows):
        return dict.fromkeys(WINDOW_KEYS)
    widths = [w for w in windows if not is_off(w)]
    return {
        "layer_types": ",".join("full" if is_off(w) else "sliding" for w in windows),
        "sliding_window": OFF if not widths else widths[0] if len(set(widths)) == 1 else list(windows),
    }


def at_layer(contract: dict[str, Any], layer: int | None) -> dict[str, Any]:
    """``contract`` as layer ``layer`` computes with it: its layer type, its window (``OFF`` on a full layer), each
    per-layer list's own entry, and on a sliding layer Gemma 3's local RoPE base as its ``rope_theta``.

    A contract not read per layer (no ``layer_types``: a dump's declared contract, an older result) and a
    model-level op (``layer`` None) are returned as they are.
    """
    types = contract.get("layer_types") if contract else None
    if layer is None or not isinstance(types, str) or layer >= len(types.split(",")):
        return contract
    kinds = types.split(",")
    out = {k: v[layer] if isinstance(v, list) and len(v) == len(kinds) else v for k, v in contract.items()}
    out["layer_types"] = kinds[layer]
    if kinds[layer] != "sliding" and out.get("sliding_window") is not None:
        out["sliding_window"] = OFF
    local = out.pop("rope_local_base_freq", None)
    if kinds[layer] == "sliding" and applied(local) is not None:
        out["rope_theta"] = local
    return out
