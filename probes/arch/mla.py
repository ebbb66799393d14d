"""Multi-head latent attention (MLA, DeepSeek-V2/V3): its layer's boundaries, its replay, its consistent forward.

What every adapter of an MLA model shares (``deepseek_v2.DeepseekV2Adapter`` and V3 use it):
the boundaries of one decoder layer in semantic order (``mla_layer_boundaries``, with the
shared-experts MoE or a dense gated MLP after the attention), the boundaries of the functions
HF calls outside modules (``FUNCTION_BOUNDARIES``), the replay that runs HF's latent attention
on the other engine's inputs (``latent_attention_replay``) and the attention module's
``forward`` in consistent mode (``consistent_mla_forward``). The layer itself is described in
``deepseek_v2``'s docstring.

How the engines expose it, and the boundaries named after what they compute
(docs/result-schema.md):

* ``self_attn.q_proj.nope`` / ``.pe`` (or ``q_b_proj.nope`` / ``.pe``): each
  head's slice of the query projection, split by ``split_heads`` with the
  calling module's ``qk_nope_head_dim``/``qk_rope_head_dim`` (HF's attention,
  vLLM's MLA wrapper hold both);
* ``self_attn.kv_a_proj_with_mqa.compressed_kv`` / ``.k_pe``: the latent and
  the RoPE key before RoPE (vLLM: ``kv_lora`` split the same way; with a
  q-LoRA, vLLM fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` into
  ``fused_qkv_a_proj``, split into the three);
* ``self_attn.rope_q`` / ``rope_k``: RoPE on the RoPE parts only. HF calls
  ``apply_rotary_emb(q_pe, k_pe, freqs_cis)`` (the recorder wraps it,
  ``rope_function``); vLLM's ``rotary_emb`` returns the same pair;
* ``self_attn.latent_attn``: attention *from the latent*: ``kv_b_proj``'s
  up-projection plus softmax attention, output per head of ``v_head_dim``. It
  is one boundary because vLLM exposes nothing in between: its decode
  absorbs ``kv_b_proj`` into the query and output (no ``k_nope``/``v`` ever
  exist), and its prefill builds k and v inside the attention op. HF's
  attention function output and vLLM's ``MLAAttention`` output are the equal
  taps; ``kv_b_proj.weight`` is read here. The replay
  (``latent_attention_replay``) rebuilds HF's q, k, v from the other engine's
  four input boundaries, so the op's own error is separated from its inputs'.
* the MoE: ``mlp.gate`` (router logits), ``mlp.shared_experts.*`` (gate,
  up, act_mul, down, as a dense MLP; vLLM packs gate/up), ``mlp`` (routed
  sum plus the shared experts: vLLM's MoE runner returns only the total).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from logdiff.probes.correspondence import Boundary
from logdiff.probes.replay import ReplaySpec

#: suffixes of the boundaries a projection's output is split into (each reads the projection's weight)
SPLIT_PARTS = (".nope", ".pe", ".compressed_kv", ".k_pe")

FUNCTION_BOUNDARIES = {
    "rope_q": "model.layers.{N}.self_attn.rope_q",
    "rope_k": "model.layers.{N}.self_attn.rope_k",
    "attn_core": "model.layers.{N}.self_attn.latent_attn",
}


def latent_attention_replay(
    fn: Any, owner: Any, names: tuple[str, ...], q: Any, k: Any, v: Any, args: tuple, kwargs: dict, live: dict
) -> ReplaySpec | None:
    """HF's MLA attention on the other engine's ``(q nope, RoPE'd q, normed latent, RoPE'd k)``.

    Rebuilds what HF's attention module does between those boundaries and its
    attention function: ``q = [q_nope | rope_q]``, ``k, v = expand_kv(latent, rope_k)``
    (``kv_b_proj`` and the per-head split), then the live call's attention
    function with its mask and scale. Templates are the live tensors (``[B, heads,
    L, D]``; the latent as ``kv_a_layernorm`` emitted it), so the live values
    give back the live output exactly.
    """
    from logdiff.probes.align import HEADS_FIRST, PLAIN

    latent = live.get(names[2])
    if latent is None or not hasattr(owner, "expand_kv"):
        return None
    nope, batch, length = owner.qk_nope_head_dim, q.shape[0], q.shape[2]

    def run(xs: list[Any]) -> Any:
        import torch

        query = torch.cat((xs[0], xs[1]), dim=-1)
        key, value = owner.expand_kv(xs[2].reshape(batch, 1, length, -1), xs[3])
        return fn(owner, query, key, value, *args, **kwargs)[0]

    inputs = [
        (names[0], q[..., :nope], HEADS_FIRST),
        (names[1], q[..., nope:], HEADS_FIRST),
        (names[2], latent, PLAIN),
        (names[3], k[:, :1, :, nope:], HEADS_FIRST),
    ]
    return ReplaySpec(inputs, run, causal=True, method="attention")


def gated_mlp_boundaries(p: str, n: int, ln: str) -> list[Boundary]:
    """A gated MLP's boundaries under ``p`` (the dense layers' ``mlp``, the MoE's ``shared_experts``)."""
    return [
        Boundary(f"{p}.gate_proj", "linear", n, (ln,)),
        Boundary(f"{p}.up_proj", "linear", n, (ln,)),
        Boundary(f"{p}.act_mul", "act", n, (f"{p}.gate_proj", f"{p}.up_proj")),
        Boundary(f"{p}.down_proj", "linear", n, (f"{p}.act_mul",)),
    ]


