"""Capture inside megatron-core models (``GPTModel``), on every rank, into logdiff's bundle format.

Entry point (lazy: nothing else in logdiff imports this package)::

    from logdiff.sources.megatron import capture

    with capture(gpt_model, "bundles/train", hf_config="MODEL/config.json"):
        logits = gpt_model(input_ids, position_ids, attention_mask)

Modules, one job each:

* ``names``: Megatron module paths -> logdiff's (HF-style) boundary names, global layer numbers,
  the per-query-group split of ``linear_qkv`` and the gate/up halves of ``linear_fc1``;
* ``placements``: each record's ``Placement`` and each weight's slice, from Megatron's own metadata
  (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``allreduce``) and ``parallel_state``;
* ``weights``: the HF <-> Megatron weight mapping (QKV per query group, gate/up), gathering a rank's
  shards into logical tensors, and their fingerprints under HF names;
* ``contract``: the effective contract read from Megatron's ``TransformerConfig``;
* ``recording``: the hooks and the bundle writer (``capture``, re-exported here);
* ``te``: the Transformer Engine spec's module names (coded, not run).

It never imports the comparison, and it never patches Megatron: the CUDA shims a CPU run needs live in
the tests (``tests/megatron_shims.py``).
"""

from __future__ import annotations

from typing import Any


def capture(*args: Any, **kwargs: Any) -> Any:
    """``logdiff.sources.megatron.recording.capture`` (see there), loaded on first use."""
    from logdiff.sources.megatron.recording import capture as run

    return run(*args, **kwargs)
