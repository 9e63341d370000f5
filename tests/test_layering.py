"""The package's floors: each module imports only from its own floor or lower ones (function-local
imports included), so there is no import cycle and no arrow against the data path. The floors are
written down once, in zeroshard's package docstring ("Floors:"); this test reads them from there.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import zeroshard


def read_floors(doc: str) -> list[tuple[str, list[str]]]:
    """The docstring's numbered floor lines, lowest first: (label, top-level names on that floor)."""
    floors = []
    for line in doc.split("Floors:", 1)[1].splitlines():
        m = re.match(r"(\d+)\. ([\w, ]+):", line)
        if m:
            names = [n.strip() for n in m.group(2).split(",")]
            floors.append((" ".join(names), names))
    return floors


FLOORS = read_floors(zeroshard.__doc__)
TOP = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}


def floor_of(module: str) -> int | None:
    """A module's floor: its top-level name's (`runtime.chunks` is on runtime's floor)."""
    return TOP.get(module.split(".")[0])


def modules(root: str) -> dict[str, str]:
    """Module name (relative to the package, `__init__` for the package itself) -> file."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__") if rel != "__init__" else rel] = os.path.join(folder, f)
    return out


def imports(name: str, path: str, known: set[str]) -> dict[str, int]:
    """The package's modules that `name` imports anywhere in its file -> the line of the first."""
    package = [] if name == "__init__" else name.split(".")[:-1] if not path.endswith("__init__.py") \
        else name.split(".")
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(open(path).read())):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            targets = [".".join(base + [node.module])] if node.module else [".".join(base + [a.name]) for a in node.names]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            full = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            targets = [t.removeprefix("zeroshard.") for t in full if t and t.startswith("zeroshard.")]
        for t in targets:
            t = t or "__init__"
            if t in known and t != name:
                found.setdefault(t, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    mods = modules(os.path.dirname(zeroshard.__file__))
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (a, b, ..., a), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return None
    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_floors_are_read():
    assert [label for label, _ in FLOORS][:2] == ["errors units config numerics", "distributed"] and len(FLOORS) == 10


def test_every_module_has_a_floor():
    missing = sorted(m for m in graph() if floor_of(m) is None)
    assert not missing, f"modules without a floor (add them to FLOORS): {missing}"


def test_no_module_imports_from_a_higher_floor():
    upward = [f"{m} (floor {FLOORS[floor_of(m)][0]!r}) imports {t} (floor {FLOORS[floor_of(t)][0]!r}) at line {line}"
              for m, targets in graph().items() if floor_of(m) is not None
              for t, line in sorted(targets.items()) if floor_of(t) is not None and floor_of(t) > floor_of(m)]
    assert not upward, "imports against the floors:\n  " + "\n  ".join(upward)


def test_import_zeroshard_leaves_the_checkpoint_machinery_unloaded():
    """torch.distributed.checkpoint is imported where a checkpoint is saved or loaded, not by
    `import zeroshard` (it was 2.3 s of 5.6 s on a loaded machine)."""
    code = "import sys, zeroshard; print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.strip()
    assert out == "[]", out


def test_no_assert_in_the_package():
    """`python -O` strips asserts: a file's contents and a user's input are checked by explicit
    tests raising named errors, invariants by errors.invariant."""
    found = [f"{m} line {node.lineno}" for m, path in modules(os.path.dirname(zeroshard.__file__)).items()
             for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.Assert)]
    assert not found, f"assert statements: {found}"


# zeroshard's own objects, by the names the code holds them under: an attribute of one is written
# by its own methods only (restore_counters, at(), uncounted(), expect_arrival, ...).
OWNED = {"engine", "comm", "cache", "layout", "reducer", "optim", "scaler", "hooks", "sequencer", "check",
         "timeline", "meter", "transfer", "saved", "tp", "plan", "partition", "chunk", "c"}  # c: a chunk


def test_no_module_writes_another_objects_attributes():
    writes = []
    for m, path in modules(os.path.dirname(zeroshard.__file__)).items():
        for node in ast.walk(ast.parse(open(path).read())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if not (isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)):
                        continue
                    holder = t.value  # the object written: `engine.x`, `self.comm.x`, `self.cache.x`
                    name = holder.id if isinstance(holder, ast.Name) else \
                        holder.attr if isinstance(holder, ast.Attribute) else None
                    if name in OWNED:
                        writes.append(f"{m} line {node.lineno}: {ast.unparse(t)} = ...")
    assert not writes, "writes to another object's attributes (give its owner a method):\n  " + "\n  ".join(writes)


