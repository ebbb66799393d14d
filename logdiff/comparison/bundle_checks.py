"""What two capture bundles say about how they were captured, before any numbers are compared.

``logdiff compare`` (``offline.py``) asks four things of the bundles themselves:

* did an engine run compiled, so that its module hooks never fired and only its
  logits were recorded (``compiled_warning``: one line with the fix, in each
  framework's own terms);
* which captured sequences found no partner by token ids (``matching_warning``:
  one line counting both sides);
* was a side read from a foreign dump (msprobe), and what could it not give
  (``dump_warning``);
* did one side feed a paired sequence at shifted positions (a left-padded row
  without ``position_ids``: ``offset_findings``, a warning and, where the
  logprobs differ, a cause at the first RoPE boundary: ``operator_path`` /
  ``position_offset`` where RoPE is the model's only use of positions and its
  type depends on position differences alone (the same function, rounded at
  other angles), else ``framework_difference`` / ``position_ids``).
"""

from __future__ import annotations

from typing import Any

from logdiff.comparison.result import ScanResult
from logdiff.records.bundle import Bundle

#: the fix for a vLLM side that ran compiled (its module hooks never fire), in each framework's own terms
COMPILED_FIX = ("build it with LLM(..., enforce_eager=True); verl: actor_rollout_ref.rollout.enforce_eager=True; "
                "TRL: trl vllm-serve --enforce_eager true, or colocated, build the trainer inside "
                "logdiff.integrations.trl.eager_vllm()")

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


def dump_warning(bundles: dict[str, Bundle]) -> str | None:
    """One line naming what the sides converted from msprobe dumps (``logdiff/sources/msprobe/``: ``source: msprobe`` in
    their metadata) could not give, and what they left out; None when neither side is a dump."""
    parts = []
    for role, bundle in bundles.items():
        meta = bundle.meta
        if meta.get("source") != "msprobe":
            continue
        counts = meta.get("msprobe") or {}
        left = [f"{counts[k]} {what}" for k, what in (("unmatched_rows", "rows no sequence continued"),
                                                      ("not_kept", "tensors whose file was not kept"),
                                                      ("logits_unplaced", "logits records not placed on rows"),
                                                      ("other_shape", "tensors of another row count"))
                if counts.get(k)]
        parts.append(f"{role} ({meta.get('engine')}){': left out ' + ', '.join(left) if left else ''}")
    if not parts:
        return None
    missing = next(b.meta.get("missing") for b in bundles.values() if b.meta.get("source") == "msprobe")
    return (f"msprobe dumps read for {'; '.join(parts)}: a dump holds no {', '.join(missing)}, so what depends on "
            "them is not judged")


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
    row without ``position_ids``: ``logdiff/records/batching.py``): a warning that counts them and, where the logprobs
    differ, a cause at the first RoPE boundary (``shift_invariant`` says which class)."""
    from logdiff.comparison.cause import FAMILY, Cause, Findings

    offsets = position_offsets(tb, ib, matching)
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
        invariant = shift_invariant(tb.meta.get("config") or {})
        if invariant:
            kind, cls = "position_offset", "operator_path"
            evidence = [line, f"the same function: {invariant}, so attention sees only position differences and a "
                              "whole sequence shifted computes the same logprobs, rounded at other angles"]
        else:
            kind, cls = "position_ids", "framework_difference"
            evidence = [line, "the model's positions are not RoPE's differences alone: shifted positions are "
                              "another input"]
        found.causes.append(Cause(rope, None, "rope", FAMILY.get("rope"), cls, kind, evidence, fix,
                                  differs=["position_ids"]))
    return found


def add_offset_findings(result: ScanResult, tb: Bundle, ib: Bundle, matching: Any, cmap: Any) -> None:
    """``offset_findings`` into ``result``. A shift that computes the same function takes in the RoPE boundaries'
    own operator-path causes: their outputs differ by the rotation, which the per-op local error (both sides
    fed the same inputs but not the same positions) cannot tell from rounding; each side's conformance, at its
    own positions, stays in the evidence."""
    found = offset_findings(tb, ib, matching, cmap, result.primary.bitwise_equal)
    shift = next((c for c in found.causes if c.kind == "position_offset"), None)
    folded = [c for c in result.causes if c.op_kind == "rope" and c.class_ == "operator_path"] if shift else []
    if folded:
        result.causes[:] = [c for c in result.causes if c not in folded]
        names = ", ".join(c.boundary for c in folded[:4]) + (" ..." if len(folded) > 4 else "")
        shift.evidence.append(f"the RoPE outputs at {len(folded)} boundaries ({names}) differ by the rotation, not "
                              "by rounding; each side is within its rounding bound of the exact RoPE at its own "
                              "positions" if all(c.conformance for c in folded) else
                              f"the RoPE outputs at {len(folded)} boundaries ({names}) differ by the rotation")
    result.add(found)


def position_offsets(tb: Bundle, ib: Bundle, matching: Any) -> dict[int, dict[str, int]]:
    """Each paired sequence's model position of its first token, per side (0 where the capture saw no shift)."""
    offsets: dict[int, dict[str, int]] = {}
    for side, bundle, common in (("train", tb, matching.train), ("infer", ib, matching.infer)):
        for (group, seq), c in common.items():
            offsets.setdefault(c, {})[side] = bundle.position_offset(group, seq)
    return offsets


#: RoPE types whose rotation angle is linear in the position (so q.k depends on position differences alone)
SHIFT_INVARIANT_ROPE = ("default", "linear", "llama3", "yarn")


def shift_invariant(config: dict[str, Any]) -> str | None:
    """Why a whole sequence shifted to other positions computes the same function, or None: positions enter
    only through RoPE (no learned or absolute position table) of a type linear in the position."""
    if any(k in config for k in ("n_positions", "max_learned_position_embeddings")) or config.get(
            "position_embedding_type", "rope") not in ("rope", "rotary"):  # fmt: skip
        return None
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not ("rope_theta" in config or "rope_theta" in params):
        return None
    kind = params.get("rope_type") or params.get("type") or "default"
    return f"RoPE ({kind}) rotates q and k by angles linear in the position" if kind in SHIFT_INVARIANT_ROPE else None
