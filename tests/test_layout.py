"""The shape of the package, kept by a test: one way in (the engine never
touches GGUF; every entrance loads through ``loading``), no import cycles
(function-level imports included), no private names imported across
packages, files and functions small enough to read, and one table of
environment switches that the docs print."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "fastllm"
MAX_FUNCTION_LINES = 120
MAX_ENTRANCE_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str) -> list[tuple[str, str]]:
    """(imported module, imported name or '') of every fastllm import in
    ``module``, at any depth (function-level imports included)."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".")
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] == "fastllm":
                found += [(src, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "fastllm"]
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for src, name in _imports(module):
            if name == "_core":  # the compiled module: no Python imports of its own
                continue
            target = f"{src}.{name}" if f"{src}.{name}" in MODULES else src
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_the_engine_never_touches_gguf():
    for path in (PKG / "engine").glob("*.py"):
        assert "gguf" not in path.read_text().lower(), path


def test_entrances_load_through_loading_only():
    """The CLI, the benchmark, the server and Ray reach models through
    ``fastllm.loading``, never ``gguf/`` or a loader of their own."""
    entrances = [
        m for m in MODULES if m.split(".")[1:2] in (["cli"], ["benchmark"], ["server"], ["ray"])
    ]
    for module in entrances:
        for src, _ in _imports(module):
            assert not src.startswith(("fastllm.gguf", "fastllm.models.loader")), (module, src)


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(MODULES):
        if v not in index:
            visit(v)
    assert not cycles


def test_no_private_names_across_packages():
    bad = []
    for module in MODULES:
        for src, name in _imports(module):
            private = name.startswith("_") and not name.startswith("__") and name != "_core"
            if private and _package_of(module) != (
                src
                if src in MODULES and MODULES[src].name == "__init__.py"
                else src.rsplit(".", 1)[0]
            ):
                bad.append((module, f"{src}.{name}"))
    assert not bad


def test_functions_and_entrance_files_are_small():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append((module, node.name, n))
    assert not long
    for name in ("cli.py", "server/app.py"):
        assert len((PKG / name).read_text().splitlines()) < MAX_ENTRANCE_LINES, name


def test_every_environment_switch_is_in_the_table_and_the_docs():
    from fastllm import envs

    used = set()
    for path in [*PKG.rglob("*.py"), *(ROOT / "rust").rglob("*.rs")]:
        used |= set(re.findall(r"\bFASTLLM_[A-Z_]+\b", path.read_text()))
    table = {s.name for s in envs.SWITCHES}
    assert used <= table, used - table
    docs = (ROOT / "docs" / "architecture.md").read_text()
    assert envs.markdown_table() in docs
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}" in readme for name in table), table
    # Python reads them only through envs.py
    for path in PKG.rglob("*.py"):
        if path.name != "envs.py":
            assert 'os.environ.get("FASTLLM' not in path.read_text(), path