def mla_layer_boundaries(n: int, q_lora: bool, sparse: bool) -> list[Boundary]:
    p, a = f"model.layers.{n}", f"model.layers.{n}.self_attn"
    res_in = "model.embed_tokens" if n == 0 else f"model.layers.{n - 1}.residual_mlp"
    ln_in = f"{p}.input_layernorm"
    out = [Boundary(ln_in, "norm", n, (res_in,))]
    if q_lora:
        out += [
            Boundary(f"{a}.q_a_proj", "linear", n, (ln_in,)),
            Boundary(f"{a}.q_a_layernorm", "norm", n, (f"{a}.q_a_proj",)),
        ]
        q, q_in = f"{a}.q_b_proj", f"{a}.q_a_layernorm"
    else:
        q, q_in = f"{a}.q_proj", ln_in
    kv = f"{a}.kv_a_proj_with_mqa"
    out += [
        Boundary(f"{q}.nope", "linear", n, (q_in,)),
        Boundary(f"{q}.pe", "linear", n, (q_in,)),
        Boundary(f"{kv}.compressed_kv", "linear", n, (ln_in,)),
        Boundary(f"{kv}.k_pe", "linear", n, (ln_in,)),
        Boundary(f"{a}.kv_a_layernorm", "norm", n, (f"{kv}.compressed_kv",)),
        Boundary(f"{a}.rope_q", "rope", n, (f"{q}.pe",)),
        Boundary(f"{a}.rope_k", "rope", n, (f"{kv}.k_pe",)),
        Boundary(
            f"{a}.latent_attn",
            "attn",
            n,
            (f"{q}.nope", f"{a}.rope_q", f"{a}.kv_a_layernorm", f"{a}.rope_k"),
            causal=True,
        ),
        Boundary(f"{a}.o_proj", "linear", n, (f"{a}.latent_attn",)),
        Boundary(f"{p}.residual_attn", "add", n, (res_in, f"{a}.o_proj")),
        Boundary(f"{p}.post_attention_layernorm", "norm", n, (f"{p}.residual_attn",)),
    ]
    ln = f"{p}.post_attention_layernorm"
    if sparse:
        shared = f"{p}.mlp.shared_experts"
        out += [Boundary(f"{p}.mlp.gate", "router", n, (ln,))]
        out += gated_mlp_boundaries(shared, n, ln)
        out += [Boundary(f"{p}.mlp", "moe", n, (ln, f"{shared}.down_proj"))]
        mlp_out = f"{p}.mlp"
    else:
        out += gated_mlp_boundaries(f"{p}.mlp", n, ln)
        mlp_out = f"{p}.mlp.down_proj"
    out.append(Boundary(f"{p}.residual_mlp", "add", n, (f"{p}.residual_attn", mlp_out)))
    return out


def consistent_mla_forward(module: Any, style: str, consistent_rope: Callable[[Any], bool]) -> Callable:
    """An MLA attention module's ``forward`` (DeepSeek-V2/V3): HF's own computation, with RoPE on the kernel.

    The same steps as HF's ``DeepseekV2Attention``/``DeepseekV3Attention.forward``, each through the
    module's own (patched) children: ``q_proj`` (or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``),
    ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` (the latent) and ``k_pe``, the cache update on the latent,
    ``expand_kv`` (``kv_b_proj`` up-projects every cached latent: the ``linear`` kernel, row by row), then the
    attention function (the consistent one: q/k heads ``qk_nope + qk_rope``, v heads ``v_head_dim``) and
    ``o_proj``. Only the RoPE call differs: HF's own (``apply_rotary_emb``'s complex multiply in V2,
    ``apply_rotary_pos_emb_interleave`` in V3) is replaced by ``rope_apply`` on the tagged cos/sin of the
    patched rotary module, in the adapter's style (interleaved pairs, kept interleaved as vLLM keeps them:
    V3's de-interleaving permutes q and k alike, so it is the same model). Installed with the ``rope``
    family, which patches the rotary module (``consistent_rope(cos)``: whether ``cos`` is its table).
    """
    import sys

    import torch

    from logdiff import kernels

    modeling = sys.modules[type(module).__module__]
    nope, rope = int(module.qk_nope_head_dim), int(module.qk_rope_head_dim)

    def forward(
        hidden_states: Any,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        cos, sin = position_embeddings if isinstance(position_embeddings, tuple) else (None, None)
        if not consistent_rope(cos) or cos.shape[-1] != rope:
            raise NotImplementedError("consistent_hf: MLA attention without the consistent rotary module's cos/sin")
        b, t = hidden_states.shape[:-1]
        if module.q_lora_rank is None:
            q = module.q_proj(hidden_states)
        else:
            q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
        q_nope, q_pe = torch.split(q.view(b, t, -1, module.qk_head_dim).transpose(1, 2), [nope, rope], dim=-1)
        latent, k_pe = torch.split(module.kv_a_proj_with_mqa(hidden_states), [module.kv_lora_rank, rope], dim=-1)
        latent = module.kv_a_layernorm(latent).view(b, 1, t, module.kv_lora_rank)
        c, s = cos[..., : rope // 2].unsqueeze(1), sin[..., : rope // 2].unsqueeze(1)
        q_pe = kernels.rope_apply(q_pe, c, s, style)
        k_pe = kernels.rope_apply(k_pe.view(b, 1, t, rope), c, s, style)
        if past_key_values is not None:
            latent, k_pe = past_key_values.update(latent, k_pe, module.layer_idx)
        key, value = module.expand_kv(latent, k_pe)
        attend = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            module.config._attn_implementation, modeling.eager_attention_forward
        )
        out, weights = attend(
            module,
            torch.cat((q_nope, q_pe), dim=-1),
            key,
            value,
            attention_mask,
            dropout=0.0 if not module.training else module.attention_dropout,
            scaling=module.scaling,
            **kwargs,
        )
        return module.o_proj(out.reshape(b, t, -1).contiguous()), weights

    return forward
