"""me.interop against the real torchrec 1.8 / fbgemm-gpu-cpu 1.8 (extra [interop]).

Round trips, one test per documented gap (named in the report, refused with strict=True),
trained state torchrec -> meshembed checkpoint -> torch/JAX backends -> torchrec, and the
differential report with ulp assertions.
"""

from __future__ import annotations

import numpy as np
import pytest

REASON = "torchrec==1.8.0 and fbgemm-gpu-cpu==1.8.0 (extra [interop], `make test-interop`) are not installed"
torch = pytest.importorskip("torch", reason=REASON)
pytest.importorskip("torchrec", reason=REASON)
pytest.importorskip("fbgemm_gpu", reason=REASON)

import torchrec.optim as trec_optim  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.interop import from_torchrec, to_torchrec, ulp_distance  # noqa: E402
from meshembed.interop._conformance import ROUNDING, compare_torchrec  # noqa: E402


def tables(pooling=PoolingType.SUM, **extra):
    return [EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t0", feature_names=["f0", "f1"],
                               pooling=pooling, **extra),
            EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", feature_names=["f2"], pooling=pooling)]


def same_tables(a, b):
    fields = ("name", "num_embeddings", "embedding_dim", "feature_names", "pooling", "data_type")

    def key(t):
        return [getattr(t, f) for f in fields] + [t.get_weight_init_min(), t.get_weight_init_max()]

    return [key(t) for t in a] == [key(t) for t in b]


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_sgd_round_trip_is_exact(pooling):
    cfg, gaps = from_torchrec(tables(pooling), torch.optim.SGD, {"lr": 0.05}, batch_size=4)
    assert not gaps and str(gaps).startswith("no gaps")
    assert [t.combiner for t in cfg.tables] == [pooling.value.lower()] * 2
    assert [f.name for f in cfg.features] == ["f0", "f1", "f2"]
    assert all(f.input_shape == (4,) for f in cfg.features)
    assert isinstance(cfg.tables[0].optimizer, me.embedding.SGD) and cfg.tables[0].optimizer.learning_rate == 0.05
    back, gaps2 = to_torchrec(cfg, strict=True)
    assert not gaps2 and same_tables(back.tables, tables(pooling))
    assert back.optimizer == EmbOptimType.EXACT_SGD and back.optimizer_kwargs == {"learning_rate": 0.05}
    assert back.tables[0].weight_init_max == tables()[0].get_weight_init_max()


def test_adagrad_without_eps_is_tpu_adagrad_both_ways():
    cfg, gaps = from_torchrec(tables(), EmbOptimType.EXACT_ADAGRAD, {"learning_rate": 0.1, "eps": 0.0},
                              batch_size=2, strict=True)
    spec = cfg.tables[0].optimizer
    assert not gaps and type(spec) is me.embedding.Adagrad and spec.initial_accumulator_value == 0.0
    back, _ = to_torchrec(cfg, strict=True)
    assert back.optimizer == EmbOptimType.EXACT_ADAGRAD and back.optimizer_kwargs == {"learning_rate": 0.1, "eps": 0.0}
    ebc = back.build()  # fbgemm starts at 0; a TPU Adagrad's initial value is written in
    assert back.initial_accumulators == {"t0": 0.0, "t1": 0.0}
    assert isinstance(ebc, FusedEmbeddingBagCollection)


def test_tpu_adagrad_initial_accumulator_reaches_fbgemm():
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 10, 4, optimizer=me.embedding.Adagrad(0.2, initial_accumulator_value=0.5),
                               initializer=me.interop.Uniform(-0.1, 0.1))],
        features=[me.FeatureConfig("t", (3,), name="f")])
    back, gaps = to_torchrec(cfg, strict=True)
    ebc = back.build()
    acc = ebc.fused_optimizer().state_dict()["state"]["t.weight"]["t.weight.momentum_1"]
    assert not gaps and torch.all(acc == 0.5)
    again, _ = from_torchrec(ebc, batch_size=3)  # a module carries its tables and optimizer
    assert [t.name for t in again.tables] == ["t"] and again.tables[0].initializer == me.interop.Uniform(-0.1, 0.1)


