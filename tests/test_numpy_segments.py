"""The NumPy backend's segment sums keep the reference's order: every key's rows added one by
one in input order to +0.0 — ``np.add.at``'s definition, the oracle here — bit for bit,
whichever way (rounds, the flat ``add.at`` of the long keys, chunk edges) a row is added.
A NaN is compared as NaN: its sign and payload are the hardware's (x86's inf − inf is a
negative NaN; which NaN operand survives depends on the instruction NumPy's loop picks)."""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding.layout import build_layout
from meshembed.embedding.updates import make_rule
from meshembed.sharding.placement import Placement
from meshembed_numpy import kernels
from meshembed_numpy.backend import NumpyBackend
from meshembed_numpy.kernels import Segments, add_rows_at

# inf − inf and overflow are part of the cases
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")


def _oracle(keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unique, inverse = np.unique(keys, return_inverse=True)
    sums = np.zeros((unique.size, rows.shape[1]), rows.dtype)
    np.add.at(sums, inverse.reshape(-1), rows)
    return unique, sums


def _bits(a: np.ndarray) -> bytes:
    """The float32 bit patterns, every NaN made the same NaN."""
    a = np.where(np.isnan(a), np.float32(np.nan), a).astype(np.float32)
    return a.view(np.int32).tobytes()


def _rows(rng: np.random.Generator, n: int, d: int, case: int) -> np.ndarray:
    """Rows whose sum depends on the order: magnitudes 1e-20..1e20, -0.0, ±inf, NaN."""
    rows = (rng.standard_normal((n, d)) * 10.0 ** rng.integers(-20, 20, (n, d))).astype(np.float32)
    rows[rng.random((n, d)) < 0.1] = -0.0
    if case % 3 == 1:
        rows[rng.random((n, d)) < 0.01] = np.inf
        rows[rng.random((n, d)) < 0.01] = -np.inf
        rows[rng.random((n, d)) < 0.01] = np.nan
    if case % 5 == 4:
        rows[:] = -0.0  # +0.0 + (-0.0) is +0.0: the sum never starts from the first row
    return rows


@pytest.mark.parametrize("rounds,chunk", [(1, 3), (2, 4096), (16, 5), (16, 4096)])
def test_segment_sums_are_np_add_at_bit_for_bit(monkeypatch, rounds, chunk):
    monkeypatch.setattr(kernels, "ROUNDS", rounds)
    monkeypatch.setattr(kernels, "CHUNK_ROWS", chunk)
    rng = np.random.default_rng(rounds * 100 + chunk)
    for case in range(12):
        n, d = int(rng.integers(0, 2000)), int(rng.integers(1, 70))
        keys = rng.zipf(1.3, n).astype(np.int64) % 50  # a few keys with hundreds of rows
        if case % 4 == 0:
            keys = np.sort(keys)  # the combiner's bags come sorted: no argsort
        rows = _rows(rng, n, d, case)
        unique, want = _oracle(keys, rows)
        segs = Segments(keys)
        got = segs.sum(lambda pos: rows[pos], d, rows.dtype)
        np.testing.assert_array_equal(segs.unique, unique)
        assert _bits(got) == _bits(want), case
        by_count = segs.sum(lambda pos: rows[pos], d, rows.dtype, sorted_keys=False)
        assert _bits(by_count[np.argsort(segs.by_count)]) == _bits(want)


def test_add_rows_at_is_np_add_at():
    rng = np.random.default_rng(3)
    targets = rng.integers(0, 7, 10_000)
    rows = _rows(rng, targets.size, 9, 0)  # no NaN: the very same instruction sequence
    want = np.zeros((7, 9), np.float32)
    np.add.at(want, targets, rows)
    got = add_rows_at(np.zeros((7, 9), np.float32), targets, lambda part: rows[part])
    assert _bits(got) == _bits(want)


def test_backend_sums_and_update_match_the_plain_definitions():
    """``segment_sum``, ``segment_sum_to``, ``gather_combine`` (weighted) and an SGD
    ``update_rows`` through ``grad_index``/``grad_weights`` against the protocol's plain
    composition of gather, multiply and ``np.add.at``, on 1 and 3 shards."""
    rng = np.random.default_rng(5)
    be = NumpyBackend()
    vocab, d, n, bags = 60, 8, 3000, 400
    ids = rng.zipf(1.2, n).astype(np.int64) % vocab
    slots = np.sort(rng.integers(0, bags, n))
    weights = rng.standard_normal(n).astype(np.float32)
    values = rng.standard_normal((vocab, d)).astype(np.float32)
    grads = rng.standard_normal((bags, d)).astype(np.float32)
    for shards in (1, 3):
        table = be.create_table(values, Placement(vocab, shards, "mod"))
        rows = values[ids] * weights[:, None]
        want = np.zeros((bags, d), np.float32)
        np.add.at(want, slots, rows)
        assert be.gather_combine(table, ids, slots, bags, weights).tobytes() == want.tobytes()
        assert be.segment_sum_to(rows, slots, bags).tobytes() == want.tobytes()
        uids, sums = be.segment_sum(ids, rows)
        want_ids, want_sums = _oracle(ids, rows)
        np.testing.assert_array_equal(uids, want_ids)
        assert sums.tobytes() == want_sums.tobytes()
        rule = make_rule(_sgd_table(vocab, d), be)
        per_id = grads[slots] * weights[:, None]
        u, g = _oracle(ids, per_id)
        expect = values.copy()
        expect[u] = values[u] - np.float32(0.5) * g
        (new,) = be.update_rows([table], ids, grads, rule, values=(0.5,), grad_index=slots, grad_weights=weights)
        assert be.unshard(new).tobytes() == expect.tobytes()


def test_values_of_any_trailing_shape():
    """1-D values (a dense optimizer's sparse rows) and ``[n, a, b]`` ones, as ``np.add.at``."""
    rng = np.random.default_rng(8)
    be = NumpyBackend()
    ids = rng.integers(0, 9, 500)
    for shape in ((500,), (500, 3, 2)):
        values = rng.standard_normal(shape).astype(np.float32)
        want_ids, want = _oracle(ids, values.reshape(500, -1))
        uids, sums = be.segment_sum(ids, values)
        np.testing.assert_array_equal(uids, want_ids)
        assert sums.shape == (want_ids.size,) + shape[1:] and sums.tobytes() == want.tobytes()
        dense = np.zeros((12,) + shape[1:], np.float32)
        np.add.at(dense, ids, values)
        assert be.segment_sum_to(values, ids, 12).tobytes() == dense.tobytes()


def _sgd_table(vocab: int, d: int):
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=vocab, dimension=d,
                               optimizer=me.embedding.SGD(me.embedding.DynamicLearningRate(0)))],
        features=[me.FeatureConfig(table="t", input_shape=(4,), name="f")])
    return build_layout(cfg).tables[0]
