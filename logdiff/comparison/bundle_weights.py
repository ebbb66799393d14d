"""Which weights a bundle's compared sequences ran with, and whether ``--model`` holds them.

``logdiff compare`` (``offline.py``) judges weights by their fingerprints. A rollout
engine's bundle may hold several weight *versions* (the trainer synced new weights
into it while it recorded: ``weight_versions`` in its metadata, a ``weight_version``
per step; ``logdiff/records/bundle.py``), so a side's fingerprints are those of the versions
the steps that fed its *matched* sequences ran with (``SideWeights``):

* one version: its fingerprints (those rounded to a narrower dtype where the capture
  kept them: ``fingerprints_at``, an fp32 trainer's);
* several: a weight equal in all of them keeps its fingerprint; a weight whose
  fingerprint differs between them is **treated as differing** (its fingerprint is
  replaced by a ``mixed:`` marker that equals nothing the other side holds): whatever
  the other side's weights, some of the compared sequences ran with others. One
  warning line counts the versions, their steps and such weights, and names the fix
  (compare the sequences of one version). A weight some version did not hash is
  unverified (None).

``model_warning`` checks ``--model``'s live weights against the training bundle's:
replay and conformance read the live model as the captured step's, so it is only used
where its fingerprints equal the bundle's.
"""

from __future__ import annotations

from typing import Any

from logdiff.records.bundle import Bundle

MIXED = "mixed:"  # the prefix of a weight's fingerprint that differs between the versions compared


class SideWeights:
    """The fingerprints of one side's weights, over the versions its matched sequences ran with."""

    def __init__(self, bundle: Bundle, keys: Any, role: str):
        self.bundle, self.role = bundle, role
        self.runs = bundle.versions_of(keys)  # (group, version) -> steps
        self._sets: dict[str | None, dict[str, str | None]] = {}
        self.changed: list[str] = []  # weights whose fingerprint differs between the versions compared

    def fingerprints(self, at: str | None = None) -> dict[str, str | None]:
        if at not in self._sets:
            self._sets[at] = self._merged(at)
        return dict(self._sets[at])

    def _merged(self, at: str | None) -> dict[str, str | None]:
        runs = sorted(self.runs) or [(self.bundle.ranks[0].layout.group("tp"), 0)]
        sets = [self.bundle.part_of(group).fingerprints(version, at) for group, version in runs]
        if len(sets) == 1:
            return sets[0] or {}
        names = list(dict.fromkeys(n for s in sets for n in (s or {})))
        out: dict[str, str | None] = {}
        for name in names:
            values = [(s or {}).get(name) for s in sets]
            if any(v is None for v in values):
                out[name] = None  # a version that did not hash it: unverified
            elif len(set(values)) > 1:
                out[name] = MIXED + "/".join(dict.fromkeys(values))
                if name not in self.changed:
                    self.changed.append(name)
            else:
                out[name] = values[0]
        return out

    def warning(self) -> str | None:
        """One line when the matched sequences ran with several weight versions that differ, else None."""
        self.fingerprints()
        versions = sorted({v for _, v in self.runs})
        if len(versions) < 2 or not self.changed:
            return None
        steps = {v: sorted({s for (_, w), run in self.runs.items() if w == v for s in run}) for v in versions}
        spans = "; ".join(f"version {v} in steps {_ranges(steps[v])}" for v in versions)
        return (f"{self.role} bundle: the matched sequences ran with {len(versions)} weight versions ({spans}), and "
                f"{len(self.changed)} weights changed between them (e.g. {self.changed[0]}): those are treated as "
                "differing; to judge one version's weights, compare only its sequences (capture the trainer on them)")


def model_warning(live: dict[str, str | None], captured: dict[str, str | None]) -> str | None:
    """One line when ``--model``'s live weights (``live``) are not those the training bundle's step ran with
    (``captured``, its fingerprints); None when every weight both name agrees (or none can be compared)."""
    from logdiff.probes.contracts import same_hash

    common = [n for n, v in captured.items() if v is not None and live.get(n) is not None and same_hash(v, live[n])]
    differs = [n for n in common if live[n] != captured[n]]
    if not differs:
        return None
    return (f"--model's weights are not those the captured step ran with: {len(differs)} of {len(common)} weights "
            f"differ from the training bundle's fingerprints (e.g. {differs[0]}), so it was not used for replay or "
            "conformance; give the checkpoint the trainer held when it was captured")


def _ranges(steps: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5`` (at most four spans, then ``...``)."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    text = [f"{a}-{b}" if b > a else str(a) for a, b in spans]
    return ", ".join(text[:4]) + (", ..." if len(text) > 4 else "")