# ------------------------------------------------------------------ one test per gap
FROM_GAPS = [
    ("optimizer.eps", dict(optimizer=torch.optim.Adagrad, kwargs={"lr": 0.1})),
    ("optimizer.rowwise", dict(optimizer=trec_optim.RowWiseAdagrad, kwargs={"lr": 0.1, "eps": 0.0})),
    ("optimizer", dict(optimizer=EmbOptimType.SGD, kwargs={"learning_rate": 0.1})),
    ("optimizer.weight_decay", dict(optimizer=torch.optim.SGD, kwargs={"lr": 0.1, "weight_decay": 0.01})),
    ("optimizer.gradient_clipping", dict(optimizer=torch.optim.SGD, kwargs={"lr": 0.1, "gradient_clipping": True})),
    ("optimizer.max_norm", dict(optimizer=torch.optim.SGD, kwargs={"lr": 0.1, "max_norm": 1.0})),
    ("data_type", dict(table_kw={"data_type": DataType.FP16})),
    ("need_pos", dict(table_kw={"need_pos": True})),
    ("num_embeddings_post_pruning", dict(table_kw={"num_embeddings_post_pruning": 10})),
    ("init_fn", dict(table_kw={"init_fn": torch.nn.init.zeros_})),
]


@pytest.mark.parametrize("field,case", FROM_GAPS, ids=[f for f, _ in FROM_GAPS])
def test_from_torchrec_gap_is_reported_and_strict_refuses(field, case):
    args = (tables(**case.get("table_kw", {})), case.get("optimizer", torch.optim.SGD),
            case.get("kwargs", {"lr": 0.1}))
    _, gaps = from_torchrec(*args, batch_size=2)
    assert field in gaps.fields() and all(g.done and g.differs for g in gaps)
    with pytest.raises(me.ConfigError, match=field.replace(".", r"\.")):
        from_torchrec(*args, batch_size=2, strict=True)


def base_cfg(optimizer=None, combiner="sum", initializer=me.interop.Uniform(-0.1, 0.1), name="f"):
    optimizer = optimizer or me.embedding.SGD(0.1)
    return me.EmbeddingConfig(
        tables=[me.TableConfig("t", 10, 4, optimizer=optimizer, combiner=combiner, initializer=initializer)],
        features=[me.FeatureConfig("t", (2,), name=name)])


TO_GAPS = [
    ("combiner", dict(combiner="sqrtn")),
    ("initializer", dict(initializer=None)),
    ("optimizer.epsilon", dict(optimizer=me.embedding.AdagradMomentum(0.1, momentum=0.0, epsilon=1e-10))),
    ("optimizer.clip_weight_min", dict(optimizer=me.embedding.SGD(0.1, clip_weight_min=-1.0))),
    ("optimizer.clipvalue", dict(optimizer=me.embedding.SGD(0.1, clipvalue=1.0))),
    ("optimizer.weight_decay_factor", dict(optimizer=me.embedding.SGD(0.1, weight_decay_factor=0.1))),
    ("optimizer.use_gradient_accumulation", dict(optimizer=me.embedding.SGD(0.1, use_gradient_accumulation=False))),
    ("feature.name", dict(name=None)),
]


@pytest.mark.parametrize("field,case", TO_GAPS, ids=[f for f, _ in TO_GAPS])
def test_to_torchrec_gap_is_reported_and_strict_refuses(field, case):
    cfg = base_cfg(**case)
    result, gaps = to_torchrec(cfg)
    assert field in gaps.fields("t") and result.tables[0].name == "t"
    with pytest.raises(me.ConfigError, match=field.replace(".", r"\.")):
        to_torchrec(cfg, strict=True)


def test_sqrtn_becomes_sum_pooling_and_epsilon_moves_outside_the_root():
    result, _ = to_torchrec(base_cfg(combiner="sqrtn"))
    assert result.tables[0].pooling == PoolingType.SUM
    result, _ = to_torchrec(base_cfg(me.embedding.AdagradMomentum(0.1, momentum=0.0, epsilon=1e-10)))
    assert result.optimizer_kwargs["eps"] == pytest.approx(1e-5)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("args,match", [
    ((torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}), "lr_decay"),
    ((EmbOptimType.ADAM, {}), "adam"),
    ((torch.optim.RMSprop, {}), "optimizer"),
    ((None, None), "Missing `optimizer`"),
])
def test_from_torchrec_refuses_untranslatable_optimizers(args, match):
    with pytest.raises(me.ConfigError, match=match):
        from_torchrec(tables(), *args, batch_size=2)


