"""Every backend stores, moves and sums rows exactly as the NumPy reference.

Row i of a test table holds the value i (plus the column index / 1000), so a misplaced
row is obvious in any failure message.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.tolerances import assert_close
from meshembed.sharding import Placement

SHARDINGS = [(v, n, s) for v, n in [(13, 1), (13, 2), (13, 3), (16, 8), (10, 3)] for s in ("mod", "div")]
DTYPES = ["float32", "float64"]


def _table(vocab: int, dim: int, dtype: str) -> np.ndarray:
    return (np.arange(vocab)[:, None] + np.arange(dim)[None, :] / 1000.0).astype(dtype)


def _skip_dtype(backend, dtype):
    if dtype == "float64" and not backend.capabilities.float64:
        pytest.skip(f"backend {backend.name!r} declares no float64 support")


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_create_unshard_round_trip(backend, vocab, shards, strategy, dtype):
    _skip_dtype(backend, dtype)
    values = _table(vocab, 4, dtype)
    table = backend.create_table(values, Placement(vocab, shards, strategy))
    assert table.shape == (vocab, 4)
    out = backend.unshard(table)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize("vocab,dim", [(13, 4), (4096, 16), (65536, 64)])
@pytest.mark.parametrize("shards", [1, 2])
def test_create_table_copies_the_callers_values(backend, vocab, dim, shards):
    """A table owns its storage: writing into the array it was made from afterwards (or the
    table's updates) never shows through the other (some runtimes alias host buffers)."""
    values = _table(vocab, dim, "float32")
    expected = values.copy()
    table = backend.create_table(values, Placement(vocab, shards, "mod"))
    values[:] = -1.0
    np.testing.assert_array_equal(backend.unshard(table), expected)


def _blocks(values: np.ndarray, sizes: list[int]):
    start = 0
    for size in sizes + [values.shape[0]]:
        stop = min(values.shape[0], start + size)
        if stop > start:
            yield values[start:stop]
        start = stop


# 131,075 x 64 float32 is 32 MiB: large enough that a backend may fill it on its devices
# window by window (JAX), with shards of unequal size.
@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS + [(131075, 1, "mod"), (131075, 3, "mod"), (131075, 3, "div")])
def test_create_table_from_blocks(backend, vocab, shards, strategy):
    """Blocks of logical rows of any size make the same table as the whole array."""
    dim = 64 if vocab > 1000 else 4
    values = _table(vocab, dim, "float32")
    placement = Placement(vocab, shards, strategy)
    table = backend.create_table_from_blocks((vocab, dim), _blocks(values, [1, 5, vocab // 3, 7]), placement)
    assert table.shape == (vocab, dim)
    np.testing.assert_array_equal(backend.unshard(table), values)
    if vocab < 1000:  # and the table behaves like one made by create_table
        ids = np.array([vocab - 1, 0, 2], dtype=np.int64)
        np.testing.assert_array_equal(backend.to_numpy(backend.gather(table, backend.asarray(ids))), values[ids])


# 16-bit patterns (a low-precision table's storage, int16) are placed as they are; 262,147 x 64
# int16 is 32 MiB: a backend may fill it window by window too.
@pytest.mark.parametrize("vocab,shards", [(11, 3), (262147, 3)])
def test_create_table_from_blocks_of_int16_patterns(backend, vocab, shards):
    if backend.processes > 1:
        pytest.skip("16-bit tables run in one process (docs/low_precision.md): gloo has no int16 all-gather")
    dim = 64 if vocab > 1000 else 4
    values = np.random.default_rng(7).integers(-2**15, 2**15, (vocab, dim)).astype(np.int16)
    placement = Placement(vocab, shards, "mod")
    table = backend.create_table_from_blocks((vocab, dim), _blocks(values, [2, vocab // 2, 9]), placement, "int16")
    got = backend.unshard(table)
    assert got.dtype == np.int16 and np.array_equal(got, values)


@pytest.mark.parametrize("sizes", [[3, 3], [3, 3, 3, 3, 3], [13, 1]])
def test_create_table_from_blocks_that_do_not_cover_the_table(backend, sizes):
    values = _table(20, 4, "float32")
    blocks = [values[:k] for k in sizes]
    with pytest.raises(ValueError, match="blocks"):
        backend.create_table_from_blocks((13, 4), iter(blocks), Placement(13, 2, "mod"))


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
def test_gather_with_duplicates(backend, vocab, shards, strategy):
    values = _table(vocab, 3, "float32")
    table = backend.create_table(values, Placement(vocab, shards, strategy))
    ids = np.array([vocab - 1, 0, 2, 2, vocab - 1, 1], dtype=np.int64)
    rows = backend.to_numpy(backend.gather(table, backend.asarray(ids)))
    np.testing.assert_array_equal(rows, values[ids])


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
def test_scatter_touches_only_given_rows(backend, vocab, shards, strategy):
    values = _table(vocab, 3, "float32")
    table = backend.create_table(values, Placement(vocab, shards, strategy))
    ids = np.array([vocab - 1, 0, 4], dtype=np.int64)
    new_rows = -np.ones((3, 3), dtype=np.float32) * np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    table = backend.scatter(table, backend.asarray(ids), backend.asarray(new_rows))
    expected = values.copy()
    expected[ids] = new_rows
    np.testing.assert_array_equal(backend.unshard(table), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_sum(backend, dtype):
    _skip_dtype(backend, dtype)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, size=200)
    vals = rng.standard_normal((200, 5)).astype(dtype)
    uids, sums = backend.segment_sum(backend.asarray(ids), backend.asarray(vals))
    uids, sums = backend.to_numpy(uids), backend.to_numpy(sums)
    expected_ids = np.unique(ids)
    expected = np.stack([vals[ids == i].sum(0) for i in expected_ids])
    order = np.argsort(uids)
    np.testing.assert_array_equal(uids[order], expected_ids)
    assert_close(sums[order], expected, dtype=dtype, rtol=1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_sum_to(backend, dtype):
    _skip_dtype(backend, dtype)
    rng = np.random.default_rng(1)
    seg = rng.integers(0, 7, size=50)
    vals = rng.standard_normal((50, 3)).astype(dtype)
    out = backend.to_numpy(backend.segment_sum_to(backend.asarray(vals), backend.asarray(seg), 9))
    expected = np.zeros((9, 3))
    np.add.at(expected, seg, vals)
    assert out.shape == (9, 3)
    assert_close(out, expected, dtype=dtype, rtol=1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
def test_update_rows_sums_duplicates_then_applies_once(backend, vocab, shards, strategy):
    """The rule must see one summed gradient per unique row; untouched rows stay bit-identical."""
    from meshembed.math import UpdateRule, get_math

    values = _table(vocab, 2, "float32")
    slot = np.full((vocab, 2), 0.5, dtype=np.float32)
    placement = Placement(vocab, shards, strategy)
    tables = [backend.create_table(values, placement), backend.create_table(slot, placement)]
    ids = np.array([1, 3, 1, 1, vocab - 1], dtype=np.int64)
    grads = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], dtype=np.float32)
    # Adagrad with lr 1: a nonlinear rule, so summing after squaring would differ
    rule = UpdateRule(get_math("adagrad"), ("accumulators",))
    new = backend.update_rows(tables, backend.asarray(ids), backend.asarray(grads), rule, values=(1.0,))
    p, s = backend.unshard(new[0]), backend.unshard(new[1])
    ep, es = values.copy(), slot.copy()
    for row in np.unique(ids):
        g = grads[ids == row].sum(0)
        es[row] = slot[row] + g * g
        ep[row] = values[row] - g / np.sqrt(es[row])
    assert_close(p, ep, dtype="float32")
    assert_close(s, es, dtype="float32")
    untouched = np.setdiff1d(np.arange(vocab), ids)
    np.testing.assert_array_equal(p[untouched], values[untouched])
    np.testing.assert_array_equal(s[untouched], slot[untouched])


def test_asarray_round_trip(backend):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = backend.asarray(x)
    assert backend.is_native(y)
    np.testing.assert_array_equal(backend.to_numpy(y), x)
    wide = backend.to_numpy(backend.asarray([1, 2], dtype="int64"))
    # JAX without the user's jax_enable_x64 holds no int64: ids are narrowed to int32 (range-checked)
    assert wide.dtype == np.int64 or (wide.dtype == np.int32 and not backend.capabilities.float64)
    np.testing.assert_array_equal(wide, [1, 2])


def test_stats_counts_by_name_and_is_a_copy(backend):
    """``stats()``: counts of the fast paths taken, by name; a copy (changing it changes
    nothing), and a count never goes down after more calls."""
    from meshembed.math import UpdateRule, get_math

    before = backend.stats()
    assert isinstance(before, dict) and all(isinstance(k, str) and isinstance(v, int) for k, v in before.items())
    backend.stats()["fused_updates"] = -1
    assert backend.stats() == before
    tables = [backend.create_table(_table(13, 2, "float32"), Placement(13, 2, "mod"))]
    rule = UpdateRule(get_math("stochastic_gradient_descent"), ())
    backend.update_rows(tables, backend.asarray(np.array([1, 1, 5])), backend.asarray(np.ones((3, 2), np.float32)),
                        rule, values=(0.5,))
    after = backend.stats()
    assert all(after.get(k, 0) >= v for k, v in before.items())
