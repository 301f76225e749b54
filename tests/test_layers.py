"""Imports run one way (docs/DESIGN.md, "Files"): the method's three files import nothing of the
project (the comparator imports the method, never the other way round); no product file imports
tests/ or evidence/, the training path imports no asset builder, the rewards no prompt set, train.py
no miniature's module, and no files import each other in a loop. Imports are read with ast, inside
functions too; no edge is exempt."""

import ast
import os

from test_references import ROOT, tracked  # the files git tracks

METHOD = ("policy.py", "baselines.py", "rollout.py")


def module_file(name, files):
    """The tracked file a dotted module name is, or None outside the project."""
    base = name.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in files:
            return candidate
    return None


def imports(path, files):
    """The project files that `path` imports (a package's __init__.py for `from package import
    name` where name is no module of it)."""
    with open(os.path.join(ROOT, path)) as handle:
        tree = ast.parse(handle.read())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            target = module_file(name, files)
            if target and target != path:
                found.add(target)
    return found


def graph():
    """file -> the project files it imports."""
    files = {path for path in tracked() if path.endswith(".py")}
    product = [path for path in files if not path.startswith("tests/")]
    return {path: imports(path, files) for path in product}


def test_no_file_imports_a_folder_it_must_not():
    """The rewards import no prompt set, train.py no miniature, no product file tests/ nor (but
    evidence/ itself) evidence/; the method's files import nothing of the project."""
    edges = graph()
    rules = [("rewards/", "prompts/"), ("train.py", "miniatures/")]
    rules += [("", "tests/"), ("", "evidence/")]  # "": every product file
    for source, folder in rules:
        for path in (path for path in edges if path.startswith(source)):
            if not path.startswith(folder):  # evidence/ imports evidence/
                assert not [target for target in edges[path] if target.startswith(folder)], path
    assert {path: sorted(edges[path]) for path in METHOD} == {path: [] for path in METHOD}


def test_the_training_path_imports_no_asset_builder():
    edges, reached, todo = graph(), set(), ["train.py", "sample.py", "evaluate.py"]
    while todo:
        path = todo.pop()
        if path not in reached:
            reached.add(path)
            todo += sorted(edges[path])
    assert "miniatures/build.py" not in reached  # nor evidence/: no product file imports it


def loops(edges):
    """Every loop of imports that a depth-first walk of `edges` (file -> files) meets."""
    state, found = {}, []

    def visit(path, trail):
        state[path] = "open"
        for target in sorted(edges.get(path, ())):
            if state.get(target) == "open":
                found.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[path] = "done"

    for path in sorted(edges):
        if path not in state:
            visit(path, [path])
    return found


def test_no_files_import_each_other_in_a_loop():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert loops(graph()) == []
