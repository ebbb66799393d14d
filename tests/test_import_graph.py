"""Who may import whom (../shared/design.md), held on the source: no import circles, and the layers.

Every module of the four packages (``logdiff`` = logdiff/, ``logdiff.kernels`` = kernels/,
``logdiff.probes`` = probes/, ``logdiff.reports`` = reports/: pyproject's package-dir) is parsed
with ``ast``, never imported, and every import of one of our modules is an edge: at module level,
inside a function (a lazy import is a dependency all the same), under ``if TYPE_CHECKING``, relative
ones resolved, and ``from pkg import name`` an edge to the submodule ``pkg.name`` where there is one
(to ``pkg`` itself otherwise). A package's ``__init__`` running before its submodules is not an edge.
New modules are picked up as the directories are scanned.

1. No circles: the strongly connected components of the graph are single modules; a failure
   names one circle, module by module.
2. The layers. A module's layer is the longest name in ``LAYERS`` it equals or lies under
   (``EXACT`` first); a module named nowhere is ``scan``. Each layer imports only ``MAY_IMPORT``:

   ==========  =====================================================================  ==============================
   layer       modules                                                                may import
   ==========  =====================================================================  ==============================
   kernels     kernels/                                                               nothing of ours
   probes      probes/ (hooks, records, bundles, adapters)                            probes, kernels
   reports     reports/ (renders the result dict)                                     nothing of ours
   common      errors, isa, phases, version, sequences, dumps, config, options, ...   common, interface, registry,
                                                                                      probes, kernels
   interface   ``logdiff.engines`` (default names), ``engines.base`` (the protocol)   common, probes, kernels
   registry    ``engines.registry`` (lists the engines), ``engines.pool``             + sources (it lists them)
   source      every engine folder (hf, vllm, megatron, ...), ``logdiff.msprobe``    source, interface, common,
                                                                                      probes, kernels, reports
   comparison  compare, locate, offline, bundle_feed, bundle_checks, bundle_weights,  comparison, common, interface,
               bundle_shards, nonfinite, result, environment, diagnosis/              registry, probes, kernels,
                                                                                      reports
   scan        pipeline and everything else: batch_probe, check, outputs, doctor,     anything but top
               integrations/, demo/, ...
   top         the ``logdiff`` package (the public API) and ``logdiff.cli``           anything
   ==========  =====================================================================  ==============================

   So the comparison imports no source except through the protocol (``engines.base``) and the
   registry, which lists the implementations and is imported by none of them; sources never import
   the comparison or the scan; nothing imports the scan back from below.
3. A source is one folder: it imports no other source folder, except the crossings in
   ``CROSSINGS``, each with its reason (every one listed must still exist, so the table shrinks as
   they are removed).

What it cannot see: an import by a computed name (``importlib.import_module(f"...{x}")``). Two
registries use one: ``kernels/registry.py`` (the catalogue; no kernel imports it) and
``probes/arch/base.py`` (``FAMILIES``), whose family modules import ``base`` back for ``register``:
the circle design.md forbids, not yet split (a registry module importing the families, as
``logdiff/engines/registry.py`` does for the engines).

Negative controls: a planted package with a circle through a relative, lazy ``from pkg import
submodule`` import is found (and the same package without the back edge is not); a planted
comparison -> engine edge and a planted source -> scan edge are reported; the parser sees the lazy,
relative and ``TYPE_CHECKING`` imports the real code holds.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: modules that are their layer by their exact name only (their submodules are placed by ``LAYERS``)
EXACT = {"logdiff": "top", "logdiff.engines": "interface"}
#: layer -> the names it holds (each name and everything under it; the longest name wins)
LAYERS = {
    "kernels": ("logdiff.kernels",),
    "probes": ("logdiff.probes",),
    "reports": ("logdiff.reports",),
    "common": ("logdiff.errors", "logdiff.isa", "logdiff.phases", "logdiff.version", "logdiff.sequences",
               "logdiff.dumps", "logdiff.config", "logdiff.options", "logdiff.override_types"),
    "interface": ("logdiff.engines.base",),
    "registry": ("logdiff.engines.registry", "logdiff.engines.pool"),
    "source": ("logdiff.engines", "logdiff.msprobe"),
    "comparison": ("logdiff.compare", "logdiff.locate", "logdiff.offline", "logdiff.bundle_feed",
                   "logdiff.bundle_checks", "logdiff.bundle_weights", "logdiff.bundle_shards", "logdiff.nonfinite", "logdiff.result",
                   "logdiff.environment", "logdiff.diagnosis"),
    "top": ("logdiff.cli",),
}
ALL = frozenset([*LAYERS, "scan"])
MAY_IMPORT = {
    "kernels": {"kernels"},
    "probes": {"probes", "kernels"},
    "reports": {"reports"},
    "common": {"common", "interface", "registry", "probes", "kernels"},
    "interface": {"interface", "common", "probes", "kernels"},
    "registry": {"registry", "interface", "source", "common", "probes", "kernels"},
    "source": {"source", "interface", "common", "probes", "kernels", "reports"},
    "comparison": {"comparison", "common", "interface", "registry", "probes", "kernels", "reports"},
    "scan": ALL - {"top"},
    "top": ALL,
}
#: (source folder, another source folder it imports) -> why; each must still exist
CROSSINGS = {
    ("logdiff.engines.vllm_ascend", "logdiff.engines.vllm"): "vllm-ascend is the vllm engine on Ascend's platform",
    ("logdiff.engines.vllm", "logdiff.engines.vllm_ascend"):
        "vllm's consistent mode picks its NPU backend (vllm_ascend.consistent) by platform",
    ("logdiff.msprobe", "logdiff.engines.hf"):
        "an HF TP msprobe dump is placed by the plan logdiff's own HF TP capture runs (tensor_parallel.tp_plan)",
    ("logdiff.msprobe", "logdiff.engines.vllm"):
        "a vLLM TP msprobe dump is placed by the layer types engines/vllm/placements.py declares, not a copy",
}


# ------------------------------------------------------------------------------------------- the graph


def packages(root: Path = ROOT) -> dict[str, Path]:
    """Our top-level packages and their folders: pyproject's ``[tool.setuptools.package-dir]`` (read with a
    regular expression: ``tomllib`` is Python 3.11+, the project 3.10+), ``logdiff`` first."""
    text = (root / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [tool.setuptools.package-dir]"
    dirs = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1), re.M))
    assert dirs.get("logdiff") == "logdiff", dirs
    return {"logdiff": root / "logdiff", **{k: root / v for k, v in dirs.items() if k != "logdiff"}}


def modules(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``), for every ``.py`` under each root."""
    out: dict[str, tuple[Path, bool]] = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join([package, *(parts[:-1] if init else parts)])] = (path, init)
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str, init: bool, known: Iterable[str]) -> list[str]:
    """The module names one import statement in module ``name`` reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if init else name.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    return subs + ([base] if len(subs) < len(node.names) else [])


def _owner(target: str, known: dict[str, tuple[Path, bool]]) -> str | None:
    """The module of ours ``target`` names (``logdiff.x.attr`` -> ``logdiff.x``), or None."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its source (module level, functions, TYPE_CHECKING)."""
    known = modules(roots)
    graph: dict[str, set[str]] = {}
    for name, (path, init) in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, init, known):
                    owner = _owner(target, known)
                    if owner is not None and owner != name:
                        edges.add(owner)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; our graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_shortest_circle(graph, set(c)) for c in components]


