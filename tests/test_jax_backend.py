"""JAX backend: protocol-level parity with the NumPy reference, sharding, donation,
capacity errors and compile counting.

The same module runs on 1 device here and on 8 CPU devices in a subprocess
(``test_jax_multidevice.py`` sets ``MESHEMBED_JAX_EXPECT_DEVICES=8``). Row i of a test
table holds i (+ column/1000), so a misplaced row is obvious.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import meshembed as me  # noqa: E402
from meshembed import math as me_math  # noqa: E402
from meshembed.errors import CapacityError  # noqa: E402
from meshembed.sharding import Placement  # noqa: E402
from meshembed.math.rule import UpdateRule  # noqa: E402
from meshembed_jax import JaxBackend  # noqa: E402
from meshembed_numpy import NumpyBackend  # noqa: E402
from tests.jax_x64 import x64_where_named  # noqa: E402,F401

SHARDINGS = [(v, n, s) for v, n in [(13, 1), (13, 2), (13, 3), (16, 8), (37, 8)] for s in ("mod", "div")]
RTOL = {"float32": 2e-6, "float64": 1e-13}


@pytest.fixture(scope="module")
def be() -> JaxBackend:
    return me.get_backend("jax")


@pytest.fixture(scope="module")
def ref() -> NumpyBackend:
    return NumpyBackend()


def _table(vocab: int, dim: int, dtype: str = "float32") -> np.ndarray:
    return (np.arange(vocab)[:, None] + np.arange(dim)[None, :] / 1000.0).astype(dtype)


def _close(actual, expected, dtype: str) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


class CompileCounter:
    """Counts XLA backend compilations (``jax.monitoring`` duration events) in a block."""

    _events: list[str] = []
    _installed = False

    def __init__(self) -> None:
        if not CompileCounter._installed:
            jax.monitoring.register_event_duration_secs_listener(
                lambda name, _secs, **_kw: CompileCounter._events.append(name)
            )
            CompileCounter._installed = True

    def __enter__(self) -> "CompileCounter":
        self._start = len(self._events)
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def count(self) -> int:
        return sum("backend_compile" in e for e in self._events[self._start:])


def make_fn(xp, algorithm: str, lr: float, hp: dict) -> dict:
    """``update_rows``' rule arguments (``**make_fn(...)``) for the core's ``algorithm`` with
    static hyper-parameters ``hp`` and the learning rate ``lr`` passed as a value."""
    math_ = me_math.get_math(algorithm)
    rule = UpdateRule(math=math_, slot_names=math_.slot_names, static=tuple(sorted(hp.items())))
    return {"fn": rule, "values": (lr,)}


@pytest.fixture(autouse=True)
def _xla_update_step(monkeypatch):
    """These tests are about the XLA update step (capacity, pieces, donation); the generated
    fused kernels have their own tests (conformance/test_fused_kernels.py, test_jax_fused.py)."""
    monkeypatch.setenv("MESHEMBED_JAX_FUSED", "0")


OPTIMIZERS = {
    "adadelta": (dict(rho=0.9, epsilon=1e-6), (0.0, 0.0)),
    "adagrad": ({}, (0.1,)),
}


def test_devices_as_expected():
    expected = int(os.environ.get("MESHEMBED_JAX_EXPECT_DEVICES", "0") or 0)
    if expected:
        assert len(jax.devices()) == expected


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_create_unshard_and_sharding(be, vocab, shards, strategy, dtype):
    values = _table(vocab, 4, dtype)
    placement = Placement(vocab, shards, strategy)
    table = be.create_table(values, placement)
    slot = be.create_table(np.zeros_like(values), placement)
    np.testing.assert_array_equal(be.unshard(table), values)
    assert be.unshard(table).dtype == np.dtype(dtype)
    # padded [S, max_rows, D], sharded on axis 0 over the largest device count dividing S
    assert table.data.shape == (shards, placement.max_rows, 4)
    n_dev = max(d for d in range(1, min(shards, len(jax.devices())) + 1) if shards % d == 0)
    assert len(table.data.sharding.device_set) == n_dev
    assert table.data.sharding.spec[0] == "shard"
    assert slot.data.sharding == table.data.sharding  # slots co-sharded with their table
    # each device holds exactly its logical shards' rows
    for piece in table.data.addressable_shards:
        s0 = piece.index[0].start or 0
        block = np.asarray(piece.data)
        for j in range(block.shape[0]):
            rows = placement.rows_in_shard(s0 + j)
            np.testing.assert_array_equal(block[j, :rows], values[placement.global_ids(s0 + j)])


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("window_rows", [1, 3, 100])
def test_create_table_from_blocks_fills_in_place_on_the_devices(be, vocab, shards, strategy, window_rows, monkeypatch):
    """Forced onto the device-side fill (small windows: several windows per block, windows
    clamped at the end of a shard): the same padded, sharded table as ``create_table``."""
    from meshembed_jax import table as jax_table

    dim = 4
    monkeypatch.setattr(jax_table, "BLOCKWISE_MIN_BYTES", 0)
    monkeypatch.setattr(jax_table, "WINDOW_BYTES", 4 * dim * shards * window_rows)
    values = _table(vocab, dim)
    placement = Placement(vocab, shards, strategy)
    blocks = (values[a : a + 5] for a in range(0, vocab, 5))
    table = be.create_table_from_blocks((vocab, dim), blocks, placement)
    expected = be.create_table(values, placement)
    np.testing.assert_array_equal(np.asarray(table.data), np.asarray(expected.data))  # padding rows too
    assert table.data.sharding == expected.data.sharding
    assert ("window_write", table.layout, min(window_rows, placement.max_rows), dim) in be._kernels


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
def test_gather_scatter_parity(be, ref, vocab, shards, strategy):
    values = _table(vocab, 3)
    placement = Placement(vocab, shards, strategy)
    t, r = be.create_table(values, placement), ref.create_table(values, placement)
    ids = np.array([[vocab - 1, 0, 2], [2, vocab - 1, 1]], dtype=np.int64)
    out = be.gather(t, be.asarray(ids))
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(be.to_numpy(out), values[ids])
    uids = np.array([vocab - 1, 0, 4, 7], dtype=np.int64)
    rows = -np.arange(12, dtype=np.float32).reshape(4, 3)
    t = be.scatter(t, be.asarray(uids), be.asarray(rows))
    r = ref.scatter(r, uids, rows)
    np.testing.assert_array_equal(be.unshard(t), ref.unshard(r))
    # NumPy inputs are accepted too (no asarray first)
    np.testing.assert_array_equal(be.to_numpy(be.gather(t, uids)), rows)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_segment_sums_parity(be, ref, dtype):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=300)
    vals = rng.standard_normal((300, 4)).astype(dtype)
    u, s = be.segment_sum(be.asarray(ids), be.asarray(vals))
    eu, es = ref.segment_sum(ids, vals)
    np.testing.assert_array_equal(be.to_numpy(u), eu)
    _close(be.to_numpy(s), es, dtype)
    assert be.to_numpy(s).dtype == np.dtype(dtype)
    seg = rng.integers(0, 9, size=300)
    for segs in (seg, np.sort(seg)):  # unsorted and sorted (the sorted-scatter variant)
        out = be.segment_sum_to(be.asarray(vals), be.asarray(segs), 11)
        _close(be.to_numpy(out), ref.segment_sum_to(vals, segs, 11), dtype)


@pytest.mark.parametrize("algorithm", sorted(OPTIMIZERS))
@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_update_rows_core_optimizers_parity(be, ref, algorithm, vocab, shards, strategy, dtype):
    """Three steps of the core's Adadelta/Adagrad with a new lr each step: same numbers as
    NumPy, untouched rows bit-identical, and no compilation after the first step."""
    hp, slot_init = OPTIMIZERS[algorithm]
    placement = Placement(vocab, shards, strategy)
    rng = np.random.default_rng(vocab + shards)
    values = _table(vocab, 4, dtype)
    slots = [np.full_like(values, v) for v in slot_init]
    tj = [be.create_table(x, placement) for x in [values, *slots]]
    tr = [ref.create_table(x, placement) for x in [values, *slots]]
    counter = CompileCounter()
    for step in range(3):
        ids = rng.integers(0, vocab, size=11)
        ids[:3] = ids[3]  # duplicates
        grads = rng.standard_normal((11, 4)).astype(dtype)
        lr = 0.1 * (step + 1)
        with counter:
            tj = be.update_rows(tj, be.asarray(ids), be.asarray(grads), **make_fn(be.xp, algorithm, lr, hp))
            compiles = counter.count
        if step:
            assert compiles == 0, f"step {step} recompiled"
        tr = ref.update_rows(tr, ids, grads, **make_fn(ref.xp, algorithm, lr, hp))
    for a, b in zip(tj, tr):
        _close(be.unshard(a), ref.unshard(b), dtype)


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("pieces", [False, True])
def test_gather_combine_and_fused_backward_parity(be, ref, vocab, shards, strategy, pieces, monkeypatch):
    """The fused forward (gather_combine) and the combiner backward fused into update_rows
    (grad_index/grad_weights) equal NumPy, with one piece and with many loop pieces."""
    from meshembed_jax import kernels

    if pieces:  # force the kernels' loops over many small pieces (fresh kernel cache)
        monkeypatch.setattr(kernels, "CHUNK_BYTES", 64)
        be = JaxBackend()
    placement = Placement(vocab, shards, strategy)
    rng = np.random.default_rng(vocab * 3 + shards)
    values = _table(vocab, 4)
    tj = [be.create_table(values, placement), be.create_table(np.full_like(values, 0.1), placement)]
    tr = [ref.create_table(values, placement), ref.create_table(np.full_like(values, 0.1), placement)]
    n, segments = 1000, 37
    ids = rng.integers(0, vocab, size=n)
    seg = np.sort(rng.integers(0, segments, size=n))
    w = rng.random(n).astype(np.float32)
    for weights in (None, w):
        wj = None if weights is None else be.asarray(weights)
        out = be.gather_combine(tj[0], be.asarray(ids), be.asarray(seg), segments, wj)
        assert tuple(out.shape) == (segments, 4)
        _close(be.to_numpy(out), ref.gather_combine(tr[0], ids, seg, segments, weights), "float32")
    g = rng.standard_normal((segments, 4)).astype(np.float32)
    tj = be.update_rows(tj, be.asarray(ids), be.asarray(g), **make_fn(be.xp, "adagrad", 0.1, {}),
                        grad_index=be.asarray(seg), grad_weights=be.asarray(w))
    tr = ref.update_rows(tr, ids, g, **make_fn(ref.xp, "adagrad", 0.1, {}), grad_index=seg, grad_weights=w)
    for a, b in zip(tj, tr):
        _close(be.unshard(a), ref.unshard(b), "float32")


def test_update_rows_donates_buffers(be):
    placement = Placement(64, 1, "mod")
    t = [be.create_table(_table(64, 8), placement), be.create_table(np.ones((64, 8), np.float32), placement)]
    old = [x.data for x in t]
    fn = make_fn(be.xp, "adagrad", 0.1, {})
    t = be.update_rows(t, be.asarray(np.array([1, 2, 2])), be.asarray(np.ones((3, 8), np.float32)), **fn)
    assert all(o.is_deleted() for o in old), "table/slot buffers were copied, not donated"
    old = t[0].data
    t0 = be.scatter(t[0], be.asarray(np.array([5])), be.asarray(np.zeros((1, 8), np.float32)))
    assert old.is_deleted() and t0 is t[0]


def test_capacity_error_leaves_state_unchanged():
    be = JaxBackend(capacity=4)
    placement = Placement(40, 2, "div")
    values = _table(40, 3)
    t = [be.create_table(values, placement), be.create_table(np.full((40, 3), 0.1, np.float32), placement)]
    fn = make_fn(be.xp, "adagrad", 0.5, {})
    ids = np.arange(0, 20)  # 10 unique ids per shard (20 per device on one device) > capacity 4
    with pytest.raises(CapacityError, match=r"capacity is 4.*Nothing was updated.*at least (10|20)\b"):
        be.update_rows(t, be.asarray(ids), be.asarray(np.ones((20, 3), np.float32)), **fn)
    np.testing.assert_array_equal(be.unshard(t[0]), values)
    np.testing.assert_array_equal(be.unshard(t[1]), np.full((40, 3), 0.1, np.float32))
    # a batch within capacity still works on the same tables
    t = be.update_rows(t, be.asarray(np.array([1, 1, 30])), be.asarray(np.ones((3, 3), np.float32)), **fn)
    assert not np.array_equal(be.unshard(t[0])[[1, 30]], values[[1, 30]])


@pytest.mark.parametrize("combined", [False, True])
def test_false_guard_writes_nothing(be, combined):
    """``update_rows(guard=False)`` (the engine's NaN/Inf check, not waited for) writes no
    row of the table or its slot, in the plain and the combiner-backward kernel."""
    placement = Placement(40, 2, "div")
    values = _table(40, 3)
    t = [be.create_table(values, placement), be.create_table(np.full((40, 3), 0.1, np.float32), placement)]
    fn = make_fn(be.xp, "adagrad", 0.5, {})
    ids = be.asarray(np.array([1, 1, 30, 7]))
    extra = {"grad_index": be.asarray(np.array([0, 1, 1, 0]))} if combined else {}
    grads = be.asarray(np.ones((2 if combined else 4, 3), np.float32))
    for guard in (False, True):
        t = be.update_rows(t, ids, grads, **fn, guard=be.finite_guard([np.float32(1 if guard else np.nan)]), **extra)
        changed = not np.array_equal(be.unshard(t[0]), values)
        assert changed == guard
        assert changed == (not np.array_equal(be.unshard(t[1]), np.full((40, 3), 0.1, np.float32)))


def test_update_runs_only_the_pieces_holding_unique_rows(ref, monkeypatch):
    """The unique rows are packed at the front of the capacity: the update's loop stops after
    the pieces that hold them (here 4 of 8, the last one partly) and still equals NumPy; with a false guard it
    writes nothing, however many pieces."""
    from meshembed_jax import kernels

    monkeypatch.setattr(kernels, "CHUNK_BYTES", 64)  # 256 rows per piece
    be = JaxBackend(capacity=2048)
    placement = Placement(3000, 2, "mod")
    rng = np.random.default_rng(5)
    values = rng.standard_normal((3000, 4)).astype(np.float32)
    ids = rng.integers(0, 3000, 900)
    grads = rng.standard_normal((900, 4)).astype(np.float32)
    for guard in (False, True):
        t = [be.create_table(values, placement), be.create_table(np.full((3000, 4), 0.1, np.float32), placement)]
        r = [ref.create_table(values, placement), ref.create_table(np.full((3000, 4), 0.1, np.float32), placement)]
        t = be.update_rows(t, be.asarray(ids), be.asarray(grads), **make_fn(be.xp, "adagrad", 0.5, {}),
                           guard=be.finite_guard([np.float32(1 if guard else np.nan)]))
        if guard:
            r = ref.update_rows(r, ids, grads, **make_fn(ref.xp, "adagrad", 0.5, {}))
        for got, want in zip(t, r):
            _close(be.unshard(got), ref.unshard(want), "float32")


@pytest.mark.parametrize("ffi", ["1", "0"])
@pytest.mark.parametrize("capacity", [16, 4096])
def test_update_kernel_copies_no_table(monkeypatch, ffi, capacity):
    """The compiled update writes the donated table and slot in place: its HLO holds no copy
    of a table-sized array, with one piece of unique rows (a small capacity: an inline step
    once made XLA copy the table twice, 97 ms a step on W1's table) or several."""
    from meshembed_jax import kernels

    monkeypatch.setenv("MESHEMBED_JAX_CPU_KERNELS", ffi)
    monkeypatch.setattr(kernels, "CHUNK_BYTES", 1024)  # 256 rows per piece
    be = JaxBackend(capacity=capacity)
    placement = Placement(5000, 1, "mod")
    t = [be.create_table(_table(5000, 8), placement), be.create_table(np.ones((5000, 8), np.float32), placement)]
    fn = make_fn(be.xp, "adagrad", 0.1, {})
    ids, grads = be.asarray(np.arange(0, 30, 3)), be.asarray(np.ones((10, 8), np.float32))
    t = be.update_rows(t, ids, grads, **fn)
    ((key, kernel),) = [(k, v) for k, v in be._kernels.items() if k[0] == "update"]
    gids, ggrads, _, _ = be._global_batch(t[0].layout, ids, grads)
    hlo = kernel.lower(tuple(x.data for x in t), gids, ggrads, be._guard(t[0].layout, None),
                       fn["values"]).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "5000" in line]
    assert not copies, copies


def test_one_device_kernels_have_no_collective():
    """On a one-device mesh the lookup, the combiner's forward and the update return their
    per-device result: no all-reduce (XLA keeps a one-device all-reduce, a copy of the
    output: 0.2 ms of W1's 0.9 ms forward)."""
    from meshembed_jax import kernels

    be = JaxBackend()
    placement = Placement(500, 1, "mod")
    t = [be.create_table(_table(500, 8), placement)]
    layout = t[0].layout
    ids, segs = np.arange(0, 60, 3), np.repeat(np.arange(10), 2)
    gids = be._replicated_1d(layout, ids, 32, -1, kernels.index_dtype(layout))
    gsegs = be._replicated_1d(layout, segs, 32, 16, np.int32)
    texts = [
        kernels.make_lookup(layout, 8).lower(t[0].data, gids).compile().as_text(),
        kernels.make_gather_combine(layout, 8, 32, 16, False).lower(
            t[0].data, gids, gsegs, be._no_weights(layout, np.float32)).compile().as_text(),
    ]
    fn = make_fn(be.xp, "stochastic_gradient_descent", 0.1, {})
    be.update_rows(t, be.asarray(ids), be.asarray(np.ones((20, 8), np.float32)), **fn)
    ((key, kernel),) = [(k, v) for k, v in be._kernels.items() if k[0] == "update"]
    g, gg, _, _ = be._global_batch(layout, be.asarray(ids), be.asarray(np.ones((20, 8), np.float32)))
    texts.append(kernel.lower((t[0].data,), g, gg, be._guard(layout, None), fn["values"]).compile().as_text())
    for text in texts:
        assert "all-reduce" not in text, text[:3000]


def test_table_creation_leaves_shardings_intact(monkeypatch):
    """Creating tables (filled on the devices window by window, then collapsed to huge
    pages) must not touch the sharding's cached device set, which other tables of the same
    layout share: the huge-page hint once emptied it with ``devices().pop()``."""
    from meshembed_jax import table as jax_table

    monkeypatch.setattr(jax_table, "BLOCKWISE_MIN_BYTES", 0)
    be = JaxBackend()
    placement = Placement(40, 1, "mod")
    first = be.create_table(_table(40, 4), placement)
    devices = set(first.data.sharding.device_set)
    assert devices
    be.create_table_from_blocks((40, 4), [_table(40, 4)], placement)
    later = be.create_table(_table(40, 4), placement)
    assert set(first.data.sharding.device_set) == set(later.data.sharding.device_set) == devices


def test_engine_checks_nonfinite_gradients_without_an_early_sync(monkeypatch):
    """On JAX the engine's NaN/Inf check is a device guard of the update: no eager
    ``all_finite`` on a good step; on a bad one the error names the feature, nothing moved."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 30, 4, optimizer=me.embedding.Adagrad(0.1))],
        features=[me.FeatureConfig("t", (6,), name="f")],
    )
    emb = me.TPUEmbedding(cfg, backend="jax")
    assert emb.backend.capabilities.guarded_updates
    calls = []
    original = type(emb.backend).all_finite
    monkeypatch.setattr(type(emb.backend), "all_finite", lambda self, x: calls.append(1) or original(self, x))
    emb.enqueue([np.arange(6)])
    acts = emb.backend.to_numpy(emb.dequeue()[0])
    emb.apply_gradients([np.ones_like(acts)])
    assert calls == []
    before = emb.retrieve_parameters("t")
    emb.enqueue([np.arange(6)])
    emb.dequeue()
    bad = np.ones_like(acts)
    bad[2, 1] = np.inf
    with pytest.raises(me.InputError, match="feature 'f'.*NaN or Inf.*Nothing was updated"):
        emb.apply_gradients([bad])
    after = emb.retrieve_parameters("t")
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_capacity_error_in_a_later_table_changes_no_table():
    """A fixed capacity that table "b" exceeds is refused before table "a" (stepped first)
    is written: the error names "b" and both tables keep their values."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("a", 100, 4, optimizer=me.embedding.SGD(0.5)),
                me.TableConfig("b", 100, 4, optimizer=me.embedding.SGD(0.5))],
        features=[me.FeatureConfig("a", (8,), name="fa"), me.FeatureConfig("b", (8,), name="fb")],
    )
    emb = me.TPUEmbedding(cfg, backend=JaxBackend(capacity=8))
    before = {t: emb.retrieve_parameters(t)["parameters"] for t in "ab"}
    emb.enqueue([np.arange(8), me.RaggedIds(np.arange(0, 17, 2), np.arange(16))])  # b: 16 ids (13 on one of 8 devices)
    emb.dequeue()
    with pytest.raises(CapacityError, match=r"Table 'b'.*owns 1[36] unique ids.*capacity is 8.*Nothing was updated"):
        emb.apply_gradients([np.ones((8, 4), np.float32)] * 2)
    for t in "ab":
        np.testing.assert_array_equal(emb.retrieve_parameters(t)["parameters"], before[t])
    assert emb.pending is not None  # the batch is still pending (a larger capacity could take it)


