"""The package's import structure: every module imports in a fresh interpreter, and the
module-level imports among roformer's modules form no cycle (a cycle works or fails by
import order, and hiding one in a function-level import only moves the failure)."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

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


def import_graph() -> dict[str, set[str]]:
    """module -> the roformer modules its module-level statements import. Importing
    `a.b.c` runs the packages `a.b` and `a` first, so they count too (except the module's
    own packages, which are already running when it is imported)."""
    files = module_files()

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _module_level(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:   # `from pkg import module` imports the module
                    targets.add(known(f"{base}.{alias.name}") or known(base))
        own = {name.rsplit(".", k)[0] for k in range(name.count(".") + 1)}
        edges = set()
        for target in targets - {None, name}:
            edges.update(t for t in (target.rsplit(".", k)[0] for k in range(target.count(".") + 1))
                         if t in files and t not in own)
        graph[name] = edges
    return graph


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
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    result = run(names)
    assert result["failed"] == {}
    assert len(result["alone"]) < len(names) // 4   # the retry below is for the few flag clashes
    for name in result["alone"]:
        alone = run([name])
        assert alone["failed"] == {} and alone["alone"] == [], (name, alone)
