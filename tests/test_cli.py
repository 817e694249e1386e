"""`meshembed conformance` prints one table, writes JSON/Markdown and fails on a failure."""

from __future__ import annotations

import json
import subprocess
import sys

_BROKEN = """
import sys, numpy as np
from meshembed.backend import registry
from meshembed_numpy import NumpyBackend

class Broken(NumpyBackend):
    name = "broken"
    def gather(self, table, ids):  # off by one row: the suite must notice
        return super().gather(table, (np.asarray(ids) + 1) % table.shape[0])

registry.register_backend("broken", Broken)
from meshembed.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_conformance_command_on_numpy(tmp_path):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    proc = subprocess.run(
        [sys.executable, "-m", "meshembed.cli", "conformance", "--backends", "numpy", "-k", "gather or segment_sum",
         "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out_json.read_text())
    assert report["backends"] == ["numpy"] and not report["failed"]
    assert "test_gather_with_duplicates[13-2-mod]" in report["rows"]
    assert "| test group | numpy |" in out_md.read_text()


def test_conformance_command_fails_on_a_broken_backend():
    proc = subprocess.run(
        [sys.executable, "-c", _BROKEN, "conformance", "--backends", "numpy,broken", "-k", "gather_with_duplicates"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| test_gather_with_duplicates[13-2-mod]"))
    assert row.split("|")[2].strip().startswith("pass") and row.split("|")[3].strip().startswith("FAIL")
