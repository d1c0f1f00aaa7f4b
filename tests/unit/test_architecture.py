"""The architecture of DESIGN.md, checked: layers are folders, arrows point one way, no cycles.

A module's layer is the folder it sits in (:data:`RANKS`, bottom to top); a module at the top
of ``pstrain/`` is the face (the public API and the programs users run). Every import inside
``pstrain/`` counts, at module level or inside a function (a function-level import hides a
cycle; it does not remove it). Imports under ``if TYPE_CHECKING:`` count for cycles (two
modules that need each other's types are one concept) but not for layers (a lower layer may
name a higher one's type in an annotation).
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pstrain"
LAYOUT_DOC = ROOT.parent / "docs" / "architecture.md"  # its Layout section

#: The layer folders, bottom to top. A module imports only from its own folder or lower ones;
#: ``server`` (the servers) imports only ``SERVERS_MAY_IMPORT`` and is imported only by the face.
RANKS: tuple[str, ...] = (
    "_kernels",
    "_base",
    "_formats",
    "_transport",
    "_serving",
    "server",
    "_variables",
    "_training",
    "_embeddings",
    "_checkpoint",
    "_frameworks",
    "_distribute",
    "_coordinator",
    "face",
)
RANK = {layer: i for i, layer in enumerate(RANKS)}
#: Packages of the face: the ``pstrain`` command's subcommands.
RANK["cli"] = RANK["face"]
SERVERS_MAY_IMPORT = {"_kernels", "_base", "_formats", "_transport", "_serving", "server"}
#: Public modules that only re-export private ones (the face users import; nothing inside
#: the layers may import them).
FACADES = {
    "checkpoint",
    "cluster",
    "data",
    "errors",
    "evaluator",
    "initializers",
    "jax",
    "math",
    "metrics",
    "nn",
    "optimizers",
    "partitioners",
    "rpc",
    "schedules",
    "summary",
    "torch",
}


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts) if rel.parts != ("__init__",) else "__init__"


def all_modules(root: Path) -> list[str]:
    return sorted(module_name(root, p) for p in root.rglob("*.py"))


def layer_of(module: str) -> str:
    """The folder a module sits in, which is its layer."""
    top = module.split(".")[0]
    if "." not in module:
        return "face"
    if top not in RANK:
        raise AssertionError(
            f"pstrain/{top}/ is not a layer: add it to RANKS (its place in the "
            "order) and to the Layout of docs/architecture.md"
        )
    return top


class _Imports(ast.NodeVisitor):
    """The pstrain modules a module imports at run time."""

    def __init__(self, module: str, modules: set[str], type_checking: bool = False) -> None:
        self.module = module
        self.modules = modules
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
        base = package[: len(package) - (level - 1)] if level > 1 else package
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
            self.found.add(candidate if _known(candidate, self.modules) else (target or "__init__"))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "pstrain" or alias.name.startswith("pstrain."):
                self.found.add(alias.name.removeprefix("pstrain").lstrip(".") or "__init__")


def _known(name: str, modules: set[str]) -> bool:
    return name in modules or f"{name}.__init__" in modules


class Tree:
    """The import graph of one copy of the package."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules = set(all_modules(root))
        self.graph: dict[str, set[str]] = {}
        self.typed_graph: dict[str, set[str]] = {}
        for m in self.modules:
            path = self.root / (m.replace(".", "/") + ".py")
            tree = ast.parse(path.read_text(), str(path))  # once for both graphs
            self.graph[m] = self.imports_of(m, tree=tree)
            self.typed_graph[m] = self.imports_of(m, type_checking=m != "__init__", tree=tree)

    def imports_of(self, module: str, type_checking: bool = False, tree: ast.AST | None = None) -> set[str]:
        if tree is None:
            path = self.root / (module.replace(".", "/") + ".py")
            tree = ast.parse(path.read_text(), str(path))
        visitor = _Imports(module, self.modules, type_checking)
        visitor.visit(tree)
        found = {m if m in self.modules else f"{m}.__init__" for m in visitor.found}
        found.discard(module)
        return {m for m in found if m in self.modules}

    def layer_violations(self) -> list[str]:
        wrong = []
        for module, deps in self.graph.items():
            mine = layer_of(module)
            for dep in deps:
                theirs = layer_of(dep)
                if mine == "server":
                    ok = theirs in SERVERS_MAY_IMPORT
                elif theirs == "server":
                    ok = RANK[mine] == RANK["face"]
                else:
                    ok = RANK[theirs] <= RANK[mine]
                if not ok:
                    wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
        return sorted(wrong)

    def cycle(self) -> list[str] | None:
        graph = self.typed_graph
        state: dict[str, int] = {}
        path: list[str] = []

        def visit(m: str) -> list[str] | None:
            state[m] = 1
            path.append(m)
            for dep in sorted(graph[m]):
                if state.get(dep) == 1:
                    return path[path.index(dep) :] + [dep]
                if dep not in state and (found := visit(dep)):
                    return found
            path.pop()
            state[m] = 2
            return None

        for m in sorted(self.modules):
            if m not in state and (found := visit(m)):
                return found
        return None


