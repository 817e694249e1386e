"""Backend-generic engine behaviour: sharding invariance, combiner gradients, update
scheduling, modes, dynamic learning rates, and bad input leaving every table untouched."""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from conformance.tolerances import assert_close
from conformance import reference

B = 4


def config(opt=None, strategy="div", vocab=(13, 7), seq=3):
    opt = opt or me.embedding.Adagrad(0.1)
    tables = [me.TableConfig("a", vocab[0], 3, optimizer=opt, combiner="mean"),
              me.TableConfig("b", vocab[1], 2, optimizer=opt, combiner="sqrtn")]
    features = [me.FeatureConfig("a", (B,), name="fa"), me.FeatureConfig("a", (B, seq), name="fa_seq"),
                me.FeatureConfig("b", (B,), name="fb")]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy=strategy)


def batch(step: int, vocab=(13, 7)):
    rng = np.random.default_rng(step)
    fa = me.RaggedIds.from_lists([rng.integers(0, vocab[0], rng.integers(1, 4)).tolist() for _ in range(B)])
    wa = me.RaggedIds(fa.row_splits, rng.uniform(0.5, 2.0, len(fa.values)).astype(np.float32))
    seq = me.RaggedIds.from_lists([rng.integers(0, vocab[0], rng.integers(0, 5)).tolist() for _ in range(B)])
    fb = rng.integers(0, vocab[1], (B,))
    return [fa, seq, fb], [wa, None, None]


def run(emb, steps=3, start=0):
    for s in range(start, start + steps):
        feats, weights = batch(s)
        emb.enqueue(feats, weights)
        acts = emb.dequeue()
        emb.apply_gradients([emb.backend.to_numpy(a) * 0.5 + 0.1 for a in acts])


def snapshot(emb):
    return {t: {k: v.copy() for k, v in emb.retrieve_parameters(t).items()} for t in emb.table_names}


def assert_same_state(a, b, exact=True):
    for t in a:
        for k in a[t]:
            if exact:
                np.testing.assert_array_equal(a[t][k], b[t][k], err_msg=f"{t}/{k}")
            else:
                assert_close(a[t][k], b[t][k], what=f"{t}/{k}")


@pytest.mark.parametrize("strategy", ["mod", "div"])
@pytest.mark.parametrize("num_shards", [2, 3, 7])
def test_sharding_changes_no_number(backend, strategy, num_shards):
    base = me.TPUEmbedding(config(strategy=strategy), backend="numpy", num_shards=1, seed=3)
    run(base)
    emb = me.TPUEmbedding(config(strategy=strategy), backend=backend, num_shards=num_shards, seed=3)
    run(emb)
    assert_same_state(snapshot(base), snapshot(emb), exact=backend.name == "numpy")


