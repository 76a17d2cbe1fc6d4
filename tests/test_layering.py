"""The package's imports follow its layering (docs/architecture.md): no import cycle, and no import up the layers.

Every module of ``pipeoptim`` and ``pipeoptim_kernels`` is read with ``ast`` (nothing is imported): each
``import`` and ``from ... import`` statement, at module level or inside a function (a lazy import is still a
dependency), relative or absolute, becomes an edge of the import graph. The graph must have no cycle, and an
edge may only point to a module of the same layer or of a layer below. ``LAYERS`` is the list the architecture
page shows (a test there keeps the two the same); a new module must be placed in a layer before it can land.
Imports by name in a string (``importlib.import_module("...")``, the CLI's ``lazy("pipeoptim.cli.train", ...)``)
are not seen.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeoptim_kernels", "pipeoptim")

# bottom to top: (layer, the modules in it: a name covers the module or package and everything below it)
LAYERS = [
    ("kernels", ["pipeoptim_kernels"]),
    ("foundations", ["pipeoptim", "pipeoptim.errors", "pipeoptim.links"]),
    ("prediction", ["pipeoptim.prediction", "pipeoptim.optim"]),
    ("schedules", ["pipeoptim.schedules"]),
    ("policies", ["pipeoptim.policies", "pipeoptim.delay"]),
    ("stages", ["pipeoptim.stages"]),
    ("runtime", ["pipeoptim.runtime"]),
    ("simulator", ["pipeoptim.sim", "pipeoptim.viz"]),
    ("data", ["pipeoptim.data"]),
    ("pipeline", ["pipeoptim.train"]),
    ("models", ["pipeoptim.models", "pipeoptim.recipes"]),
    ("job", ["pipeoptim.job"]),
    ("cli", ["pipeoptim.cli", "pipeoptim.cli_train", "pipeoptim.cli_torchrun", "pipeoptim.cli_prepare"]),
]

# (importer, imported) -> why it may run up the layers for now. Empty today: keep it so, or say why here.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# the CLI's entry point: the subcommands are below it, so only the package's front door and ``-m`` may import it
CLI_ENTRY = "pipeoptim.cli.main"
CLI_ENTRY_IMPORTERS = {"pipeoptim.cli", "pipeoptim.cli.__main__"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the two packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _known(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``a.b.f`` for a function f of module a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, is_package: bool, modules) -> set[str]:
    """The modules among ``modules`` that ``source`` (the text of ``module``) imports anywhere in its body."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # "from a import b": b may be a module of its own, else a name defined in a
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != module:
                found.add(known)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path.read_text(), path.name == "__init__.py", files)
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts (``[a, b, a]``), or None when there is none."""
    done, on_path, path = set(), set(), []

    def visit(node: str) -> list[str] | None:
        on_path.add(node)
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (cycle := visit(nxt)) is not None:
                return cycle
        on_path.discard(node)
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)) is not None:
            return cycle
    return None


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of the most specific name that covers ``module``."""
    best, depth = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = index, name.count(".")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    lines = []
    for importer, imported_set in sorted(graph.items()):
        for imported in sorted(imported_set):
            low, high = layer_of(importer), layer_of(imported)
            if high > low and (importer, imported) not in KNOWN_UPWARD:
                lines.append(f"{importer} (layer {LAYERS[low][0]}) imports {imported} (layer {LAYERS[high][0]}, "
                             "above it)")
    return lines


# ---- the cycle finder itself, on small graphs: the check below cannot pass by finding nothing ---------------
def test_the_cycle_finder_finds_a_planted_cycle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"d", "a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": set(), "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_the_cycle_finder_passes_a_graph_without_one():
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}) is None


def test_imports_are_read_relative_absolute_and_inside_functions():
    modules = {"p", "p.x", "p.y", "p.sub", "p.sub.z", "q"}
    source = ("import q\nfrom . import y\n"
              "def f():\n    from .sub.z import thing\n    import p.x\n")
    assert imports_of("p.sub.w", "from .. import x\nfrom .z import t\n", False, modules) == {"p.x", "p.sub.z"}
    assert imports_of("p.x", source, False, modules) == {"q", "p.y", "p.sub.z"}


def test_an_upward_import_is_named():
    assert upward_imports({"pipeoptim.errors": {"pipeoptim.cli.train"}}) == [
        "pipeoptim.errors (layer foundations) imports pipeoptim.cli.train (layer cli, above it)"]


# ---- the package ---------------------------------------------------------------------------------------------
def test_the_graph_is_read_from_the_package():
    graph = import_graph()
    assert "pipeoptim.cli.train" in graph and "pipeoptim.runtime.plan" in graph["pipeoptim.train"]


def test_there_is_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, f"modules in no layer of LAYERS (tests/test_layering.py, docs/architecture.md): {missing}"


def test_no_import_runs_up_the_layers():
    lines = upward_imports(import_graph())
    assert not lines, "imports up the layering of docs/architecture.md:\n" + "\n".join(lines)


def test_every_known_upward_import_is_still_there():
    graph = import_graph()
    gone = [pair for pair in KNOWN_UPWARD if pair[1] not in graph.get(pair[0], ())]
    assert not gone, f"KNOWN_UPWARD lists imports that no longer exist; remove them: {gone}"


def test_the_kernels_import_nothing_of_pipeoptim():
    graph = import_graph()
    wrong = {m: sorted(i for i in imported if i.split(".")[0] == "pipeoptim")
             for m, imported in graph.items() if m.split(".")[0] == "pipeoptim_kernels"}
    assert not any(wrong.values()), wrong


def test_nothing_imports_the_cli_entry_point_back():
    graph = import_graph()
    back = sorted(m for m, imported in graph.items() if CLI_ENTRY in imported and m not in CLI_ENTRY_IMPORTERS)
    assert not back, f"{CLI_ENTRY} is the top of the CLI; these import it back: {back}"


def test_the_architecture_page_lists_the_same_layers():
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = re.findall(r"^\|\s*\d+\s*\|\s*([\w ]+?)\s*\|\s*(.+?)\s*\|", page, re.MULTILINE)
    written = [(layer, re.findall(r"`([\w.]+)`", modules)) for layer, modules in table]
    assert written == [(layer, names) for layer, names in LAYERS], (
        "docs/architecture.md's table of layers and LAYERS here disagree; change both")


@pytest.mark.parametrize("module", ["pipeoptim.errors"])
def test_the_bottom_modules_import_nothing(module):
    assert import_graph()[module] == set()


MAX_MODULE_LINES = 400  # a module longer than this holds more than one job: split it by job (docs/architecture.md)


def test_no_module_of_the_package_is_longer_than_a_job():
    long = {name: n for name, path in module_files().items()
            if name.split(".")[0] == "pipeoptim" and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by job, as docs/architecture.md says): {long}"
