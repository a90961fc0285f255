"""The package's import structure: every module imports in a fresh interpreter; the
module-level imports among roformer's modules form no cycle (a cycle works or fails by
import order, and hiding one in a function-level import only moves the failure); the
packages stand on the floors of HOUSE, each importing (at module or function level) only
from its own floor and those below, with no cycle among them; no module imports another
module's private (_underscore) names; no module of model/, train/, data/, ablation/ or study/
is over 450 lines; no function is over 80 lines; and no test file imports
another test module or conftest.py.

`python tests/test_imports.py` prints the house: its upward imports, its package cycles,
the biggest modules and the functions over 80 lines."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import patient


pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)
REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "roformer"


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def _module_level(body: list[ast.stmt]):
    """The statements that run when the module is imported: the body, with the bodies of
    module-level if/try/with blocks and class bodies, not of functions."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With)):
            yield from _module_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body + node.orelse + node.finalbody
                                     + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.ClassDef):
            yield from _module_level(node.body)


def imported_modules(node: ast.AST, package: str, known) -> list[str | None]:
    """The roformer modules an import statement `node` (in `package`) names, each resolved by
    `known` to the module file it runs (None: not a roformer module); [] for other nodes.
    `from pkg import module` imports the module."""
    if isinstance(node, ast.Import):
        return [known(alias.name) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
    return [known(f"{base}.{alias.name}") or known(base) for alias in node.names]


def module_resolver(files: dict[str, Path]):
    """name -> the longest prefix of `name` that is a roformer module, or None."""
    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None
    return known


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def import_graph() -> dict[str, set[str]]:
    """module -> the roformer modules its module-level statements import. Importing
    `a.b.c` runs the packages `a.b` and `a` first, so they count too (except the module's
    own packages, which are already running when it is imported)."""
    files = module_files()
    known = module_resolver(files)
    graph = {}
    for name, path in files.items():
        package = package_of(name, path)
        targets = set()
        for node in _module_level(ast.parse(path.read_text()).body):
            targets.update(imported_modules(node, package, known))
        own = {name.rsplit(".", k)[0] for k in range(name.count(".") + 1)}
        edges = set()
        for target in targets - {None, name}:
            edges.update(t for t in (target.rsplit(".", k)[0] for k in range(target.count(".") + 1))
                         if t in files and t not in own)
        graph[name] = edges
    return graph


def all_imports() -> dict[str, dict[str, int]]:
    """module -> {roformer module it imports anywhere (module level or inside a function):
    the line of the first such import}."""
    files = module_files()
    known = module_resolver(files)
    graph = {}
    for name, path in files.items():
        package = package_of(name, path)
        targets: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported_modules(node, package, known):
                if target and target != name:
                    targets.setdefault(target, node.lineno)
        graph[name] = targets
    return graph


# The floors of the house, from the ground up: a package (or top-level module) imports only
# from its own floor and the floors below. Commands (`python -m roformer.<x>`: the entry
# points and every package's __main__) are the top floor: nothing imports them.
HOUSE = (
    ("errors", "files", "checksums", "settings", "host_memory", "machine", "orbax_logs", "distributed",
     "workdir_lock", "workdir_kind", "config_files", "native_logs", "cli"),   # the ground: the standard library's neighbours
    ("model",),
    ("data", "accelerator"),   # accelerator: the device, dtype and attention path a run logs
    ("workdir",),            # a pretraining workdir's layout and its one reader
    ("convert", "hub"),      # HF format in and out, and its upload to the Hub
    ("checkpoint_source",),  # which of those a model comes from
    ("train",),
    ("glue",),
    ("ablation", "study"),    # two programs side by side: neither imports the other (SIBLINGS)
    ("bench", "deviceless"),   # deviceless: the train step compiled for a GPU this host lacks
    ("launch_check", "glue_launch_check"),   # a run's steps compiled for a target ahead of its hardware
    ("commands",),           # pretrain, ablate, capability, every __main__
)
COMMANDS = ("pretrain", "ablate", "capability", "evaluate", "console_scripts")
# Packages on one floor that must not import each other: what both use lives below them.
SIBLINGS = (("ablation", "study"),)
# Upward imports tolerated, each named with why (at most one): none.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def unit(module: str) -> str:
    """The floor-plan unit of a roformer module: 'commands' for an entry point, else its
    package below roformer (or the top-level module's own name)."""
    parts = module.split(".")[1:]
    if not parts:
        return "roformer"
    if parts[-1] == "__main__" or parts[0] in COMMANDS:
        return "commands"
    return parts[0]


def floor_of(name: str) -> int:
    for level, names in enumerate(HOUSE):
        if name in names:
            return level
    raise KeyError(f"{name} stands on no floor of HOUSE (tests/test_imports.py): place it")


def house(graph: dict[str, dict[str, int]] | None = None) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(unit -> units it imports, the upward imports as (module, line, imported module))."""
    graph = all_imports() if graph is None else graph
    units: dict[str, set[str]] = {}
    upward = []
    for module, targets in graph.items():
        source = unit(module)
        if source == "roformer":
            continue
        units.setdefault(source, set())
        for target, line in targets.items():
            dest = unit(target)
            if dest in (source, "roformer"):
                continue
            units[source].add(dest)
            if floor_of(dest) > floor_of(source):
                upward.append((module, line, target))
    return units, sorted(upward)


def where(module: str, line: int) -> str:
    return f"{module_files()[module].relative_to(REPO)}:{line}"


def private_imports() -> list[str]:
    """`from a import _name` and `a._name` where `a` is another roformer module: each as
    'path:line: name'."""
    files = module_files()
    found = []
    for path in files.values():
        tree = ast.parse(path.read_text())
        modules = set()   # local names bound to roformer modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("roformer") or \
                    isinstance(node, ast.ImportFrom) and node.level:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}")
                    if f"{node.module}.{alias.name}" in files:
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("roformer"):
                        modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its modules in import order, the first repeated), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_module_level_imports_have_no_cycle():
    graph = import_graph()
    assert "roformer.workdir" in graph["roformer.convert"]   # the graph sees real imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_packages_stand_on_their_floors():
    """No import runs up the house (at module or function level) but those KNOWN_UPWARD
    names, and the packages form no cycle."""
    graph = all_imports()
    assert "roformer.checkpoint_source" in graph["roformer.data.__main__"]   # sees function-level imports
    assert len(KNOWN_UPWARD) <= 1
    units, upward = house(graph)
    assert set(units) <= {name for names in HOUSE for name in names}
    unexpected = [u for u in upward if (unit(u[0]), unit(u[2])) not in KNOWN_UPWARD]
    assert not unexpected, "imports running up the house (tests/test_imports.py HOUSE): " + "; ".join(
        f"{where(module, line)} {module} imports {target}" for module, line, target in unexpected)
    cycle = find_cycle(units)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_siblings_import_nothing_of_each_other():
    """The ablation and the study are two programs: what they share (a scheme's pretraining
    config, list settings, fingerprints) lives below them, in train/ and config_files."""
    units, _ = house()
    crossing = [(a, b) for pair in SIBLINGS for a, b in (pair, pair[::-1]) if b in units.get(a, set())]
    assert not crossing, f"sibling packages import each other: {crossing}"


def test_the_house_check_sees_an_upward_import():
    units, upward = house({"roformer.model.x": {"roformer.train.y": 3}, "roformer.train.y": {"roformer.model.x": 1},
                           "roformer.data.__main__": {"roformer.train.y": 5}})
    assert units == {"model": {"train"}, "train": {"model"}, "commands": {"train"}}
    assert [(module, target) for module, _, target in upward] == [("roformer.model.x", "roformer.train.y")]
    assert find_cycle(units) == ["train", "model", "train"]


def test_no_module_imports_another_modules_private_names():
    found = private_imports()
    assert not found, "private names imported from another module: " + "; ".join(found)


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


IMPORT_ALL = """
import importlib, json, sys
from absl import flags
failed, alone = {}, []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except flags.DuplicateFlagError:   # another command's flags are defined already
        alone.append(name)
    except Exception as error:
        failed[name] = f"{type(error).__name__}: {error}"
print(json.dumps({"failed": failed, "alone": alone}))
"""


def test_every_module_imports_in_a_fresh_interpreter():
    """All modules in one interpreter (sorted), and the command-line modules whose absl flags
    clash with another's each in an interpreter of its own."""
    names = [n for n in module_files() if n != "roformer"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}

    def run(modules):
        proc = subprocess.run([sys.executable, "-c", IMPORT_ALL, *modules], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=patient(600))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    result = run(names)
    assert result["failed"] == {}
    assert len(result["alone"]) < len(names) // 4   # the retry below is for the few flag clashes
    for name in result["alone"]:
        alone = run([name])
        assert alone["failed"] == {} and alone["alone"] == [], (name, alone)


def biggest_modules(count: int = 10) -> list[tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), str(p.relative_to(REPO))) for p in module_files().values()),
                  reverse=True)[:count]


