"""The README is the user's door: every ```python block runs as written, its optimizer count
is the registry's, and its conformance excerpt is what the command it shows prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.doc_blocks import ROOT, blocks, compiled

README = ROOT / "README.md"
BLOCKS = blocks(README)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs(block):
    if block.not_run is not None:
        pytest.skip(f"{block.id} not run: {block.not_run}")
    exec(compiled(block), {})


def test_readme_has_blocks():
    assert len(BLOCKS) >= 2


def test_optimizer_count_is_the_registrys():
    """"18 of the 19 algorithms": the proto's oneof, the registry, and the ones meshembed trains."""
    from meshembed._proto import optimization_parameters_pb2 as pb
    from meshembed.math.registry import OPTIMIZERS

    proto = {f.name for f in pb.OptimizationParameters.DESCRIPTOR.oneofs_by_name["parameters"].fields}
    trained = sorted(name for name, m in OPTIMIZERS.items() if m.supported)
    assert set(OPTIMIZERS) == proto
    assert sorted(proto - set(trained)) == ["mdl_adagrad_light"]
    m = re.search(r"\((\d+) of the (\d+) algorithms of\s+`optimization_parameters.proto`; the \d+th, (\w+),",
                  README.read_text())
    assert m, "the README's count of optimizers is gone"
    assert (int(m.group(1)), int(m.group(2)), m.group(3)) == (len(trained), len(proto), "MDLAdagradLight")


def _excerpt() -> tuple[str, list[str]]:
    text = README.read_text()
    m = re.search(r"```text\n\$ (meshembed conformance [^\n]*)\n(.*?)```", text, re.S)
    assert m, "the README's conformance excerpt is gone"
    return m.group(1), [line for line in m.group(2).splitlines() if line.startswith("|")]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def test_conformance_excerpt_is_real_output(tmp_path):
    """The excerpt's command, run: the same table (groups, backends, outcomes), and each error
    figure within 4x of the pasted one (the last bits of a kernel may differ on another CPU)."""
    command, pasted = _excerpt()
    args = re.findall(r'"[^"]*"|\S+', command)[1:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "meshembed", *[a.strip('"') for a in args]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    real = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(real) == len(pasted) >= 3
    for got, want in zip(real, pasted):
        got_cells, want_cells = _cells(got), _cells(want)
        assert [re.sub(r"[\d.e+-]+/[\d.e+-]+", "N", c) for c in got_cells] == \
            [re.sub(r"[\d.e+-]+/[\d.e+-]+", "N", c) for c in want_cells], (got, want)
        for g, w in zip(re.findall(r"[\d.]+e[+-]\d+", got), re.findall(r"[\d.]+e[+-]\d+", want)):
            assert float(w) / 4 <= float(g) <= float(w) * 4, (got, want)
    assert (tmp_path / "report.json").exists()