def _shortest_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest circle through the component's first module, by breadth-first search inside it."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start} in its component")  # pragma: no cover


def layer_of(module: str) -> str:
    if module in EXACT:
        return EXACT[module]
    best, layer = "", "scan"
    for name, names in LAYERS.items():
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, layer = prefix, name
    return layer


def source_folder(module: str) -> str | None:
    """The source folder a module belongs to (``logdiff.engines.hf``, ``logdiff.msprobe``), or None."""
    if layer_of(module) != "source":
        return None
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1] == "engines" else ".".join(parts[:2])


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge the layers or the one-folder rule forbid, one line each."""
    out = []
    for module in sorted(graph):
        layer = layer_of(module)
        for target in sorted(graph[module]):
            if layer_of(target) not in MAY_IMPORT[layer]:
                out.append(f"{module} ({layer}) imports {target} ({layer_of(target)}); "
                           f"{layer} may import only {', '.join(sorted(MAY_IMPORT[layer]))}")
            mine, theirs = source_folder(module), source_folder(target)
            if mine and theirs and mine != theirs and (mine, theirs) not in CROSSINGS:
                out.append(f"{module} imports {target}: a source is one folder and touches no other source")
    return out


def crossings(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(source_folder(m), source_folder(t)) for m, ts in graph.items() for t in ts
            if source_folder(m) and source_folder(t) and source_folder(m) != source_folder(t)}


# ------------------------------------------------------------------------------------------- the checks


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(packages())


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_layers(graph: dict[str, set[str]]) -> None:
    found = violations(graph)
    assert not found, "imports across the layers of design.md:\n" + "\n".join(found)


def test_every_listed_name_and_crossing_exists(graph: dict[str, set[str]]) -> None:
    """A name in the tables that matches no module, or a crossing that no longer exists, is stale."""
    names = [*EXACT, *(n for names in LAYERS.values() for n in names)]
    stale = [n for n in names if not any(m == n or m.startswith(n + ".") for m in graph)]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"
    gone = set(CROSSINGS) - crossings(graph)
    assert not gone, f"CROSSINGS lists crossings that no longer exist (remove them): {sorted(gone)}"


def test_the_parser_sees_lazy_relative_and_type_checking_imports(graph: dict[str, set[str]]) -> None:
    """Edges the real code holds only inside a function, only relatively, or only for type checking."""
    assert "logdiff.bundle_feed" in graph["logdiff.pipeline"]  # lazy, in ``_score``
    assert "logdiff.kernels.attention_backward" in graph["logdiff.kernels.attention"]  # relative and lazy
    assert "logdiff.diagnosis.distribution" in graph["logdiff.diagnosis.truncation"]  # under TYPE_CHECKING
    assert "logdiff.probes.ulps" in graph["logdiff.probes.store"]  # lazy, in ``PathStore.emit``
    assert "logdiff.engines.hf" in graph["logdiff.engines.registry"]  # the registry lists the engines
    for package in packages():  # every folder of pyproject's package-dir was scanned, not only logdiff/
        assert package in graph and any(m.startswith(package + ".") for m in graph), package


def test_control_a_planted_circle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    from .. import c\n    return c\n")
    (pkg / "c.py").write_text("def g():\n    from planted import a\n    return a.b\n")
    roots = {"planted": pkg}
    found = circles(import_graph(roots))
    assert found == [["planted.a", "planted.sub.b", "planted.c", "planted.a"]]
    (pkg / "c.py").write_text("def g():\n    import os\n    return os\n")  # the back edge removed
    graph = import_graph(roots)
    assert circles(graph) == [] and graph["planted.sub.b"] == {"planted.c"}


def test_control_planted_layer_crossings_are_reported(graph: dict[str, set[str]]) -> None:
    planted = {k: set(v) for k, v in graph.items()}
    planted["logdiff.offline"].add("logdiff.engines.hf")  # the comparison naming an engine
    planted["logdiff.msprobe.convert"].add("logdiff.pipeline")  # a source importing the scan
    planted["logdiff.msprobe.convert"].add("logdiff.engines.megatron.capture")  # a source touching another
    planted["logdiff.probes.bundle"].add("logdiff.errors")  # probes importing logdiff's top level
    found = violations(planted)
    expected = ["logdiff.offline (comparison) imports logdiff.engines.hf (source)",
                "logdiff.msprobe.convert (source) imports logdiff.pipeline (scan)",
                "logdiff.msprobe.convert imports logdiff.engines.megatron.capture: a source is one folder",
                "logdiff.probes.bundle (probes) imports logdiff.errors (common)"]
    for line in expected:
        assert any(f.startswith(line) for f in found), (line, found)
    assert len(found) == len(expected) + len(violations(graph))
    planted["logdiff.engines.base"].add("logdiff.engines.registry")  # the protocol importing its registry
    assert any({"logdiff.engines.base", "logdiff.engines.registry"} <= set(c) for c in circles(planted))
