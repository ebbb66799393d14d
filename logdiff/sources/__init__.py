"""The paths: one folder per engine, behind the one interface of ``base.Engine``.

``hf`` (the training path: one teacher-forced forward, and ``hf-decode``, HF's
own KV-cache decode) and ``vllm`` (the inference path, decode and prefill) each
live in their own folder with what only they know: how to load on a device,
how to score and sample, their contract reader and their consistent-mode
installer, its tap mapping and contract readers for the architectures. Adding an
engine (SGLang, Megatron, vllm-ascend) is one folder plus a line in
``registry._builtin``, or a third-party package registering through the
``logdiff.sources`` entry-point group; the rest of logdiff asks engines for
capabilities (``base.CAPABILITIES``), never for a name. docs/engines.md;
tests/conformance/fake is a worked example.

Who imports whom here: an engine's folder imports ``base`` (the interface) and its
own modules; ``registry`` (names -> classes) imports the engines it lists, and
``pool`` (loaded engines, reused across scans) imports the registry. No engine
imports either, so no import circle runs through them (tests/test_import_graph.py).
"""

#: the engines a scan runs unless told otherwise: the training path, and the inference path it checks
DEFAULT_TRAIN = "hf"
DEFAULT_INFER = "vllm"
