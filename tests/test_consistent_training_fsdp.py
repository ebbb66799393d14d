"""Consistent training under FSDP2 sees each step's new weights (logdiff/sources/hf/training.py, issue 36).

Two processes on gloo train the demo Qwen3 in bfloat16, wrapped with ``fully_shard`` per layer and on the
model, inside one ``logdiff.consistent_training`` block: two AdamW steps, then a scoring forward. That forward
must equal, bit for bit, the same forward in a fresh block (nothing cached): the prepared weight copies of
step 1 must not serve step 3.

The hazard is real, not assumed (the negative control): FSDP2 refills its unsharded parameters in every
forward from the sharded ones the optimizer stepped, into the same parameter object with its version
counter preserved, so a copy keyed by (object, version) would have been served stale. Each rank checks that
``q_proj``'s weight, as its forward sees it, is the same object with the same version counter in two
forwards, holding other values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

IDS = [[5, 17, 3, 9, 44, 2, 8, 31], [7, 7, 1, 20, 13, 6, 40, 11]]


def _rank(rank: int, world: int, model_dir: str, out: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import logdiff

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        seen: list[tuple[int, int, torch.Tensor]] = []  # q_proj's weight in each forward: (id, version, values)
        q_proj = model.model.layers[0].self_attn.q_proj
        q_proj.register_forward_pre_hook(lambda m, _: seen.append((id(m.weight), m.weight._version,
                                                                   m.weight.detach().clone())))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.tensor([IDS[rank]])
        with logdiff.consistent_training(model):
            for _ in range(2):
                loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                in_block = model(input_ids=ids).logits
        with logdiff.consistent_training(model), torch.no_grad():
            fresh = model(input_ids=ids).logits
        (first_id, first_version, first), (last_id, last_version, last) = seen[0], seen[2]
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "equal": bool(torch.equal(in_block, fresh)),
            "max_diff": float((in_block.float() - fresh.float()).abs().max()),
            "same_object": first_id == last_id, "same_version": first_version == last_version,
            "values_changed": not torch.equal(first, last)}))
    finally:
        dist.destroy_process_group()


def test_a_step_under_fsdp2_is_scored_with_its_own_weights(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(2, str(demo_model("qwen3")), str(tmp_path), str(tmp_path / "store")),
                       nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the hazard: the same parameter object, its version counter unchanged, other values
        assert result["same_object"] and result["same_version"] and result["values_changed"], result
        assert result["equal"], f"rank {rank}: the block scored with stale weights ({result['max_diff']} off)"
