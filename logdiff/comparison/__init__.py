"""The comparison: two sides' records in, per-token metrics, the first divergence and the introducing ops out.

``pairing`` lines two bundles up on one set of sequences and feeds their records into a session's sinks;
``bundle_feed``, ``bundle_checks``, ``bundle_weights`` and ``bundle_shards`` read what a bundle says of
how it was captured; ``metrics`` gives the verl-named per-token metrics; ``locate`` finds where the
values first part and which ops introduce error; ``result`` and ``cause`` are the typed result
(``result.json``'s one serialization) and the vocabulary of causes the diagnosis fills in.

It never imports a source (only the protocol, ``sources.base``, and the registry), nor the diagnosis.
"""
