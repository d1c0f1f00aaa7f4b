"""The architecture of DESIGN.md, checked: layers with one-way arrows, no cycles, lone imports.

Every import inside ``pstrain/`` counts, at module level or inside a
function (a function-level import hides a cycle; it does not remove it).
Imports under ``if TYPE_CHECKING:`` count for cycles (two modules that need
each other's types are one concept) but not for layers (a lower layer may
name a higher one's type in an annotation).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pstrain"

#: Each module's layer, bottom to top (README "Layout"). ``server.*`` is the servers column.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("errors", "cluster", "auth", "tasks", "context", "tags"),
    "formats": ("wire", "protocol", "schemas", "casting", "messages", "checkpoint_files", "schedules",
                "optimizer_rules", "observability", "initializers", "pickling", "idhash", "handshake"),
    "transport": ("rpc", "bridge"),
    "variables": ("variables", "placement", "sharding", "partitioners", "dynamic"),
    "training": ("optimizers", "metrics", "checkpoint", "restore_status", "object_graph", "jax", "torch", "evaluator", "data", "module", "summary"),
    "program": ("values", "distribution", "input_distribution", "remote_value", "scheduling", "resources", "per_worker", "dispatch",
                "membership", "ps_health", "strategy", "coordinator"),
    "face": ("__init__", "__main__", "cli", "launch", "testing", "demo", "progress", "ctr", "dashboard"),
}
RANK = {layer: i for i, layer in enumerate(LAYERS)}
SERVERS_MAY_IMPORT = {"base", "formats", "transport"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts
    return ".".join(parts) if parts != ("__init__",) else "__init__"


def all_modules() -> list[str]:
    return sorted(module_name(p) for p in ROOT.rglob("*.py"))


def layer_of(module: str) -> str:
    if module.startswith("server"):
        return "servers"
    for layer, members in LAYERS.items():
        if module in members:
            return layer
    raise AssertionError(f"pstrain/{module.replace('.', '/')}.py has no layer: add it to LAYERS "
                         "and to the README's Layout")


class _Imports(ast.NodeVisitor):
    """The pstrain modules a module imports at run time."""

    def __init__(self, module: str, type_checking: bool = False) -> None:
        self.module = module
        self.type_checking = type_checking
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" and not self.type_checking:
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _resolve(self, level: int, target: str | None) -> str:
        package = self.module.split(".")[:-1] if self.module != "__init__" else []
        if self.module.endswith("__init__") and self.module != "__init__":
            package = self.module.split(".")[:-1]
        base = package[:len(package) - (level - 1)] if level > 1 else package
        return ".".join([*base, *([target] if target else [])])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            target = self._resolve(node.level, node.module)
        elif node.module and (node.module == "pstrain" or node.module.startswith("pstrain.")):
            target = node.module.removeprefix("pstrain").lstrip(".")
        else:
            return
        for alias in node.names:
            candidate = f"{target}.{alias.name}" if target else alias.name
            self.found.add(candidate if candidate in MODULES else (target or "__init__"))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "pstrain" or alias.name.startswith("pstrain."):
                self.found.add(alias.name.removeprefix("pstrain").lstrip(".") or "__init__")


MODULES = set(all_modules())


def imports_of(module: str, type_checking: bool = False) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    visitor = _Imports(module, type_checking)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    found = {m if m in MODULES else f"{m}.__init__" for m in visitor.found}
    found.discard(module)
    return {m for m in found if m in MODULES}


GRAPH = {m: imports_of(m) for m in MODULES}
#: With the imports made for type checkers only (the public __init__ re-exports everything).
TYPED_GRAPH = {m: imports_of(m, type_checking=m != "__init__") for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_the_import_graph_has_no_cycle():
    graph = TYPED_GRAPH
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_imports_follow_the_layers():
    wrong = []
    for module, deps in GRAPH.items():
        mine = layer_of(module)
        for dep in deps:
            theirs = layer_of(dep)
            if mine == "servers":
                ok = theirs in SERVERS_MAY_IMPORT or theirs == "servers"
            elif theirs == "servers":
                ok = mine == "face"
            else:
                ok = RANK[theirs] <= RANK[mine]
            if not ok:
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_graph_sees_function_level_imports():
    # The checks above would pass vacuously if the parser missed imports.
    assert "rpc" in GRAPH["bridge"] and "server.ps" in GRAPH["testing"]
    assert "scheduling" in GRAPH["coordinator"] and "__init__" not in GRAPH["coordinator"]
    assert "rpc" in TYPED_GRAPH["context"] and "rpc" not in GRAPH["context"]


def _import_alone(module: str) -> tuple[str, int, str]:
    name = "pstrain" if module == "__init__" else "pstrain." + module.removesuffix(".__init__")
    out = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                         timeout=60)
    return module, out.returncode, out.stderr[-2000:]


@pytest.mark.timeout(180)
def test_every_module_imports_alone_in_a_fresh_interpreter():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_import_alone, sorted(MODULES)))
    failed = [f"{m}: {err}" for m, code, err in results if code != 0]
    assert len(results) == len(MODULES) > 40
    assert not failed, "\n".join(failed)