# A module of these packages longer than this has more than one job: split it by its parts.
MAX_LINES = 450
SIZED_PACKAGES = ("model", "train", "data", "ablation", "study")


def long_modules(limit: int = MAX_LINES) -> list[tuple[int, str]]:
    """(lines, path) of every module of SIZED_PACKAGES over `limit` lines, longest first."""
    return [(lines, path) for lines, path in biggest_modules(len(module_files()))
            if lines > limit and Path(path).parts[1] in SIZED_PACKAGES]


def test_no_module_of_the_core_packages_is_over_450_lines():
    assert {Path(path).parts[1] for _, path in long_modules(limit=100)} == set(SIZED_PACKAGES)   # sees them all
    too_long = long_modules()
    assert not too_long, f"modules over {MAX_LINES} lines (split each by its parts): " + "; ".join(
        f"{path} {lines}" for lines, path in too_long)


# A function whose body (docstring included) is longer than this does more than one thing:
# split it into the steps it takes, each named for what it does.
MAX_FUNCTION_LINES = 80


def function_sizes(source: str, module: str) -> list[tuple[int, str, int]]:
    """(body lines, qualified name, line) of every function and method in `source`, nested
    ones too: the body counts from its first statement (the docstring) to its last line."""
    sizes = []

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                sizes.append((child.end_lineno - child.body[0].lineno + 1, name, child.lineno))
                visit(child, name)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    visit(ast.parse(source), module)
    return sizes


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, str]:
    """qualified name -> 'path:line (N lines)' of every roformer function whose body is over
    `limit` lines, longest first."""
    found = []
    for module, path in module_files().items():
        found += [(lines, name, f"{path.relative_to(REPO)}:{line} ({lines} lines)")
                  for lines, name, line in function_sizes(path.read_text(), module) if lines > limit]
    return {name: where for _, name, where in sorted(found, reverse=True)}


