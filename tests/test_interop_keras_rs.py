"""me.interop against the real keras-rs 0.4 (extra [interop]): round trips, one test per
documented gap (reported, refused with strict=True), and the differential report."""

from __future__ import annotations

import numpy as np
import pytest

REASON = "keras-rs==0.4.0 (extra [interop], `make test-interop`) is not installed"
keras_rs = pytest.importorskip("keras_rs", reason=REASON)
import keras  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.interop import from_keras_rs, to_keras_rs  # noqa: E402
from meshembed.interop._conformance import ROUNDING, compare_keras_rs  # noqa: E402


def feature(optimizer=None, combiner="mean", dim=4, initializer=None, input_shape=(8,), output_shape=None, **kw):
    init = initializer or keras.initializers.TruncatedNormal(stddev=dim ** -0.5)
    t = keras_rs.layers.TableConfig(name="t", vocabulary_size=10, embedding_dim=dim, combiner=combiner,
                                    optimizer=optimizer or keras.optimizers.SGD(0.1), initializer=init, **kw)
    return keras_rs.layers.FeatureConfig(name="f", table=t, input_shape=input_shape,
                                         output_shape=output_shape or (8, dim))


@pytest.mark.parametrize("make,spec", [
    (lambda: keras.optimizers.SGD(0.1), me.embedding.SGD),
    (lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01, beta=0.1), me.embedding.FTRL),
])
def test_round_trip_without_gaps_is_equal(make, spec):
    f = feature(make(), combiner="sqrtn")
    cfg, gaps = from_keras_rs([f], strict=spec is not me.embedding.FTRL)
    assert type(cfg.tables[0].optimizer) is spec and cfg.tables[0].combiner == "sqrtn"
    assert cfg.features[0].input_shape == (8,) and cfg.tables[0].initializer is None
    back, gaps2 = to_keras_rs(cfg)
    assert gaps2.fields() == ()
    b, t = back[0], back[0].table
    assert (b.name, b.input_shape, b.output_shape) == ("f", (8,), (8, 4))
    assert (t.name, t.vocabulary_size, t.embedding_dim, t.combiner) == ("t", 10, 4, "sqrtn")
    ours, theirs = t.optimizer.get_config(), f.table.optimizer.get_config()
    for k in ours:
        if k != "name":
            assert ours[k] == pytest.approx(theirs[k]), k
    assert t.initializer.get_config() == f.table.initializer.get_config()


def test_sequence_feature_and_initializers():
    f = feature(output_shape=(8, 3, 4), input_shape=(8, 3), initializer=keras.initializers.RandomUniform(-0.2, 0.2))
    cfg, gaps = from_keras_rs({"f": f}, strict=True)
    assert cfg.features[0].input_shape == (8, 3) and cfg.features[0].is_sequence
    assert cfg.tables[0].initializer == me.interop.Uniform(-0.2, 0.2)
    back, _ = to_keras_rs(cfg, strict=True)
    assert back[0].output_shape == (8, 3, 4)
    assert isinstance(back[0].table.initializer, keras.initializers.RandomUniform)


GAPS = [
    ("optimizer.epsilon", dict(optimizer=keras.optimizers.Adagrad(0.1))),
    ("optimizer.bias_correction", dict(optimizer=keras.optimizers.Adam(0.01))),
    ("optimizer.lazy", dict(optimizer=keras.optimizers.Ftrl(0.1))),
    ("optimizer.momentum", dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))),
    ("optimizer.clipnorm", dict(optimizer=keras.optimizers.SGD(0.1, clipnorm=1.0))),
    ("optimizer.use_ema", dict(optimizer=keras.optimizers.SGD(0.1, use_ema=True))),
    ("optimizer.weight_decay", dict(optimizer=keras.optimizers.SGD(0.1, weight_decay=0.01))),
    ("optimizer.l2_shrinkage_regularization_strength",
     dict(optimizer=keras.optimizers.Ftrl(0.1, l2_shrinkage_regularization_strength=0.1))),
    ("initializer", dict(initializer=keras.initializers.VarianceScaling(mode="fan_out"))),
    ("placement", dict(placement="default_device")),
    ("max_ids_per_partition", dict(max_ids_per_partition=64)),
    ("input_shape", dict(input_shape=(8, 5))),
]


@pytest.mark.parametrize("field,kw", GAPS, ids=[g for g, _ in GAPS])
def test_from_keras_rs_gap_is_reported_and_strict_refuses(field, kw):
    _, gaps = from_keras_rs([feature(**kw)])
    assert field in gaps.fields()
    with pytest.raises(me.ConfigError, match=field.replace(".", r"\.")):
        from_keras_rs([feature(**kw)], strict=True)


def cfg_with(optimizer, initializer=None, name="f"):
    return me.EmbeddingConfig(tables=[me.TableConfig("t", 10, 4, optimizer=optimizer, initializer=initializer)],
                              features=[me.FeatureConfig("t", (8,), name=name)])


