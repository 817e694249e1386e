"""Per-id (sequence) features: one id per output slot takes the identity path (issue #18).

A sequence feature whose every position holds one id (dense ids ``[B, M]``, or ragged rows
of exactly ``M`` ids) has ``slots == arange(B * M)``: its lookup is a plain gather and its
activation gradient is already one row per id. The engine then skips the segment sum and
the slot index; the numbers must be the general path's, bit for bit, on every backend.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import combiners

V, D, B, M = 50, 4, 6, 3


def test_is_identity():
    assert combiners.is_identity(np.arange(5), 5)
    assert combiners.is_identity(np.zeros(0, np.int64), 0)
    assert not combiners.is_identity(np.arange(5), 6)  # a missing position
    assert not combiners.is_identity(np.array([0, 2, 1]), 3)  # not in slot order
    assert not combiners.is_identity(np.array([0, 0, 1]), 3)  # two ids share a slot


def _backends() -> list[str]:
    return [b for b in ("numpy", "torch", "jax") if b in me.available_backends()]


def _run(backend: str, combiner: str, optimizer, weighted: bool) -> dict:
    """Table, slots and activations after three steps of a sequence feature."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", V, D, optimizer=optimizer, combiner=combiner)],
        features=[me.FeatureConfig("t", (B, M), name="seq")],
    )
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=2, seed=1)
    rng = np.random.default_rng(3)
    acts = []
    for _ in range(3):
        ids = rng.integers(0, V, size=(B, M))
        ids[0, :] = 7  # duplicates within and across samples
        if weighted:
            feat = me.RaggedIds(np.arange(0, B * M + 1, M), ids.reshape(-1))
            w = me.RaggedIds(np.arange(0, B * M + 1, M), rng.uniform(0.5, 2.0, B * M).astype(np.float32))
            emb.enqueue([feat], [w])
        else:
            emb.enqueue([ids])
        acts.append(np.asarray(emb.backend.to_numpy(emb.dequeue()[0])))
        g = rng.standard_normal((B, M, D)).astype(np.float32)
        emb.apply_gradients([g])
    out = emb.retrieve_parameters("t")
    out["acts"] = np.stack(acts)
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("combiner,weighted", [("sum", False), ("sum", True), ("mean", True)])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_identity_path_equals_general_path(backend, combiner, weighted, opt, monkeypatch):
    optimizer = {"sgd": me.embedding.SGD(learning_rate=0.1),
                 "adagrad": me.embedding.Adagrad(learning_rate=0.1),
                 "adam": me.embedding.Adam(learning_rate=0.01)}[opt]
    seen = []
    real = combiners.is_identity
    with monkeypatch.context() as m:
        m.setattr(combiners, "is_identity", lambda s, n: seen.append(real(s, n)) or seen[-1])
        fast = _run(backend, combiner, optimizer, weighted)
    assert seen and all(seen), "the identity path was not taken"
    with monkeypatch.context() as m:
        m.setattr(combiners, "is_identity", lambda s, n: False)
        general = _run(backend, combiner, optimizer, weighted)
    assert fast.keys() == general.keys()
    for key in fast:
        np.testing.assert_array_equal(fast[key], general[key], err_msg=key)


def test_identity_update_sends_no_slot_index(monkeypatch):
    """The update of an identity feature is one row per id: no ``grad_index`` travels."""
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", V, D, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (B, M), name="seq")])
    emb = me.TPUEmbedding(cfg, backend="numpy")
    calls = []
    real = emb.backend.update_rows

    def spy(tables, ids, grads, fn, **kw):
        calls.append((tuple(np.shape(grads)), kw.get("grad_index")))
        return real(tables, ids, grads, fn, **kw)

    monkeypatch.setattr(emb.backend, "update_rows", spy)
    emb.enqueue([np.arange(B * M).reshape(B, M)])
    emb.dequeue()
    emb.apply_gradients([np.ones((B, M, D), np.float32)])
    assert calls == [((B * M, D), None)]


def test_recycled_rows_only_reuses_released_buffers():
    """torch: a >= 32 MiB output is handed out again only once nothing refers to it."""
    torch = pytest.importorskip("torch")
    from meshembed_torch.kernels import RecycledRows

    cache, shape, f32, cpu = RecycledRows(keep=1), (131072, 64), torch.float32, torch.device("cpu")
    a = cache.empty(shape, f32, cpu)
    ptr = a.data_ptr()
    del a
    x = cache.empty(shape, f32, cpu)
    assert x.data_ptr() == ptr  # released: reused
    holders = [lambda t: t, lambda t: t.view(-1), lambda t: t.numpy(),
               lambda t: (t.reshape(-1, 1).requires_grad_() * 2).sum(),  # autograd keeps a view
               lambda t: (t.requires_grad_() * t).sum()]  # autograd keeps the tensor itself
    for hold in holders:
        held = hold(x)
        ptr = x.data_ptr()
        del x
        y = cache.empty(shape, f32, cpu)
        assert y.data_ptr() != ptr, hold  # still referenced: a new buffer
        del held
        x = y