def test_unpooled_tables_become_sequence_features_both_ways():
    seq = [EmbeddingConfig(num_embeddings=8, embedding_dim=4, name="s", feature_names=["x", "y"])]
    with pytest.raises(me.ConfigError, match="max_sequence_length"):
        from_torchrec(seq, torch.optim.SGD, {"lr": 0.1}, batch_size=2)
    cfg, gaps = from_torchrec(seq, torch.optim.SGD, {"lr": 0.1}, batch_size=2, max_sequence_length=5)
    assert [f.input_shape for f in cfg.features] == [(2, 5), (2, 5)] and gaps.fields() == ("max_sequence_length",)
    with pytest.raises(me.ConfigError, match="max_sequence_length"):
        from_torchrec(seq, torch.optim.SGD, {"lr": 0.1}, batch_size=2, max_sequence_length=5, strict=True)
    back, gaps2 = to_torchrec(cfg)
    assert type(back.tables[0]) is EmbeddingConfig and back.tables[0].feature_names == ["x", "y"]
    assert gaps2.fields() == ("input_shape", "input_shape")
    mixed = me.EmbeddingConfig(tables=[me.TableConfig("t", 8, 4, optimizer=me.embedding.SGD(0.1))],
                               features=[me.FeatureConfig("t", (2,), name="a"), me.FeatureConfig("t", (2, 3), name="b")])
    with pytest.raises(me.ConfigError, match="pooled and sequence"):
        to_torchrec(mixed)


def test_from_torchrec_refuses_bad_tables_and_batch():
    with pytest.raises(me.ConfigError, match="max_sequence_length"):
        from_torchrec(tables(), torch.optim.SGD, {"lr": 0.1}, batch_size=2, max_sequence_length=0)
    with pytest.raises(me.ConfigError, match="batch_size"):
        from_torchrec(tables(), torch.optim.SGD, {"lr": 0.1}, batch_size=0)
    with pytest.raises(me.ConfigError, match="NONE"):
        from_torchrec(tables(PoolingType.NONE), torch.optim.SGD, {"lr": 0.1}, batch_size=2)


@pytest.mark.parametrize("cfg,match", [
    (base_cfg(me.embedding.FTRL(0.1)), "FTRL"),
    (base_cfg(me.embedding.SGD(me.embedding.DynamicLearningRate(0))), "dynamic learning rate"),
])
def test_to_torchrec_refuses(cfg, match):
    with pytest.raises(me.ConfigError, match=match):
        to_torchrec(cfg)


def test_to_torchrec_refuses_odd_dimension_and_mixed_optimizers():
    odd = me.EmbeddingConfig(tables=[me.TableConfig("t", 10, 3, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (2,), name="f")])
    with pytest.raises(me.ConfigError, match="multiple of 4"):
        to_torchrec(odd)
    mixed = me.EmbeddingConfig(
        tables=[me.TableConfig("a", 10, 4, optimizer=me.embedding.SGD(0.1)),
                me.TableConfig("b", 10, 4, optimizer=me.embedding.SGD(0.2))],
        features=[me.FeatureConfig("a", (2,), name="f"), me.FeatureConfig("b", (2,), name="g")])
    with pytest.raises(me.ConfigError, match="Table 'b'.*differs"):
        to_torchrec(mixed)


# ------------------------------------------------------------------ trained state
def train_torchrec(ebc, keys, rng, steps=3, batch=4):
    """A few fused steps of random bags and output gradients (the grads are returned)."""
    for _ in range(steps):
        lengths = rng.integers(1, 3, size=batch * len(keys))
        values = rng.integers(0, 7, size=int(lengths.sum()))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.as_tensor(values),
                                                  lengths=torch.as_tensor(lengths))
        out = ebc(kjt)
        out.values().backward(torch.as_tensor(rng.standard_normal(tuple(out.values().shape)).astype(np.float32)))