def test_capacity_from_env(monkeypatch):
    monkeypatch.setenv("MESHEMBED_JAX_CAPACITY", "3")
    assert JaxBackend().capacity == 3


def test_automatic_capacity_grows_without_error(ref):
    be = JaxBackend()
    placement = Placement(5000, 1, "mod")
    values = _table(5000, 2)
    t, r = [be.create_table(values, placement)], [ref.create_table(values, placement)]
    ids = np.arange(4096)  # all unique: more than the automatic first guess (a quarter)
    g = np.ones((4096, 2), np.float32)
    fn = make_fn(be.xp, "stochastic_gradient_descent", 0.5, {})
    t = be.update_rows(t, be.asarray(ids), be.asarray(g), **fn)
    r = ref.update_rows(r, ids, g, **make_fn(ref.xp, "stochastic_gradient_descent", 0.5, {}))
    np.testing.assert_array_equal(be.unshard(t[0]), ref.unshard(r[0]))


@pytest.mark.parametrize("ffi", ["1", "0"])
def test_overflow_on_one_device_writes_on_no_device(monkeypatch, ref, ffi):
    """Device 0 owns more unique ids than the automatic first capacity, the others a few:
    no device may write before the step is redone with a larger capacity (a device that
    wrote was stepped twice), and a fixed capacity leaves every device's rows unchanged.
    Meaningful on several devices (test_backend_suite_on_eight_devices runs it on 8)."""
    import jax

    monkeypatch.setenv("MESHEMBED_JAX_CPU_KERNELS", ffi)
    shards = len(jax.devices())
    placement = Placement(20000, shards, "mod")
    values = _table(20000, 2)
    ids = np.concatenate([np.arange(1500) * shards, np.arange(1, shards)])  # 1500 on device 0
    g = np.ones((ids.size, 2), np.float32)
    fn = make_fn(JaxBackend().xp, "stochastic_gradient_descent", 0.5, {})
    be = JaxBackend()
    t = be.update_rows([be.create_table(values, placement)], be.asarray(ids), be.asarray(g), **fn)
    r = ref.update_rows([ref.create_table(values, placement)], ids, g,
                        **make_fn(ref.xp, "stochastic_gradient_descent", 0.5, {}))
    np.testing.assert_array_equal(be.unshard(t[0]), ref.unshard(r[0]))
    fixed = JaxBackend(capacity=1024)
    t = [fixed.create_table(values, placement)]
    with pytest.raises(CapacityError, match="owns 1500 unique ids"):
        fixed.update_rows(t, fixed.asarray(ids), fixed.asarray(g), **fn)
    np.testing.assert_array_equal(fixed.unshard(t[0]), values)


