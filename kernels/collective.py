"""One reduction order for a product whose reduction dimension is split across ranks (row parallel).

A row-parallel linear splits the reduction dimension K across the ranks of a
tensor-parallel group: rank r holds the K-slice ``[r K/W, (r+1) K/W)`` of x and of
the weight, computes a partial product, and an all-reduce adds the partials in an
order set by the world size and the collective's algorithm (ring, tree, NCCL's
choice). One rank computes the whole K in one GEMM. No two world sizes agree
bitwise, and a TP = 2 trainer never matches a TP = 1 engine: the
``operator_path`` / ``collective_order`` cause.

Here the reduction is cut into fixed K-chunks of width ``chunk`` whatever the
world size. Each chunk's partial product is its own fp32 GEMM (``_tiled_mm``:
batch-invariant tiles), and the chunk partials are added with ``pairwise_sum`` in
global chunk order, then the bias, then one rounding:

* ``chunked_linear(x, w, chunk=C)`` on one rank computes every chunk;
* ``row_parallel_linear(x_r, w_r, chunk=C, group=g)`` on each rank computes the
  chunks of its slice and all-gathers the partials (ranks in group order hold
  consecutive K-slices, so the gathered list is in global chunk order) and adds
  them the same way.

Both give the same bits, at any world size that divides K into whole chunks. The
price is an all-gather of ``K / C`` partials instead of an all-reduce of one.
"""

from __future__ import annotations

import torch

from .fixed_order import pairwise_sum
from .matmul import _tiled_mm


def k_chunk_partials(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[K / chunk, M, N]`` fp32 partial products of x ``[..., K]`` and weight ``[N, K]``, one per K-chunk."""
    k = x.shape[-1]
    if weight.shape[1] != k:
        raise ValueError(f"x has K={k} but weight is {tuple(weight.shape)}")
    if chunk <= 0 or k % chunk:
        raise ValueError(f"K={k} is not a whole number of chunks of {chunk}")
    x2, w = x.reshape(-1, k).float(), weight.float()
    return torch.stack([_tiled_mm(x2[:, s : s + chunk], w[:, s : s + chunk], torch.float32)
                        for s in range(0, k, chunk)])  # fmt: skip


def _finish(summed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = summed if bias is None else summed + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   chunk: int) -> torch.Tensor:  # fmt: skip
    """``x @ weight.T + bias`` as fixed K-chunks added pairwise: the bits ``row_parallel_linear`` gives at any world size."""
    return _finish(pairwise_sum(k_chunk_partials(x, weight, chunk), 0), bias, x)


def row_parallel_linear(x_local: torch.Tensor, weight_local: torch.Tensor, bias: torch.Tensor | None = None, *,
                        chunk: int, group: object = None) -> torch.Tensor:  # fmt: skip
    """This rank's K-slice of a row-parallel product; every rank returns ``chunked_linear`` of the whole, bitwise.

    ``x_local [..., K/W]`` and ``weight_local [N, K/W]`` hold the slice of rank ``i`` of ``group`` (in group
    order); ``bias`` (replicated) is added once, after the sum.
    """
    import torch.distributed as dist

    partials = k_chunk_partials(x_local, weight_local, chunk)
    gathered = [torch.empty_like(partials) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, partials.contiguous(), group=group)
    return _finish(pairwise_sum(torch.cat(gathered), 0), bias, x_local)
