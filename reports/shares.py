"""How to read the causes' shares: the words every renderer shows beside them.

Attribution (logdiff/diagnosis/attribute.py, docs/causes.md) gives each lever
a Shapley share of the mean |Δ logprob| gap and splits it equally among the
causes the lever neutralises; a group's share is the sum of its causes'. The
shares add up to ``attribution.closed``, the fraction of the gap that every
fix applied together closes. A negative share is easy to misread, so the
terminal summary, the HTML report and ``logdiff explain`` all say in words
what one means wherever it appears (``NEGATIVE``), and all show what the
shares sum to (``note``).

Results written before Shapley attribution (no ``attribution.closed``) keep
their old meaning, the fraction of the max |Δ logprob| one lever alone
removes: ``shapley`` is None for them and the renderers keep their old words.
"""

from __future__ import annotations

from typing import Any

from .format import fmt_fraction, is_number

#: what a negative share means, said beside one
NEGATIVE = "negative: on average, fixing it widens the gap; it interacts with the others"
#: the same in a table cell, where the bar of a positive share is (NEGATIVE in full is its tooltip)
NEGATIVE_HINT = "widens the gap"


def shapley(result: dict[str, Any]) -> dict[str, Any] | None:
    """The result's attribution when it holds Shapley shares (``closed``), else None."""
    attribution = result.get("attribution")
    if isinstance(attribution, dict) and is_number(attribution.get("closed")):
        return attribution
    return None


def is_negative(share: Any) -> bool:
    return is_number(share) and share < 0


def note(result: dict[str, Any], negative: bool | None = None) -> str | None:
    """What the shares are and what they sum to (None for a result without Shapley shares).

    ``negative``: whether a negative share is shown (default: any cause's share is negative).
    """
    attribution = shapley(result)
    if attribution is None:
        return None
    closed = attribution["closed"]
    how = (f", estimated from {attribution.get('permutations')} sampled orders"
           if attribution.get("method") == "sampled" else "")
    text = (f"Share: a Shapley part of the mean |Δ logprob| gap{how}; the shares sum to "
            f"{fmt_fraction(closed)}, what all fixes together close.")
    interaction = attribution.get("interaction")
    if is_number(interaction) and abs(interaction) >= 0.005:
        text += (f" Each fixed alone, their effects add up to {fmt_fraction(closed + interaction)}: "
                 f"the causes interact (interaction {fmt_fraction(interaction)}).")
    if negative is None:
        negative = any(is_negative(c.get("share")) for c in result.get("causes") or [] if isinstance(c, dict))
    if negative:
        text += " A negative share: on average, fixing that cause widens the gap; it interacts with the others."
    return text
