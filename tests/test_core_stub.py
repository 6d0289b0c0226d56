"""``python/fastllm/_core.pyi`` describes the compiled module exactly: the same
public names, and for every function and method the same argument names (and
defaults, where the runtime exposes a ``__text_signature__``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from fastllm import _core

STUB = Path(__file__).resolve().parents[1] / "python" / "fastllm" / "_core.pyi"


def _public(names):
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text())


def _stub_names(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def _stub_params(fn: ast.FunctionDef, skip_self: bool) -> list[tuple[str, str | None]]:
    """(name, default source or None) of a stub function's parameters."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [(a.arg, d) for a, d in zip(positional, defaults)]
    params += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if skip_self and params and params[0][0] in ("self", "cls"):
        params = params[1:]
    return [(n, None if d is None else ast.unparse(d)) for n, d in params]


def _runtime_params(obj) -> list[tuple[str, str | None]] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append((p.name, None if p.default is p.empty else repr(p.default)))
    return out


def _normalise(default: str | None) -> str | None:
    """A default as a value, so that ``200_000_000`` and ``200000000`` compare equal."""
    if default is None:
        return None
    try:
        return repr(ast.literal_eval(default))
    except (ValueError, SyntaxError):
        return default


def _compare(where: str, stub: list, runtime: list | None, problems: list[str]) -> None:
    if runtime is None:
        return
    s_names = [n for n, _ in stub]
    r_names = [n for n, _ in runtime]
    if s_names != r_names:
        problems.append(f"{where}: stub arguments {s_names}, module {r_names}")
        return
    for (n, sd), (_, rd) in zip(stub, runtime):
        if _normalise(sd) != _normalise(rd):
            problems.append(f"{where}({n}): stub default {sd}, module {rd}")


def stub_problems(tree: ast.Module) -> list[str]:
    """Every difference between the stub and the compiled module, in words."""
    problems: list[str] = []
    stub = _stub_names(tree)
    module = _public(dir(_core))
    stub_public = _public(stub)
    for name in sorted(module - stub_public):
        problems.append(f"{name}: in the module, missing from the stub")
    for name in sorted(stub_public - module):
        problems.append(f"{name}: in the stub, not in the module")
    for name in sorted(module & stub_public):
        node, obj = stub[name], getattr(_core, name)
        if isinstance(node, ast.FunctionDef):
            _compare(name, _stub_params(node, False), _runtime_params(obj), problems)
        elif isinstance(node, ast.ClassDef):
            members = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
            attrs = {
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            runtime = {n for n in vars(obj) if not n.startswith("_")}
            for m in sorted(runtime - set(members) - attrs):
                problems.append(f"{name}.{m}: in the module, missing from the stub")
            for m in sorted((set(members) | attrs) - runtime - {"__init__"}):
                problems.append(f"{name}.{m}: in the stub, not in the module")
            for m, fn in members.items():
                if m == "__init__":
                    _compare(f"{name}()", _stub_params(fn, True), _runtime_params(obj), problems)
                elif m in runtime:
                    _compare(
                        f"{name}.{m}",
                        _stub_params(fn, True),
                        _runtime_params(getattr(obj, m)),
                        problems,
                    )
    return problems


def test_stub_matches_compiled_module():
    assert stub_problems(_stub_tree()) == []


def test_check_catches_a_missing_name_and_a_renamed_argument():
    tree = _stub_tree()
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.args.args]
    victim = fns[0]
    tree.body.remove(victim)
    assert any(victim.name in p for p in stub_problems(tree))
    tree = _stub_tree()
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.args.args)
    fn.args.args[0].arg += "_renamed"
    assert any(fn.name in p for p in stub_problems(tree))
