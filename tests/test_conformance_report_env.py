"""``meshembed conformance`` (conformance_report.run) sets the suite's backend list only while
the suite runs: the caller's environment is the same afterwards, also when the run fails."""

from __future__ import annotations

import os

import pytest

from meshembed import conformance_report


@pytest.mark.parametrize("before", [None, "torch"])
@pytest.mark.parametrize("fails", [False, True])
def test_run_restores_the_environment(monkeypatch, before, fails):
    pytest_module = pytest
    seen = []

    def fake_main(args, plugins=()):
        seen.append(os.environ.get("MESHEMBED_TEST_BACKENDS"))
        if fails:
            raise RuntimeError("the suite crashed")
        return 0

    if before is None:
        monkeypatch.delenv("MESHEMBED_TEST_BACKENDS", raising=False)
    else:
        monkeypatch.setenv("MESHEMBED_TEST_BACKENDS", before)
    monkeypatch.setattr(pytest_module, "main", fake_main)
    if fails:
        with pytest.raises(RuntimeError, match="crashed"):
            conformance_report.run(["numpy"])
    else:
        conformance_report.run(["numpy"])
    assert seen == ["numpy"]
    assert os.environ.get("MESHEMBED_TEST_BACKENDS") == before
