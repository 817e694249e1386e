"""`meshembed bench` from an installed wheel: it needs the source checkout's benchmarks/ and says so."""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

import pytest

from meshembed import bench

ARGS = argparse.Namespace(backends="numpy", workload="tiny", peers=False, repeats=1, json=None, png=None)


def test_without_a_checkout_the_command_names_the_fix(tmp_path, monkeypatch):
    """An installed wheel: no checkout above the package and none in the working directory,
    though a foreign ``benchmarks`` package is there (it must not be run)."""
    site = tmp_path / "site-packages"
    site.mkdir()
    foreign = tmp_path / "work"
    (foreign / "benchmarks").mkdir(parents=True)
    (foreign / "benchmarks" / "runner.py").write_text("raise SystemExit('foreign benchmarks ran')\n")
    (foreign / "pyproject.toml").write_text('[project]\nname = "other"\n')
    monkeypatch.setattr(bench, "_ROOT", site)
    monkeypatch.chdir(foreign)
    with pytest.raises(SystemExit) as err:
        bench.main(ARGS)
    message = str(err.value)
    assert "source checkout" in message and str(site) in message and str(foreign) in message
    assert "Fix: clone the meshembed repository" in message


def test_a_checkout_in_the_working_directory_is_used(tmp_path, monkeypatch):
    """A wheel-installed meshembed run from a checkout's root finds the runner there and hands
    it the options (output paths made absolute: the runner runs in the checkout)."""
    root = tmp_path / "meshembed"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "__init__.py").write_text("")
    (root / "benchmarks" / "runner.py").write_text(
        "import json, pathlib, sys\n"
        "pathlib.Path('got.json').write_text(sys.argv[1])\n"
        "sys.exit(3)\n")
    (root / "pyproject.toml").write_text('[project]\nname = "meshembed"\n')
    monkeypatch.setattr(bench, "_ROOT", tmp_path / "site-packages")
    monkeypatch.chdir(root)
    args = argparse.Namespace(**{**vars(ARGS), "json": "out.json"})
    assert bench.main(args) == 3
    got = json.loads((root / "got.json").read_text())
    assert got == {**vars(ARGS), "json": str(root / "out.json")}


def test_bench_module_imports_only_the_standard_library_and_meshembed():
    tree = ast.parse(pathlib.Path(bench.__file__).read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert names <= set(sys.stdlib_module_names) | {"meshembed"}, names
