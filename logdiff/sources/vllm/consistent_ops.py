"""Replacement forwards that route vLLM's operators through ``logdiff.kernels``.

Each factory takes one live vLLM object and returns the callable that
``consistent_vllm`` installs in its place (as an instance attribute, so the
class and every other instance stay untouched). They reproduce the exact
calling convention of what they replace, and the HF semantics the kernels
implement:

* ``linear_gemm``: replaces ``layer.cpu_linear(x, weight, bias)``, which
  ``UnquantizedLinearMethod.apply`` and ``UnquantizedEmbeddingMethod.apply``
  (the lm_head) call through ``cpu_unquantized_gemm``.
* ``rms_norm_forward``: ``RMSNorm.forward(x, residual=None)``; with a residual
  it returns ``(norm(x + residual), x + residual)`` like the fused op.
* ``gemma_rms_norm_forward``: the same for ``GemmaRMSNorm`` (``(1 + w)``).
* ``rope_forward``: ``RotaryEmbedding.forward(positions, query, key)``, also
  ``Llama3RotaryEmbedding``'s, ``LinearScalingRotaryEmbedding``'s (one factor) and
  ``YaRNScalingRotaryEmbedding``'s and DeepSeek's ``DeepseekScalingRotaryEmbedding`` (their ``mscale`` on
  cos/sin); the rope's ``kernels.RopeParams`` are read from
  the module and checked against its own ``_compute_inv_freq`` (``rope_params_of``).
* ``gated_mul_forward``: ``SiluAndMul.forward(x)`` on ``[..., 2d]``, and
  ``GeluAndMul(approximate="tanh")`` alike.
* ``softcapped_logits_forward``: ``LogitsProcessor.forward`` with a soft cap
  (Gemma 2): vLLM's own ``_get_logits`` (its lm_head GEMM is already the
  kernel's), then ``softcap``.
* ``attention_forward``: ``CPUAttentionBackendImpl.forward`` (and, with FlashAttention's
  cache reader, ``FlashAttentionImpl.forward``: the ``cuda`` backend); reads each
  request's whole context back from the paged cache and runs the kernel with
  absolute query positions, all requests of the step in one padded batch
  (soft-capped scores where the layer has ``logits_soft_cap``; the layer's
  ``sliding_window`` masked by the kernel, and the cache slots before a
  request's first window zeroed: vLLM may have freed those blocks).
* ``mla_forward_impl``: ``MLAAttention.forward_impl`` (DeepSeek MLA); reads
  each request's latent and RoPE'd ``k_pe`` back from the paged latent cache
  and runs ``kernels.latent_attention`` (the explicit ``kv_b_proj``
  up-projection, then the attention kernel), decode and prefill alike.
* ``moe_forward``: ``MoERunner.forward``; router GEMM (``linear``; on fp32 rows
  for a router with a correction bias, as HF),
  ``moe_route`` (or ``moe_route_grouped``: sigmoid, groups, correction
  bias, routed scaling), then ``moe_experts`` (kernel linears and SiLU-and-mul per
  expert, fixed-order ``moe_combine``) on the recovered plain expert weights,
  plus the shared expert (a gated MLP whose own layers are patched) added last.
* ``log_softmax``: ``Sampler.compute_logprobs(logits)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _kernels() -> Any:
    from logdiff import kernels

    return kernels


def linear_gemm(weight: Any, output_sizes: Any = None) -> Callable[..., Any]:
    """``cpu_linear`` replacement bound to the recovered plain weight.

    A packed weight (``qkv_proj``, ``gate_up_proj``) is computed part by part,
    which is what ``kernels.linear(..., output_sizes=...)`` does; the parts are
    split once here so that the kernel's fp32 weight cache keeps hitting.
    """
    kernels = _kernels()
    parts = [weight] if not output_sizes or len(output_sizes) < 2 else list(weight.split(list(output_sizes)))
    parts = [p.contiguous() for p in parts]

    def gemm(x: Any, _weight: Any, bias: Any = None) -> Any:
        biases = [None] * len(parts) if bias is None else bias.to(weight.dtype).split([p.shape[0] for p in parts])
        outs = [kernels.linear(x, p, b) for p, b in zip(parts, biases)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    return gemm


def rms_norm_forward(module: Any) -> Callable[..., Any]:
    """``RMSNorm.forward`` replacement (HF order: add, round, then normalise)."""
    kernels = _kernels()
    weight = module.weight.data
    eps = float(module.variance_epsilon)

    def forward(x: Any, residual: Any = None) -> Any:
        if residual is None:
            return kernels.rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps, residual=residual)

    return forward


def gemma_rms_norm_forward(module: Any) -> Callable[..., Any]:
    """``GemmaRMSNorm.forward`` replacement: ``(1 + w)`` in fp32, with or without the fused residual add."""
    kernels = _kernels()
    weight = module.weight.data
    eps = float(module.variance_epsilon)

    def forward(x: Any, residual: Any = None) -> Any:
        return kernels.gemma_rms_norm(x, weight, eps, residual=residual)

    return forward


#: vLLM rotary class -> (HF rope_type, the RopeParams scaling fields and the module attribute each is read from)
_VLLM_ROPES: dict[str, tuple[str, dict[str, str]]] = {
    "RotaryEmbedding": ("default", {}),
    "Llama3RotaryEmbedding": (
        "llama3",
        {
            "factor": "scaling_factor",
            "low_freq_factor": "low_freq_factor",
            "high_freq_factor": "high_freq_factor",
            "original_max_position_embeddings": "orig_max_position",
        },
    ),
    "LinearScalingRotaryEmbedding": ("linear", {}),  # its one factor: scaling_factors[0]
    "YaRNScalingRotaryEmbedding": (
        "yarn",
        {
            "factor": "scaling_factor",
            "original_max_position_embeddings": "max_position_embeddings",  # yarn's is the original context
            "beta_fast": "beta_fast",
            "beta_slow": "beta_slow",
            "truncate": "truncate",
            "attention_factor": "mscale",
        },
    ),
    # DeepSeek-V2/V3's yarn: the same frequencies (always truncated: it takes no ``truncate``), cos/sin times
    # its ``mscale`` = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim); the
    # attention's own factor (mscale_all_dim's squared) is in the MLA op's ``impl.scale``
    "DeepseekScalingRotaryEmbedding": (
        "yarn",
        {
            "factor": "scaling_factor",
            "original_max_position_embeddings": "max_position_embeddings",
            "beta_fast": "beta_fast",
            "beta_slow": "beta_slow",
            "attention_factor": "mscale",
        },
    ),
}


def _module_inv_freq(module: Any, rope_type: str) -> Any:
    """The frequencies the vLLM module's cos/sin cache is built from (linear scales the positions instead:
    its frequencies divided by the factor; yarn's ``_compute_inv_freq`` takes the factor)."""
    if rope_type == "linear":
        return module._compute_inv_freq(module.base) / module.scaling_factors[0]
    if rope_type == "yarn":
        return module._compute_inv_freq(module.scaling_factor)
    return module._compute_inv_freq(module.base)