TO_GAPS = [
    ("optimizer.epsilon", me.embedding.Adagrad(0.1)),
    ("optimizer.bias_correction", me.embedding.Adam(0.1)),
    ("optimizer.sum_inside_sqrt", me.embedding.Adam(0.1, sum_inside_sqrt=True)),
    ("optimizer.lazy", me.embedding.Adam(0.1, lazy_adam=True)),
    ("optimizer.momentum", me.embedding.Momentum(0.1)),
    ("optimizer.clipvalue", me.embedding.SGD(0.1, clipvalue=(-1.0, 2.0))),
    ("optimizer.clip_weight_max", me.embedding.SGD(0.1, clip_weight_max=1.0)),
    ("optimizer.weight_decay_factor", me.embedding.SGD(0.1, weight_decay_factor=0.1)),
    ("optimizer.initial_linear_value", me.embedding.FTRL(0.1, initial_linear_value=0.5)),
]


@pytest.mark.parametrize("field,spec", TO_GAPS, ids=[g for g, _ in TO_GAPS])
def test_to_keras_rs_gap_is_reported_and_strict_refuses(field, spec):
    _, gaps = to_keras_rs(cfg_with(spec))
    assert field in gaps.fields("t")
    with pytest.raises(me.ConfigError, match=field.replace(".", r"\.")):
        to_keras_rs(cfg_with(spec), strict=True)


def test_to_keras_rs_symmetric_clipvalue_and_unnamed_feature():
    back, gaps = to_keras_rs(cfg_with(me.embedding.SGD(0.1, clipvalue=2.0), name=None))
    assert back[0].table.optimizer.clipvalue == 2.0 and gaps.fields() == ("feature.name",)


@pytest.mark.parametrize("bad,match", [
    (lambda: from_keras_rs([feature(keras.optimizers.RMSprop())]), "RMSprop"),
    (lambda: from_keras_rs([feature(keras.optimizers.Adam(amsgrad=True))]), "amsgrad"),
    (lambda: from_keras_rs([feature(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)))]),
     "schedule"),
    (lambda: from_keras_rs([feature(output_shape=(8, 5))]), "output_shape"),
    (lambda: from_keras_rs(["nope"]), "FeatureConfig"),
    (lambda: to_keras_rs(cfg_with(me.embedding.Adadelta(0.1))), "Adadelta"),
    (lambda: to_keras_rs(cfg_with(me.embedding.SGD(me.embedding.DynamicLearningRate(0)))), "dynamic"),
])
def test_refusals(bad, match):
    with pytest.raises(me.ConfigError, match=match):
        bad()


def test_keras_arrays_round_trip_through_an_engine():
    cfg, _ = from_keras_rs([feature(keras.optimizers.Ftrl(0.1))])
    engine = me.TPUEmbedding(cfg, backend="numpy")
    rng = np.random.default_rng(0)
    arrays = {"t": {"parameters": rng.standard_normal((10, 4)).astype(np.float32),
                    "accumulator": rng.uniform(0.1, 1, (10, 4)).astype(np.float32),
                    "linear": rng.standard_normal((10, 4)).astype(np.float32)}}
    me.interop.import_table_arrays(engine, arrays, source="keras_rs")
    out = me.interop.export_table_arrays(engine, source="keras_rs")
    for k, v in arrays["t"].items():
        np.testing.assert_array_equal(out["t"][k], v)
    with pytest.raises(me.InputError, match="velocity"):
        me.interop.import_table_arrays(engine, {"t": {"velocity": arrays["t"]["linear"]}}, source="keras_rs")
    with pytest.raises(me.InputError, match="shape"):
        me.interop.import_table_arrays(engine, {"t": {"parameters": np.zeros((5, 4))}}, source="keras_rs")


@pytest.mark.parametrize("make", [lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adagrad(0.1, epsilon=0.0),
                                  lambda: keras.optimizers.Adagrad(0.1), lambda: keras.optimizers.Adam(0.01),
                                  lambda: keras.optimizers.Ftrl(0.1)],
                         ids=["sgd", "adagrad-eps0", "adagrad", "adam", "ftrl"])
def test_differential_against_keras(make):
    feats = [feature(make(), combiner=c, dim=d) for c, d in (("sum", 8), ("mean", 4))]
    feats = [keras_rs.layers.FeatureConfig(name=f"f{i}", table=keras_rs.layers.TableConfig(
        name=f"t{i}", vocabulary_size=10, embedding_dim=f.table.embedding_dim, combiner=f.table.combiner,
        optimizer=f.table.optimizer, initializer=f.table.initializer), input_shape=(8,),
        output_shape=f.output_shape) for i, f in enumerate(feats)]
    report = compare_keras_rs(feats, steps=3)
    assert not report.findings, str(report)
    opt = feats[0].table.optimizer
    if isinstance(opt, keras.optimizers.SGD):
        assert all(r.normwise <= ROUNDING for r in report), str(report)
    if isinstance(opt, (keras.optimizers.Adam, keras.optimizers.Ftrl)):  # the gaps are real
        assert any(r.status == "explained" for r in report if r.slot == "parameters")


