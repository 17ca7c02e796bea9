"""jax_ls2's subpackages depend on each other in one direction only: the top-level
private modules, then ``ops`` <- ``fp8`` <- ``nn``, with ``parallel`` (on ``ops``) and
``optim`` below ``nn`` (``optim`` on nothing but the private modules, so below ``fp8``,
whose optimizer step helpers call it). Every import counts, wherever it is written (module level or inside a
function), and so does ``importlib.import_module("jax_ls2...")``. The plain-Flax twin
(``flax_models/plain``) imports no jax_ls2 code at all.

Read from the sources with ``ast``, nothing is imported."""
from __future__ import annotations

import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_ls2"
PLAIN = ROOT / "flax_models" / "plain"

PRIVATE = {"_C", "_ffi", "_dispatch", "_random", "_deprecation"}
# What each unit may import (besides itself). The package's own __init__ is left out:
# it only re-exports, and no unit imports it by its bare name.
ALLOWED = {
    "_C": set(),
    "_ffi": {"_C"},
    "_random": set(),
    "_deprecation": set(),
    "_dispatch": {"_ffi"},
    "ops": PRIVATE,
    "fp8": PRIVATE | {"ops", "optim"},
    "parallel": PRIVATE | {"ops"},
    "optim": PRIVATE,
    "nn": PRIVATE | {"ops", "fp8", "parallel", "optim"},
}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path):
    """(line, dotted module name) of every import in ``path``: ``import`` and ``from``
    statements at any depth (relative ones resolved against ``root``'s package), the
    names a ``from package import name`` takes (they may be submodules), and string
    constants given to ``importlib.import_module`` / ``__import__``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _unit(module: str) -> str | None:
    """The unit (subpackage or top-level private module) of a jax_ls2 module name, None
    for the package itself and for anything outside it."""
    parts = module.split(".")
    if parts[0] != "jax_ls2" or len(parts) < 2:
        return None
    return parts[1]


def unit_edges(root: pathlib.Path = PACKAGE):
    """{(importer unit, imported unit): [where, ...]} over every .py file under ``root``."""
    edges = {}
    for path in sorted(root.rglob("*.py")):
        source = _unit(_module_name(path, root))
        if source is None:
            continue
        for line, module in imported_modules(path, root):
            target = _unit(module)
            if target is None or target == source or target not in ALLOWED:
                continue  # outside jax_ls2, within one unit, or a name that is no unit
            edges.setdefault((source, target), []).append(f"{path.relative_to(root.parent)}:{line} ({module})")
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle of the directed graph ``edges`` (as [a, b, ..., a]), or None."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_unit_under_jax_ls2_is_known():
    units = {_unit(_module_name(p, PACKAGE)) for p in PACKAGE.rglob("*.py")} - {None}
    assert units <= set(ALLOWED), f"units without a place in ALLOWED: {sorted(units - set(ALLOWED))}"


def test_no_import_cycle_between_subpackages():
    edges = unit_edges()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
        w for a, b in zip(cycle, cycle[1:]) for w in edges[(a, b)])


def test_imports_run_in_the_allowed_direction():
    wrong = [w for (a, b), where in sorted(unit_edges().items()) if b not in ALLOWED[a] for w in where]
    assert not wrong, "imports against the allowed direction:\n" + "\n".join(wrong)


def test_no_module_looks_up_sys_modules():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "modules" and getattr(node.value, "id", None) == "sys":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "sys.modules looked up (import what is needed, or take it as an argument):\n" + "\n".join(found)


def test_plain_twin_imports_no_jax_ls2():
    found = [f"{p.relative_to(ROOT)}:{line} ({m})" for p in sorted(PLAIN.rglob("*.py"))
             for line, m in imported_modules(p, ROOT / "flax_models")
             if m.split(".")[0] == "jax_ls2" or (m.startswith("flax_models.") and not m.startswith("flax_models.plain"))]
    assert not found, "flax_models/plain imports outside itself and third-party code:\n" + "\n".join(found)


def test_the_checks_catch_a_function_local_cycle_and_importlib(tmp_path):
    pkg = tmp_path / "jax_ls2"
    for sub in ("ops", "fp8"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "fp8" / "dot.py").write_text("from jax_ls2.ops import layer_norm\n")
    (pkg / "ops" / "cast.py").write_text("def f():\n    from ..fp8 import dot\n    return dot\n")
    (pkg / "ops" / "late.py").write_text("import importlib\nM = importlib.import_module('jax_ls2.fp8.dot')\n")
    edges = unit_edges(pkg)
    assert set(edges) == {("fp8", "ops"), ("ops", "fp8")}
    assert [w.split(" ")[0] for w in edges[("ops", "fp8")]] == [os.path.join("jax_ls2", "ops", "cast.py") + ":2",
                                                                 os.path.join("jax_ls2", "ops", "cast.py") + ":2",
                                                                 os.path.join("jax_ls2", "ops", "late.py") + ":2"]
    assert find_cycle(edges) in (["fp8", "ops", "fp8"], ["ops", "fp8", "ops"])
