"""The diagnosis of a localized divergence: what caused it, of which class, and how much of it.

One module a step, each importing only ``cause`` (the values) and the steps it
builds on, never ``logdiff.comparison.result``:

* ``cause``: ``Cause``, ``Findings``, the verdict rule;
* ``spacing``: dtype spacing and the rounding bounds every check measures in;
* ``preflight``: the effective contracts of both engines and the weight fingerprints;
* ``conformance``: each side's output against the exact (fp64) function its own
  contract names, on its own recorded inputs;
* ``classify``: per introducing op, the class and kind from contracts and conformance;
* ``attribute``: Shapley shares of the gap over the cause families;
* ``sampling``, ``routing``: the sampling-semantics and MoE-routing findings;
* ``diagnose``: the steps in order, on a measured scan;
* ``closure``: how much of the gap the causes can account for, what enters after the last compared
  boundary, and whether it is identified (else the ``unexplained`` verdict); run last, by ``scan`` and
  ``compare`` alike.
"""