TF = keras.backend.backend() == "tensorflow"


@pytest.mark.skipif(not TF, reason="IndexedSlices reach the Keras optimizer on the TensorFlow Keras backend only")
def test_duplicate_ids_are_the_only_adagrad_difference():
    """keras-rs' real layer on TF: without repeated ids Adagrad(epsilon=0) is bit-exact; with
    them Keras adds each occurrence's g² and the report says so (optimizer.duplicates)."""
    def feats(vocab):
        t = keras_rs.layers.TableConfig(name="t", vocabulary_size=vocab, embedding_dim=4, combiner="mean",
                                        optimizer=keras.optimizers.Adagrad(0.1, epsilon=0.0),
                                        initializer=keras.initializers.TruncatedNormal(stddev=0.5))
        return [keras_rs.layers.FeatureConfig(name="f", table=t, input_shape=(4,), output_shape=(4, 4))]

    unique = compare_keras_rs(feats(1_000_000), steps=2, max_bag_size=2)
    assert all(r.status == "exact" for r in unique), str(unique)
    repeated = compare_keras_rs(feats(3), steps=2)
    acc = next(r for r in repeated if r.slot == "accumulators")
    assert acc.status == "explained" and acc.explained_by == ("optimizer.duplicates",) and not repeated.findings
    assert "optimizer.duplicates" in from_keras_rs(feats(3)).gaps.fields()


def test_on_the_jax_keras_backend_adagrad_is_exact_and_reports_no_duplicates_gap():
    """Keras on JAX gets the dense table gradient: Adagrad(epsilon=0) matches TPU Adagrad bit
    for bit and the report has no gap (a child process: the Keras backend is per process)."""
    import os
    import subprocess
    import sys

    code = """
import keras, keras_rs, meshembed as me
assert keras.backend.backend() == "jax"
feats = []
for c, d in (("sum", 8), ("mean", 4)):
    t = keras_rs.layers.TableConfig(name=f"t_{c}", vocabulary_size=10, embedding_dim=d, combiner=c,
        optimizer=keras.optimizers.Adagrad(0.1, epsilon=0.0), initializer=keras.initializers.TruncatedNormal(stddev=0.5))
    feats.append(keras_rs.layers.FeatureConfig(name=f"f_{c}", table=t, input_shape=(4,), output_shape=(4, d)))
r = me.interop.compare_keras_rs(feats, steps=3)
assert not me.interop.from_keras_rs(feats, strict=True).gaps
assert all(x.status in ("exact", "rounding") for x in r) and all(x.max_ulp == 0 for x in r if x.slot != "activations"), r
print("ok")
"""
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.skipif(not TF, reason="drives keras-rs' layer with tf.GradientTape (TensorFlow Keras backend)")
def test_trained_keras_rs_layer_state_to_engine_and_back():
    import tensorflow as tf

    t = keras_rs.layers.TableConfig(name="t", vocabulary_size=6, embedding_dim=4, combiner="sum",
                                    optimizer=keras.optimizers.Adagrad(0.1, epsilon=0.0),
                                    initializer=keras.initializers.TruncatedNormal(stddev=0.5))
    f = {"f": keras_rs.layers.FeatureConfig(name="f", table=t, input_shape=(3,), output_shape=(3, 4))}
    layer = keras_rs.layers.DistributedEmbedding(f)
    ids = {"f": tf.RaggedTensor.from_row_splits(np.array([0, 1, 2, 5]), np.array([0, 2, 3, 4]))}
    opt = keras.optimizers.Adagrad(0.1, epsilon=0.0)
    with tf.GradientTape() as tape:
        out = layer(ids)["f"]
    opt.apply_gradients(zip(tape.gradient(out, layer.trainable_variables, output_gradients=tf.ones((3, 4))),
                            layer.trainable_variables))
    arrays = me.interop.keras_rs_arrays(layer, opt)
    assert sorted(arrays["t"]) == ["accumulator", "parameters"] and arrays["t"]["accumulator"][5, 0] == pytest.approx(1.1)
    cfg, gaps = from_keras_rs(f)
    assert gaps.fields() == ("optimizer.duplicates",)
    engine = me.TPUEmbedding(cfg, backend="numpy")
    me.interop.import_table_arrays(engine, arrays, source="keras_rs")
    np.testing.assert_array_equal(engine.retrieve_parameters("t")["accumulators"], arrays["t"]["accumulator"])
    engine.load_parameters("t", parameters=np.zeros((6, 4), np.float32))
    me.interop.load_keras_rs_arrays(layer, me.interop.export_table_arrays(engine, source="keras_rs"), opt)
    assert not np.asarray(layer.trainable_variables[0]).any()
    with pytest.raises(me.InputError, match="shape"):
        me.interop.load_keras_rs_arrays(layer, {"t": {"parameters": np.zeros((2, 4))}}, opt)
