"""The fake engine's decoder: plain PyTorch, its own module names and fusions, loaded from HF tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """NeoX-style RoPE (rotate halves) on ``[B, L, heads, D]`` q and k."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.theta = float(theta)
        self.inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class Core(nn.Module):
    """Causal attention over one unpadded sequence, grouped-query."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.groups, self.scale = heads // kv_heads, head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2)  # [B, L, heads, D]


class Attention(nn.Module):
    def __init__(self, wqkv: Linear, wo: Linear, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                 heads: int, kv_heads: int, head_dim: int, theta: float):
        super().__init__()
        self.wqkv, self.wo, self.q_norm, self.k_norm = wqkv, wo, q_norm, k_norm
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim  # what split_qkv reads
        self.rope = Rotary(head_dim, theta)
        self.core = Core(heads, kv_heads, head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[:2]
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.reshape(b, n, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, k, positions)
        return self.wo(self.core(q, k, v).reshape(b, n, -1))


class SiluMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FeedForward(nn.Module):
    def __init__(self, w13: Linear, w2: Linear):
        super().__init__()
        self.w13, self.act, self.w2 = w13, SiluMul(), w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w13(x)))


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Block(nn.Module):
    def __init__(self, attn_norm: RMSNorm, attn: Attention, ffn_norm: RMSNorm, ffn: FeedForward):
        super().__init__()
        self.attn_norm, self.attn, self.add_attn = attn_norm, attn, Add()
        self.ffn_norm, self.ffn, self.add_ffn = ffn_norm, ffn, Add()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        r = self.add_attn(x, self.attn(self.attn_norm(x), positions))
        return self.add_ffn(r, self.ffn(self.ffn_norm(r)))


class LogSoftmax(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1)


class FakeLM(nn.Module):
    def __init__(self, embeddings: torch.Tensor, blocks: list[Block], norm: RMSNorm, output: Linear):
        super().__init__()
        self.tok_embeddings = nn.Embedding.from_pretrained(embeddings, freeze=True)
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.output, self.log_softmax = norm, output, LogSoftmax()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        for block in self.blocks:
            h = block(h, positions)
        return self.log_softmax(self.output(self.norm(h)))

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight under its HF name (the packed projections split back into their parts)."""
        out = {"model.embed_tokens.weight": self.tok_embeddings.weight, "model.norm.weight": self.norm.weight,
               "lm_head.weight": self.output.weight}
        for n, blk in enumerate(self.blocks):
            p, a = f"model.layers.{n}", blk.attn
            sizes = [a.q_size, a.kv_size, a.kv_size]
            for part, w in zip(("q_proj", "k_proj", "v_proj"), a.wqkv.weight.split(sizes)):
                out[f"{p}.self_attn.{part}.weight"] = w
            if a.wqkv.bias is not None:
                for part, b in zip(("q_proj", "k_proj", "v_proj"), a.wqkv.bias.split(sizes)):
                    out[f"{p}.self_attn.{part}.bias"] = b
            if a.q_norm is not None:
                out[f"{p}.self_attn.q_norm.weight"] = a.q_norm.weight
                out[f"{p}.self_attn.k_norm.weight"] = a.k_norm.weight
            out[f"{p}.self_attn.o_proj.weight"] = a.wo.weight
            out[f"{p}.input_layernorm.weight"], out[f"{p}.post_attention_layernorm.weight"] = (
                blk.attn_norm.weight, blk.ffn_norm.weight)
            gate, up = blk.ffn.w13.weight.chunk(2)
            out[f"{p}.mlp.gate_proj.weight"], out[f"{p}.mlp.up_proj.weight"] = gate, up
            out[f"{p}.mlp.down_proj.weight"] = blk.ffn.w2.weight
        return out


def load(model_dir: Path, config: dict[str, Any], dtype: str) -> FakeLM:
    """The checkpoint's tensors (every ``*.safetensors`` file) in ``dtype``, packed into the fake's modules."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    dt = getattr(torch, dtype)
    t = {k: v.to(dt) for k, v in tensors.items()}
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    eps = float(config["rms_norm_eps"])
    theta = float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))
    blocks = []
    for n in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{n}"
        parts = [f"{p}.self_attn.{x}_proj" for x in "qkv"]
        bias = torch.cat([t[f"{x}.bias"] for x in parts]) if f"{parts[0]}.bias" in t else None
        wqkv = Linear(torch.cat([t[f"{x}.weight"] for x in parts]), bias)
        qn = f"{p}.self_attn.q_norm.weight"
        q_norm = RMSNorm(t[qn], eps) if qn in t else None
        k_norm = RMSNorm(t[f"{p}.self_attn.k_norm.weight"], eps) if qn in t else None
        attn = Attention(wqkv, Linear(t[f"{p}.self_attn.o_proj.weight"]), q_norm, k_norm, heads, kv_heads, head_dim,
                         theta)
        w13 = Linear(torch.cat([t[f"{p}.mlp.gate_proj.weight"], t[f"{p}.mlp.up_proj.weight"]]))
        ffn = FeedForward(w13, Linear(t[f"{p}.mlp.down_proj.weight"]))
        blocks.append(Block(RMSNorm(t[f"{p}.input_layernorm.weight"], eps), attn,
                            RMSNorm(t[f"{p}.post_attention_layernorm.weight"], eps), ffn))
    embeddings = t["model.embed_tokens.weight"]
    head = t.get("lm_head.weight") if not config.get("tie_word_embeddings") else None
    output = Linear(head if head is not None else embeddings)
    model = FakeLM(embeddings, blocks, RMSNorm(t["model.norm.weight"], eps), output)
    if head is None:
        model.output.weight = model.tok_embeddings.weight  # tied: one tensor
    return model.eval()