@functools.cache
def package_tree() -> Tree:
    """The package's import graph, made when a test first asks (not as the file is
    collected: every test process collects every file)."""
    return Tree(ROOT)


def test_every_module_sits_in_a_layer_folder():
    for module in package_tree().modules:
        layer_of(module)
    # the layer folders are packages, with nothing else at their level
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(RANK) - {"face"}, folders ^ (set(RANK) - {"face"})


def test_the_import_graph_has_no_cycle():
    cycle = package_tree().cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_follow_the_layers():
    wrong = package_tree().layer_violations()
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_an_injected_layer_violation_is_caught(tmp_path):
    # The check above would pass vacuously if it could not fail: break the rule in a copy.
    copy = tmp_path / "pstrain"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "dashboard_static"))
    tags = copy / "_base" / "tags.py"
    tags.write_text(
        tags.read_text() + "\n\ndef _late():\n    from .._coordinator import scheduling\n"
        "    return scheduling\n"
    )
    worker = copy / "server" / "worker" / "executor.py"
    worker.write_text(worker.read_text() + "\nfrom ..._variables import variables  # noqa\n")
    wrong = Tree(copy).layer_violations()
    assert wrong == [
        "_base.tags (_base) imports _coordinator.scheduling (_coordinator)",
        "server.worker.executor (server) imports _variables.variables (_variables)",
    ]
    (copy / "_widgets").mkdir()
    (copy / "_widgets" / "__init__.py").write_text("")
    with pytest.raises(AssertionError, match="_widgets/ is not a layer"):
        Tree(copy).layer_violations()


def test_the_graph_sees_function_level_imports():
    # The checks above would pass vacuously if the parser missed imports.
    graph, typed = package_tree().graph, package_tree().typed_graph
    assert "_transport.channels" in graph["_transport.bridge"] and "server.ps.handlers" in graph["testing"]
    assert "_coordinator.scheduling" in graph["_coordinator.coordinator"]
    assert "__init__" not in graph["_coordinator.coordinator"]
    assert "_transport.channels" in typed["_base.context"]
    assert "_transport.channels" not in graph["_base.context"]


def _is_all(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]


def test_facades_only_re_export_and_nothing_inside_imports_them():
    facades = []
    for path in ROOT.glob("*.py"):
        if path.stem not in FACADES:
            continue
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"pstrain/{path.name}: say what it is for, for the reference"
        facades.append(path.stem)
        body = tree.body[1:]
        assert body and all(isinstance(node, ast.ImportFrom) or _is_all(node) for node in body), (
            f"pstrain/{path.name} is a façade: imports only (and its __all__)"
        )
    assert set(facades) == FACADES
    for module, deps in package_tree().graph.items():
        if layer_of(module) != "face":
            assert not set(deps) & set(facades), f"{module} imports a public façade"


