"""The demo Qwen3 (and Qwen3-MoE) as a megatron-core ``GPTModel`` of the local spec, with the HF weights.

``megatron_config`` maps the HF config to a ``TransformerConfig`` (RMSNorm, q/k norms, gated SiLU, no biases,
RoPE at the HF theta, dropout off, fusions off, fp32, CPU initialization); ``build`` makes the model for this
rank's parallel state and loads the HF checkpoint through logdiff's mapping (``weights.hf_to_megatron``),
each tensor-parallel weight sliced by its own ``partition_dim`` / ``partition_stride`` and each rank's local
experts picked by their global index.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def hf_state(model_dir: Path) -> dict[str, Any]:
    """The HF checkpoint's tensors in float32, fused experts as transformers 5 holds them in memory."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def megatron_config(hf: dict[str, Any], tp: int = 1, sp: bool = False, pp: int = 1, ep: int = 1,
                    dispatcher: str = "allgather"):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if hf.get("num_experts") or hf.get("num_local_experts"):
        moe = {"num_moe_experts": int(hf.get("num_experts") or hf["num_local_experts"]),
               "moe_router_topk": int(hf["num_experts_per_tok"]), "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
               "moe_token_dispatcher_type": dispatcher, "moe_router_load_balancing_type": "none",
               "expert_model_parallel_size": ep, "moe_aux_loss_coeff": 0.0}
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"], ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, sequence_parallel=sp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32 if pp > 1 else None, **moe)


def build(model_dir: Path, tp: int = 1, sp: bool = False, pp: int = 1, ep: int = 1, dispatcher: str = "allgather"):
    """This rank's ``GPTModel`` (eval mode) holding the demo model's weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from logdiff.sources.megatron.names import Geometry
    from logdiff.sources.megatron.weights import hf_to_megatron, shard_of

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = megatron_config(hf, tp, sp, pp, ep, dispatcher)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    stage, stages = ps.get_pipeline_model_parallel_rank(), pp
    model = GPTModel(cfg, spec, vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                     position_embedding_type="rope", rotary_base=int(hf["rope_parameters"]["rope_theta"]),
                     share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
                     pre_process=stage == 0, post_process=stage == stages - 1).eval()
    logical = hf_to_megatron(hf_state(Path(model_dir)), Geometry.of(cfg, 1), cfg.num_layers)
    layers = [m for m in model.modules() if type(m).__name__ == "TransformerLayer"]
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank, local_experts = ps.get_expert_model_parallel_rank(), (cfg.num_moe_experts or 0) // ep
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(layers[int(parts[2])].layer_number) - 1)
                if "local_experts" in parts:
                    i = parts.index("local_experts") + 1
                    parts[i] = str(ep_rank * local_experts + int(parts[i]))
                key = ".".join(parts)
            t = logical[key]
            if getattr(param, "tensor_model_parallel", False) and tp > 1 and getattr(param, "allreduce", True):
                t = shard_of(t, int(param.partition_dim), int(getattr(param, "partition_stride", 1)), tp_rank, tp)
            param.copy_(t)
    return model
