"""The docs stay true to the tree: links and section names resolve, the raw results they cite exist, every
odma-serve flag is in the serving guide, and no history label ("session 7", "issue #20") says when instead of what."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("odma", "predictor", "backends", "training", "scripts", "tests", "datasets")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def test_the_slug_matches_githubs():
    assert slug("Serving: odma vs vLLM-CPU") == "serving-odma-vs-vllm-cpu"
    assert slug("Layers (checked by `tests/test_layering.py`)") == "layers-checked-by-teststest_layeringpy"
    assert slug("Several replicas: `odma-serve --ray`") == "several-replicas-odma-serve---ray"
    assert slug("7. The ODMA paper's table, side by side") == "7-the-odma-papers-table-side-by-side"


def test_every_link_between_docs_resolves():
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in {slug(h) for h in headings(path)}:
                broken.append(f"{doc.name}: {target} (no such section)")
    assert not broken, "\n".join(broken)


def test_every_section_named_in_benchmarks_exists():
    """Code and docs cite BENCHMARKS.md sections by name: `docs/BENCHMARKS.md, "CPU linear layers"`."""
    names = headings(ROOT / "docs" / "BENCHMARKS.md")
    files = DOCS + [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".c", ".md")]
    missing = []
    for path in files:
        text = " ".join(path.read_text().split())
        for name in re.findall(r'BENCHMARKS\.md[,]? \(?"([^"]+)"', text):
            if not any(h.startswith(name) for h in names):
                missing.append(f"{path.relative_to(ROOT)}: {name!r}")
    assert not missing, "\n".join(missing)


def _patterns(spec: str) -> list[str]:
    """A cited path as globs: {a,b} alternatives, $VAR / ${VAR}, [_optional] parts and a bare T as wildcards."""
    spec = re.sub(r"\$\{?\w+\}?", "*", spec)
    spec = re.sub(r"\[[^\]]*\]", "*", spec)
    spec = re.sub(r"(?<=_)T(?=[._])", "*", spec)
    match = re.search(r"\{([^{}]*)\}", spec)
    if not match:
        return [spec]
    return [p for alt in match.group(1).split(",") for p in _patterns(spec[:match.start()] + alt + spec[match.end():])]


def test_every_cited_result_file_exists():
    files = DOCS + [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    missing = []
    for path in files:
        for spec in re.findall(r"docs/(?:results|reports)/[\w./*{},$\[\]-]+", path.read_text()):
            spec = spec.rstrip(".,")
            if not any(list(ROOT.glob(p)) for p in _patterns(spec)):
                missing.append(f"{path.relative_to(ROOT)}: {spec}")
    results = ROOT / "docs" / "results"
    for name in re.findall(r"`([\w*{},.-]+\.(?:json|txt|png|\*))`", (ROOT / "docs" / "BENCHMARKS.md").read_text()):
        if not any(list(results.rglob(p)) for p in _patterns(name)):
            missing.append(f"BENCHMARKS.md: {name}")
    assert not missing, "\n".join(missing)


def test_every_odma_serve_flag_is_in_the_serving_guide():
    from odma.server.cli import build_parser

    guide = (ROOT / "docs" / "serving.md").read_text()
    flags = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert flags and not [f for f in flags if f"`{f}`" not in guide]


def test_no_history_labels():
    """Say what the code does and date a result where the date matters; "session 12" and "issue #20" say neither."""
    label = re.compile(r"\bsession[- ]\d|\bsessions \d|\bissue #?\d", re.I)
    files = DOCS + [p for d in CODE_DIRS for p in (ROOT / d).rglob("*")
                    if p.suffix in (".py", ".c", ".md", ".sh") and p != Path(__file__).resolve()]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if label.search(line)]
    assert not found, "\n".join(found)
