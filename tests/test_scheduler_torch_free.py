"""The scheduler's policy is bookkeeping: its modules, and every module they load, import no torch (replays, benches
and the vLLM plugin's order run it without a model; a test of it needs no tensors).

Two checks: a static one over the modules' import closure inside the repository (imports run at import time, at
module level; `if TYPE_CHECKING:` blocks never run and are skipped), which names the chain that brings torch in, and
an import of the modules in a fresh interpreter where torch cannot load."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICY = ("odma.engine.scheduler", "odma.engine.scheduler_config", "odma.engine.ordering", "odma.engine.admission",
          "odma.engine.prefill_cost")
FORBIDDEN = "torch"


def source(module: str, root: Path) -> Path | None:
    """The file that defines `module` in the repository (None: a module from outside it)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def load_time_imports(path: Path) -> list[str]:
    """The modules `path` imports when it is loaded: its module-level imports (inside try/if too), not those in
    functions or under `if TYPE_CHECKING:`. `from a import b` names both a and a.b (b may be a module)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                if isinstance(child, ast.ClassDef):  # a class body runs at import time
                    visit(child)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append(child.module)
                found.extend(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def forbidden_chains(modules: tuple[str, ...], root: Path = ROOT, forbidden: str = FORBIDDEN) -> list[str]:
    """'a -> b -> torch' for each module of the repository reached from `modules` at import time that imports
    `forbidden` itself (the parent packages a module loads count: their __init__ runs first)."""
    parent: dict[str, str | None] = {}
    queue: list[str] = []

    def reach(module: str, by: str | None) -> None:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            name = ".".join(parts[:i])
            if name not in parent and source(name, root) is not None:
                parent[name] = by
                queue.append(name)

    for module in modules:
        reach(module, None)
    chains = []
    while queue:
        module = queue.pop(0)
        for imported in load_time_imports(source(module, root)):
            if imported.split(".")[0] == forbidden:
                chain, at = [forbidden], module
                while at is not None:
                    chain.append(at)
                    at = parent[at]
                chains.append(" -> ".join(reversed(chain)))
            else:
                reach(imported, module)
    return sorted(set(chains))


def test_the_scheduler_policy_loads_no_torch_through_any_import():
    assert all(source(m, ROOT) is not None for m in POLICY)
    chains = forbidden_chains(POLICY)
    assert not chains, "torch is imported by the scheduler's policy:\n" + "\n".join(chains)


def test_the_scheduler_policy_imports_with_torch_unavailable():
    code = "import sys\nsys.modules['torch'] = None  # any import of torch raises\n"
    code += "".join(f"import {m}\n" for m in POLICY)
    code += "assert sys.modules['torch'] is None\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_static_check_follows_imports_and_skips_what_never_runs(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\nfrom pkg.c import thing\n",
        "pkg/b.py": "import json\nif True:\n    import torch.nn\n",
        "pkg/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                     "def lazy():\n    import torch\nthing = 1\n"),
        "pkg/d.py": "class Holder:\n    import torch\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    assert forbidden_chains(("pkg.a",), tmp_path) == ["pkg.a -> pkg.b -> torch"]
    assert forbidden_chains(("pkg.c",), tmp_path) == []  # annotations and a function's import never run on load
    assert forbidden_chains(("pkg.d",), tmp_path) == ["pkg.d -> torch"]