def batch(rng, cfg, n=4):
    ids, grads = [], []
    for f in cfg.features:
        lengths = rng.integers(1, 3, size=n)
        ids.append(me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 7, size=lengths.sum())))
        grads.append(rng.standard_normal((n, 4)).astype(np.float32))
    return ids, grads


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_trained_adagrad_state_to_checkpoint_and_on_to_other_backends(tmp_path, backend):
    """Done-when: torchrec tables + fused Adagrad state, trained on CPU, export to a meshembed
    checkpoint, continue training on torch / JAX as on NumPy, and export back exactly."""
    tabs = [EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
            EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", feature_names=["f2"],
                               pooling=PoolingType.MEAN)]
    ebc = FusedEmbeddingBagCollection(tabs, torch.optim.Adagrad, {"lr": 0.1, "eps": 0.0})
    train_torchrec(ebc, ["f0", "f1", "f2"], np.random.default_rng(0))
    cfg, gaps = from_torchrec(ebc, batch_size=4, strict=True)
    engine = me.TPUEmbedding(cfg, backend="numpy")
    me.interop.import_torchrec_state(engine, ebc)
    acc = ebc.fused_optimizer().state_dict()["state"]["t0.weight"]["t0.weight.momentum_1"]
    np.testing.assert_array_equal(engine.retrieve_parameters("t0")["accumulators"], acc.numpy())
    np.testing.assert_array_equal(engine.retrieve_parameters("t1")["parameters"],
                                  ebc.embedding_bags["t1"].weight.detach().numpy())
    path = engine.save(tmp_path / "ckpt")
    other = me.TPUEmbedding.restore(path, backend=backend)
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    for _ in range(2):
        for eng, rng in ((engine, rng_a), (other, rng_b)):
            ids, grads = batch(rng, cfg)
            eng.enqueue(ids)
            eng.dequeue()
            eng.apply_gradients(grads)
    for t in ("t0", "t1"):
        mine, theirs = engine.retrieve_parameters(t), other.retrieve_parameters(t)
        for k in mine:
            assert ulp_distance(mine[k], theirs[k]).max() <= 4, (t, k)
    fresh = to_torchrec(other.config)[0].build()
    me.interop.export_torchrec_state(other, fresh)
    for t in ("t0", "t1"):
        np.testing.assert_array_equal(fresh.embedding_bags[t].weight.detach().numpy(),
                                      other.retrieve_parameters(t)["parameters"])
        st = fresh.fused_optimizer().state_dict()["state"][f"{t}.weight"][f"{t}.weight.momentum_1"]
        np.testing.assert_array_equal(st.numpy(), other.retrieve_parameters(t)["accumulators"])


def test_rowwise_adagrad_translates_to_row_wise_adagrad_and_its_state_round_trips():
    tabs = [EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t0", feature_names=["f0"])]
    ebc = FusedEmbeddingBagCollection(tabs, trec_optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6})
    train_torchrec(ebc, ["f0"], np.random.default_rng(2))
    cfg, gaps = from_torchrec(ebc, batch_size=4, strict=True)  # fbgemm's rule itself: no gap
    assert cfg.tables[0].optimizer == me.embedding.RowWiseAdagrad(learning_rate=0.1, epsilon=1e-6)
    engine = me.TPUEmbedding(cfg, backend="numpy")
    me.interop.import_torchrec_state(engine, ebc)
    row = ebc.fused_optimizer().state_dict()["state"]["t0.weight"]["t0.weight.momentum_1"].numpy().copy()
    got = engine.retrieve_parameters("t0")
    np.testing.assert_array_equal(got["accumulators"], row[:, None])  # one accumulator per row, as fbgemm
    with torch.no_grad():
        ebc.fused_optimizer().state_dict()["state"]["t0.weight"]["t0.weight.momentum_1"].zero_()
    me.interop.export_torchrec_state(engine, ebc)
    np.testing.assert_array_equal(ebc.fused_optimizer().state_dict()["state"]["t0.weight"]["t0.weight.momentum_1"],
                                  row)
    back, gaps = to_torchrec(cfg, strict=True)
    assert str(back.optimizer.value) == "exact_row_wise_adagrad" and back.optimizer_kwargs["eps"] == 1e-6