def test_automatic_capacity_check_waits_until_a_table_is_read(ref):
    """With automatic capacity update_rows returns without waiting for the step (the host can
    prepare the next one); an overflowing step (its kernel wrote nothing) is redone with a
    larger capacity before anything reads the tables, also when another update follows."""
    be = JaxBackend()
    placement = Placement(5000, 1, "mod")
    values = _table(5000, 2)
    t, r = [be.create_table(values, placement)], [ref.create_table(values, placement)]
    fn = make_fn(be.xp, "stochastic_gradient_descent", 0.5, {})
    fr = make_fn(ref.xp, "stochastic_gradient_descent", 0.5, {})
    for step, ids in enumerate((np.arange(4096), np.arange(4096) % 7)):  # overflows the first guess, then fits
        g = np.ones((4096, 2), np.float32)
        t = be.update_rows(t, be.asarray(ids), be.asarray(g), **fn)
        assert t[0].pending is not None  # not checked yet
        # the first step's overflow is seen (and the step redone) when the second reads the table
        assert bool(be._auto_capacity) == (step == 1)
        r = ref.update_rows(r, ids, g, **fr)
    np.testing.assert_array_equal(be.unshard(t[0]), ref.unshard(r[0]))
    assert t[0].pending is None and max(be._auto_capacity.values()) >= 4096


