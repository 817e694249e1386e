"""Simulated quantization (spec §2.1) through ``TPUEmbedding`` on every backend.

Forward only: gathered rows are clamped to ``[lo, hi]`` and rounded to one of
``num_buckets`` levels *before* the combiner; the stored table stays unquantized and the
backward pass is unchanged (straight-through). Expected values are plain NumPy.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import meshembed as me
from conformance.tolerances import assert_close
from conformance import reference

E = me.embedding
LO, HI, BUCKETS = -0.5, 0.75, 6  # q = 0.25
V, D, B, M = 9, 4, 3, 2
ROWS = [[1, 1, 4], [0, 8], [2, 5, 5, 7]]
WEIGHTS = [0.5, 2.0, 1.0, 1.5, 0.25, 1.0, 3.0, 0.5, 2.0]
SEQ = [[3, 4, 6], [], [8]]


def _table():
    """Values away from rounding boundaries (so float32 vs float64 cannot flip a bucket),
    some outside ``[LO, HI]`` so the clamp matters."""
    rng = np.random.default_rng(0)
    q = (HI - LO) / (BUCKETS - 1)
    k = rng.integers(-2, BUCKETS + 2, (V, D))
    frac = rng.choice([0.15, 0.3, 0.7, 0.85], (V, D))
    return (LO + (k + frac) * q).astype(np.float32)


def quantize(x):
    """Spec §2.1, in float64."""
    q = (HI - LO) / (BUCKETS - 1)
    c = np.clip(x, LO, HI)
    return np.floor((c - LO) / q + 0.5) * q + LO


def _config(quantization, opt=None, on_table=False):
    opt = opt or E.SGD(0.5)
    if not on_table:
        opt = opt.replace(simulated_quantization=quantization)
    kw = dict(quantization=quantization) if on_table else {}
    tables = [me.TableConfig("t", V, D, optimizer=opt, combiner="mean", **kw)]
    features = [me.FeatureConfig("t", (B,), name="multi"), me.FeatureConfig("t", (B, M), name="seq")]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy="mod")


def _inputs():
    ragged = me.RaggedIds.from_lists(ROWS)
    weights = me.RaggedIds(ragged.row_splits, np.asarray(WEIGHTS, np.float32))
    return [ragged, me.RaggedIds.from_lists(SEQ)], [weights, None]


def _matrices():
    slots = np.array([b for b, r in enumerate(ROWS) for _ in r])
    ids = np.array([i for r in ROWS for i in r])
    a_multi = reference.combination_matrix(slots, ids, np.asarray(WEIGHTS), B, V, "mean")
    seq_slots = np.array([b * M + p for b, r in enumerate(SEQ) for p, _ in enumerate(r) if p < M])
    seq_ids = np.array([i for r in SEQ for p, i in enumerate(r) if p < M])
    a_seq = reference.combination_matrix(seq_slots, seq_ids, np.ones(len(seq_ids)), B * M, V, "mean")
    return a_multi, a_seq


def _step(emb, grads=None):
    feats, weights = _inputs()
    emb.enqueue(feats, weights)
    acts = [emb.backend.to_numpy(a) for a in emb.dequeue()]
    if grads is not None:
        emb.apply_gradients(grads)
    return acts


@pytest.mark.parametrize("on_table", [False, True], ids=["optimizer_option", "table_config"])
def test_forward_is_quantized_before_the_combiner(backend, on_table):
    table0 = _table()
    cfg = _config(E.QuantizationConfig(BUCKETS, LO, HI), on_table=on_table)
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=2, initializers={"t": table0})
    acts = _step(emb)
    a_multi, a_seq = _matrices()
    eq = quantize(table0.astype(np.float64))
    assert_close(acts[0], a_multi @ eq, what="multi-hot mean of quantized rows")
    assert_close(acts[1], (a_seq @ eq).reshape(B, M, D), what="sequence of quantized rows")
    # quantize-then-combine is not combine-then-quantize: the order is observable here
    assert np.max(np.abs(acts[0] - quantize(a_multi @ table0.astype(np.float64)))) > 1e-2
    np.testing.assert_array_equal(emb.retrieve_parameters("t")["parameters"], table0)  # table untouched


def test_disabled_or_absent_quantization_is_plain(backend):
    table0 = _table()
    plain = me.TPUEmbedding(_config(None), backend=backend, num_shards=2, initializers={"t": table0})
    off = me.TPUEmbedding(_config(E.QuantizationConfig(BUCKETS, LO, HI, enabled=False)), backend=backend,
                          num_shards=2, initializers={"t": table0})
    a_multi, _ = _matrices()
    acts = _step(plain)
    assert_close(acts[0], a_multi @ table0.astype(np.float64), what="no quantization")
    for x, y in zip(acts, _step(off)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("opt", [E.SGD(0.5), E.Adagrad(0.3)], ids=["sgd", "adagrad"])
def test_backward_is_straight_through(backend, opt):
    """apply_gradients ignores the quantization: tables and slots equal an unquantized run,
    which equals the reference update ``p − lr·Aᵀg`` for SGD."""
    table0 = _table()
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=(B, D)).astype(np.float32), rng.normal(size=(B, M, D)).astype(np.float32)]
    quant = me.TPUEmbedding(_config(E.QuantizationConfig(BUCKETS, LO, HI), opt), backend=backend, num_shards=2,
                            initializers={"t": table0})
    plain = me.TPUEmbedding(_config(None, opt), backend=backend, num_shards=2, initializers={"t": table0})
    for _ in range(2):
        _step(quant, grads)
        _step(plain, grads)
    got, want = quant.retrieve_parameters("t"), plain.retrieve_parameters("t")
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    if isinstance(opt, E.SGD):
        a_multi, a_seq = _matrices()
        g = a_multi.T @ grads[0] + a_seq.T @ grads[1].reshape(B * M, D)
        assert_close(got["parameters"], table0 - 2 * 0.5 * g, what="SGD straight-through")
    # the activations of the next lookup are quantized rows of the *updated* float table
    acts = _step(quant)
    assert_close(acts[0], _matrices()[0] @ quantize(got["parameters"].astype(np.float64)), what="after update")


def test_quantization_survives_the_proto_round_trip(backend):
    table0 = _table()
    cfg = _config(E.QuantizationConfig(BUCKETS, LO, HI))
    a = me.TPUEmbedding(cfg, backend=backend, num_shards=2, initializers={"t": table0})
    b = me.TPUEmbedding(cfg.to_proto(), backend=backend, num_shards=1, initializers={"t": table0})
    for x, y in zip(_step(a), _step(b)):
        assert_close(x, y, what="proto round trip")


@pytest.mark.parametrize("bounds", [(LO, None), (None, HI), (None, None), (HI, HI)],
                         ids=["upper_unset", "lower_unset", "both_unset", "lower_eq_upper"])
def test_enabled_quantization_without_a_bucket_width_is_a_config_error(backend, bounds):
    """Spec §2.1: an unset side means ±inf, which would make every activation NaN. The
    config rejects it naming the table (on the optimizer and on the TableConfig); the
    engine rejects it too for a duck-typed config that skips EmbeddingConfig validation."""
    q = E.QuantizationConfig(BUCKETS, *bounds)
    for on_table in (False, True):
        with pytest.raises(me.ConfigError, match="Invalid `simulated_quantization` for table 't'"):
            _config(q, on_table=on_table)
    ns = types.SimpleNamespace
    cfg = ns(tables=[ns(name="t", vocabulary_size=V, dimension=D, optimizer=E.SGD(0.5, simulated_quantization=q),
                        combiner="mean")],
             features=[ns(table="t", input_shape=(B,), name="multi")], sharding_strategy="mod")
    with pytest.raises(me.ConfigError, match="Invalid `simulated_quantization` for table 't'"):
        me.TPUEmbedding(cfg, backend=backend, num_shards=2)
    # disabled, the same bounds are only recorded: the forward pass is plain
    off = _config(E.QuantizationConfig(BUCKETS, *bounds, enabled=False))
    table0 = _table()
    acts = _step(me.TPUEmbedding(off, backend=backend, num_shards=2, initializers={"t": table0}))
    assert_close(acts[0], _matrices()[0] @ table0.astype(np.float64), what="disabled quantization")