def rope_params_of(module: Any) -> Any:
    """The ``kernels.RopeParams`` of a vLLM rotary module, read from the module and checked against the
    frequencies it computes itself (``_compute_inv_freq``); ``NotImplementedError`` (one line) for any
    other rotary class or a module whose frequencies disagree."""
    from logdiff.kernels import RopeParams
    from logdiff.kernels.rope import inv_freq_matches
    from logdiff.sources.vllm.contract_extras import VLLM_ROPE_TYPES

    cls = type(module).__name__
    if cls not in _VLLM_ROPES:
        rope_type = VLLM_ROPE_TYPES.get(cls, "unknown")
        covered = ", ".join(f"{c} ({t})" for c, (t, _) in _VLLM_ROPES.items())
        raise NotImplementedError(f"{cls}: rope_type {rope_type!r} has no consistent kernel (covered: {covered})")
    rope_type, fields = _VLLM_ROPES[cls]
    values = {k: getattr(module, a) for k, a in fields.items()}
    if rope_type == "linear":
        if len(module.scaling_factors) != 1:
            raise NotImplementedError(f"{cls}: {len(module.scaling_factors)} scaling factors (one is covered)")
        values["factor"] = module.scaling_factors[0]
    try:
        params = RopeParams(float(module.base), int(module.rotary_dim), rope_type, **values)
    except ValueError as e:
        raise NotImplementedError(f"{cls}: {e}") from None
    if not inv_freq_matches(params, _module_inv_freq(module, rope_type)):
        raise NotImplementedError(f"{cls}: its inv_freq is not what its parameters give ({rope_type} rope)")
    return params


