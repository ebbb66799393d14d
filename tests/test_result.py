"""The typed scan result without engines: its verdict, its findings, and its JSON."""

from __future__ import annotations

from logdiff.comparison.result import Cause, Findings, Located, Pair, PathInfo, ScanResult, ScanSettings, SequencesInfo

ALWAYS = ["schema_version", "tool", "created", "complete", "warnings", "model", "checkpoint", "infer_checkpoint",
          "architecture", "dtype", "settings", "environment", "paths", "sequences", "pairs", "logprobs",
          "first_divergence", "introducing_ops", "causes", "verdict"]  # fmt: skip


def _pair(infer: str, equal: float) -> Pair:
    return Pair("hf", infer, {"abs_diff_max": 1.0 - equal, "bitwise_equal_fraction": equal}, {}, {}, {})


def _result(*pairs: Pair) -> ScanResult:
    settings = ScanSettings(0, "modules", False, {"train": {}, "infer": {}}, "probe", False, 0.2)
    paths = [PathInfo("hf", "train", "forward", "hf", "5.19", {})]
    paths += [PathInfo(p.infer, "infer", "decode", "vllm", "0.32.0", {}) for p in pairs]
    return ScanResult("m", None, None, "Qwen3ForCausalLM", "bfloat16", settings, {}, paths,
                      SequencesInfo(1, "probe", None, [8], [8]), list(pairs))  # fmt: skip


def _cause(boundary: str, cls: str, kind: str, evidence: str) -> Cause:
    return Cause(boundary, None, "module", None, cls, kind, [evidence], "")


def test_without_causes_the_verdict_is_whether_the_logprobs_are_bitwise_equal() -> None:
    equal, differs = _pair("vllm", 1.0), _pair("vllm-prefill", 0.5)
    r = _result(equal, differs)
    r.conclude()
    assert r.verdict == "divergent"  # undiagnosed: every pair counts
    r.classified = True
    r.conclude()
    assert r.verdict == "consistent"  # diagnosed: the primary pair is what was diagnosed
    r = _result(differs)
    r.classified = True
    r.conclude()
    assert r.verdict == "divergent"  # differs, and no cause was found


def test_causes_decide_the_verdict_and_their_groups() -> None:
    r = _result(_pair("vllm", 0.5))
    r.classified = True
    r.add(Findings(causes=[_cause("model.layers.0.self_attn.rope_q", "operator_path", "rope_precision", "a")]))
    r.conclude()
    assert r.verdict == "operator_path" and len(r.cause_groups) == 1
    r.add(Findings(causes=[_cause("model.norm", "framework_difference", "eps", "b")]))
    r.conclude()
    assert r.verdict == "mixed" and len(r.cause_groups) == 2
    # A cause found even though the primary pair is bitwise equal (a sampling contract) still decides it.
    r = _result(_pair("vllm", 1.0))
    r.classified = True
    r.add(Findings(causes=[_cause("sampling", "framework_difference", "sampling_semantics", "c")]))
    r.conclude()
    assert r.verdict == "framework_difference"


def test_findings_merge_a_cause_at_the_same_boundary_and_kind_and_keep_the_rest() -> None:
    r = _result(_pair("vllm", 0.5))
    r.add(Findings(causes=[_cause("sampling", "framework_difference", "sampling_semantics", "contract")],
                   warnings=["w1"], contracts={"differs": []}))  # fmt: skip
    fit = _cause("sampling", "framework_difference", "sampling_semantics", "numbers")
    fit.sampling, fit.fix = {"vllm": {}}, "set temperature=1"
    r.add(Findings(causes=[fit], warnings=["w1", "w2"]))
    assert len(r.causes) == 1 and r.causes[0].evidence == ["contract", "numbers"]
    assert r.causes[0].fix == "set temperature=1" and r.causes[0].sampling == {"vllm": {}}
    assert r.warnings == ["w1", "w2"] and r.contracts == {"differs": []}  # a later step without contracts keeps them
    r.add(Findings(causes=[_cause("sampling", "framework_difference", "tokens", "bos")]))
    assert [c.kind for c in r.causes] == ["sampling_semantics", "tokens"]


def test_to_dict_is_the_documented_json() -> None:
    r = _result(_pair("vllm", 0.5), _pair("vllm-prefill", 1.0))
    r.located = Located(first_divergence={"boundary": "model.layers.0.self_attn.rope_q"})
    r.pairs[0].boundaries = []
    r.conclude()
    d = r.to_dict()
    assert list(d)[: len(ALWAYS)] == ALWAYS
    assert d["logprobs"] is d["pairs"][0]["metrics"] and d["schema_version"] == 2
    assert "boundaries" in d["pairs"][0] and "boundaries" not in d["pairs"][1]  # only located pairs carry them
    assert d["paths"][1] == {"name": "vllm", "role": "infer", "mode": "decode", "engine": "vllm",
                             "version": "0.32.0", "settings": {}}  # fmt: skip
    assert d["settings"]["depth"] == "modules" and d["sequences"]["response_lens"] == [8]
    assert "attribution" not in d and "op_trace" not in d and "timings" not in d  # absent until measured
    r.attribution, r.timings, r.peak_rss_bytes = {"residual_abs_diff_max": 0.0}, {"compare": 0.1}, 1
    assert {"attribution", "timings", "peak_rss_bytes"} <= set(r.to_dict())