def test_no_recompilation_across_steps_and_batch_sizes(be):
    placement = Placement(1000, 2, "mod")
    zeros = np.zeros((1000, 8), np.float32)
    t = [be.create_table(_table(1000, 8), placement)] + [be.create_table(zeros, placement) for _ in range(2)]
    rng = np.random.default_rng(3)

    def step(n: int, lr: float):
        nonlocal t
        ids = be.asarray(rng.integers(0, 1000, size=n))
        t = be.update_rows(t, ids, be.asarray(np.ones((n, 8), np.float32)), **make_fn(be.xp, "adadelta", lr, dict(rho=0.9, epsilon=1e-6)))
        be.gather(t[0], ids)

    step(120, 0.1)  # compiles
    counter = CompileCounter()
    with counter:
        for i in range(5):
            step(120, 0.1 / (i + 1))  # same shapes, new learning rate each step
    assert counter.count == 0
    # another batch size in the same bucket (120 and 125 -> 128) reuses the compiled
    # kernels; only the small eager padding ops see a new shape
    kernels = [k for k in be._kernels.values() if hasattr(k, "_cache_size")]
    sizes = [k._cache_size() for k in kernels]
    n_kernels = len(be._kernels)
    step(125, 0.2)
    assert len(be._kernels) == n_kernels
    assert [k._cache_size() for k in kernels] == sizes


