"""``benchmarks.numpy_w1``: the plain NumPy programs sum what the engine sums, and the table
judges the engine's update against the best of them."""

from __future__ import annotations

import numpy as np

from benchmarks import numpy_w1
from benchmarks.common import TINY_W1, W1Inputs


def test_the_plain_sums_agree():
    d = W1Inputs(TINY_W1)
    dim = TINY_W1["dim"]
    rows = lambda pos: np.take(d.grad, d.segments[pos], axis=0)  # noqa: E731
    sums = {how: numpy_w1._sum_per_id(how, d.ids, rows, dim) for how in numpy_w1.SUMS}
    ids, exact = sums["add.at"]
    assert ids.size == d.unique
    flat_ids, flat = sums["flat add.at"]
    assert (flat_ids == ids).all() and flat.tobytes() == exact.tobytes()  # same order, same bits
    for how in ("sort + reduceat", "bincount"):  # other orders: float32 rounding apart
        np.testing.assert_array_equal(sums[how][0], ids)
        np.testing.assert_allclose(sums[how][1], exact, rtol=1e-5, atol=1e-7)


def test_a_quick_run_gives_every_row_and_a_verdict():
    results = numpy_w1.run(TINY_W1, ("sgd", "adagrad"), repeats=1, rounds=1, warmup=1)
    text = numpy_w1.table(results)
    for optimizer in ("sgd", "adagrad"):
        assert set(results[optimizer]) == {"meshembed[numpy]"} | {f"plain NumPy, {h}" for h in numpy_w1.SUMS}
        line = next(x for x in text.splitlines() if x.startswith(f"| {optimizer} | meshembed[numpy] |"))
        assert ("✓" in line) != ("✗" in line), line