def test_eight_shards_large_vocab(backend):
    cfg = config(vocab=(1001, 17))
    base = me.TPUEmbedding(cfg, backend="numpy", num_shards=1)
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=8)
    for e in (base, emb):
        for s in range(2):
            feats, weights = batch(s, vocab=(1001, 17))
            e.enqueue(feats, weights)
            e.apply_gradients([e.backend.to_numpy(a) + 1.0 for a in e.dequeue()])
    assert_same_state(snapshot(base), snapshot(emb), exact=False)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiner_backward_matches_finite_differences(backend, combiner):
    """SGD with lr 1 exposes −∂L/∂E; L = Σ G ⊙ act is linear in E, so a finite difference
    is exact up to rounding."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 6, 2, optimizer=me.embedding.SGD(1.0), combiner=combiner)],
        features=[me.FeatureConfig("t", (3,), name="f")])
    ids = me.RaggedIds(np.array([0, 3, 3, 5]), np.array([1, 1, 4, 2, 2]))
    w = me.RaggedIds(ids.row_splits, np.array([0.5, 2.0, 1.5, 1.0, 3.0], np.float32))
    g = np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)
    emb = me.TPUEmbedding(cfg, backend=backend)
    table0 = emb.retrieve_parameters("t")["parameters"].astype(np.float64)

    def loss(table):
        probe = me.TPUEmbedding(cfg, backend="numpy", initializers={"t": table.astype(np.float32)})
        probe.enqueue([ids], [w], training=False)
        return float(np.sum(g * probe.dequeue()[0].astype(np.float64)))

    h = 0.25
    fd = np.zeros_like(table0)
    for i in range(6):
        for j in range(2):
            plus, minus = table0.copy(), table0.copy()
            plus[i, j] += h
            minus[i, j] -= h
            fd[i, j] = (loss(plus) - loss(minus)) / (2 * h)
    emb.enqueue([ids], [w])
    emb.dequeue()
    emb.apply_gradients([g])
    grad = table0 - emb.retrieve_parameters("t")["parameters"]
    assert_close(grad, fd, rtol=1e-5, what=combiner)


def test_gradient_accumulation_off_applies_contributions_one_by_one(backend):
    opt = me.embedding.Adagrad(0.5, initial_accumulator_value=0.1, use_gradient_accumulation=False)
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 4, 1, optimizer=opt, combiner="sum")],
                             features=[me.FeatureConfig("t", (3,), name="f")])
    emb = me.TPUEmbedding(cfg, backend=backend, initializers={"t": np.zeros((4, 1), np.float32)})
    emb.enqueue([np.array([2, 2, 1])])
    emb.dequeue()
    emb.apply_gradients([np.array([[1.0], [3.0], [2.0]], np.float32)])
    p, acc = 0.0, 0.1
    for g in (1.0, 3.0):  # row 2 sees its two contributions separately
        acc += g * g
        p -= 0.5 * g / np.sqrt(acc)
    got = emb.retrieve_parameters("t")
    assert_close(got["parameters"][2, 0], p, rtol=1e-6)
    assert_close(got["accumulators"][2, 0], acc, rtol=1e-6)
    on = reference.adagrad(np.zeros(1), np.array([4.0]), (np.array([0.1]),), 0.5)[0][0]
    assert abs(p - on) > 1e-3  # accumulation on would differ


@pytest.mark.parametrize("lazy", [True, False])
def test_lazy_and_non_lazy_adam(backend, lazy):
    opt = me.embedding.Adam(0.1, lazy_adam=lazy)
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 5, 2, optimizer=opt, combiner="sum")],
                             features=[me.FeatureConfig("t", (1,), name="f")])
    emb = me.TPUEmbedding(cfg, backend=backend)
    for ids in ([1], [2]):
        emb.enqueue([np.array(ids)])
        emb.dequeue()
        before = emb.retrieve_parameters("t")["parameters"]
        emb.apply_gradients([np.ones((1, 2), np.float32)])
    after = emb.retrieve_parameters("t")["parameters"]
    moved = ~np.all(after == before, axis=1)
    assert moved[2]
    assert moved[1] == (not lazy)  # non-lazy: momentum keeps moving row 1
    assert not moved[0]  # m = v = 0 and g = 0: no change even when non-lazy


def test_touched_row_with_zero_gradient_still_updates(backend):
    opt = me.embedding.Adam(0.1)
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 3, 1, optimizer=opt, combiner="sum")],
                             features=[me.FeatureConfig("t", (1,), name="f")])
    emb = me.TPUEmbedding(cfg, backend=backend)
    for g in (1.0, 0.0):
        emb.enqueue([np.array([1])])
        emb.dequeue()
        emb.apply_gradients([np.full((1, 1), g, np.float32)])
    m = emb.retrieve_parameters("t")["momenta"][1, 0]
    assert_close(m, 0.9 * 0.1, rtol=1e-6)


def test_dynamic_learning_rate_equals_constant(backend):
    a = me.TPUEmbedding(config(me.embedding.Adagrad(0.3)), backend=backend)
    b = me.TPUEmbedding(config(me.embedding.Adagrad(me.embedding.DynamicLearningRate(0))), backend=backend)
    run(a)
    for s in range(3):
        feats, weights = batch(s)
        b.enqueue(feats, weights)
        b.apply_gradients([b.backend.to_numpy(x) * 0.5 + 0.1 for x in b.dequeue()], learning_rates=[0.3])
    assert_same_state(snapshot(a), snapshot(b), exact=True)


def test_backward_pass_only_mode(backend):
    a = me.TPUEmbedding(config(), backend=backend)
    b = me.TPUEmbedding(config(), backend=backend)
    feats, weights = batch(0)
    a.enqueue(feats, weights)
    grads = [a.backend.to_numpy(x) for x in a.dequeue()]
    a.apply_gradients(grads)
    b.enqueue(feats, weights, mode_override="backward_pass_only")
    b.apply_gradients(grads)  # no dequeue needed
    assert_same_state(snapshot(a), snapshot(b))


def test_inference_mode(backend):
    emb = me.TPUEmbedding(config(), backend=backend)
    before = snapshot(emb)
    feats, weights = batch(0)
    for mode in ("inference", "inference"):  # a second inference enqueue is fine
        emb.enqueue(feats, weights, mode_override=mode)
        acts = emb.dequeue()
    with pytest.raises(me.StateError, match="inference"):
        emb.apply_gradients([emb.backend.to_numpy(x) for x in acts])
    assert_same_state(before, snapshot(emb))


def test_zero_total_weight_gives_zero_activation(backend):
    """mean / sqrtn over zero total weight: TF's div_no_nan, activation 0 (not NaN)."""
    emb = me.TPUEmbedding(config(), backend=backend)
    fa = me.RaggedIds.from_lists([[1, 2], [3], [4], [5]])
    wa = me.RaggedIds(fa.row_splits, np.array([0.0, 0.0, 1.0, 1.0, 1.0], np.float32))
    feats, weights = batch(0)
    emb.enqueue([fa, feats[1], feats[2]], [wa, None, None])
    act = emb.backend.to_numpy(emb.dequeue()[0])
    assert np.all(act[0] == 0.0) and np.all(np.isfinite(act))


