"""me.ops: the raw-op mirror reproduces the engine and TensorFlow's numbers, both Recv/Send
layouts, and every Load/Retrieve op of spec §3.4 exists and round-trips."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import meshembed as me
from conformance.test_engine_golden import FEATURES, TABLES, B, golden_config, initializers, load_case
from conformance.tolerances import assert_close

GOLDEN = pathlib.Path(__file__).parents[1] / "conformance" / "golden"
SPEC_OPS = ["stochastic_gradient_descent", "adagrad", "adagrad_momentum", "adam", "adadelta", "ftrl", "momentum",
            "rms_prop", "centered_rms_prop", "mdl_adagrad_light", "proximal_adagrad", "proximal_yogi",
            "frequency_estimator"]


@pytest.fixture(autouse=True)
def _fresh():
    yield
    me.ops.shutdown_tpu_embedding()


def test_golden_sgd_through_raw_ops():
    inputs, gold = load_case(GOLDEN, "sgd")
    cfg = golden_config(me.embedding.SGD(0.1))
    engine = me.ops.configure_tpu_embedding(cfg.to_proto())
    for t, *_ in TABLES:  # load the golden tables through the per-table Load op, 2 host shards
        for shard in range(2):
            ids = me.sharding.Placement(engine.layout.table(t).vocabulary_size, 2, "div").global_ids(shard)
            me.ops.load_tpu_embedding_stochastic_gradient_descent_parameters(
                inputs[f"table_init__{t}"][ids], num_shards=2, shard_id=shard, table_name=t)
    combiners = [c for *_, c in TABLES]
    for s in range(3):
        idx, ids, wts = [], [], []
        for n, *_ in FEATURES:
            p = f"s{s}__{n}__"
            idx.append(np.stack([inputs[p + "sample"], inputs[p + "position"]], axis=1).astype(np.int32))
            ids.append(inputs[p + "id"].astype(np.int32))
            wts.append(inputs[p + "weight"])
        me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch(idx, ids, wts, combiners=combiners, mode_override="train")
        acts = me.ops.recv_tpu_embedding_activations(len(FEATURES))
        for a, (n, *_) in zip(acts, FEATURES):
            assert_close(a, gold[f"s{s}__act__{n}"], against="golden", what=n)
        me.ops.send_tpu_embedding_gradients([a - inputs[f"s{s}__{n}__target"] for a, (n, *_) in zip(acts, FEATURES)])
        for t, *_ in TABLES:
            got = np.concatenate([me.ops.retrieve_tpu_embedding_stochastic_gradient_descent_parameters(
                num_shards=1, shard_id=0, table_name=t)])
            assert_close(got, gold[f"s{s}__table_after__{t}"], against="golden", what=t)


def test_empty_combiners_mean_sum():
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 5, 2, optimizer=me.embedding.SGD(0.1), combiner="mean")],
                             features=[me.FeatureConfig("t", (2,), name="f")])
    engine = me.ops.configure_tpu_embedding(cfg, seed=1)
    table = engine.retrieve_parameters("t")["parameters"]
    me.ops.enqueue_tpu_embedding_ragged_tensor_batch([np.array([0, 2, 3])], [np.array([1, 4, 2])], [np.array([])],
                                                     table_ids=[0], mode_override="inference")
    (act,) = me.ops.recv_tpu_embedding_activations(1)
    np.testing.assert_allclose(act, [table[1] + table[4], table[2]], rtol=1e-6)


def test_legacy_layout_is_per_table_and_interleaved():
    """No feature descriptors: one [B·nf, dim] tensor per table, row = b·nf + f."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("u", 10, 2, optimizer=me.embedding.Adagrad(0.1), combiner="sum", num_features=2),
                me.TableConfig("v", 6, 3, optimizer=me.embedding.SGD(0.1), combiner="sum", num_features=1)],
        batch_size_per_tensor_core=3)
    engine = me.ops.configure_tpu_embedding(cfg)
    u, v = (engine.retrieve_parameters(t)["parameters"] for t in ("u", "v"))
    # table u: sample b, feature f -> row b*2+f; ids per (b, f)
    u_ids = np.array([1, 2, 3, 4, 5, 6])
    me.ops.enqueue_tpu_embedding_sparse_batch([np.arange(6), np.array([0, 1, 2])], [u_ids, np.array([5, 4, 3])],
                                              [np.ones(6, np.float32), np.array([2, 1, 1], np.float32)])
    acts = me.ops.recv_tpu_embedding_activations(2)
    assert [a.shape for a in acts] == [(6, 2), (3, 3)]
    np.testing.assert_allclose(acts[0], u[u_ids], rtol=1e-6)
    np.testing.assert_allclose(acts[1][0], 2 * v[5], rtol=1e-6)
    with pytest.raises(me.InputError, match="num_outputs"):
        me.ops.recv_tpu_embedding_activations(3)
    me.ops.send_tpu_embedding_gradients([np.ones((6, 2), np.float32), np.zeros((3, 3), np.float32)])
    acc = me.ops.retrieve_tpu_embedding_adagrad_parameters(num_shards=1, shard_id=0, table_id=0)[1]
    np.testing.assert_allclose(acc[u_ids], 1.1, rtol=1e-6)
    me.ops.enqueue_tpu_embedding_integer_batch([np.array([0, 1, 2, 3, 4, 5]), np.array([0, 1, 2])],
                                               mode_override="inference")
    assert me.ops.recv_tpu_embedding_activations(2)[1].shape == (3, 3)


