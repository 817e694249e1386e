"""The layering rules of docs/internals.md ("Layering"), checked on the source text (ast).

* A backend package imports, from meshembed, only the protocol, the math, sharding, config
  and errors (plus its own package and ``meshembed_native``), never ``meshembed.embedding``
  or the top-level ``meshembed`` — anywhere in the file, lazy imports included. Front ends
  that live in a backend package (``me.jax``, ``me.torch``: its ``frontend/`` subpackage) may
  use the public engine API; no backend module imports a front end (the engine side never
  depends on the front end).
* The core (``src/meshembed``) imports no framework (torch, jax, cupy, tensorflow) when it is
  imported (inside a function is fine: a lazy alias), and never the repository's
  ``benchmarks`` package; ``meshembed/bench.py`` imports nothing outside the standard library
  and meshembed.
* No import circle among the core's modules at import time.
* Every backend package keeps its backend class in backend.py, its ShardedTable in table.py
  and its dense mixin in dense.py (Keras' ``backend/{jax,torch,numpy}/`` layout).
* No backend takes a function apart (``__closure__``, ``__code__``, ``inspect.signature``,
  ``update_spec``, ...): the core hands backends UpdateRules, which are data.

Reading the files (not importing them) keeps the test fast and lets it see lazy imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "meshembed"
BACKENDS = ROOT / "backends"

#: meshembed modules a backend file may import (with their submodules).
BACKEND_MAY_USE = ("meshembed.backend", "meshembed.math", "meshembed.sharding", "meshembed.config",
                   "meshembed.errors", "meshembed_native")
#: Front ends living in backend packages (a module, or a subpackage with everything under it):
#: they may use the public engine API as well, and no other backend file may import them.
FRONT_ENDS = {"meshembed_jax/frontend", "meshembed_torch/frontend"}
FRAMEWORKS = ("torch", "jax", "jaxlib", "cupy", "tensorflow")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool, top_level_only: bool = False
             ) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names)`` of every import in ``tree``: ``import m`` gives ``(line, "m",
    ())``, ``from m import a, b`` gives ``(line, "m", ("a", "b"))`` (relative ones resolved).
    With ``top_level_only``, only those that run when the module is imported: not inside a
    function, nor under ``if TYPE_CHECKING:``."""
    out: list[tuple[int, str, tuple[str, ...]]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if top_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                out.extend((child.lineno, alias.name, ()) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                out.append((child.lineno, base, tuple(alias.name for alias in child.names)))
            visit(child)

    visit(tree)
    return out


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts and not p.name.endswith("_pb2.py"))


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _front_end(rel: str) -> bool:
    """Whether the file ``rel`` (relative to backends/) is a front end (``FRONT_ENDS``)."""
    return any(rel == f or rel.startswith(f + "/") for f in FRONT_ENDS)


#: The front ends as module names (``meshembed_jax.frontend``, ``meshembed_torch.frontend``).
FRONT_END_MODULES = tuple(f.removesuffix(".py").replace("/", ".") for f in sorted(FRONT_ENDS))


def _backend_files(backends: Path) -> list[tuple[str, Path, ast.Module]]:
    """``(path relative to backends/, path, parsed tree)`` of every backend file but the front ends."""
    out = []
    for path in _files(backends):
        rel = path.relative_to(backends).as_posix()
        if not _front_end(rel):
            out.append((rel, path, ast.parse(path.read_text(), str(path))))
    return out


def backend_violations(backends: Path = BACKENDS) -> list[str]:
    """Every forbidden meshembed import in backend files, as ``file:line name``: outside the
    allowed core modules, or a front end (the backend never depends on its front end)."""
    bad = []
    for rel, path, tree in _backend_files(backends):
        allowed = (*BACKEND_MAY_USE, rel.split("/")[0])
        for line, base, names in _imports(tree, _module_name(path, backends), path.name == "__init__.py"):
            if _under(base, FRONT_END_MODULES):
                bad.append(f"{rel}:{line} {base} (a front end)")
                continue
            bad += [f"{rel}:{line} {base}.{n} (a front end)" for n in names if _under(f"{base}.{n}", FRONT_END_MODULES)]
            if not _under(base, ("meshembed",)) or _under(base, allowed):
                continue  # the standard library, frameworks, own package, allowed core modules
            if base == "meshembed" and names:  # from meshembed import errors, math: each must be allowed
                bad += [f"{rel}:{line} meshembed.{n}" for n in names if not _under(f"meshembed.{n}", allowed)]
            else:
                bad.append(f"{rel}:{line} {base}")
    return bad


def core_violations(core: Path = CORE) -> list[str]:
    """Frameworks imported when a core module is imported, and ``benchmarks`` anywhere."""
    bad = []
    for path in _files(core):
        rel = path.relative_to(core.parent).as_posix()
        module, package = _module_name(path, core.parent), path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for line, base, _ in _imports(tree, module, package, top_level_only=True):
            if _under(base, FRAMEWORKS):
                bad.append(f"{rel}:{line} {base} (at import time)")
        bad += [f"{rel}:{line} {base}" for line, base, _ in _imports(tree, module, package)
                if _under(base, ("benchmarks",))]
    return bad


def bench_violations(path: Path = CORE / "bench.py") -> list[str]:
    """Imports of ``meshembed/bench.py`` from outside the standard library and meshembed."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"bench.py:{line} {base}" for line, base, _ in _imports(tree, "meshembed.bench", False)
            if base.split(".")[0] not in (*sys.stdlib_module_names, "meshembed", "__future__")]


def import_graph(core: Path = CORE) -> dict[str, set[str]]:
    """Core module -> core modules it imports when it is imported. Explicit imports only (a
    package's ``__init__`` running before its submodule is not an edge); ``from pkg import
    sub`` is an edge to the submodule ``pkg.sub``, ``from pkg import name`` to ``pkg``."""
    modules = {_module_name(p, core.parent): p for p in _files(core)}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for _, base, names in _imports(tree, module, path.name == "__init__.py", top_level_only=True):
            targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base]
            edges.update(t for t in targets if t in modules and t != module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (one per strongly connected component, Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


#: Reading these takes a function apart (what backends did to the core's update closures).
INTROSPECTION = {"__closure__", "__code__", "__defaults__", "__kwdefaults__", "__globals__", "__wrapped__",
                 "update_spec", "signature", "getfullargspec", "getclosurevars"}
#: (file, function) allowed to read them, and why.
INTROSPECTION_ALLOWED = {
    # copies a function into a fresh code object so that dynamo keeps one cache per compiled
    # entry; it reads nothing out of the function, and the core hands it no closure to parse
    ("meshembed_torch/kernels.py", "distinct_code"),
}


def introspection_violations(backends: Path = BACKENDS) -> list[str]:
    """Reads of function internals or signatures in backend files, as ``file:line name``."""
    bad = []
    for rel, _, tree in _backend_files(backends):
        allowed_lines: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) in INTROSPECTION_ALLOWED:
                allowed_lines.update(range(node.lineno, node.end_lineno + 1))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in INTROSPECTION:
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in INTROSPECTION:
                name = node.args[1].value
            if name and node.lineno not in allowed_lines:
                bad.append(f"{rel}:{node.lineno} {name}")
    return sorted(bad)


def test_backends_never_take_core_functions_apart():
    assert introspection_violations() == [], (
        "backends get UpdateRules (data), never closures to inspect (docs/internals.md, Update rules)")


def test_backends_import_only_protocol_math_sharding_config():
    assert backend_violations() == [], (
        "backend files may import only meshembed.{backend,math,sharding,config,errors}, their own "
        "package and meshembed_native (front ends: docs/internals.md, Layering)")


def test_core_imports_no_framework_at_import_and_never_benchmarks():
    assert core_violations() == []


def test_bench_imports_nothing_outside_the_package():
    assert bench_violations() == []


def test_no_import_circle_in_the_core():
    assert cycles(import_graph()) == []


#: The backend packages with storage of their own (meshembed_native is the shared C++ build).
BACKEND_PACKAGES = ("meshembed_numpy", "meshembed_torch", "meshembed_jax", "meshembed_array_api")
#: Where each kind of class lives in every backend package (the Keras-style layout).
HOME_OF = {"Backend": "backend.py", "ShardedTable": "table.py", "DenseMixin": "dense.py"}


def structure_violations(backends: Path = BACKENDS) -> list[str]:
    """Backend classes outside their file (``HOME_OF``), and packages without backend.py/table.py."""
    bad = [f"{pkg}/{name} missing" for pkg in BACKEND_PACKAGES for name in ("backend.py", "table.py")
           if not (backends / pkg / name).is_file()]
    for rel, _, tree in _backend_files(backends):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            kinds = {ast.unparse(base).split(".")[-1] for base in node.bases}
            kinds |= {"DenseMixin"} if node.name.endswith("DenseMixin") else set()
            for kind in kinds & set(HOME_OF):
                if not rel.endswith("/" + HOME_OF[kind]):
                    bad.append(f"{rel}:{node.lineno} {node.name} ({kind}: belongs in {HOME_OF[kind]})")
    return bad


def test_every_backend_package_has_the_same_files():
    assert structure_violations() == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checks_catch_what_they_forbid(tmp_path):
    """Each check fails on a planted violation (so the empty lists above mean something)."""
    _write(tmp_path / "b", {
        "meshembed_x/backend.py": "from meshembed.math.rule import UpdateRule\n"
                                  "def f():\n    from meshembed.embedding.updates import make_rule\n",
        "meshembed_x/api.py": "import meshembed as me\nfrom meshembed import errors, TPUEmbedding\n",
        "meshembed_x/ok.py": "from meshembed.backend.status import status_of\nfrom meshembed_x import backend\n"
                             "import numpy\nfrom meshembed_native import build\n",
        "meshembed_x/table.py": "from meshembed_torch import frontend\ndef f():\n"
                                "    from meshembed_torch.frontend.module import EmbeddingCollection\n",
    })
    assert backend_violations(tmp_path / "b") == [
        "meshembed_x/api.py:1 meshembed", "meshembed_x/api.py:2 meshembed.TPUEmbedding",
        "meshembed_x/backend.py:3 meshembed.embedding.updates",
        "meshembed_x/table.py:1 meshembed_torch.frontend (a front end)",
        "meshembed_x/table.py:3 meshembed_torch.frontend.module (a front end)",
    ]
    _write(tmp_path / "i", {
        "meshembed_x/backend.py": "import inspect\ndef f(fn):\n    fn.__wrapped__ = fn\n"
                                  "    return fn.__closure__, getattr(fn, 'update_spec', None), inspect.signature(fn)\n",
    })
    assert introspection_violations(tmp_path / "i") == [
        "meshembed_x/backend.py:4 __closure__", "meshembed_x/backend.py:4 signature",
        "meshembed_x/backend.py:4 update_spec"]
    _write(tmp_path / "s", {
        "meshembed_numpy/backend.py": "class T(ShardedTable): pass\nclass B(NumpyDenseMixin, Backend): pass\n",
        "meshembed_numpy/table.py": "class NumpyDenseMixin: pass\n",
    })
    assert structure_violations(tmp_path / "s")[-2:] == [
        "meshembed_numpy/backend.py:1 T (ShardedTable: belongs in table.py)",
        "meshembed_numpy/table.py:1 NumpyDenseMixin (DenseMixin: belongs in dense.py)"]
    assert "meshembed_torch/backend.py missing" in structure_violations(tmp_path / "s")
    core = tmp_path / "src" / "meshembed"
    _write(core, {
        "__init__.py": "from meshembed import a\n",
        "a.py": "import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jax\n"
                "def f():\n    import jax\n    from benchmarks import runner\n",
        "b.py": "from meshembed.c import x\n",
        "c.py": "from . import b\n",
        "bench.py": "import json\nfrom benchmarks.runner import main\nfrom meshembed import a\n",
    })
    assert core_violations(core) == ["meshembed/a.py:1 torch (at import time)", "meshembed/a.py:7 benchmarks",
                                     "meshembed/bench.py:2 benchmarks.runner"]
    assert bench_violations(core / "bench.py") == ["bench.py:2 benchmarks.runner"]
    assert cycles(import_graph(core)) == [["meshembed.b", "meshembed.c"]]


@pytest.mark.parametrize("rel", sorted(FRONT_ENDS))
def test_front_ends_named_here_exist(rel):
    assert (BACKENDS / rel).is_file() or (BACKENDS / rel / "__init__.py").is_file(), (
        f"{rel} is listed as a front end but does not exist")


# -- one step under every front end: no private names across packages, no backend names ---------
def _package_of(path: Path) -> str:
    """The package a file belongs to: its directory relative to src/; under backends/, the
    backend package, subpackages (``frontend/``, ``kernels/``) included."""
    if CORE.parent in path.parents:
        return path.parent.relative_to(CORE.parent).as_posix()
    return path.relative_to(BACKENDS).parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_definitions(files: list[Path]) -> dict[str, set[str]]:
    """Package -> the private attribute and method names its classes define (``self._x = ...``,
    ``def _x``): what another package's code must not reach into."""
    out: dict[str, set[str]] = {}
    for path in files:
        names = out.setdefault(_package_of(path), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) \
                            and isinstance(item.value, ast.Name) and item.value.id in ("self", "cls") \
                            and _private(item.attr):
                        names.add(item.attr)
    return out


def private_violations(files: list[Path] | None = None) -> list[str]:
    """``from other.package import _name`` (or a private module of another package), and
    ``obj._name`` where ``_name`` is private to a class of another package only."""
    files = files if files is not None else _files(CORE) + _files(BACKENDS)
    defined = _private_definitions(files)
    bad = []
    for path in files:
        pkg = _package_of(path)
        root = CORE.parent if CORE.parent in path.parents else BACKENDS
        module = _module_name(path, root)
        rel = path.relative_to(root.parent).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for line, base, names in _imports(tree, module, path.name == "__init__.py"):
            if not _under(base, ("meshembed",)) and not base.startswith("meshembed_"):
                continue
            target_pkg = base.replace(".", "/")
            own = target_pkg == pkg or target_pkg.rsplit("/", 1)[0] == pkg \
                or (root == BACKENDS and target_pkg.split("/")[0] == pkg)
            if own:
                continue
            parts = base.split(".")
            if any(_private(p) for p in parts[1:]) and parts[1] != "_proto":
                bad.append(f"{rel}:{line} {base}")
            bad += [f"{rel}:{line} {base}.{n}" for n in names if _private(n)]
        mine = defined.get(pkg, set())
        others = set().union(*(v for k, v in defined.items() if k != pkg)) - mine
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in others \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{rel}:{node.lineno} .{node.attr}")
    return sorted(set(bad))


#: Backend names: the core never branches on one (a backend says what it can in its capabilities).
BACKEND_NAMES = {"jax", "torch", "cupy", "array_api", "array_api_strict"}


def backend_name_branches(core: Path = CORE) -> list[str]:
    """``backend.name == "jax"`` (or ``in (...)``) anywhere in the core."""
    bad = []
    for path in _files(core):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr == "name" and "backend" in ast.unparse(s.value)
                        for s in sides)
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
            if named and consts & BACKEND_NAMES:
                bad.append(f"{path.relative_to(core.parent).as_posix()}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_no_private_name_crosses_a_package():
    assert private_violations() == [], (
        "front ends and backends use the public step/batch/engine API only (docs/internals.md, Layering)")


def test_the_core_never_branches_on_a_backend_name():
    assert backend_name_branches() == []


def test_the_private_and_name_checks_catch_what_they_forbid(tmp_path):
    core = tmp_path / "src" / "meshembed"
    _write(core, {
        "embedding/engine.py": "class E:\n    def _plan(self):\n        self._state = 1\n",
        "ops.py": "def f(e, backend):\n    e._plan()\n    from meshembed.embedding.engine import _load\n"
                  "    return backend.name == 'jax'\n",
    })
    files = _files(core)
    global CORE
    saved, CORE = CORE, core
    try:
        assert private_violations(files) == ["src/meshembed/ops.py:2 ._plan",
                                             "src/meshembed/ops.py:3 meshembed.embedding.engine._load"]
        assert backend_name_branches(core) == ["meshembed/ops.py:4 backend.name == 'jax'"]
    finally:
        CORE = saved


#: The modules that decide how a table's rows are updated: the routing, the rule that names the
#: kinds, and the 16-bit branch the routing hands a low-precision table to.
ROUTING = {"src/meshembed/embedding/routing.py", "src/meshembed/embedding/updates.py",
           "src/meshembed/embedding/precision.py"}


def test_the_per_table_routing_lives_once():
    """The engine and me.jax both run ``routing.update_table`` (issue #30): no other module
    decides a table's update kind again (``update_kind``), and both step functions call it."""
    deciders = sorted(p.relative_to(ROOT).as_posix() for base in (CORE, BACKENDS) for p in base.rglob("*.py")
                      if "update_kind(" in p.read_text() and p.relative_to(ROOT).as_posix() not in ROUTING)
    assert deciders == []
    for rel in ("src/meshembed/embedding/step.py", "backends/meshembed_jax/frontend/step.py"):
        assert "routing.update_table(" in (ROOT / rel).read_text(), rel
