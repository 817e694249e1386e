"""Correctness of the torch backend's per-id fast paths (issue #18: the per-id W1 step).

* ``native.gather_rows``: the lookup of large outputs with streaming stores equals
  ``index_select`` bit for bit (aligned rows, unaligned rows, float64, through ``gather``).
* ``update_rows(check_finite=True)`` (``Capabilities.checked_updates``): the fused kernel checks
  the gradients while it sums them; any NaN/Inf element — in a row a contribution reads or in
  one none does — raises NonFiniteError with every table and slot bit-identical; finite
  gradients give the same bits as without the check, also when their sums overflow.
* The engine: the table checked in its update is the largest and is updated first, so a
  NaN/Inf anywhere raises the same error naming the feature, with every table unchanged;
  no separate all_finite pass runs over that table's gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install 'meshembed[torch]'")

import meshembed as me  # noqa: E402
from meshembed.errors import InputError, NonFiniteError  # noqa: E402
from meshembed.sharding.placement import Placement  # noqa: E402
from meshembed_torch import native  # noqa: E402

BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(scope="module")
def be():
    return me.get_backend("torch")


# -- gather_rows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.float32, 12), (torch.float64, 8)])
def test_gather_rows_equals_index_select(dtype, dim):
    rng = np.random.default_rng(0)
    data = torch.from_numpy(rng.standard_normal((1000, dim))).to(dtype)
    n = -(-native.STREAM_MIN_BYTES // (dim * data.element_size())) + 3  # just above the threshold
    index = torch.from_numpy((rng.zipf(1.2, size=n) - 1) % 1000)
    out = torch.full((n, dim), 7.0, dtype=dtype)
    assert native.gather_rows(data, index, out)
    assert torch.equal(out, torch.index_select(data, 0, index))


def test_gather_rows_declines_small_or_odd_inputs():
    data = torch.zeros(10, 4)
    small = torch.empty(3, 4)
    assert not native.gather_rows(data, torch.tensor([0, 1, 2]), small)
    big = native.STREAM_MIN_BYTES // 16 + 1
    assert not native.gather_rows(data, torch.zeros(big, dtype=torch.int32), torch.empty(big, 4))  # int32 ids
    assert not native.gather_rows(data, torch.zeros(big, dtype=torch.int64), torch.empty(big, 4).t().contiguous().t())


def test_backend_gather_uses_streaming_path(be, monkeypatch):
    dim, n = 64, native.STREAM_MIN_BYTES // 256 + 5
    rng = np.random.default_rng(1)
    values = rng.standard_normal((5000, dim)).astype(np.float32)
    table = be.create_table(values, Placement(5000, 1, "mod"))
    ids = (rng.zipf(1.1, size=n) - 1) % 5000
    taken = []
    real = native.gather_rows
    monkeypatch.setattr(native, "gather_rows", lambda *a: taken.append(real(*a)) or taken[-1])
    out = be.gather(table, be.asarray(ids))
    assert taken == [True]
    np.testing.assert_array_equal(be.to_numpy(out), values[ids])


# -- update_rows(check_finite=True) ---------------------------------------------------------------

def _tables(be, rule, vocab=50, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    p = Placement(vocab, 1, "mod")
    return [be.create_table(rng.standard_normal((vocab, dim)).astype(np.float32), p)] + [
        be.create_table(np.full((vocab, dim), 0.1, np.float32), p) for _ in rule.slot_names]


def _rule(be, optimizer):
    from meshembed.embedding.updates import make_rule

    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=50, dimension=16, optimizer=optimizer)],
                             features=[me.FeatureConfig(table="t", input_shape=(4,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="numpy")
    return make_rule(emb.layout.tables[0], be)


OPTIMIZERS = [me.embedding.SGD(learning_rate=0.1), me.embedding.Adagrad(learning_rate=0.1)]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd", "adagrad"])
@pytest.mark.parametrize("form", ["per_id", "weighted", "grad_index", "grad_index_unread"])
@pytest.mark.parametrize("bad", BAD)
def test_fused_check_refuses_and_writes_nothing(be, optimizer, form, bad, monkeypatch):
    rule = _rule(be, optimizer)
    values = [0.1]
    rng = np.random.default_rng(3)
    n = 600  # enough unique rows for two threads
    ids = (rng.zipf(1.3, size=n) - 1) % 50
    tables = _tables(be, rule)
    before = [be.to_numpy(t.data).copy() for t in tables]
    kw = {}
    if form in ("per_id", "weighted"):
        grads = rng.standard_normal((n, 16)).astype(np.float32)
        grads[n - 7, 5] = bad
        if form == "weighted":
            kw["grad_weights"] = be.asarray(rng.uniform(0.5, 2, size=n).astype(np.float32))
    else:
        grads = rng.standard_normal((40, 16)).astype(np.float32)
        index = rng.integers(0, 39, size=n)  # row 39 is read by no contribution
        kw["grad_index"] = be.asarray(index)
        grads[39 if form == "grad_index_unread" else index[n // 2], 3] = bad
    calls = be.stats().get("fused_updates", 0)
    with pytest.raises(NonFiniteError):
        be.update_rows(tables, be.asarray(ids), be.asarray(grads), rule, values=values, check_finite=True, **kw)
    for t, b in zip(tables, before):
        np.testing.assert_array_equal(be.to_numpy(t.data), b)
    assert be.stats().get("fused_updates", 0) == calls
    # without the fused kernel (fused=False, MESHEMBED_TORCH_FUSED=0) the backend checks first: same outcome
    monkeypatch.setattr(be, "fused", False)
    with pytest.raises(NonFiniteError):
        be.update_rows(tables, be.asarray(ids), be.asarray(grads), rule, values=values, check_finite=True, **kw)
    for t, b in zip(tables, before):
        np.testing.assert_array_equal(be.to_numpy(t.data), b)


@pytest.mark.parametrize("form", ["per_id", "grad_index"])
def test_fused_check_passes_finite_gradients_bit_identically(be, form):
    rule = _rule(be, me.embedding.Adagrad(learning_rate=0.1))
    rng = np.random.default_rng(4)
    n = 700
    ids = (rng.zipf(1.3, size=n) - 1) % 50
    if form == "per_id":
        grads, kw = rng.standard_normal((n, 16)).astype(np.float32), {}
        grads[ids == ids[0]] = 3e38  # finite elements whose sum overflows: not refused
    else:
        grads = rng.standard_normal((40, 16)).astype(np.float32)
        kw = {"grad_index": be.asarray(rng.integers(0, 40, size=n))}
    out = []
    for check in (False, True):
        tables = _tables(be, rule)
        calls = be.stats().get("fused_updates", 0)
        be.update_rows(tables, be.asarray(ids), be.asarray(grads), rule, values=[0.1], check_finite=check, **kw)
        assert be.stats().get("fused_updates", 0) == calls + 1
        out.append([be.to_numpy(t.data) for t in tables])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_protocol_default_checks_too():
    np_be = me.get_backend("numpy")
    rule = _rule(np_be, me.embedding.SGD(learning_rate=0.1))
    table = np_be.create_table(np.zeros((50, 16), np.float32), Placement(50, 1, "mod"))
    g = np.zeros((3, 16), np.float32)
    g[1, 1] = np.nan
    with pytest.raises(NonFiniteError):
        np_be.update_rows([table], np.array([0, 1, 2]), g, rule, values=[0.1], check_finite=True)
    np.testing.assert_array_equal(np_be.unshard(table), 0)


# -- the engine ----------------------------------------------------------------------------------

def _engine(per_id_rows=4096, weighted=False, optimizer=None):
    opt = optimizer or me.embedding.Adagrad(learning_rate=0.05)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="small", vocabulary_size=30, dimension=8, optimizer=opt, combiner="mean"),
                me.TableConfig(name="big", vocabulary_size=400, dimension=8, optimizer=opt, combiner="sum")],
        features=[me.FeatureConfig(table="small", input_shape=(16,), name="user"),
                  me.FeatureConfig(table="big", input_shape=(per_id_rows, 1), name="items"),
                  me.FeatureConfig(table="big", input_shape=(per_id_rows, 1), name="more_items")])
    rng = np.random.default_rng(5)
    feats = [me.RaggedIds(np.arange(0, 33, 2), rng.integers(0, 30, size=32)),
             (rng.zipf(1.2, size=(per_id_rows, 1)) - 1) % 400, rng.integers(0, 400, size=(per_id_rows, 1))]
    grads = [rng.standard_normal((16, 8)).astype(np.float32),
             rng.standard_normal((per_id_rows, 1, 8)).astype(np.float32),
             rng.standard_normal((per_id_rows, 1, 8)).astype(np.float32)]
    weights = None
    if weighted:  # one weighted id per row: the identity path with a scale
        feats[1] = me.RaggedIds(np.arange(per_id_rows + 1), feats[1].reshape(-1))
        weights = [None, rng.uniform(0.5, 2, size=per_id_rows).astype(np.float32), None]
    return cfg, feats, grads, weights


def _state(emb):
    return {n: {k: v.copy() for k, v in emb.retrieve_parameters(n).items()} for n in ("small", "big")}


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("bad", BAD)
def test_engine_nonfinite_names_feature_and_changes_nothing(be, weighted, where, bad):
    cfg, feats, grads, weights = _engine(weighted=weighted)
    emb = me.TPUEmbedding(cfg, backend="torch", num_shards=1)
    assert emb.backend.capabilities.checked_updates
    emb.enqueue(feats, weights=weights)
    emb.dequeue()
    before, step = _state(emb), emb.step
    grads[where].reshape(-1)[-5] = bad
    name = cfg.features[where].name
    with pytest.raises(InputError, match=f"feature {name!r}.*NaN or Inf"):
        emb.apply_gradients([torch.from_numpy(g) for g in grads])
    after = _state(emb)
    for t in before:
        for k in before[t]:
            np.testing.assert_array_equal(after[t][k], before[t][k])
    assert emb.step == step
    grads[where].reshape(-1)[-5] = 0.0  # the same batch still applies afterwards
    emb.apply_gradients([torch.from_numpy(g) for g in grads])
    assert emb.step == step + 1


def test_engine_checks_largest_table_in_its_update_only(be, monkeypatch):
    """The big table's gradients are checked inside the fused kernel (no all_finite pass over
    them); the small table's by all_finite; results equal the NumPy backend's."""
    cfg, feats, grads, _ = _engine()
    emb = me.TPUEmbedding(cfg, backend="torch", num_shards=1)
    ref = me.TPUEmbedding(cfg, backend="numpy", num_shards=1)
    seen, checked = [], []
    real_all_finite, real_update = type(emb.backend).all_finite, native.update
    monkeypatch.setattr(type(emb.backend), "all_finite", lambda self, x: seen.append(tuple(x.shape)) or real_all_finite(self, x))
    monkeypatch.setattr(native, "update", lambda *a, **k: checked.append(k.get("check_finite")) or real_update(*a, **k))
    for e in (emb, ref):
        for _ in range(2):
            e.enqueue(feats)
            e.dequeue()
            e.apply_gradients(grads)
    assert seen == [(16, 8), (16, 8)]  # only the small table's gradient, once per step
    assert True in checked
    for t in ("small", "big"):
        for k, v in ref.retrieve_parameters(t).items():
            np.testing.assert_array_equal(emb.retrieve_parameters(t)[k], v)  # the generated kernel's bits


def test_engine_allow_nonfinite_applies(be):
    cfg, feats, grads, _ = _engine(optimizer=me.embedding.SGD(learning_rate=0.1))
    emb = me.TPUEmbedding(cfg, backend="torch", num_shards=1, allow_nonfinite=True)
    emb.enqueue(feats)
    emb.dequeue()
    grads[1][0, 0, 0] = np.inf
    emb.apply_gradients(grads)
    assert not np.isfinite(emb.retrieve_parameters("big")["parameters"]).all()
