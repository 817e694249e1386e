"""me.interop against the real jax-tpu-embedding 0.1 (extra [interop]; its specs need flax)."""

from __future__ import annotations

import numpy as np
import pytest

REASON = "jax-tpu-embedding==0.1.0 and flax (extra [interop], `make test-interop`) are not installed"
pytest.importorskip("flax", reason=REASON)
es = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding_spec", reason=REASON)
import jax  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.interop import from_jax_tpu_embedding, to_jax_tpu_embedding  # noqa: E402


def spec(optimizer, combiner="sum", output_shape=(8, 4), **kw):
    t = es.TableSpec(name="t", vocabulary_size=10, embedding_dim=4, initializer=jax.nn.initializers.zeros,
                     optimizer=optimizer, combiner=combiner, **kw)
    return es.FeatureSpec(name="f", table_spec=t, input_shape=[8, 1], output_shape=list(output_shape))


EXACT = [es.SGDOptimizerSpec(0.1), es.AdagradOptimizerSpec(0.1, initial_accumulator_value=0.3),
         es.FTRLOptimizerSpec(0.1, l1_regularization_strength=0.01, initial_linear_value=0.2,
                              multiply_linear_by_learning_rate=True),
         es.AdagradMomentumOptimizerSpec(0.1, momentum=0.5, initial_accumulator_value=0.0)]


@pytest.mark.parametrize("opt", EXACT, ids=lambda o: type(o).__name__)
def test_round_trip_is_equal_where_no_gap(opt):
    cfg, gaps = from_jax_tpu_embedding([spec(opt, combiner="mean")])
    assert gaps.fields() == ("initializer",)  # a jax initializer is opaque
    back, gaps2 = to_jax_tpu_embedding(cfg, strict=True)
    t = back[0].table_spec
    assert not gaps2 and t.optimizer == opt and vars(t.optimizer) == pytest.approx(vars(opt))
    assert (t.name, t.vocabulary_size, t.embedding_dim, t.combiner) == ("t", 10, 4, "mean")
    assert back[0].output_shape == [8, 4]


def test_quantization_and_sequence_round_trip():
    q = es.QuantizationConfig(min_value=-1.0, max_value=1.0, num_buckets=16)
    cfg, _ = from_jax_tpu_embedding(spec(es.SGDOptimizerSpec(0.1), output_shape=(8, 3, 4), quantization_config=q))
    assert cfg.tables[0].quantization == me.embedding.QuantizationConfig(16, -1.0, 1.0)
    assert cfg.features[0].input_shape == (8, 3)
    back, _ = to_jax_tpu_embedding(cfg)
    assert back[0].table_spec.quantization_config == q and back[0].output_shape == [8, 3, 4]


GAPS = [
    ("optimizer.bias_correction", dict(opt=es.AdamOptimizerSpec(0.01))),
    ("optimizer.initial_accumulator_value", dict(opt=es.AdagradMomentumOptimizerSpec(0.1))),
    ("max_ids_per_partition", dict(kw={"max_ids_per_partition": 64})),
    ("suggested_coo_buffer_size_per_device", dict(kw={"suggested_coo_buffer_size_per_device": 1024})),
    ("initializer", dict()),
]


@pytest.mark.parametrize("field,case", GAPS, ids=[g for g, _ in GAPS])
def test_from_gap_is_reported_and_strict_refuses(field, case):
    f = spec(case.get("opt", es.SGDOptimizerSpec(0.1)), **case.get("kw", {}))
    assert field in from_jax_tpu_embedding(f).gaps.fields()
    with pytest.raises(me.ConfigError, match=field.replace(".", r"\.")):
        from_jax_tpu_embedding(f, strict=True)


def cfg_with(optimizer, initializer=None):
    return me.EmbeddingConfig(tables=[me.TableConfig("t", 10, 4, optimizer=optimizer, initializer=initializer)],
                              features=[me.FeatureConfig("t", (8,), name="f")])


TO_GAPS = [
    ("optimizer.bias_correction", me.embedding.Adam(0.1)),
    ("optimizer.sum_inside_sqrt", me.embedding.Adam(0.1, sum_inside_sqrt=True)),
    ("optimizer.lazy", me.embedding.Adam(0.1, lazy_adam=False)),
    ("optimizer.clipvalue", me.embedding.SGD(0.1, clipvalue=1.0)),
    ("optimizer.weight_decay_factor", me.embedding.SGD(0.1, weight_decay_factor=0.1)),
    ("optimizer.allow_zero_accumulator", me.embedding.FTRL(0.1, allow_zero_accumulator=True)),
]


@pytest.mark.parametrize("field,opt", TO_GAPS, ids=[g for g, _ in TO_GAPS])
def test_to_gap_is_reported_and_strict_refuses(field, opt):
    assert field in to_jax_tpu_embedding(cfg_with(opt)).gaps.fields("t")
    with pytest.raises(me.ConfigError, match=field.replace(".", r"\.")):
        to_jax_tpu_embedding(cfg_with(opt), strict=True)


def test_initializer_gap_to_jte():
    _, gaps = to_jax_tpu_embedding(cfg_with(me.embedding.SGD(0.1), initializer=me.embedding.Zeros()))
    assert gaps.fields() == ("initializer",)


@pytest.mark.parametrize("bad,match", [
    (lambda: from_jax_tpu_embedding(spec(es.LaPropOptimizerSpec(0.1))), "LaProp"),
    (lambda: from_jax_tpu_embedding(spec(es.SGDOptimizerSpec(lambda step: 0.1))), "callable of the step"),
    (lambda: from_jax_tpu_embedding(spec(es.SGDOptimizerSpec(0.1), output_shape=(8, 5))), "output_shape"),
    (lambda: to_jax_tpu_embedding(cfg_with(me.embedding.Lion(0.1))), "Lion"),
])
def test_refusals(bad, match):
    with pytest.raises(me.ConfigError, match=match):
        bad()


def test_per_table_arrays_round_trip_and_training_continues():
    cfg, _ = from_jax_tpu_embedding(spec(es.AdagradOptimizerSpec(0.1)))
    engine = me.TPUEmbedding(cfg, backend="numpy")
    rng = np.random.default_rng(0)
    arrays = {"t": {"parameters": rng.standard_normal((10, 4)).astype(np.float32),
                    "accumulator": rng.uniform(0.1, 1, (10, 4)).astype(np.float32)}}
    me.interop.import_table_arrays(engine, arrays, source="jax_tpu_embedding")
    out = me.interop.export_table_arrays(engine, source="jax_tpu_embedding")
    for k, v in arrays["t"].items():
        np.testing.assert_array_equal(out["t"][k], v)
    engine.enqueue([np.arange(8) % 10])
    engine.dequeue()
    engine.apply_gradients([np.ones((8, 4), np.float32)])
    acc = engine.retrieve_parameters("t")["accumulators"]
    np.testing.assert_allclose(acc[:8], arrays["t"]["accumulator"][:8] + 1, rtol=1e-6)
    bad = {"t": {"parameters": np.full((10, 4), np.inf, np.float32)}}
    with pytest.raises(me.InputError, match="NaN or Inf"):
        me.interop.import_table_arrays(engine, bad, source="jax_tpu_embedding")
    with pytest.raises(me.InputError, match="source"):
        me.interop.export_table_arrays(engine, source="nope")
