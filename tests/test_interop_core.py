"""me.interop without any peer library: ulp distances, gap reports, strict errors, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import meshembed as me
from meshembed.interop import Gap, GapReport
from meshembed.interop._conformance import ROUNDING, ConformanceRow, _diff, ulp_distance
from meshembed.interop._gaps import _Gaps


def test_ulp_distance_counts_representable_floats():
    one = np.float32(1.0)
    assert ulp_distance(one, np.nextafter(one, np.float32(2))) == 1
    assert ulp_distance(np.float32(-0.0), np.float32(0.0)) == 0
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    assert ulp_distance(-tiny, tiny) == 2  # across zero
    x = np.float32(3.0)
    assert ulp_distance(x, np.float32(x + 8 * np.spacing(x))) == 8
    assert ulp_distance(np.nan, np.float32(np.nan)) == 0 and ulp_distance(np.float32(np.nan), one) == np.inf
    assert ulp_distance(1.0, np.nextafter(1.0, 2.0)) == 1  # float64 too


def test_diff_and_status():
    a = np.array([1.0, 1e-3], np.float32)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(1))
    ulp, rel, norm = _diff(a, b)
    assert ulp == 1 and rel > 0 and norm < ROUNDING
    assert ConformanceRow("c", "t", "parameters", ulp, rel, (), norm).status == "rounding"
    assert ConformanceRow("c", "t", "parameters", 0, 0, (), 0).status == "exact"
    assert ConformanceRow("c", "t", "parameters", 9e6, 0.1, ("optimizer.eps",), 0.1).status == "explained"
    assert ConformanceRow("c", "t", "parameters", 9e6, 0.1, (), 0.1).status == "FINDING"


def test_gap_report_and_strict():
    gaps = _Gaps("x -> y", strict=False)
    gaps.add("optimizer.eps", "placed differently", "moved", "t")
    gaps.add("combiner", "no sqrtn", "sum")
    cfg, report = gaps.finish("cfg")
    assert cfg == "cfg" and isinstance(report, GapReport) and report.fields() == ("optimizer.eps", "combiner")
    assert report.for_table("u") == (Gap("combiner", "no sqrtn", "sum"),)
    assert "table 't': optimizer.eps: placed differently; moved" in str(report)
    strict = _Gaps("x -> y", strict=True)
    strict.add("combiner", "no sqrtn", "sum")
    with pytest.raises(me.ConfigError, match=r"(?s)x -> y translation is not exact.*combiner: no sqrtn"):
        strict.finish("cfg")
    assert _Gaps("x", strict=True).finish(1) == (1, ())
    with pytest.raises(me.ConfigError, match="strict"):
        _Gaps("x", strict="yes")


def test_interop_imports_no_framework():
    code = ("import sys, meshembed as me; me.interop.Gap; import meshembed.interop._torchrec, "
            "meshembed.interop._keras_rs, meshembed.interop._jte, meshembed.interop._conformance; "
            "bad = [m for m in ('torch', 'jax', 'keras', 'tensorflow', 'torchrec', 'keras_rs', 'fbgemm_gpu', "
            "'jax_tpu_embedding') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "interop" in dir(me) and "from_torchrec" in dir(me.interop)
    with pytest.raises(AttributeError):
        me.interop.nothing  # noqa: B018


def test_cli_refuses_unknown_peer(capsys):
    from meshembed.cli import main

    assert main(["conformance", "--against", "nope"]) == 2  # a message, not a traceback
    assert "--against" in capsys.readouterr().err