# -- bad input: precise error, bit-identical state ------------------------------------------
def _dequeued(emb, step=0):
    feats, weights = batch(step)
    emb.enqueue(feats, weights)
    return [emb.backend.to_numpy(a) for a in emb.dequeue()]


BAD_ENQUEUE = {
    "negative id": lambda f, w: ([me.RaggedIds(f[0].row_splits, -f[0].values), f[1], f[2]], w),
    "id >= vocabulary": lambda f, w: ([f[0], f[1], np.full(B, 7)], w),
    "ragged splits not monotone": lambda f, w: ([me.RaggedIds(np.array([0, 3, 1, 4, len(f[0].values)]), f[0].values),
                                                 f[1], f[2]], [None, None, None]),
    "wrong feature count": lambda f, w: (f[:2], w[:2]),
    "wrong batch size": lambda f, w: ([f[0], f[1], np.zeros(B + 1, np.int64)], w),
    "float ids": lambda f, w: ([f[0], f[1], np.zeros(B, np.float32)], w),
    "weights on dense ids": lambda f, w: (f, [w[0], None, np.ones(B, np.float32)]),
    "nan weight": lambda f, w: (f, [me.RaggedIds(w[0].row_splits, np.full(len(w[0].values), np.nan, np.float32)),
                                    None, None]),
}


@pytest.mark.parametrize("case", sorted(BAD_ENQUEUE))
def test_bad_enqueue_is_rejected_and_changes_nothing(backend, case):
    emb = me.TPUEmbedding(config(), backend=backend)
    run(emb, steps=1)
    before = snapshot(emb)
    feats, weights = BAD_ENQUEUE[case](*batch(5))
    with pytest.raises(me.InputError) as info:
        emb.enqueue(feats, weights)
    assert any(name in str(info.value) for name in ("fa", "fb", "fa_seq", "feature", "features"))
    assert_same_state(before, snapshot(emb))
    assert emb.pending is None  # nothing half-queued: a good batch goes through next
    run(emb, steps=1, start=6)


def _bad_grads(acts):
    return {
        "wrong gradient shape": [acts[0][:, :2], acts[1], acts[2]],
        "wrong gradient count": acts[:2],
        "nan gradient": [acts[0], np.full_like(acts[1], np.nan), acts[2]],
        "inf gradient": [acts[0], acts[1], np.full_like(acts[2], np.inf)],
    }


@pytest.mark.parametrize("case", ["wrong gradient shape", "wrong gradient count", "nan gradient", "inf gradient",
                                  "wrong learning-rate count", "non-scalar learning rate"])
def test_bad_apply_is_rejected_and_changes_nothing(backend, case):
    dynamic = "learning" in case
    opt = me.embedding.Adagrad(me.embedding.DynamicLearningRate(0) if dynamic else 0.1)
    emb = me.TPUEmbedding(config(opt), backend=backend)
    acts = _dequeued(emb)
    before = snapshot(emb)
    if case == "wrong learning-rate count":
        args = (acts, [0.1, 0.2])
    elif case == "non-scalar learning rate":
        args = (acts, [np.array([0.1, 0.2])])
    else:
        args = (_bad_grads(acts)[case], [0.1] if dynamic else [])
    with pytest.raises(me.InputError) as info:
        emb.apply_gradients(*args)
    # the NaN/Inf error names its feature (on a guarded backend table "a" was already
    # stepped, writing nothing, when table "b"'s Inf is found)
    named = {"nan gradient": "'fa_seq'", "inf gradient": "'fb'"}.get(case, "")
    assert named in str(info.value)
    assert_same_state(before, snapshot(emb))
    emb.apply_gradients(acts, [0.1] if dynamic else [])  # the batch is still pending and usable
    assert emb.step == 1


def test_allow_nonfinite_lets_nan_through(backend):
    emb = me.TPUEmbedding(config(me.embedding.SGD(0.1)), backend=backend)
    acts = _dequeued(emb)
    emb.apply_gradients([np.full_like(a, np.nan) for a in acts], allow_nonfinite=True)
    assert np.isnan(emb.retrieve_parameters("b")["parameters"]).any()


