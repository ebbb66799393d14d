"""Whether a contract difference changes the function an op computes, on the inputs this scan saw.

The preflight lists every key whose value differs anywhere in the model. An op
reads only its own layer's view of a contract (``probes.contracts.at_layer``:
its window, its layer type, its RoPE base), so a key is judged at an op on that
view (``layer_differs``): a window that one side applies on layer 1 only is no
difference at layer 0's attention.

A difference is a cause only where it changes the function on the inputs seen.
A window hides a key only from a sequence longer than the window (a query sees
the last W keys, its own included, in HF's masks and vLLM's kernels alike), so
windows no shorter than every sequence give the attention of no window:
evidence, not a cause (``inert_window``, per op and, for the preflight's own
causes, over the whole model). Other keys keep the preflight's rule: an eps or
a RoPE base that differs changes the function, even where its effect hides
below the output's rounding.

Conformance measures the same question: where the contracts differ at an op,
each side's output is checked against the exact function under the *other*
side's contract too (``Conformance.crossed``). When a side is outside the
function its own contract names but within the other's, the contract and the
measurement disagree (``disagreement``): the result says so in the op's
evidence and in a warning (``DISAGREE``), and where both sides compute the
same function the op is not judged on the contract alone.
"""

from __future__ import annotations

from typing import Any

from logdiff.diagnosis.preflight import compare_contracts, difference_line
from logdiff.probes.contracts import WINDOW_KEYS, applied, at_layer

SIDES = ("train", "infer")
#: how every evidence line and warning about a contract the measurement contradicts begins
DISAGREE = "contract and conformance disagree"


def layer_view(contracts: dict[str, Any] | None, layer: int | None) -> dict[str, Any] | None:
    """The contracts block with both sides' contracts as layer ``layer`` computes with them (``at_layer``)."""
    if not contracts or layer is None:
        return contracts
    return {**contracts, **{s: at_layer(contracts[s], layer) if contracts.get(s) else contracts.get(s) for s in SIDES}}


def layer_differs(keys: list[str], contracts: dict[str, Any] | None, layer: int | None) -> list[str]:
    """Of ``keys``, those that differ between the sides at ``layer``'s view: a layer one side slides and the
    other does not differs in its window there even where both read the same width (gpt-oss's vLLM sliding a
    layer HF keeps full). A model-level op, or contracts not read per layer, take the preflight's ``differs``."""
    if not contracts:
        return []
    listed = [k for k in keys if k in (contracts.get("differs") or [])]
    sides = [contracts.get(s) or {} for s in SIDES]
    if layer is None or not all(sides) or not any(isinstance(c.get("layer_types"), str) for c in sides):
        return listed
    view = layer_view(contracts, layer)
    here = compare_contracts(view["train"], view["infer"])["differs"]
    return [k for k in keys if k in here]


def difference_at(key: str, here: dict[str, Any] | None, layer: int | None, contracts: dict[str, Any] | None) -> str:
    """The evidence line of ``key`` differing at an op: its layer's values (``here``, ``layer_view``), with the
    layer named where they are that layer's own (a window; Gemma 3's local RoPE base; a per-layer list)."""
    line = difference_line(key, here)
    own = key in WINDOW_KEYS or any(((here or {}).get(s) or {}).get(key) != ((contracts or {}).get(s) or {}).get(key)
                                    for s in SIDES)  # fmt: skip
    if layer is not None and own:
        line = line.replace("contract differs:", f"contract differs at layer {layer}:", 1)
    return line


def _widths(value: Any) -> list[int]:
    """The windows a contract value masks: one width, one per layer (a list), or none (off, unread)."""
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if applied(v) is not None]


def inert_window(keys: list[str], contracts: dict[str, Any] | None, layer: int | None,
                 longest: int | None) -> str | None:
    """Why a difference of ``keys`` (window keys only) at ``layer`` (None: anywhere in the model) changes no
    attention on sequences of at most ``longest`` tokens, as an evidence line; None where it may, where another
    key differs too, or where the sequences are not known."""
    if not keys or longest is None or not set(keys) <= set(WINDOW_KEYS) or not contracts:
        return None
    view = layer_view(contracts, layer)
    widths = [w for s in SIDES for w in _widths((view.get(s) or {}).get("sliding_window"))]
    if widths and min(widths) < longest:
        return None
    where = f"at layer {layer}" if layer is not None else "in the model"
    differs = "; ".join(difference_line(k, view) for k in keys)
    reach = (f"no sequence here is longer than {min(widths)} tokens (the longest has {longest})" if widths
             else "neither side masks a window")  # fmt: skip
    return (f"{differs} {where}, but {reach}: a window hides a key only from a longer sequence, so both give the "
            "same attention on these inputs (evidence, not a cause)")


def disagreement(conf: Any, paths: dict[str, str]) -> tuple[str, bool] | None:
    """Where a side's output is outside the exact function its own contract names but within the one the other
    side's names: (the evidence line, whether both sides compute the same function, the other contract's);
    None where the measurement agrees with the contracts or was not made."""
    if conf is None or not conf.crossed_decided:
        return None
    swapped = [s for s in SIDES if not conf.sides[s].within and conf.crossed[s].within]
    if not swapped:
        return None
    side = swapped[0]
    other = SIDES[1 - SIDES.index(side)]
    same = conf.sides[other].within and side == swapped[-1]  # the other side computes its own contract's function
    line = (f"{DISAGREE}: the {side} side ({paths.get(side, side)}) is outside its bound of the function its own "
            f"contract names but within the one the {other} side's contract names")
    if same:
        line += (f", which the {other} side computes too: both sides compute one function here, and the {side} "
                 "side's contract as read does not describe it (a setting without effect, or misread)")
    return line, same


def contract_cross_lines(conf: Any) -> list[str]:
    """How far each side is from the other contract's function, where the contracts give different functions."""
    if conf is None or not conf.crossed_decided:
        return []
    if all(conf.sides[s].within for s in SIDES) and not all(conf.crossed[s].within for s in SIDES):
        return [("each side is within its bound of its own contract's function and a side is outside the other's: "
                 "the contract difference changes this op's output")]
    if all(conf.sides[s].within and conf.crossed[s].within for s in SIDES):
        return [("each side is also within its bound of the other contract's function: on these inputs the "
                 "difference is below the output's rounding here")]
    return []


def inert_differences(contracts: dict[str, Any] | None, longest: int | None) -> dict[str, str]:
    """The preflight's differing keys that change no op's function on sequences of at most ``longest`` tokens
    (the window keys, over the whole model), each with its evidence line (the result's warning)."""
    keys = [k for k in (contracts or {}).get("differs") or [] if k in WINDOW_KEYS]
    line = inert_window(keys, contracts, None, longest)
    return dict.fromkeys(keys, line) if line else {}


def reads_a_difference(keys: list[str], contracts: dict[str, Any] | None, layer: int | None,
                       longest: int | None) -> bool:
    """Whether a contract key among ``keys`` differs at ``layer`` in a way that can change the op there."""
    differs = layer_differs(keys, contracts, layer)
    return bool(differs) and inert_window(differs, contracts, layer, longest) is None
