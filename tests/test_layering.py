"""Dependencies run one way: a static check of every import in the four packages (no code is imported).

Layers, lowest first: `backends` (devices; knows nothing of odma) · odma's core (errors, config, traces,
tokenizer) · `odma.kv` (the memory room) and `odma.models` · `predictor` · `odma.engine` · `odma.analyze`,
`training` · `odma.server` (with `odma.serve_ray`, the same server on Ray Serve) · `odma.bench`. A package may
import only packages listed for it below; no package imports another's private (`_name`) members; no two modules
import each other at import time.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("odma", "predictor", "backends", "training")
SUBPACKAGES = ("kv", "engine", "server", "analyze", "bench", "models")
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
    "odma.bench": {"odma.core", "odma.kv", "odma.models", "backends", "predictor", "odma.engine", "odma.analyze",
                   "odma.server"},
}


SAME_LAYER = {"serve_ray": "server"}  # odma-serve on Ray Serve: the server's layer (the CLI starts either)


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "odma":
        return parts[0]
    if len(parts) > 1 and parts[1] in SAME_LAYER:
        return f"odma.{SAME_LAYER[parts[1]]}"
    return f"odma.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else "odma.core"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> list[tuple[str, str, list[str], bool]]:
    """(importing module, imported module, names, at import time) for every import of our packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = module_name(path)

            def visit(node: ast.AST, top: bool) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                        continue  # annotations only
                    if isinstance(child, ast.Import):
                        found.extend((module, a.name, [], top) for a in child.names)
                    elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                        found.append((module, child.module, [a.name for a in child.names], top))
                    visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

            visit(ast.parse(path.read_text()), True)
    return [f for f in found if f[1].split(".")[0] in PACKAGES]


def test_packages_import_only_the_layers_below_them():
    wrong = sorted({(layer(src), layer(dst), src, dst) for src, dst, _, _ in imports()
                    if layer(src) != layer(dst) and layer(dst) not in ALLOWED[layer(src)]})
    assert not wrong, "imports against the layering:\n" + "\n".join(f"{s} imports {d}" for *_, s, d in wrong)


def test_no_private_name_crosses_a_package():
    crossing = [(src, dst, n) for src, dst, names, _ in imports() for n in names
                if n.startswith("_") and not n.startswith("__") and layer(src) != layer(dst)]
    assert not crossing


def test_no_import_cycle_between_modules():
    known = {module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst, names, top in imports():
        if not top:
            continue
        for target in [f"{dst}.{n}" for n in names if f"{dst}.{n}" in known] or [dst]:
            if target != src and not src.startswith(target + "."):  # a package's own __init__ is no cycle
                graph[src].add(target)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def dfs(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycle.extend(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
                return True
            if nxt not in state and dfs(nxt, path + [nxt]):
                return True
        state[node] = 2
        return False

    for start in sorted(graph):
        if start not in state and dfs(start, [start]):
            break
    assert not cycle, " -> ".join(cycle)


def test_the_check_sees_real_imports():
    found = imports()
    assert len(found) > 200  # the walk reaches the whole tree
    assert any(src == "odma.engine.scheduler" and dst == "odma.kv" for src, dst, _, _ in found)
