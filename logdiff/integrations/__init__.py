"""logdiff inside RL frameworks: one call each, at the framework's own hook points.

An integration writes nothing of its own: it calls the captures every source uses (``logdiff.capture`` on the
trainer's model, the vLLM worker capture on the rollout engine) around the framework's log-prob pass and its
rollout, names the bundles by the framework's step, and, where both sides live in one process, runs
``logdiff compare`` on them. Each imports its framework lazily: logdiff depends on none of them.

* ``trl``: TRL's ``GRPOTrainer`` with vLLM colocated (run in the suite), and its consistent mode;
* ``verl``: verl 0.9's FSDP engine and its vLLM rollout server (written against its source; verl needs CUDA).

OpenRLHF has a section in docs/capture.md (the calls to place by hand), no module.
"""
