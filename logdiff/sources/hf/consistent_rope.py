"""Consistent mode's RoPE for HF models: the rope parameters, the rotary forward, ``apply_rotary_pos_emb``.

``rope_params_of`` reads an HF rotary module's ``RopeParams`` (one per layer type for Gemma 3)
and checks each against the module's ``inv_freq`` buffer, so a rope the kernel would compute
differently (another type, a config HF read otherwise) is refused before anything is patched.
The rotary module's replacement forward (``rotary_forward``) takes cos/sin from the kernel's
shared table and tags them (``_ROPE_TAG``); the modeling module's ``apply_rotary_pos_emb``
(``apply_rotary``) rotates with the kernel only when handed tagged cos/sin, and calls the
original otherwise, so one process-wide patch serves models inside and outside consistent
mode. An MLA adapter's forward asks ``is_consistent_rope`` the same question. Installed by
``consistent.consistent_hf``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ROPE_TAG = "_logdiff_consistent_rope"


def rope_params_of(module: Any) -> dict[str | None, Any]:
    """``{layer type: RopeParams}`` of an HF rotary module, each checked against its inv_freq buffer.

    A module with one rope gives one entry under ``None``; Gemma 3's computes cos/sin per layer type
    (``forward(x, position_ids, layer_type)``, ``{type}_inv_freq``, ``rope_parameters[type]``).
    """
    config = module.config
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(module, "layer_types", None)
    if not types:
        if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
            params = {**params, "rope_theta": config.rope_theta}
        buffer = getattr(module, "original_inv_freq", module.inv_freq)
        scaling = getattr(module, "attention_scaling", 1.0)
        return {None: _checked_rope(getattr(module, "rope_type", "default"), scaling, params, buffer)}
    return {
        t: _checked_rope(
            module.rope_type[t],
            getattr(module, f"{t}_attention_scaling", 1.0),
            params.get(t) or {},
            getattr(module, f"{t}_original_inv_freq", getattr(module, f"{t}_inv_freq")),
        )
        for t in types
    }


#: HF ``rope_parameters`` keys of each covered scaled rope type -> their default (None: required), as HF
#: reads them; each fills the ``RopeParams`` field of its name
_ROPE_FIELDS: dict[str, dict[str, Any]] = {
    "llama3": dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "linear": {"factor": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32, "beta_slow": 1, "truncate": True},
}


def _checked_rope(rope_type: str, scaling: float, params: dict, buffer: Any) -> Any:
    """The ``RopeParams`` of one HF rope (``params``: its ``rope_parameters``), whose inv_freq ``buffer``
    must be what the kernel computes from them (``kernels.rope.inv_freq_matches``). yarn's cos/sin factor
    is the module's ``attention_scaling`` (HF resolves it from the config)."""
    from logdiff.kernels import RopeParams
    from logdiff.kernels.rope import inv_freq_matches, rope_attention_scaling

    if rope_type != "default" and rope_type not in _ROPE_FIELDS:
        raise NotImplementedError(
            f"consistent_hf: rope_type {rope_type!r} (covered: default, {', '.join(_ROPE_FIELDS)})"
        )
    theta = params.get("rope_theta")
    if theta is None:
        raise NotImplementedError("consistent_hf: cannot find rope_theta in the config")
    wanted = _ROPE_FIELDS.get(rope_type, {})
    missing = [k for k, default in wanted.items() if default is None and params.get(k) is None]
    if missing:
        raise NotImplementedError(f"consistent_hf: rope_type {rope_type!r} without {', '.join(missing)} in the config")
    fields = {k: default if params.get(k) is None else params[k] for k, default in wanted.items()}
    if rope_type == "yarn":
        fields["attention_factor"] = float(scaling)
    try:
        rope = RopeParams(float(theta), 2 * buffer.numel(), rope_type, **fields)
    except ValueError as e:
        raise NotImplementedError(f"consistent_hf: {e}") from None
    if float(scaling) != rope_attention_scaling(rope):
        raise NotImplementedError(f"consistent_hf: rope_type {rope_type!r} with attention scaling {float(scaling)}")
    if not inv_freq_matches(rope, buffer):
        raise NotImplementedError(
            f"consistent_hf: the rotary module's inv_freq is not what its rope_parameters give ({rope_type} rope)"
        )
    return rope


def rotary_forward(ropes: dict[str | None, Any]) -> Callable:
    """The rotary module's ``forward``: cos/sin from the table of the calling layer type's rope (Gemma 3 asks
    per ``layer_type``; other families have one rope, under ``None``)."""
    import torch

    from logdiff import kernels

    def forward(x: Any, position_ids: Any, layer_type: str | None = None) -> tuple[Any, Any]:
        if layer_type not in ropes:
            raise NotImplementedError(f"consistent_hf: no RoPE for layer type {layer_type!r}")
        cos, sin = kernels.rope_cos_sin(position_ids, ropes[layer_type])
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # HF's [.., rotary_dim] layout
        setattr(cos, _ROPE_TAG, True)
        setattr(sin, _ROPE_TAG, True)
        return cos, sin

    return forward


def apply_rotary(original: Callable) -> Callable:
    """``apply_rotary_pos_emb`` that rotates with the kernel when handed tagged (consistent) cos/sin."""
    import inspect

    from logdiff import kernels

    signature = inspect.signature(original)

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not getattr(cos, _ROPE_TAG, False):
            return original(q, k, cos, sin, *args, **kwargs)
        bound = signature.bind(q, k, cos, sin, *args, **kwargs)
        bound.apply_defaults()
        unsqueeze_dim = bound.arguments.get("unsqueeze_dim", 1)
        half = cos.shape[-1] // 2
        c = cos[..., :half].unsqueeze(unsqueeze_dim)
        s = sin[..., :half].unsqueeze(unsqueeze_dim)
        return kernels.rope_apply(q, c, s, "neox"), kernels.rope_apply(k, c, s, "neox")

    return apply_rotary_pos_emb


def is_consistent_rope(cos: Any) -> bool:
    """Whether ``cos`` came from a rotary module this installer patched (its tables are the kernel's)."""
    return bool(getattr(cos, _ROPE_TAG, False))
