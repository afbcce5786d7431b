"""The shape of the code, kept by tests: small files, short functions, no dead code, no import cycles, and
comments that stand on their own (no citations of documents outside the repository)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60
# Documents a reader of the repository cannot open: the project's planning notes live outside it.
CITATION = re.compile(r"seed ?0\d\d|seeds/|DESIGN\.md|reference/|engine-anchor|peer-routers|vllm-pd-protocol"
                      r"|\.\./shared")


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def test_no_file_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in python_files("pdserve")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_too_long():
    long = []
    for path in python_files("pdserve"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_dead_code():
    """vulture over the product and everything that uses it; what it cannot see is in tests/vulture_whitelist.py."""
    try:
        import vulture  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("vulture is not installed (it is in the test extra)")
    run = subprocess.run([sys.executable, "-m", "vulture", "pdserve", "tests", "scripts", "bench",
                          "--min-confidence", "60"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    dead = [line for line in run.stdout.splitlines() if line.startswith("pdserve")]
    assert not dead, "unused code (delete it, or whitelist it with the reason):\n" + "\n".join(dead)


def test_comments_cite_nothing_outside_the_repository():
    files = python_files("pdserve", "tests", "scripts", "bench") + sorted((ROOT / "docs").glob("*.md"))
    files += [ROOT / "README.md", ROOT / "bench" / "README.md"]
    found = []
    for path in files:
        if path.name == Path(__file__).name or not path.exists():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CITATION.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "say what is meant instead of citing a document outside the repository:\n" + "\n".join(found)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The pdserve modules this file imports when it is imported (not under TYPE_CHECKING, not in functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
    return out & modules


def test_no_import_cycles():
    paths = python_files("pdserve")
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): module_imports(p, modules) - {module_name(p)} for p in paths}
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            cycle = stack[stack.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for dependency in sorted(graph.get(module, ())):
            visit(dependency, stack + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