#: What each folder holds, as the Layout of docs/architecture.md draws it (top of the stack first).
LAYER_NOTES = {
    ".": "face: the public modules users import, and the programs",
    "cli": "face: the pstrain command",
    "_coordinator": "program: ClusterCoordinator and its parts",
    "_coordinator/elastic": "program: ps health, joins, leaves, moves and replacements",
    "_distribute": "program: the strategy, replicas, distributed values",
    "_frameworks": "training: JAX and PyTorch models",
    "_checkpoint": "training: checkpoints by object graph",
    "_embeddings": "training: jagged features, pooled lookups, collections of tables",
    "_training": "training: optimizers, metrics, data, summaries",
    "_variables": "variables: handles, placement, sharding, tables",
    "server": "servers: the tasks (only the face starts them)",
    "server/ps": "servers: the parameter server",
    "server/ps/checkpoints": "servers: the ps's saves, snapshots, deltas and the serving feed",
    "server/ps/moves": "servers: the ps's side of moves between ps",
    "server/ps/tables": "servers: the ps's dynamic embedding tables",
    "server/worker": "servers: the worker",
    "_serving": "serving: the server core every task and the coordinator use",
    "_transport": "transport: the connection, both ends: codec, frames, handshake, channels, listener",
    "_formats": "formats: what both ends of a connection agree on",
    "_formats/files": "formats: checkpoint, delta and tensor files, checksums, the feed's reading",
    "_formats/messages": "formats: every operation declared once, its records, pickled closures",
    "_formats/numerics": "formats: optimizer rules, initializers, schedules, id hashes, dtype casts",
    "_base": "base: errors, cluster, auth, context",
    "_kernels": "kernels: the id index, optimizer steps, distinct ids and per-id sums; C and numpy",
    "_kernels/reference": "kernels: the numpy ones, a module a concept (as the C's included files)",
}


def tree_modules() -> dict[str, list[str]]:
    """``folder -> module names`` of the package ("." is the top)."""
    actual: dict[str, list[str]] = {}
    for module in package_tree().modules:
        parts = module.split(".")
        folder = "." if len(parts) == 1 else "/".join(parts[:-1])
        actual.setdefault(folder, []).append(parts[-1])
    return {k: sorted(v) for k, v in actual.items()}


def draw_tree(width: int = 96) -> str:
    """The Layout block of docs/architecture.md, drawn from the tree (see LAYER_NOTES)."""
    lines = ["pstrain/"]
    for folder, note in LAYER_NOTES.items():
        label = "." if folder == "." else folder + "/"
        lines.append(f"  {label:<15} {note}")
        row = "      "
        for name in tree_modules().get(folder, []):
            if len(row) + len(name) + 1 > width:
                lines.append(row.rstrip())
                row = "      "
            row += name + " "
        lines.append(row.rstrip())
    return "\n".join(lines) + "\n"


def test_the_layout_in_the_design_notes_draws_the_tree():
    assert set(LAYER_NOTES) == set(tree_modules()), set(LAYER_NOTES) ^ set(tree_modules())
    text = LAYOUT_DOC.read_text()
    section = text[text.index("## Layout") :]
    block = re.search(r"```text\n(pstrain/\n.*?)```", section, re.S)
    drawn = block.group(1) if block else ""
    assert drawn == draw_tree(), "the Layout block of docs/architecture.md should read:\n" + draw_tree()


def test_the_longest_modules_are_listed_for_a_reviewer(capsys):
    # DESIGN.md: a module that holds two concepts is split along its seam, whatever its
    # length; a length is a prompt to look for a seam, never a budget. So nothing fails on
    # a number: the ten longest modules are printed for whoever reviews the tree.
    sizes = {
        m: len((ROOT / (m.replace(".", "/") + ".py")).read_text().splitlines())
        for m in package_tree().modules
    }
    longest = sorted(sizes.items(), key=lambda kv: -kv[1])[:10]
    with capsys.disabled():
        print("\nlongest modules: " + ", ".join(f"{m} {n}" for m, n in longest))
    assert len(sizes) == len(package_tree().modules) and all(n > 0 for n in sizes.values())


#: Files a docstring names that are a user's, not pstrain's (an example of a program).
USERS_FILES = {"train.py", "model.py"}


def test_the_module_maps_name_real_files():
    # Each ``name.py`` a module's docstring names is a file of the tree: by its path from the
    # module's folder, its parent, pstrain/, the repository or a folder the docstring names;
    # a bare name anywhere in pstrain/ (maps went stale as modules moved into folders).
    everywhere = {p.name for p in ROOT.rglob("*.py")}
    stale = []
    for path in ROOT.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        folders = re.findall(r"``([\w/]+)/``", doc)
        for name in re.findall(r"``([\w./]+\.py)``", doc):
            bases = [
                path.parent,
                path.parent.parent,
                ROOT,
                ROOT.parent,
                *(ROOT / d for d in folders),
                *(path.parent / d for d in folders),
            ]
            if any((base / name).exists() for base in bases) or name in USERS_FILES:
                continue
            if "/" not in name and name in everywhere:
                continue
            stale.append(f"{path.relative_to(ROOT.parent)}: {name}")
    assert not stale, stale
