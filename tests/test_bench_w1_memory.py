"""``benchmarks.w1_memory``: a W1 row's peak memory, measured in a fresh process, beside the
bytes of its tables, slots (as stored) and batch."""

from __future__ import annotations

from benchmarks import w1_memory
from benchmarks.common import TINY_W1

SGD = "stochastic_gradient_descent"


def test_a_row_reports_its_peak_and_its_bytes_as_stored():
    v, d = TINY_W1["vocab"], TINY_W1["dim"]
    f32 = w1_memory.run_row("numpy", "adagrad", "constant", TINY_W1, timeout=300)
    bf16 = w1_memory.measure("numpy", "adagrad", "bf16", TINY_W1)  # here: only the numbers matter
    assert "error" not in f32, f32
    assert f32["state_bytes"] == 2 * v * d * 4  # table + accumulator, float32
    assert bf16["state_bytes"] == v * d * 2 + v * d * 4  # bf16 table, float32 accumulator
    ids = TINY_W1["batch"] * TINY_W1["ids_per_sample"]
    assert f32["batch_bytes"] == 2 * ids * 8 + (TINY_W1["batch"] + 1) * 8 + TINY_W1["batch"] * d * 4
    assert f32["peak_mb"] > 0 and w1_memory.ratio(f32) > 0


def test_the_memory_table_judges_each_row():
    rows = {(SGD, "constant"): {"peak_mb": 100.0, "state_bytes": 80 * 2**20, "batch_bytes": 4 * 2**20},
            (SGD, "bf16"): {"peak_mb": 100.0, "state_bytes": 40 * 2**20, "batch_bytes": 4 * 2**20},
            ("adam", "tf"): {"error": "tensorflow does not import"}}
    text = w1_memory.table(rows, {SGD: "sgd"}.get)
    assert "| sgd | constant | 100 | 80 | 4.0 | 1.19× ✓ |" in text
    assert "| sgd | bf16 | 100 | 40 | 4.0 | 2.27× ✗ |" in text
    assert "failed: tensorflow does not import" in text