@pytest.mark.parametrize("n_features", [1, 2])
def test_engine_steps_with_varying_id_counts_do_not_recompile(n_features):
    """Full engine steps (weighted combiner, fused lookup and update) whose id counts vary
    inside one size bucket compile nothing after the first: padding is done on the host,
    not by a function compiled per batch size, and the ragged slots and weights of several
    features of one table are joined on the host (joined on the device, every new length
    compiled a concatenate: the JAX demo spent 8 of its 25 s compiling)."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=500, dimension=4,
                               optimizer=me.embedding.Adagrad(learning_rate=0.1), combiner="mean")],
        features=[me.FeatureConfig(table="t", input_shape=(16,), name=f"f{k}") for k in range(n_features)],
    )
    emb = me.TPUEmbedding(cfg, backend="jax")
    rng = np.random.default_rng(11)

    def ragged(n_ids: int) -> me.RaggedIds:
        splits = np.concatenate([[0], np.sort(rng.integers(0, n_ids + 1, 15)), [n_ids]])
        return me.RaggedIds(splits, rng.integers(0, 500, n_ids))

    def step(n_ids: int) -> None:
        first = n_ids // n_features
        emb.enqueue([ragged(first)] + [ragged(n_ids - first)] * (n_features - 1))
        emb.dequeue()
        emb.apply_gradients([np.ones((16, 4), np.float32)] * n_features)

    step(97)
    step(112)  # 97..112 share one bucket
    with CompileCounter() as counter:
        for n in (98, 100, 105, 111, 103):
            step(n)
    assert counter.count == 0


def test_plain_callables_are_refused_with_the_fix(be):
    """The backend takes an UpdateRule and its values, never a closure to take apart."""
    placement = Placement(10, 1, "mod")
    t = [be.create_table(_table(10, 2), placement)]
    with pytest.raises(me.errors.InputError, match="UpdateRule.*make_rule"):
        be.update_rows(t, be.asarray(np.array([1])), be.asarray(np.ones((1, 2), np.float32)), lambda g, p: (p - g,))
    with pytest.raises(me.errors.InputError, match=r"Expected 1 values.*\('lr',\)"):
        be.update_rows(t, be.asarray(np.array([1])), be.asarray(np.ones((1, 2), np.float32)),
                       make_fn(be.xp, "adagrad", 0.1, {})["fn"])
    np.testing.assert_array_equal(be.unshard(t[0]), _table(10, 2))


def test_a_rule_branching_on_a_traced_value_is_refused(be):
    """Math that branches in Python on a dynamic value cannot take it traced: ConfigError
    naming the rule and the fix, tables unchanged (the trace fails before anything runs)."""
    from meshembed.math.registry import OptimizerMath

    def branching(xp, params, grads, slots, *, lr):
        return (params - grads if lr > 0.5 else params + grads), slots

    rule = UpdateRule(math=OptimizerMath("custom", branching, None, ()), slot_names=())
    placement = Placement(10, 1, "mod")
    t = [be.create_table(_table(10, 2), placement)]
    with pytest.raises(me.errors.ConfigError, match="'custom'.*branches in Python.*Fix"):
        be.update_rows(t, be.asarray(np.array([1])), be.asarray(np.ones((1, 2), np.float32)), rule, values=(1.0,))
    np.testing.assert_array_equal(be.unshard(t[0]), _table(10, 2))


def test_capabilities_and_namespace(be):
    caps = be.capabilities
    assert caps.compiles and caps.autodiff and caps.devices == len(jax.devices())
    assert caps.float64 == bool(jax.config.jax_enable_x64)
    import jax.numpy as jnp

    assert be.xp is jnp or be.xp.__name__ == "jax.numpy"
    x = be.asarray(np.arange(3), dtype="int64")  # int32 without x64 (range-checked)
    assert be.is_native(x) and be.to_numpy(x).dtype == (np.int64 if jax.config.jax_enable_x64 else np.int32)
    assert be.compile(lambda a: a * 2)(x).tolist() == [0, 2, 4]


def test_engine_full_steps_match_numpy():
    """TPUEmbedding(backend="jax") vs backend="numpy": SGD, Adagrad, Adadelta, 3 steps,
    two features on one table (sum and mean), 3 logical shards."""
    rng = np.random.default_rng(7)
    for opt in (
        me.embedding.SGD(learning_rate=0.5),
        me.embedding.Adagrad(learning_rate=0.1),
        me.embedding.Adadelta(learning_rate=0.1, rho=0.95, epsilon=1e-6),
    ):
        engines = {}
        for name in ("numpy", "jax"):
            cfg = me.EmbeddingConfig(
                tables=[me.TableConfig(name="t", vocabulary_size=300, dimension=8, optimizer=opt, combiner="mean")],
                features=[me.FeatureConfig(table="t", input_shape=(16,), name="a"),
                          me.FeatureConfig(table="t", input_shape=(16, 4), name="b")],
            )
            engines[name] = me.TPUEmbedding(cfg, backend=name, num_shards=3)
        for _ in range(3):
            feats = [rng.integers(0, 300, size=(16,)), rng.integers(0, 300, size=(16, 4))]
            acts = {}
            for name, e in engines.items():
                e.enqueue(feats)
                acts[name] = [np.asarray(e.backend.to_numpy(a)) for a in e.dequeue()]
            for a, b in zip(acts["jax"], acts["numpy"]):
                _close(a, b, "float32")
            grads = [rng.standard_normal(a.shape).astype(np.float32) for a in acts["numpy"]]
            for e in engines.values():
                e.apply_gradients(grads)
        got, want = engines["jax"].retrieve_parameters("t"), engines["numpy"].retrieve_parameters("t")
        for k in want:
            _close(got[k], want[k], "float32")


def test_module_imports_without_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import meshembed_jax\n"
        "reason = meshembed_jax.JaxBackend.unavailable_reason()\n"
        "assert reason and 'jax' in reason, reason\n"
        "import meshembed as me\n"
        "try:\n    me.get_backend('jax')\nexcept me.BackendUnavailableError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_invalid_dedup_is_a_config_error():
    with pytest.raises(me.errors.ConfigError, match="Invalid `dedup`.*Received: dedup='hash'"):
        JaxBackend(dedup="hash")


def test_tracing_is_answered_inside_jit_and_nowhere_else(be):
    """``Backend.tracing()``: True while ``jax.jit`` stages the caller (even on concrete arrays,
    the engine's refusal), False eagerly and under ``jax.grad`` alone; eager backends never."""
    import jax

    seen = []

    @jax.jit
    def staged(x):
        seen.append(be.tracing())
        return x

    staged(1.0)
    assert seen == [True] and be.tracing() is False
    jax.grad(lambda x: (seen.append(be.tracing()), x * x)[1])(1.0)
    assert seen == [True, False]
    assert NumpyBackend().tracing() is False
