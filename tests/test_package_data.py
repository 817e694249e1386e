"""A built wheel holds every C++ source the backends compile on first use
(``meshembed_native.build``: a backend's ``.cc`` and the shared headers): each ``.cc``/``.h``
under ``backends/`` matches a ``[tool.setuptools.package-data]`` pattern of its package in
pyproject.toml, and the sources the bindings name exist. Reads files only (fast); the wheel
itself was checked once with ``pip wheel --no-deps .`` (the dense driver, now ``native_dense.cc``, was missing)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml with tomllib")

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "backends"


def _package_data() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def _cpp_sources() -> list[Path]:
    return sorted(p for p in BACKENDS.glob("*/*") if p.suffix in (".cc", ".h"))


def test_every_cpp_source_is_package_data():
    data = _package_data()
    sources = _cpp_sources()
    assert sources, "no C++ sources found under backends/"
    missing = [str(p.relative_to(ROOT)) for p in sources
               if not any(fnmatch.fnmatch(p.name, pat) for pat in data.get(p.parent.name, []))]
    assert not missing, f"not in the wheel (add to [tool.setuptools.package-data]): {missing}"


def test_the_sources_the_bindings_compile_exist():
    """Every ``with_name("x.cc")`` in a backend module names a file that is there (and so,
    by the test above, is shipped)."""
    named = []
    for module in BACKENDS.glob("*/*.py"):
        for name in re.findall(r"""with_name\(["']([^"']+\.(?:cc|h))["']\)""", module.read_text()):
            named.append(module.parent / name)
    assert named, "no binding names a C++ source"
    assert [str(p.relative_to(ROOT)) for p in named if not p.exists()] == []
