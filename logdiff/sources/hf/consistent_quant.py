"""Consistent mode against a quantized rollout: the trainer's linears computed as the INT8 engine computes them.

A bf16 trainer and an INT8 W8A8 rollout engine differ by the quantization itself, which no kernel choice
removes. In consistent mode the trainer's forward can instead apply the *same* quantization with the same
kernel the engine runs there (``sources/vllm/consistent_int8.py``): every ``nn.Linear`` the scheme targets
runs ``kernels.fake_quant_linear`` on its own bf16 weight, i.e. ``kernels.int8_linear`` of
``quantize_weight(weight)`` (the weights the quantized checkpoint holds, bit for bit, when it was written
from these weights) on activations quantized per token. Both sides then compute the same function in the
same order, and the logprobs are bitwise equal (logdiff = 0) at the cost of the quantization's own error
on the trainer's side.

For training the backward through the fake quantization is a straight-through estimator
(``kernels/int8.py``, docs/kernels.md): gradients flow to the bf16 weights as if unrounded.

``quantization`` is the scheme name ``"int8-w8a8"`` (compressed-tensors' defaults: every ``Linear`` but
``lm_head``) or the rollout checkpoint's ``quantization_config`` (``quant_method: compressed-tensors``; its
config groups must be the INT8 W8A8 scheme targeting ``Linear``; its ``ignore`` list is honoured: names,
a module's last name parts, or ``re:`` patterns). Anything else raises ``NotImplementedError`` naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from logdiff.probes.quantization import ignores

INT8_W8A8 = "int8-w8a8"


def _int8_args(args: dict[str, Any] | None, strategy: str, dynamic: bool) -> bool:
    return bool(args) and (
        int(args.get("num_bits", 0)) == 8 and args.get("type") == "int" and args.get("symmetric", True)
        and args.get("strategy") == strategy and bool(args.get("dynamic")) == dynamic
    )  # fmt: skip


def targeted_linears(model: Any, quantization: str | dict[str, Any]) -> list[tuple[str, Any]]:
    """The ``(name, nn.Linear)`` of ``model`` that ``quantization`` quantizes (see the module docstring)."""
    import torch.nn as nn

    if isinstance(quantization, str):
        if quantization != INT8_W8A8:
            raise NotImplementedError(f"consistent mode has no quantized kernel for the scheme {quantization!r}")
        ignore = ["lm_head"]
    else:
        if quantization.get("quant_method") != "compressed-tensors":
            raise NotImplementedError(f"consistent mode: quant_method {quantization.get('quant_method')!r}")
        groups = list((quantization.get("config_groups") or {}).values())
        for g in groups:
            if list(g.get("targets") or []) != ["Linear"] or not (
                _int8_args(g.get("weights"), "channel", False) and _int8_args(g.get("input_activations"), "token", True)
            ):
                raise NotImplementedError("consistent mode covers only the INT8 W8A8 scheme (int8 per-channel "
                                          "weights, dynamic per-token activations) targeting Linear")  # fmt: skip
        if not groups:
            raise NotImplementedError("consistent mode: a quantization_config without config groups")
        ignore = [str(x) for x in quantization.get("ignore") or []]
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not ignores(ignore, n)]


def _forward(module: Any) -> Any:
    from logdiff.kernels.int8 import fake_quant_linear

    def forward(x: Any) -> Any:
        return fake_quant_linear(x, module.weight, module.bias)

    return forward


@contextlib.contextmanager
def consistent_quantized(model: Any, quantization: str | dict[str, Any]) -> Iterator[list[str]]:
    """Inside the block, every linear ``quantization`` targets runs ``fake_quant_linear``; yields their names.

    Entered inside ``consistent_hf`` (its linear forwards are replaced on top of the consistent ones and
    put back first), so the rest of the model keeps the consistent kernels."""
    from logdiff.kernels import kernel_caches
    from logdiff.probes.patching import Patches

    linears = targeted_linears(model, quantization)
    with Patches() as patches, kernel_caches():
        for _, module in linears:
            patches.set(module, "forward", _forward(module))
        yield [name for name, _ in linears]