def test_every_spec_load_retrieve_op_exists():
    for part in SPEC_OPS:
        assert callable(getattr(me.ops, f"load_tpu_embedding_{part}_parameters"))
        assert callable(getattr(me.ops, f"retrieve_tpu_embedding_{part}_parameters"))
    assert not hasattr(me.ops, "load_tpu_embedding_lion_parameters")  # TF 2.21 has none


def test_adadelta_load_retrieve_per_shard_and_all():
    opt = me.embedding.Adadelta(0.1, rho=0.9, epsilon=1e-6)
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("a", 7, 2, optimizer=opt, combiner="sum"),
                                     me.TableConfig("s", 5, 2, optimizer=me.embedding.SGD(0.1), combiner="sum")],
                             features=[me.FeatureConfig("a", (2,), name="fa"), me.FeatureConfig("s", (2,), name="fs")],
                             sharding_strategy="mod")
    me.ops.configure_tpu_embedding(cfg.to_proto(), num_shards=2)
    rows = [3, 2, 2]  # V=7 over 3 host shards
    for shard in range(3):
        p = np.full((rows[shard], 2), shard, np.float32)
        me.ops.load_tpu_embedding_adadelta_parameters(p, p + 10, p + 20, num_shards=3, shard_id=shard, table_name="a")
    params, acc, upd = me.ops.retrieve_tpu_embedding_adadelta_parameters(num_shards=1, shard_id=0, table_id=0)
    np.testing.assert_array_equal(params[:, 0], np.arange(7) % 3)  # MOD: id i on shard i % 3
    np.testing.assert_array_equal(upd, params + 20)
    everything = me.ops.retrieve_all_tpu_embedding_parameters(num_shards=1, shard_id=0)
    assert len(everything) == 8 and everything[3][0].shape == (0, 0) and everything[1][1].shape == (0, 0)
    np.testing.assert_array_equal(everything[2][0], upd)
    doubled = [[x * 2 if x.size else x for x in group] for group in everything]
    me.ops.load_all_tpu_embedding_parameters(*doubled, num_shards=1, shard_id=0)
    np.testing.assert_array_equal(me.ops.retrieve_tpu_embedding_adadelta_parameters(1, 0, table_name="a")[1], acc * 2)
    with pytest.raises(me.InputError, match="adadelta"):
        me.ops.load_tpu_embedding_adagrad_parameters(params, acc, num_shards=1, shard_id=0, table_name="a")
    with pytest.raises(me.InputError, match="exactly one"):
        me.ops.retrieve_tpu_embedding_adadelta_parameters(1, 0, table_id=0, table_name="a")
    with pytest.raises(me.InputError, match="non-empty"):
        me.ops.retrieve_tpu_embedding_adadelta_parameters(8, 0, table_name="a")


def test_mode_override_spellings_and_state_errors():
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 5, 2, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (2,), name="f")])
    with pytest.raises(me.StateError, match="configure"):
        me.ops.recv_tpu_embedding_activations(1)
    me.ops.configure_tpu_embedding(cfg)
    for mode in ("train", "training", "inference", "backward_pass_only", "unspecified", b"inference"):
        me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch([np.zeros((0, 2))], [np.array([1, 2])], [np.zeros(0)],
                                                            mode_override=mode)
        if mode in ("inference", b"inference"):
            continue
        if mode != "backward_pass_only":
            me.ops.recv_tpu_embedding_activations(1)
        me.ops.send_tpu_embedding_gradients([np.zeros((2, 2), np.float32)])
    with pytest.raises(me.InputError, match="mode_override"):
        me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch([np.zeros((0, 2))], [np.array([1, 2])], [np.zeros(0)],
                                                            mode_override="eval")
    with pytest.raises(me.InputError, match="table_ids"):
        me.ops.enqueue_tpu_embedding_sparse_tensor_batch([np.zeros((0, 2))], [np.array([1, 2])], [np.zeros(0)],
                                                         table_ids=[1])
