"""Devices by capability, never by name: outside backends/ no code compares a device's name.

A caller that writes `if device.type == "cuda"` or `device.startswith("cpu")` owes the backend a question instead
(`backends.for_device(spec).capabilities`, `backend.capabilities`), so that a new accelerator is one file in backends/
and one registry line, with no edit elsewhere. A static check (the code checked is not imported): every string
constant naming a device kind of the registry (cpu, cuda, mlu, or a prefix such as "cuda:") that is an operand of a
comparison (==, !=, in, is, inside a tuple or set operand too), an argument of str.startswith / endswith, or a `case`
pattern. Naming a device is fine (a CLI default, a `.to("cpu")`); branching on one is not. tests/ are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

from backends import BACKENDS

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("odma", "predictor", "training", "scripts")
KINDS = tuple(BACKENDS)  # a kind registered later is checked too


def names_a_device(node: ast.AST) -> bool:
    """A string constant that is a device kind or begins with one and a colon ("cuda:0"), or a tuple / list / set of
    expressions one of which is. Case counts: torch spells devices in lower case ("CPU" in a profiler's event type
    names where an event ran, not a device to choose)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip().partition(":")[0] in KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(names_a_device(e) for e in node.elts)
    return False


def device_name_tests(source: str) -> list[tuple[int, str]]:
    """(line, code) for every place in `source` that branches on a device's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            hit = any(names_a_device(operand) for operand in [node.left, *node.comparators])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = node.func.attr in ("startswith", "endswith") and any(names_a_device(a) for a in node.args)
        elif isinstance(node, ast.MatchValue):
            hit = names_a_device(node.value)
        else:
            continue
        if hit:
            found.append((node.lineno, ast.get_source_segment(source, node) or ast.dump(node)))
    return sorted(found)


def test_no_device_name_is_compared_outside_backends():
    found = [f"{path.relative_to(ROOT)}:{line}: {code}"
             for package in CHECKED for path in sorted((ROOT / package).rglob("*.py"))
             for line, code in device_name_tests(path.read_text())]
    assert not found, "ask the backend's capabilities instead of comparing device names:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_a_name_test():
    assert {"cpu", "cuda", "mlu"} <= set(KINDS)
    forms = [
        'device.type == "cuda"',
        'backend.name != "cpu"',
        'spec.startswith("mlu")',
        'spec.startswith(("cpu", "cuda:"))',
        'device.type in ("cuda", "mlu")',
        '"cuda:0" == spec',
        'spec.lower().endswith("cpu")',
        'backend.device.type != "mlu"',
        'name not in {"cuda:0", "cuda:1"}',
        'match kind:\n    case "mlu":\n        pass',
    ]
    for code in forms:
        assert device_name_tests(code), code


def test_the_check_leaves_naming_a_device_alone():
    fine = [
        'p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | mlu[:N]")',
        'x.to("cpu", torch.bfloat16)',
        'torch.device("cuda", 0)',
        'get_backend("cpu").linear_kernel()',
        'line.startswith("data: ")',
        'label == "cpu-bound"',
        'kind == other_kind',
        'event.device_type.name != "CPU"',
        'device.startswith("cpus")',
    ]
    for code in fine:
        assert not device_name_tests(code), code