def test_one_nonfinite_value_is_caught_and_large_finite_gradients_pass(backend):
    """The NaN/Inf check sums first (one pass) and only then looks element-wise: a single
    NaN or Inf anywhere is still caught, and finite values whose sum overflows still pass."""
    for bad in (np.nan, np.inf, -np.inf):
        emb = me.TPUEmbedding(config(me.embedding.SGD(0.1)), backend=backend)
        acts = _dequeued(emb)
        grads = [np.zeros_like(a) for a in acts]
        grads[1].reshape(-1)[-1] = bad
        before = snapshot(emb)
        with pytest.raises(me.InputError, match="NaN or Inf"):
            emb.apply_gradients(grads)
        assert_same_state(before, snapshot(emb))
    emb = me.TPUEmbedding(config(me.embedding.SGD(0.0)), backend=backend)
    acts = _dequeued(emb)
    before = snapshot(emb)
    # 1e37 everywhere: the sum over the 36 values of "fa_seq" overflows float32, no value does
    # (and no row's sum of duplicates does), so this must not be taken for an Inf
    emb.apply_gradients([np.full_like(a, 1e37) for a in acts])
    assert_same_state(before, snapshot(emb))  # lr 0: nothing moves, and nothing raised


def test_unit_weights_given_or_not_give_identical_steps(backend):
    """The sum combiner without weights skips the weighting; explicit weights of 1 must
    give bit-identical activations and tables."""
    def cfg():
        tables = [me.TableConfig("a", 13, 3, optimizer=me.embedding.Adagrad(0.1), combiner="sum")]
        features = [me.FeatureConfig("a", (B,), name="fa"), me.FeatureConfig("a", (B, 3), name="fs")]
        return me.EmbeddingConfig(tables=tables, features=features)

    rng = np.random.default_rng(4)
    fa = me.RaggedIds.from_lists([rng.integers(0, 13, rng.integers(1, 4)).tolist() for _ in range(B)])
    fs = me.RaggedIds.from_lists([rng.integers(0, 13, rng.integers(0, 5)).tolist() for _ in range(B)])
    ones = [me.RaggedIds(f.row_splits, np.ones(len(f.values), np.float32)) for f in (fa, fs)]
    runs = []
    for weights in (None, ones):
        emb = me.TPUEmbedding(cfg(), backend=backend)
        emb.enqueue([fa, fs], weights)
        acts = [emb.backend.to_numpy(a) for a in emb.dequeue()]
        emb.apply_gradients([a * 0.5 + 0.25 for a in acts])
        runs.append((acts, snapshot(emb)))
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b)
    assert_same_state(runs[0][1], runs[1][1])


def test_order_errors(backend):
    emb = me.TPUEmbedding(config(), backend=backend)
    before = snapshot(emb)
    with pytest.raises(me.StateError, match="enqueue"):
        emb.dequeue()
    with pytest.raises(me.StateError, match="no batch"):
        emb.apply_gradients([None, None, None])
    feats, weights = batch(0)
    emb.enqueue(feats, weights)
    with pytest.raises(me.StateError, match="dequeue"):
        emb.apply_gradients([np.zeros(emb.output_shape(f), np.float32) for f in emb.feature_names])
    with pytest.raises(me.StateError, match="apply_gradients"):
        emb.enqueue(feats, weights)
    assert_same_state(before, snapshot(emb))


def test_load_and_retrieve_per_shard_round_trip(backend):
    emb = me.TPUEmbedding(config(strategy="mod"), backend=backend, num_shards=2)
    run(emb, steps=1)
    full = emb.retrieve_parameters("a")
    parts = [emb.retrieve_parameters("a", num_shards=3, shard_id=s) for s in range(3)]
    assert [p["parameters"].shape[0] for p in parts] == [5, 4, 4]
    np.testing.assert_array_equal(parts[1]["accumulators"], full["accumulators"][1::3])
    emb.load_parameters("a", parts[1]["parameters"] + 1, num_shards=3, shard_id=1,
                        accumulators=parts[1]["accumulators"] * 2)
    after = emb.retrieve_parameters("a")
    np.testing.assert_array_equal(after["parameters"][1::3], full["parameters"][1::3] + 1)
    np.testing.assert_array_equal(after["parameters"][0::3], full["parameters"][0::3])
    before = snapshot(emb)
    with pytest.raises(me.InputError):
        emb.load_parameters("a", np.zeros((4, 3)), num_shards=3, shard_id=0)  # shard 0 has 5 rows
    with pytest.raises(me.InputError):
        emb.load_parameters("a", accumulators=np.zeros((13, 3)), velocity=np.zeros((13, 3)))
    assert_same_state(before, snapshot(emb))