def test_moved_module_paths_import_the_modules_they_moved_to():
    """The README's module paths from before the floors (`zeroshard.estimate`, ...) still import, as
    the very modules that moved (so monkeypatching either name patches the same thing)."""
    import importlib
    for old, new in zeroshard.MOVED.items():
        moved = importlib.import_module(f"zeroshard.{old}")
        assert moved is importlib.import_module(f"zeroshard.{new}"), old
        assert moved.__name__ == f"zeroshard.{new}" and getattr(zeroshard, old) is moved
    with __import__("pytest").raises(ModuleNotFoundError):
        importlib.import_module("zeroshard.no_such_module")


def test_one_vocabulary():
    """docs/vocabulary.md defines each word once; no module opens a vocabulary of its own."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "vocabulary.md")).read()
    defined = re.findall(r"\*\*([^*]+)\*\*", doc)
    repeated = sorted({w for w in defined if defined.count(w) > 1})
    assert not repeated, f"defined more than once in docs/vocabulary.md: {repeated}"
    assert {"chunk", "slot", "piece", "fragment", "full", "whole", "cache_chunks", "agree", "settle"} <= set(defined)
    own = [m for m, path in modules(os.path.dirname(zeroshard.__file__)).items()
           if "Vocabulary" in (ast.get_docstring(ast.parse(open(path).read())) or "")]
    assert not own, f"modules defining their own vocabulary (point to docs/vocabulary.md): {own}"


def test_no_module_reads_another_objects_private_attributes():
    """docs/house-rules.md: no `other._name` outside its owner (an object's underscored attributes
    are its own; others ask it through a method or a public attribute)."""
    reads = []
    for m, path in modules(os.path.dirname(zeroshard.__file__)).items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                holder = node.value
                name = holder.id if isinstance(holder, ast.Name) else \
                    holder.attr if isinstance(holder, ast.Attribute) else None
                if name in OWNED:
                    reads.append(f"{m} line {node.lineno}: {ast.unparse(node)}")
    assert not reads, "another object's private attributes used:\n  " + "\n  ".join(reads)


# Built-in exceptions the package may raise itself, each for a reason: a protocol that names the
# type (attribute lookup), a missing optional dependency, or the very error plain PyTorch or
# Lightning raises for the same user code, which that code may already catch.
BUILTIN_ALLOWED = {
    ("engine", "AttributeError"): "Engine.__getattr__: Python's attribute protocol",
    ("telemetry.timeline", "ImportError"): "matplotlib, an optional dependency, is missing",
    ("integrations.lightning", "TypeError"): "storage_options, refused with the TypeError Lightning's own "
                                             "checkpoint IO raises",
    ("optim.window_gradients", "RuntimeError"): "clip_grad_norm_(error_if_nonfinite=True): torch's own RuntimeError",
    ("runtime.saved_tensors", "RuntimeError"): "a saved tensor modified in place: autograd's own RuntimeError",
    ("optim.cpu_adam", "RuntimeError"): "sparse gradients: the RuntimeError of torch's own Adam",
    ("files.checkpoint_files", "ValueError"): "checks of a checkpoint's metadata, caught where it is read and "
                                              "raised as CheckpointError naming the file",
}


def test_every_error_raised_on_purpose_is_named():
    """errors.py: what zeroshard raises on purpose is a ZeroShardError (named, one base to catch),
    not a bare built-in, but for BUILTIN_ALLOWED."""
    import builtins
    bare = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)}
    found = []
    for m, path in modules(os.path.dirname(zeroshard.__file__)).items():
        for node in ast.walk(ast.parse(open(path).read())):
            exc = node.exc.func if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) else \
                node.exc if isinstance(node, ast.Raise) else None
            if isinstance(exc, ast.Name) and exc.id in bare and (m, exc.id) not in BUILTIN_ALLOWED:
                found.append(f"{m} line {node.lineno}: raise {exc.id}")
    assert not found, "bare built-in errors (raise one of errors.py's):\n  " + "\n  ".join(found)