def test_function_sizes_count_the_body_of_functions_methods_and_nested_functions():
    source = ('def f(x):\n    """Doc."""\n    y = x\n\n    return y\n\n\n'
              'class A:\n    @property\n    def g(self):\n        def h():\n            return 1\n        return h\n')
    assert function_sizes(source, "m") == [(4, "m.f", 1), (3, "m.A.g", 10), (1, "m.A.g.h", 11)]


def test_no_function_is_over_80_lines():
    assert len(long_functions(limit=40)) >= 10   # sees the package's functions
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split each into its steps): " + "; ".join(
        f"{name} {where}" for name, where in found.items())


TESTS = REPO / "tests"


def imports_of_test_modules(tests: Path = TESTS) -> list[str]:
    """Imports of a test module or of conftest.py by a file of the suite in `tests`, each as
    'path:line: name' (what tests share lives in tests/helpers/)."""
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(tests.parent)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[-1].startswith("test_") or name.split(".")[0] == "conftest"]
    return found


def test_tests_import_helpers_not_one_another():
    found = imports_of_test_modules()
    assert not found, "test files importing a test module or conftest (move what they share to tests/helpers/): " \
        + "; ".join(found)

if __name__ == "__main__":
    units, upward = house()
    print("upward imports:", len(upward))
    for module, line, target in upward:
        print(f"  {where(module, line)} {module} -> {target}")
    cycle = find_cycle(units)
    print("package cycles:", "none" if cycle is None else " -> ".join(cycle))
    print("private-name imports:", len(private_imports()))
    print("biggest modules:")
    for lines, path in biggest_modules():
        print(f"  {lines:5d} {path}")
    print(f"functions over {MAX_FUNCTION_LINES} lines:")
    for name, where in long_functions().items():
        print(f"  {where} {name}")