def test_per_id_activations_stay_valid_while_held():
    """The torch engine recycles a per-id lookup's 32 MiB rows, never ones a caller holds."""
    pytest.importorskip("torch")
    n, dim = 131072, 64
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 1000, dim, optimizer=me.embedding.SGD(0.5))],
                             features=[me.FeatureConfig("t", (n, 1), name="seq")])
    emb = me.TPUEmbedding(cfg, backend="torch", num_shards=1, initializers={"t": np.zeros((1000, dim), np.float32)})
    ids = (np.arange(n) % 1000).reshape(n, 1)
    grad = np.ones((n, 1, dim), np.float32)

    def step():
        emb.enqueue([ids])
        acts = emb.dequeue()[0]
        emb.apply_gradients([grad])
        return acts

    first = step()
    kept = first.clone()
    second = step()  # `first` is still held: its memory must not be reused
    assert first.data_ptr() != second.data_ptr()
    assert bool((first == kept).all()) and not bool((second == kept).all())
    ptrs = {first.data_ptr(), second.data_ptr()}
    del first, second, kept
    third = step()
    assert third.data_ptr() in ptrs  # released buffers are reused
    count = np.bincount(ids.reshape(-1), minlength=1000).astype(np.float32)  # 132 or 131 per row
    want = np.repeat(-2 * 0.5 * count[:, None], dim, axis=1)  # two SGD steps of lr 0.5 from zeros
    np.testing.assert_array_equal(third.numpy()[:1000, 0], want)


@pytest.mark.parametrize("fused", ["1", "0"])  # the generated fused update, the XLA step
@pytest.mark.parametrize("combiner,weighted", [("sum", False), ("mean", True)])
def test_jax_per_id_rows_keep_their_shape(fused, combiner, weighted, monkeypatch):
    """JAX (``shaped_rows``): the per-id lookup takes ids ``[B, M]`` and returns ``[B, M, D]``,
    the update takes the ``[B, M, D]`` gradients as they are (an eager reshape copies every
    row), and the numbers are NumPy's, bit for bit."""
    pytest.importorskip("jax")
    from meshembed_jax import JaxBackend

    monkeypatch.setenv("MESHEMBED_JAX_FUSED", fused)
    assert JaxBackend().capabilities.shaped_rows
    seen = {"gather": [], "update": []}
    real_gather, real_update = JaxBackend.gather, JaxBackend.update_rows

    def gather(self, table, ids):
        out = real_gather(self, table, ids)
        seen["gather"].append((tuple(ids.shape), tuple(out.shape)))
        return out

    def update_rows(self, tables, ids, grads, fn, **kw):
        seen["update"].append((tuple(grads.shape), kw.get("grad_index")))
        return real_update(self, tables, ids, grads, fn, **kw)

    monkeypatch.setattr(JaxBackend, "gather", gather)
    monkeypatch.setattr(JaxBackend, "update_rows", update_rows)
    for opt in (me.embedding.SGD(learning_rate=0.1), me.embedding.Adagrad(learning_rate=0.1),
                me.embedding.Adam(learning_rate=0.01)):
        seen["gather"].clear()
        seen["update"].clear()
        got = _run("jax", combiner, opt, weighted)
        assert seen["gather"] == [((B, M), (B, M, D))] * 3
        assert seen["update"] == [((B, M, D), None)] * 3
        with monkeypatch.context() as m:
            m.setattr(combiners, "is_identity", lambda s, n: False)
            general = _run("jax", combiner, opt, weighted)
        assert len(seen["gather"]) == 3  # the general path: gather_combine, no plain gather
        # the generated kernels are NumPy's bits; the XLA step is the general path's (XLA's
        # CPU code for Adagrad/Adam differs from NumPy in the last bit, either path)
        wants = [general] + ([_run("numpy", combiner, opt, weighted)] if fused == "1" else [])
        for want in wants:
            assert got.keys() == want.keys()
            for key in got:
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_jax_gather_shapes_and_padding():
    """``gather`` returns ``ids.shape + (D,)`` for N-d ids and for 1-d ids of any length
    (padded to a bucket or not), zeros nowhere: the table's rows themselves."""
    pytest.importorskip("jax")
    from meshembed.sharding import Placement
    from meshembed_jax import JaxBackend

    be = JaxBackend()
    values = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)
    table = be.create_table(values, Placement(V, 2, "mod"))
    rng = np.random.default_rng(1)
    for shape in [(16,), (13,), (1,), (0,), (B, M), (B, 1), (2, 3, 4), (0, 3)]:
        ids = rng.integers(0, V, size=shape)
        for x in (ids, be.asarray(ids, dtype="int64")):
            out = be.gather(table, x)
            assert tuple(out.shape) == shape + (D,)
            np.testing.assert_array_equal(be.to_numpy(out), values[ids])


def test_jax_per_id_lookup_copies_no_rows():
    """The per-id lookup's ``[n, 1, D]`` rows are the gather's own output: no XLA copy of
    them (a reshape of the FFI result got a layout of its own and a copy of 32 MiB at W1)."""
    pytest.importorskip("jax")
    from meshembed.sharding import Placement
    from meshembed_jax import JaxBackend, kernels

    be = JaxBackend()
    table = be.create_table(np.zeros((V, D), np.float32), Placement(V, 1, "mod"))
    if not kernels.use_cpu_kernels(table.layout, np.float32):
        pytest.skip("no CPU FFI kernels here")
    ids = np.arange(64).reshape(64, 1) % V
    gids, _, _ = be._global_batch(table.layout, ids)
    hlo = kernels.make_lookup(table.layout, D, (64, 1)).lower(table.data, gids).compile().as_text()
    assert "meshembed_gather_rows" in hlo
    assert " copy(" not in hlo, hlo
