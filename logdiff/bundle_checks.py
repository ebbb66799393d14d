"""What two capture bundles say about how they were captured, before any numbers are compared.

``logdiff compare`` (``offline.py``) asks three things of the bundles themselves:

* did an engine run compiled, so that its module hooks never fired and only its
  logits were recorded (``compiled_warning``: one line with the fix, in each
  framework's own terms);
* which captured sequences found no partner by token ids (``matching_warning``:
  one line counting both sides);
* did one side feed a paired sequence at shifted positions (a left-padded row
  without ``position_ids``: ``offset_findings``, a warning and, where the
  logprobs differ, a ``position_ids`` cause at the first RoPE boundary).
"""

from __future__ import annotations

from typing import Any

from logdiff.probes.bundle import Bundle
from logdiff.result import ScanResult

#: the fix for a vLLM side that ran compiled (its module hooks never fire), in each framework's own terms
COMPILED_FIX = ("build it with LLM(..., enforce_eager=True); verl: actor_rollout_ref.rollout.enforce_eager=True; "
                "TRL: trl vllm-serve --enforce_eager true (colocated, no option: patch vllm.LLM)")

def compiled_warning(bundles: dict[str, Bundle]) -> str | None:
    """One line when a bundle's engine ran its model compiled (vLLM without ``enforce_eager``: torch.compile or
    CUDA graphs), so that its module hooks did not fire and only its logits were recorded; None otherwise.
    A rank's ``hooks_fired`` false (a recorded step held logits but no module boundary) says so; its
    ``compilation.compiled`` (the engine's config) too, unless its steps show the hooks fired after all."""
    for role, bundle in bundles.items():
        for part in bundle.ranks:
            meta = part.meta
            compilation = meta.get("compilation") or {}
            hookless = meta.get("hooks_fired") is False
            if not (hookless or (compilation.get("compiled") and meta.get("hooks_fired") is not True)):
                continue
            how = ", ".join(f"{k} {compilation[k]}" for k in ("mode", "cudagraph_mode")
                            if compilation.get(k) not in (None, "NONE"))
            what = (f" ({meta.get('hookless_steps', '?')} of {meta.get('recorded_steps', '?')} steps recorded "
                    "logits only)" if hookless else "")
            return (f"{role} bundle: {meta.get('engine') or 'the engine'} ran its model compiled"
                    f"{f' ({how})' if how else ''}, so its module hooks did not fire{what}: {COMPILED_FIX}")
    return None


def matching_warning(result: ScanResult, unmatched: dict[str, int], total: dict[str, int]) -> None:
    """One line counting the captured sequences of both bundles that found no partner by token ids."""
    if not any(unmatched.values()):
        return
    sides = {"train": "training", "infer": "inference"}
    parts = ", ".join(f"{unmatched[side]} of the {sides[side]} bundle's {total[side]}" for side in ("train", "infer"))
    result.warn(f"{sum(unmatched.values())} of {sum(total.values())} sequences found no partner with the same token "
                f"ids in the other bundle: {parts}; they were left out")


def offset_findings(tb: Bundle, ib: Bundle, matching: Any, cmap: Any, bitwise_equal: bool) -> Any:
    """Paired sequences whose first token one side fed at another model position than the other (a left-padded
    row without ``position_ids``: ``probes/batching.py``): a warning that counts them and, where the logprobs
    differ, a ``position_ids`` framework difference at the first RoPE boundary (its inputs are other positions)."""
    from logdiff.diagnosis.cause import Findings, framework_cause

    offsets: dict[int, dict[str, int]] = {}
    for side, bundle, common in (("train", tb, matching.train), ("infer", ib, matching.infer)):
        for (group, seq), c in common.items():
            offsets.setdefault(c, {})[side] = bundle.position_offset(group, seq)
    shifted = {c: o for c, o in offsets.items() if o.get("train", 0) != o.get("infer", 0)}
    if not shifted:
        return Findings()

    def listed(side: str) -> str:
        values = sorted({o.get(side, 0) for o in shifted.values()})
        return ", ".join(map(str, values[:5])) + (", ..." if len(values) > 5 else "")

    line = (f"{len(shifted)} of {len(offsets)} paired sequences were fed at shifted positions: their first token at "
            f"model position {listed('train')} (train) against {listed('infer')} (infer); a left-padded batch "
            "without position_ids shifts each row's positions by its pad count")
    found = Findings(warnings=[f"position_ids: {line}"])
    if not bitwise_equal:
        rope = next((n for n in cmap.order if cmap.get(n).kind == "rope"), "position_ids")
        fix = ("pass position_ids = attention_mask.cumsum(-1) - 1 with left-padded batches, so each sequence's "
               "positions start at 0 as the inference engine's do")
        found.causes.append(framework_cause(rope, "rope", "position_ids", [line], fix, ["position_ids"]))
    return found