def test_rowwise_adagrad_with_eps_zero_trains_element_wise_and_says_so():
    tabs = [EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t0", feature_names=["f0"])]
    ebc = FusedEmbeddingBagCollection(tabs, trec_optim.RowWiseAdagrad, {"lr": 0.1, "eps": 0.0})
    train_torchrec(ebc, ["f0"], np.random.default_rng(2))
    cfg, gaps = from_torchrec(ebc, batch_size=4)
    assert "optimizer.rowwise" in gaps.fields()
    engine = me.TPUEmbedding(cfg, backend="numpy")
    me.interop.import_torchrec_state(engine, ebc)
    row = ebc.fused_optimizer().state_dict()["state"]["t0.weight"]["t0.weight.momentum_1"].numpy()
    got = engine.retrieve_parameters("t0")
    np.testing.assert_array_equal(got["accumulators"], np.broadcast_to(row[:, None], (7, 4)))
    before = row.copy()
    me.interop.export_torchrec_state(engine, ebc)  # columns agree: the row mean gives the value back
    np.testing.assert_allclose(ebc.fused_optimizer().state_dict()["state"]["t0.weight"]["t0.weight.momentum_1"],
                               before, rtol=2e-7)


def test_import_refuses_a_module_that_does_not_match_before_writing():
    cfg, _ = from_torchrec(tables(), torch.optim.SGD, {"lr": 0.1}, batch_size=2)
    engine = me.TPUEmbedding(cfg, backend="numpy")
    before = engine.retrieve_parameters("t0")["parameters"].copy()
    other = FusedEmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t0",
                                                            feature_names=["f0"])], torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(me.InputError, match="'t1'"):
        me.interop.import_torchrec_state(engine, other)
    np.testing.assert_array_equal(engine.retrieve_parameters("t0")["parameters"], before)
    ebc = FusedEmbeddingBagCollection(tables(), torch.optim.SGD, {"lr": 0.1})
    with torch.no_grad():
        ebc.embedding_bags["t1"].weight[0, 0] = float("nan")  # the second table: the first must stay as it was
    with pytest.raises(me.InputError, match="'t1'.*NaN"):
        me.interop.import_torchrec_state(engine, ebc)
    np.testing.assert_array_equal(engine.retrieve_parameters("t0")["parameters"], before)


# ------------------------------------------------------------------ differential report
@pytest.mark.parametrize("bare_tbe", [False, True], ids=["collection", "bare-tbe"])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("opt,kw", [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1, "eps": 0.0})])
def test_differential_exact_translations_differ_only_by_rounding(opt, kw, pooling, bare_tbe):
    report = compare_torchrec(tables(pooling), opt, kw, steps=3, bare_tbe=bare_tbe)
    assert not report.findings, str(report)
    assert {r.status for r in report} <= {"exact", "rounding"}
    # a few float32 ulps of each array's scale (a value near 0 can be hundreds of its own ulps off)
    assert max(r.normwise for r in report) <= ROUNDING
    assert len(report) == (6 if "eps" in kw else 4)


def test_bare_tbe_and_collection_agree_bit_for_bit():
    a = compare_torchrec(tables(PoolingType.MEAN), trec_optim.RowWiseAdagrad, {"lr": 0.1}, steps=2)
    b = compare_torchrec(tables(PoolingType.MEAN), trec_optim.RowWiseAdagrad, {"lr": 0.1}, steps=2, bare_tbe=True)
    assert [(r.slot, r.max_ulp) for r in a] == [(r.slot, r.max_ulp) for r in b]
    with pytest.raises(me.ConfigError, match="same pooling"):
        compare_torchrec([tables()[0], tables(PoolingType.MEAN)[1]], torch.optim.SGD, {"lr": 0.1}, bare_tbe=True)


def test_differential_rowwise_adagrad_differs_only_by_rounding():
    report = compare_torchrec(tables(PoolingType.MEAN), trec_optim.RowWiseAdagrad, {"lr": 0.1}, steps=3)
    assert not report.findings, str(report)
    assert {r.status for r in report} <= {"exact", "rounding"}, str(report)
    assert max(r.normwise for r in report) <= ROUNDING


def test_differential_rowwise_eps_zero_difference_is_explained():
    report = compare_torchrec(tables(PoolingType.MEAN), trec_optim.RowWiseAdagrad, {"lr": 0.1, "eps": 0.0}, steps=2)
    assert not report.findings
    rows = [r for r in report if r.slot == "parameters"]
    assert all(r.status == "explained" and "optimizer.rowwise" in r.explained_by for r in rows)
    assert max(r.max_ulp for r in rows) > 1000  # element-wise vs row-wise really differs
    text = str(report)
    assert "optimizer.rowwise" in text and "gap report" in text


def test_cli_conformance_against_torchrec(capsys):
    from meshembed.cli import main

    assert main(["conformance", "--against", "torchrec,fbgemm", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "torchrec SGD/sum" in out and "fbgemm TBE SGD/sum" in out and "RowWiseAdagrad" in out
    assert "FINDING" not in out
