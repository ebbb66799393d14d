"""The contract a dump's side is judged under: the one ``--model``'s config declares.

A dump holds no contract: eps, the RoPE table and the attention scale are read from a live model, and msprobe
writes tensors only. Conformance still judges each op against an exact function, the one the config declares,
read as the HF engine reads a model (``sources.hf.contract.hf_contract``) from the config's model built on the
meta device (no weights, no memory). That is sound either way: a side within its rounding bound of the declared
function computes it; a side outside it computes another function, a framework difference, whatever value it
ran with. What stays unknown is which value differs (which eps), and the evidence says the contract was
declared, not read (``probes.contracts.DECLARED``). The preflight never sees a declared contract: two sides declared alike are
not evidence that they ran alike.
"""

from __future__ import annotations

from typing import Any

from logdiff.probes.contracts import DECLARED

#: where a dump's contract is declared, as the evidence quotes it
SOURCE = "--model's config.json (the dump holds no contract)"


def declared_contract(config: dict[str, Any], dtype: str | None) -> dict[str, Any] | None:
    """The contract ``config`` declares, computed in ``dtype`` (the dump's own); None where transformers cannot
    build the config's model (the comparison then names each op's missing value, as before)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from logdiff.sources.hf.contract import hf_contract

        settings = {k: v for k, v in config.items() if k != "model_type"}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **settings))
        contract = hf_contract(model, {})
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build: nothing declared
        return None
    return {**contract, "dtype": dtype or contract["dtype"], DECLARED: SOURCE}