def rope_forward(module: Any, params: Any = None) -> Callable[..., Any]:
    """``RotaryEmbedding.forward`` replacement (and its covered scaled subclasses'): cos/sin from the table of
    the module's ``RopeParams`` (:func:`rope_params_of`) at absolute positions."""
    kernels = _kernels()
    params = rope_params_of(module) if params is None else params
    head_size = module.head_size
    style = "neox" if module.is_neox_style else "gptj"

    def rotate(positions: Any, x: Any) -> Any:
        heads = x.reshape(positions.shape[0], -1, head_size)
        out = kernels.rope(heads, positions, params, style=style)
        return out.reshape(x.shape)

    def forward(positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        positions = positions.flatten().long()
        return rotate(positions, query), (None if key is None else rotate(positions, key))

    return forward


def gated_mul_forward(kernel: str) -> Callable[..., Any]:
    """``SiluAndMul.forward`` / ``GeluAndMul(approximate="tanh").forward`` replacement on the packed
    ``[gate | up]`` input, through the ``kernel`` (``silu_and_mul`` or ``gelu_tanh_and_mul``)."""
    gated = getattr(_kernels(), kernel)

    def forward(x: Any) -> Any:
        d = x.shape[-1] // 2
        return gated(x[..., :d].contiguous(), x[..., d:].contiguous())

    return forward


def softcapped_logits_forward(module: Any) -> Callable[..., Any]:
    """``LogitsProcessor.forward`` replacement that soft-caps with the kernel (Gemma 2's final logits)."""
    kernels = _kernels()
    cap = float(module.soft_cap)

    def forward(lm_head: Any, hidden_states: Any, embedding_bias: Any = None, skip_gather: bool = False) -> Any:
        logits = module._get_logits(hidden_states, lm_head, embedding_bias, skip_gather)
        return None if logits is None else kernels.softcap(logits, cap)

    return forward


def log_softmax() -> Callable[..., Any]:
    """``Sampler.compute_logprobs`` replacement (a staticmethod: no ``self``)."""
    kernels = _kernels()

    def compute_logprobs(logits: Any) -> Any:
        return kernels.log_softmax(logits)

    return compute_logprobs


def processed_log_softmax(sampler: Any) -> Callable[..., Any]:
    """``TopKTopPSampler.forward`` replacement: with ``logprobs_mode="processed_logprobs"`` (TRL's, verl's) a
    sampling (not greedy) step takes its logprobs inside the top-k/top-p sampler with torch's ``log_softmax``,
    past ``compute_logprobs``. The sampler returns its processed logits instead (``processed_logits``) and the
    consistent ``log_softmax`` runs on them: the same values, in the kernel's fixed order."""
    kernels = _kernels()
    forward = sampler.forward

    def sample(*args: Any, **kwargs: Any) -> Any:
        if sampler.logprobs_mode != "processed_logprobs":
            return forward(*args, **kwargs)
        sampler.logprobs_mode = "processed_logits"
        try:
            sampled, logits = forward(*args, **kwargs)
        finally:
            sampler.logprobs_mode = "processed_logprobs"
        return sampled, None if logits is None else kernels.log_softmax(logits)

    return sample


def attention_forward(impl: Any, reader: Callable[..., Any] | None = None, window: Any = "impl") -> Callable[..., Any]:
    """``CPUAttentionBackendImpl.forward`` replacement over the paged KV cache.

    ``reader(impl, layer, kv_cache)`` gives the object whose ``read_batch`` gathers the
    requests' K and V (the CPU's learnt layout by default; the CUDA backend passes
    FlashAttention's); ``window`` overrides ``impl.sliding_window`` (another backend's
    encoding of it: None for none).
    """
    from logdiff.sources.vllm.kv_cache import PagedKVReader

    kernels = _kernels()
    read = reader or PagedKVReader.discover
    scale = float(impl.scale)
    softcap = float(impl.logits_soft_cap) if impl.logits_soft_cap else None  # 0: none
    if window == "impl":
        window = int(impl.sliding_window) if impl.sliding_window != -1 else None  # -1: none
    sinks = getattr(impl, "sinks", None)  # gpt-oss: one logit per query head in the softmax's denominator, or None

    def forward(
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        output_scale: Any = None,
        output_block_scale: Any = None,
    ) -> Any:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("consistent attention: fused output quantization")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        if not attn_metadata.causal or getattr(attn_metadata, "dynamic_causal", None) is not None:
            raise NotImplementedError("consistent attention: only causal decoder attention")
        cache = read(impl, layer, kv_cache)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()[: len(starts) - 1]
        requests = [(r, starts[r], starts[r + 1], n) for r, n in enumerate(seq_lens) if starts[r + 1] > starts[r]]
        if not requests:
            return output
        # One padded batch per step: the kernel's result for a query does not depend
        # on the other sequences, on padding, or on the key count beyond its position.
        rows = torch.tensor([r for r, *_ in requests])
        kv_lens = torch.tensor([n for *_, n in requests], dtype=torch.int64)
        k, v = cache.read_batch(kv_cache, attn_metadata.block_table[rows], kv_lens)
        longest_q = max(stop - start for _, start, stop, _ in requests)
        q = query.new_zeros(len(requests), longest_q, *query.shape[1:])
        positions = torch.full((len(requests), longest_q), -1, dtype=torch.int64)
        for i, (_, start, stop, seq_len) in enumerate(requests):
            q[i, : stop - start] = query[start:stop]
            positions[i, : stop - start] = torch.arange(seq_len - (stop - start), seq_len)
            if window:  # keys before the first query's window: hidden, and their blocks may be freed (garbage)
                hidden = max(0, seq_len - (stop - start) - window + 1)
                k[i, :hidden], v[i, :hidden] = 0, 0
        positions, kv_lens = positions.to(q.device), kv_lens.to(q.device)  # no-ops on CPU
        out = kernels.attention_batched(q, k, v, positions, scale, kv_lens, softcap, window, sinks)
        for i, (_, start, stop, _) in enumerate(requests):
            output[start:stop] = out[i, : stop - start]
        return output

    return forward


def mla_forward_impl(layer: Any, kv_b_weight: Any) -> Callable[..., Any]:
    """``MLAAttention.forward_impl`` replacement (DeepSeek MLA) over the paged latent cache.

    vLLM's layer has already written this step's latent and RoPE'd ``k_pe`` into
    the cache (``update_kv_cache``) when it calls ``forward_impl``; the stock impl
    then runs prefill tokens as MHA (``kv_b_proj`` up-projection, SDPA) and
    decode tokens as MQA against the latent with ``kv_b_proj`` absorbed into
    the query and output. Here every request, decode or prefill, reads its
    whole context back from the cache (``LatentCacheReader``) and runs
    ``kernels.latent_attention``: the explicit up-projection through the
    ``linear`` kernel with vLLM's own loaded ``kv_b_proj`` weight, then the
    consistent attention kernel (q/k heads ``qk_nope + qk_rope``, v heads
    ``v_head_dim``), all requests of the step in one padded batch.
    """
    from logdiff.kernels.mla import latent_attention
    from logdiff.sources.vllm.kv_cache import LatentCacheReader

    impl = layer.impl
    scale = float(impl.scale)
    heads, rank, v_dim = int(layer.num_heads), int(layer.kv_lora_rank), int(layer.v_head_dim)
    rope_dim = int(layer.qk_rope_head_dim)

    def forward_impl(
        q: Any,
        k_c_normed: Any,
        k_pe: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        output_scale: Any = None,
        output_block_scale: Any = None,
        **kwargs: Any,
    ) -> Any:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("consistent MLA attention: fused output quantization")
        if kwargs.get("q_dcp_replicated") is not None:
            raise NotImplementedError("consistent MLA attention: decode context parallelism")
        if attn_metadata is None:  # warm-up / profiling run
            return output.fill_(0)
        if not attn_metadata.causal:
            raise NotImplementedError("consistent MLA attention: only causal decoder attention")
        starts = attn_metadata.query_start_loc.tolist()
        n_dec = int(attn_metadata.num_decodes)
        decode, prefill = attn_metadata.decode, attn_metadata.prefill
        context = prefill.chunked_context.context_lens_list if prefill is not None and prefill.chunked_context else None
        requests, rows = [], []  # (start, stop, seq_len), block table rows
        for r in range(len(starts) - 1):
            start, stop = starts[r], starts[r + 1]
            if stop <= start:
                continue
            if r < n_dec:
                seq_len, row = int(decode.seq_lens[r]), decode.block_table[r]
            else:
                seq_len = (int(context[r - n_dec]) if context else 0) + stop - start
                row = prefill.block_table[r - n_dec]
            requests.append((start, stop, seq_len))
            rows.append(row)
        if not requests:
            return output
        reader = LatentCacheReader.discover(impl, kv_cache, rank, rope_dim)
        block_rows = torch.stack(rows)  # decode and prefill rows: slices of one block table
        kv_lens = torch.tensor([n for *_, n in requests], dtype=torch.int64)
        latent, pe = reader.read_batch(kv_cache, block_rows, kv_lens)
        longest_q = max(stop - start for start, stop, _ in requests)
        query = q.new_zeros(len(requests), longest_q, *q.shape[1:])
        positions = torch.full((len(requests), longest_q), -1, dtype=torch.int64)
        for i, (start, stop, seq_len) in enumerate(requests):
            query[i, : stop - start] = q[start:stop]
            positions[i, : stop - start] = torch.arange(seq_len - (stop - start), seq_len)
        out = latent_attention(query, latent, pe, kv_b_weight, positions, scale, kv_lens, v_dim)
        for i, (start, stop, _) in enumerate(requests):
            output[start:stop] = out[i, : stop - start].reshape(stop - start, heads * v_dim)
        return output

    return forward_impl


def moe_forward(runner: Any, gate_weight: Any, w13: Any, w2: Any, biases: Any = None) -> Callable[..., Any]:
    """``MoERunner.forward`` replacement: the router GEMM where the runner owns it, ``moe_route`` (plain
    softmax top-k: Qwen3-MoE, Mixtral) or ``moe_route_grouped`` (sigmoid or grouped, a correction bias,
    the routed scaling folded into the fp32 weights: GLM-4.5, DeepSeek-V3), ``moe_experts``, and a
    shared expert (its linears and ``SiluAndMul`` already patched) added to the routed sum last, in
    the model dtype, as HF's block does. ``biases`` (``w13_bias``, ``w2_bias``): gpt-oss's biased experts with
    vLLM's ``swigluoai`` activation (``moe_experts_oai``, with that activation's fixed constants)."""
    kernels = _kernels()
    if biases is not None:
        from logdiff.sources.vllm.contract_extras import vllm_swiglu_constants

        alpha, limit = vllm_swiglu_constants()
    router = runner.router
    top_k, renormalize = int(router.top_k), bool(router.renormalize)
    rule = routing_rule(runner)
    fp32_logits = router.e_score_correction_bias is not None
    shared = runner.shared_experts._layer if runner.shared_experts is not None else None

    def forward(hidden_states: Any, router_logits: Any, input_ids: Any = None, shared_experts_input: Any = None) -> Any:
        if gate_weight is not None:  # the runner owns the gate: vLLM passes the hidden states as logits
            # a router with a correction bias routes on fp32 logits, as consistent HF computes them (HF's
            # DeepSeek-V3/GLM routers): DeepSeek-V3's vLLM gate gives model-dtype logits (moe_router_dtype unset)
            router_logits = kernels.linear(hidden_states.float() if fp32_logits else hidden_states, gate_weight)
        if rule is None:
            weights, ids = kernels.moe_route(router_logits, top_k, renormalize)
        else:
            weights, ids = kernels.moe_route_grouped(router_logits, top_k, renormalize, **rule)
        if biases is None:
            routed = kernels.moe_experts(hidden_states, weights, ids, w13, w2)
        else:
            routed = kernels.moe_experts_oai(hidden_states, weights, ids, w13, biases[0], w2, biases[1], alpha, limit)
        if shared is None:
            return routed
        return routed + shared(hidden_states if shared_experts_input is None else shared_experts_input)

    return forward


def routing_rule(runner: Any) -> dict[str, Any] | None:
    """The runner's router as ``kernels.moe_route_grouped`` keywords, or None for plain softmax top-k."""
    router = runner.router
    bias = router.e_score_correction_bias
    grouped = bool(router.use_grouped_topk)
    scale = float(router.routed_scaling_factor) * float(runner.routed_scaling_factor)
    if router.scoring_func == "softmax" and not grouped and bias is None and scale == 1.0:
        return None
    return {
        "scoring": router.scoring_func,
        "bias": None if bias is None else bias.data,
        "n_group": int(router.num_expert_group) if grouped else 1,
        "topk_group": int(router.topk_group) if grouped else 1,
        "scaling": scale,
    }
