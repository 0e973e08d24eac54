"""Dependencies run one way: a static check of every import in the four packages (no code is imported).

Layers, lowest first: `backends` (devices; knows nothing of odma) · odma's core (errors, config, traces,
tokenizer) · `odma.kv` (the memory room) and `odma.models` · `predictor` · `odma.engine` · `odma.analyze`,
`training` · `odma.server` and `odma.vllm` (odma's scheduler inside vLLM) · `odma.serve_ray` (the same server on
Ray Serve, built on odma.server) · `odma.bench`. A
package may import only packages listed for it below; no package imports another's private (`_name`) members; and
no chain of imports between modules leads back to where it started.

Every import counts as a dependency: at module level, inside a function (imported lazily, when first called) and
under `if TYPE_CHECKING:` (for annotations only). A lazy import postpones a dependency; it does not remove it, and
a cycle through one still means neither module can be understood, tested or moved without the other.

Not counted, on purpose: a module named by a string and imported with importlib when a user asks for it. Two
places do that, as registries: `predictor.registry` (a predictor's kind → "module:attribute") and odma-serve's
`--ray` (`odma.server.cli.RAY_ENTRY`). They are extension points of the lower layer: it names the entry it calls
and never reads the other package's code at import time; `test_the_named_entry_points_exist` checks the names.

`scripts/` (tools: setup, gpu_check, generators, kernel benchmarks, server probes) and `scripts/studies/` (studies
that each reproduce a past figure) sit above every package: a script may import any package, never another's
private names, and nothing imports a script: not a package, not another script (what two scripts share belongs in
a package), not a test by a name put on sys.path (a test that exercises a script loads it from its file). A script
is imported by its bare name, which is how such an import is found here; neither a package nor a script imports
the tests.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("odma", "predictor", "backends", "training")
SCRIPTS = "scripts"  # scripts/*.py and scripts/studies/*.py
LAYERED = (*PACKAGES, SCRIPTS)  # what the layers below cover
SUBPACKAGES = ("kv", "engine", "server", "serve_ray", "analyze", "bench", "models", "vllm")
ALLOWED = {
    "backends": set(),
    "odma.core": set(),
    "odma.kv": {"odma.core", "backends"},
    "odma.models": {"odma.core", "backends"},
    "predictor": {"odma.core", "odma.kv", "odma.models", "backends"},  # the probe runs the served model itself
    "odma.engine": {"odma.core", "odma.kv", "odma.models", "backends", "predictor"},
    "odma.analyze": {"odma.core", "odma.kv", "predictor", "odma.engine"},  # it simulates the engine's scheduler
    "training": {"odma.core", "odma.kv", "odma.models", "backends", "predictor", "odma.engine"},
    "odma.server": {"odma.core", "odma.kv", "odma.models", "odma.engine", "predictor"},
    "odma.vllm": {"odma.core", "odma.kv", "odma.models", "odma.engine", "predictor", "backends"},  # its CPU kernel
    "odma.serve_ray": {"odma.core", "odma.kv", "odma.models", "odma.engine", "predictor", "odma.server"},
    "odma.bench": {"odma.core", "odma.kv", "odma.models", "backends", "predictor", "odma.engine", "odma.analyze",
                   "odma.server", "odma.serve_ray"},
}
ALLOWED[SCRIPTS] = set(ALLOWED)  # every package; nothing imports a script


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "odma":
        return parts[0]
    return f"odma.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else "odma.core"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bare_names() -> dict[str, str]:
    """A script's or a test's file name → its module here ("gemm_decode_rows" → "scripts.gemm_decode_rows"): the
    name it is imported by from its own folder or from a folder put on sys.path."""
    scripts = {p.stem: module_name(p) for p in (ROOT / SCRIPTS).rglob("*.py")}
    tests = {p.stem: module_name(p) for p in (ROOT / "tests").glob("*.py")}
    return {**tests, **scripts}


def imports(sources: tuple[str, ...] = LAYERED) -> list[tuple[str, str, list[str], str]]:
    """(importing module, imported module, names, where) for every import of our packages, scripts and tests
    made by the modules under `sources`; where is "module" (at import time), "function" (lazy) or "annotations"
    (under `if TYPE_CHECKING:`)."""
    found = []
    bare = bare_names()
    for package in sources:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = module_name(path)

            def visit(node: ast.AST, where: str) -> None:
                for child in ast.iter_child_nodes(node):
                    inner = where
                    if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                        inner = "annotations"
                    elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                        inner = "function" if where == "module" else where
                    if isinstance(child, ast.Import):
                        found.extend((module, bare.get(a.name, a.name), [], where) for a in child.names)
                    elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                        found.append((module, bare.get(child.module, child.module), [a.name for a in child.names],
                                      where))
                    elif isinstance(child, ast.ImportFrom):  # relative imports would slip past the names below
                        raise AssertionError(f"{module}: use absolute imports (from {package}...)")
                    visit(child, inner)

            visit(ast.parse(path.read_text()), "module")
    return [f for f in found if f[1].split(".")[0] in (*LAYERED, "tests")]


def module_graph() -> dict[str, dict[str, set[str]]]:
    """Module → the project modules it imports → how ("module", "function", "annotations"). `from pkg import x`
    depends on `pkg.x` when that is a module, else on `pkg` (its __init__); a module's own package is no edge."""
    known = {module_name(p) for pkg in LAYERED for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for src, dst, names, where in imports():
        for target in [f"{dst}.{n}" for n in names if f"{dst}.{n}" in known] or [dst]:
            if target != src and not src.startswith(target + "."):
                graph[src][target].add(where)
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle
    lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_packages_import_only_the_layers_below_them():
    wrong = sorted({(layer(src), layer(dst), src, dst) for src, dst, _, _ in imports()
                    if layer(src) != layer(dst) and layer(dst) not in ALLOWED[layer(src)]})
    assert not wrong, "imports against the layering:\n" + "\n".join(f"{s} imports {d}" for *_, s, d in wrong)


def test_nothing_imports_a_script():
    found = sorted({f"{src} imports {dst}" for src, dst, _, _ in imports((*LAYERED, "tests"))
                    if layer(dst) == SCRIPTS})
    assert not found, "\n".join(found)


def test_no_package_or_script_imports_the_tests():
    found = sorted({f"{src} imports {dst}" for src, dst, _, _ in imports() if layer(dst) == "tests"})
    assert not found, "\n".join(found)


def test_no_private_name_crosses_a_package():
    crossing = [(src, dst, n) for src, dst, names, _ in imports() for n in names
                if n.startswith("_") and not n.startswith("__") and layer(src) != layer(dst)]
    assert not crossing, "\n".join(f"{src} imports {dst}.{n}" for src, dst, n in crossing)


def test_no_import_cycle_between_modules():
    graph = module_graph()
    found = cycles(graph)

    def describe(component: list[str]) -> str:
        return "\n".join(f"  {a} -> {b} ({', '.join(sorted(graph[a][b]))})"
                         for a in component for b in sorted(graph[a]) if b in component)

    assert not found, "import cycles:\n" + "\n\n".join(describe(c) for c in found)


def test_the_cycle_check_finds_a_cycle_through_lazy_and_annotation_imports():
    graph = {"a": {"b": {"module"}}, "b": {"c": {"function"}}, "c": {"a": {"annotations"}}, "d": {"a": {"module"}}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": {"module"}}, "b": {}}) == []


def test_the_named_entry_points_exist():
    import importlib

    from odma.server.cli import RAY_ENTRY

    module, _, function = RAY_ENTRY.partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_check_sees_real_imports():
    found = imports()
    assert len(found) > 200  # the walk reaches the whole tree
    assert any(src == "odma.engine.scheduler" and dst == "odma.kv" for src, dst, _, _ in found)
    assert {where for *_, where in found} == {"module", "function", "annotations"}
    scripts = {src for src, *_ in found if layer(src) == SCRIPTS}
    assert {"scripts.random_gguf", "scripts.studies.predictor_pays"} <= scripts  # scripts/ and scripts/studies/
    assert any(src == "scripts.studies.balloon_seeds" and dst == "odma.bench" for src, dst, _, _ in found)


def test_a_script_or_test_imported_by_its_bare_name_is_seen():
    bare = bare_names()
    assert bare["gemm_decode_rows"] == "scripts.gemm_decode_rows"
    assert bare["noise_ceiling"] == "scripts.studies.noise_ceiling"
    assert bare["test_model_smollm2"] == "tests.test_model_smollm2"
    assert layer(bare["noise_ceiling"]) == SCRIPTS and layer(bare["test_model_smollm2"]) == "tests"
