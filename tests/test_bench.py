"""`meshembed bench` runs a tiny workload end to end and writes its table, JSON and chart."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_tiny_numpy(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "meshembed.cli", "bench", "--workload", "tiny", "--backends", "numpy",
         "--repeats", "2", "--json", str(out), "--png", str(png)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["bandwidth_gbs"] > 0 and not report["failures"]
    cases = {(r["workload"], r["case"]) for r in report["rows"]}
    assert {("W1", "sgd"), ("W1", "adagrad"), ("W1", "adadelta"),
            ("W2", "adadelta 1 tensor"), ("W2", "adadelta 64 tensors")} <= cases
    assert all(r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in report["rows"])
    assert "| W1 | adadelta | meshembed[numpy] |" in proc.stdout
    assert png.stat().st_size > 1000


def test_jax_against_fbgemm_tiny():
    """The interleaved JAX-engine-vs-fbgemm timing runs on CI sizes and times both steps."""
    import pytest

    pytest.importorskip("jax")
    pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu-cpu is not installed")
    from benchmarks.common import TINY_W1
    from benchmarks.jax_w1 import against_fbgemm

    timed = against_fbgemm(TINY_W1, "sgd", repeats=2, rounds=1)
    assert set(timed) == {"meshembed[jax] engine", "fbgemm TBE CPU"}
    assert all(0 < lo <= med <= hi for med, lo, hi in timed.values())


def test_timeit_counts_work_a_step_leaves_running():
    """``step.finish`` (the JAX engine's update still running after the step returns) is
    waited for after the warm-ups and after the last repeat, and counts toward that repeat."""
    import time

    from benchmarks.common import timeit

    calls = []

    def step():
        calls.append("step")

    def finish():
        calls.append("finish")
        time.sleep(0.05)

    step.finish = finish
    med, lo, hi = timeit(step, warmup=1, repeats=3)
    assert calls == ["step", "finish", "step", "step", "step", "finish"]
    assert hi >= 50 > med
