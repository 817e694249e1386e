"""NaN/Inf gradients on the JAX backend: checked on the device by a guard (``finite_guard``),
waited for once the update is dispatched, so the update itself runs behind the host's next
work (issue #18's per-id W1 step: the guard is one sequential pass over the gradients, and a
check inside the fused kernel would make the host wait for the whole update).

* ``update_rows(check_finite=True)``, plain (per-id) and combined (pooled) forms: a NaN/Inf in a
  row some id reads, or in one none reads, raises NonFiniteError with the table and its slots
  bit-identical (the fused step ran with a false guard and handed the donated buffers back
  unchanged); finite gradients give the bits of the unchecked step, also when a row's sum
  overflows.
* The engine: one guard over every feature's gradients; a NaN/Inf anywhere raises the error
  naming the feature with every table unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'meshembed[jax]'")

import meshembed as me  # noqa: E402
from meshembed.embedding.layout import build_layout  # noqa: E402
from meshembed.embedding.updates import make_rule  # noqa: E402
from meshembed.errors import InputError, NonFiniteError  # noqa: E402
from meshembed.sharding.placement import Placement  # noqa: E402
from meshembed_jax import backend as jax_backend  # noqa: E402
from meshembed_jax import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.usable("cpu", np.float32),
                                reason="the JAX CPU FFI kernels did not build here")

BAD = [float("nan"), float("inf"), float("-inf")]
V, D = 50, 8


def _table(be, optimizer):
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=V, dimension=D, optimizer=optimizer, combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(4,), name="f")])
    spec = build_layout(cfg).tables[0]
    rule = make_rule(spec, be)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((V, D)).astype(np.float32)] + [
        np.abs(rng.standard_normal((V, D))).astype(np.float32) + 0.1 for _ in rule.slot_names]
    tables = [be.create_table(a, Placement(V, 1)) for a in arrays]
    return rule, tables


def _contents(be, tables):
    return [np.asarray(be.unshard(t)).copy() for t in tables]


def _update(be, tables, rule, form, grads, check):
    ids = np.array([3, 7, 3, 11, 49, 0, 7, 20], np.int64)
    kw = {"values": (0.1,), "check_finite": check}
    if form == "plain":
        return be.update_rows(tables, ids, grads, rule, **kw)
    index = np.array([0, 1, 2, 0, 3, 1, 2, 3], np.int64)
    return be.update_rows(tables, ids, grads, rule, grad_index=index, **kw)


def _grads(form, seed=1):
    rows = 8 if form == "plain" else 6  # combined: rows 4 and 5 are read by no id
    return np.random.default_rng(seed).standard_normal((rows, D)).astype(np.float32)


@pytest.fixture(scope="module")
def be():
    b = jax_backend.JaxBackend()
    assert b.capabilities.guarded_updates and not b.capabilities.checked_updates
    return b


@pytest.mark.parametrize("optimizer", [me.embedding.SGD(0.1), me.embedding.Adagrad(0.1)], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("form", ["plain", "combined"])
@pytest.mark.parametrize("row", [2, 5], ids=["read-row", "last-row"])
@pytest.mark.parametrize("bad", BAD)
def test_checked_update_refuses_and_writes_nothing(be, optimizer, form, row, bad):
    rule, tables = _table(be, optimizer)
    before = _contents(be, tables)
    g = _grads(form)
    g[row, 3] = bad
    calls = be.stats().get("fused_updates", 0)
    with pytest.raises(NonFiniteError):
        _update(be, tables, rule, form, be.asarray(g), True)
    assert be.stats().get("fused_updates", 0) == calls + 1  # the fused step ran (its guard false: wrote nothing)
    for got, want in zip(_contents(be, tables), before):
        np.testing.assert_array_equal(got, want)
    g[row, 3] = 0.5  # the same tables still update afterwards
    _update(be, tables, rule, form, be.asarray(g), True)
    assert not np.array_equal(_contents(be, tables)[0], before[0])


@pytest.mark.parametrize("form", ["plain", "combined"])
@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflowing-sums"])
def test_checked_update_gives_the_unchecked_bits(be, form, overflow):
    """Finite gradients: the same bits with and without the check — also when a row's sum
    overflows to Inf (finite inputs: not a NaN/Inf gradient, so the update runs)."""
    rule, checked = _table(be, me.embedding.Adagrad(0.1))
    _, plain = _table(be, me.embedding.Adagrad(0.1))
    g = _grads(form)
    if overflow:  # ids 3 and 7 appear twice: 2e38 + 2e38 is Inf in float32
        g = np.where(g > 0, np.float32(2e38), np.float32(-2e38))
        assert np.isfinite(g).all() and np.isinf(g[0] + g[2]).any()  # id 3 reads rows 0 and 2
    _update(be, checked, rule, form, be.asarray(g), True)
    _update(be, plain, rule, form, be.asarray(g), False)
    for a, b in zip(_contents(be, checked), _contents(be, plain)):
        np.testing.assert_array_equal(a, b)


def _engine_case():
    opt = me.embedding.Adagrad(learning_rate=0.05)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="small", vocabulary_size=30, dimension=8, optimizer=opt, combiner="mean"),
                me.TableConfig(name="big", vocabulary_size=400, dimension=8, optimizer=opt, combiner="sum")],
        features=[me.FeatureConfig(table="small", input_shape=(16,), name="user"),
                  me.FeatureConfig(table="big", input_shape=(512, 1), name="items")])
    rng = np.random.default_rng(5)
    feats = [me.RaggedIds(np.arange(0, 33, 2), rng.integers(0, 30, size=32)), rng.integers(0, 400, size=(512, 1))]
    grads = [rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((512, 1, 8)).astype(np.float32)]
    return cfg, feats, grads


def _state(emb):
    return {n: {k: v.copy() for k, v in emb.retrieve_parameters(n).items()} for n in ("small", "big")}


@pytest.mark.parametrize("where", [0, 1])
@pytest.mark.parametrize("bad", BAD)
def test_engine_nonfinite_names_the_feature_and_changes_nothing(where, bad):
    cfg, feats, grads = _engine_case()
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    emb.enqueue(feats)
    emb.dequeue()
    before, step = _state(emb), emb.step
    grads[where].reshape(-1)[-5] = bad
    name = cfg.features[where].name
    with pytest.raises(InputError, match=f"feature {name!r}.*NaN or Inf"):
        emb.apply_gradients(grads)
    after = _state(emb)
    assert emb.step == step and all(np.array_equal(after[t][k], v) for t in before for k, v in before[t].items())
    grads[where].reshape(-1)[-5] = 0.0  # the same batch still applies afterwards
    emb.apply_gradients(grads)
    assert emb.step == step + 1


def test_engine_guards_every_gradient_at_once(monkeypatch):
    """One guard over both features' gradients, no check inside an update, and the result
    equals the NumPy backend's."""
    cfg, feats, grads = _engine_case()
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    ref = me.TPUEmbedding(cfg, backend="numpy", num_shards=1)
    guarded, checked = [], []
    real_guard, real_update = type(emb.backend).finite_guard, type(emb.backend).update_rows
    monkeypatch.setattr(type(emb.backend), "finite_guard",
                        lambda self, xs: guarded.append([tuple(x.shape) for x in xs]) or real_guard(self, xs))
    monkeypatch.setattr(type(emb.backend), "update_rows",
                        lambda self, *a, **k: checked.append(k.get("check_finite", False)) or real_update(self, *a, **k))
    for e in (emb, ref):
        for _ in range(2):
            e.enqueue(feats)
            e.dequeue()
            e.apply_gradients(grads)
    assert guarded == [[(16, 8), (512, 1, 8)]] * 2
    assert checked == [False] * 4
    for t in ("small", "big"):  # the generated kernels: the NumPy reference's bits
        for k, v in ref.retrieve_parameters(t).items():
            np.testing.assert_array_equal(emb.retrieve_parameters(t)[k], v)
