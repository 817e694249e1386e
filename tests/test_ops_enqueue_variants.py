"""``me.ops`` enqueue variants (spec §3.3) against the equivalent ``TPUEmbedding.enqueue``.

Each variant is fed the same lookups as an engine built from the same config and seed; the
activations must be identical, and so must the tables after one Send / apply_gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me

E = me.embedding
B, M = 3, 2
ROWS_A = [[1, 1, 4], [0], [2, 11, 5, 7]]
W_A = [0.5, 2.0, 1.0, 1.5, 0.25, 1.0, 3.0, 0.5]
ROWS_SEQ = [[3, 4, 6], [], [8]]  # truncated to M = 2 positions
DENSE_B = [6, 0, 6]


@pytest.fixture(autouse=True)
def _fresh():
    yield
    me.ops.shutdown_tpu_embedding()


def _config():
    tables = [me.TableConfig("a", 12, 3, optimizer=E.Adagrad(0.2), combiner="mean"),
              me.TableConfig("b", 7, 2, optimizer=E.SGD(0.5), combiner="sqrtn")]
    features = [me.FeatureConfig("a", (B,), name="fa"), me.FeatureConfig("a", (B, M), name="fseq"),
                me.FeatureConfig("b", (B,), name="fb")]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy="mod")


COMBINERS = ["mean", "sqrtn"]


def _ragged(rows, dtype):
    splits = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(dtype)
    return splits, np.asarray([i for r in rows for i in r], dtype)


def _coo(rows, dtype):
    return np.asarray([[b, p] for b, r in enumerate(rows) for p in range(len(r))], dtype).reshape(-1, 2)


def _engine_inputs():
    fa = me.RaggedIds.from_lists(ROWS_A)
    return ([fa, me.RaggedIds.from_lists(ROWS_SEQ), np.asarray(DENSE_B)],
            [me.RaggedIds(fa.row_splits, np.asarray(W_A, np.float32)), None, None])


def _grads(shapes):
    rng = np.random.default_rng(5)
    return [rng.normal(size=s).astype(np.float32) for s in shapes]


def _compare(enqueue_op, engine_enqueue, cfg=None, learning_rates=()):
    """Run the op path and the engine path; activations and updated tables must match exactly."""
    cfg = cfg or _config()
    ops_engine = me.ops.configure_tpu_embedding(cfg, backend="numpy", num_shards=2, seed=4)
    direct = me.TPUEmbedding(cfg, backend="numpy", num_shards=2, seed=4)
    enqueue_op()
    acts = me.ops.recv_tpu_embedding_activations(len(direct.layout.features))
    engine_enqueue(direct)
    want = direct.dequeue()
    assert len(acts) == len(want)
    for got, exp in zip(acts, want):
        np.testing.assert_array_equal(got, exp)
        assert got.dtype == np.float32
    grads = _grads([a.shape for a in want])
    me.ops.send_tpu_embedding_gradients(grads, learning_rates)
    direct.apply_gradients(grads, learning_rates)
    for t in direct.table_names:
        for k, v in direct.retrieve_parameters(t).items():
            np.testing.assert_array_equal(ops_engine.retrieve_parameters(t)[k], v, err_msg=f"{t}/{k}")
    return acts


def _engine_default(direct):
    feats, weights = _engine_inputs()
    direct.enqueue(feats, weights)


ID_TYPES = [np.int32, np.int64]
W_TYPES = [np.float32, np.float64]


@pytest.mark.parametrize("wtype", W_TYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("itype", ID_TYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_ordinal"])
def test_arbitrary_tensor_batch_sparse_ragged_dense(itype, wtype, dynamic):
    """Rank-2 indices (fa), rank-1 row splits (fseq), empty = one id per sample (fb)."""
    splits, seq_ids = _ragged(ROWS_SEQ, itype)
    indices = [_coo(ROWS_A, itype), splits, np.zeros((0,), itype)]
    ids = [np.asarray([i for r in ROWS_A for i in r], itype), seq_ids, np.asarray(DENSE_B, itype)]
    weights = [np.asarray(W_A, wtype), np.zeros(0, wtype), np.zeros(0, wtype)]

    def op():
        if dynamic:
            me.ops.dynamic_enqueue_tpu_embedding_arbitrary_tensor_batch(
                indices, ids, weights, mode_override="train", device_ordinal=np.int32(0), combiners=COMBINERS)
        else:
            me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch(indices, ids, weights, combiners=COMBINERS,
                                                                mode_override="train")

    acts = _compare(op, _engine_default)
    assert [a.shape for a in acts] == [(B, 3), (B, M, 3), (B, 2)]


@pytest.mark.parametrize("wtype", W_TYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("itype", ID_TYPES, ids=["i32", "i64"])
def test_sparse_tensor_batch(itype, wtype):
    """Per feature with table_ids, max_sequence_lengths and num_features; rank-2 indices for
    the combined and the sequence feature, the rank-1 sample column for fb."""
    indices = [_coo(ROWS_A, itype), _coo(ROWS_SEQ, itype), np.arange(B, dtype=itype)]
    ids = [np.asarray([i for r in ROWS_A for i in r], itype), np.asarray([i for r in ROWS_SEQ for i in r], itype),
           np.asarray(DENSE_B, itype)]
    weights = [np.asarray(W_A, wtype), np.ones(4, wtype), np.zeros(0, wtype)]

    def op():
        me.ops.enqueue_tpu_embedding_sparse_tensor_batch(
            indices, ids, weights, table_ids=[0, 0, 1], combiners=COMBINERS, mode_override="training",
            max_sequence_lengths=[0, M, 0], num_features=[1, 1, 1])

    _compare(op, _engine_default)


@pytest.mark.parametrize("itype", ID_TYPES, ids=["i32", "i64"])
def test_ragged_tensor_batch(itype):
    ids_a = np.asarray([i for r in ROWS_A for i in r], itype)
    splits = [_ragged(ROWS_A, itype)[0], _ragged(ROWS_SEQ, itype)[0], np.arange(B + 1, dtype=itype)]
    ids = [ids_a, _ragged(ROWS_SEQ, itype)[1], np.asarray(DENSE_B, itype)]
    weights = [np.asarray(W_A, np.float64), np.zeros(0), np.zeros(0)]

    def op():
        me.ops.enqueue_tpu_embedding_ragged_tensor_batch(splits, ids, weights, table_ids=[0, 0, 1],
                                                         combiners=COMBINERS, max_sequence_lengths=[0, M, 0])

    _compare(op, _engine_default)


def test_table_ids_and_sequence_lengths_are_checked():
    me.ops.configure_tpu_embedding(_config(), backend="numpy")
    splits = [np.array([0, 1, 2, 3])] * 3
    ids = [np.array([1, 2, 3])] * 3
    with pytest.raises(me.InputError, match="max_sequence_lengths"):
        me.ops.enqueue_tpu_embedding_ragged_tensor_batch(splits, ids, [], table_ids=[0, 0, 1],
                                                         max_sequence_lengths=[0, 5, 0])
    with pytest.raises(me.InputError, match="table_ids"):
        me.ops.enqueue_tpu_embedding_ragged_tensor_batch(splits, ids, [], table_ids=[0, 1, 1])


# -- legacy, per-table layout ------------------------------------------------------------
def _legacy_config():
    """No feature descriptors: table u has 2 features per sample, v one (spec §1.5)."""
    tables = [me.TableConfig("u", 10, 2, optimizer=E.Adagrad(0.1), combiner="mean", num_features=2),
              me.TableConfig("v", 6, 3, optimizer=E.SGD(0.1), combiner="sum", num_features=1)]
    return me.EmbeddingConfig(tables=tables, batch_size_per_tensor_core=B)


@pytest.mark.parametrize("itype", ID_TYPES, ids=["i32", "i64"])
def test_integer_batch(itype):
    u_ids, v_ids = np.asarray([1, 2, 3, 3, 9, 0], itype), np.asarray([5, 4, 5], itype)

    def op():
        me.ops.enqueue_tpu_embedding_integer_batch([u_ids, v_ids], mode_override="train")

    acts = _compare(op, lambda e: e.enqueue([u_ids, v_ids]), _legacy_config())
    assert [a.shape for a in acts] == [(B * 2, 2), (B, 3)]


@pytest.mark.parametrize("wtype", W_TYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("itype", ID_TYPES, ids=["i32", "i64"])
def test_sparse_batch_legacy_sample_indices(itype, wtype):
    """``sample_indices = b·nf + f``: several ids per (sample, feature) row, combined."""
    # table u: (b, f) rows -> ids
    u_rows = {(0, 0): [1, 1], (0, 1): [2], (1, 0): [3, 9, 4], (1, 1): [], (2, 0): [0], (2, 1): [7, 8]}
    u_slot = np.asarray([b * 2 + f for (b, f), r in u_rows.items() for _ in r], itype)
    u_ids = np.asarray([i for r in u_rows.values() for i in r], itype)
    u_w = np.linspace(0.5, 2.0, len(u_ids)).astype(wtype)
    v_rows = [[5, 4], [1], [5]]
    v_slot = np.asarray([b for b, r in enumerate(v_rows) for _ in r], itype)
    v_ids = np.asarray([i for r in v_rows for i in r], itype)

    def op():
        me.ops.enqueue_tpu_embedding_sparse_batch([u_slot, v_slot], [u_ids, v_ids], [u_w, np.zeros(0, wtype)],
                                                  combiners=["mean", "sum"], mode_override="training")

    def engine(e):
        order = np.argsort(u_slot, kind="stable")  # RaggedIds need ids grouped by row
        counts = np.bincount(u_slot, minlength=B * 2)
        u = me.RaggedIds(np.concatenate([[0], np.cumsum(counts)]), u_ids[order].astype(np.int64))
        uw = me.RaggedIds(u.row_splits, u_w[order].astype(np.float32))
        e.enqueue([u, me.RaggedIds.from_lists(v_rows)], [uw, None])

    _compare(op, engine, _legacy_config())


# -- mode_override --------------------------------------------------------------------------
def _arbitrary(mode):
    splits, seq_ids = _ragged(ROWS_SEQ, np.int64)
    me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch(
        [_coo(ROWS_A, np.int64), splits, np.zeros(0)],
        [np.asarray([i for r in ROWS_A for i in r]), seq_ids, np.asarray(DENSE_B)],
        [np.asarray(W_A, np.float32), np.zeros(0), np.zeros(0)], combiners=COMBINERS, mode_override=mode)


@pytest.mark.parametrize("mode", ["train", "training", "unspecified", b"train", "TRAINING"])
def test_mode_override_training_spellings(mode):
    _compare(lambda: _arbitrary(mode), lambda e: _engine_default(e))


def test_mode_override_inference_and_backward_pass_only():
    engine = me.ops.configure_tpu_embedding(_config(), backend="numpy", seed=4)
    direct = me.TPUEmbedding(_config(), backend="numpy", seed=4)
    before = {t: engine.retrieve_parameters(t)["parameters"] for t in engine.table_names}
    _arbitrary("inference")
    acts = me.ops.recv_tpu_embedding_activations(3)
    feats, weights = _engine_inputs()
    direct.enqueue(feats, weights, mode_override="inference")
    for got, exp in zip(acts, direct.dequeue()):
        np.testing.assert_array_equal(got, exp)
    with pytest.raises(me.StateError, match="inference"):
        me.ops.send_tpu_embedding_gradients(_grads([a.shape for a in acts]))
    for t in before:
        np.testing.assert_array_equal(engine.retrieve_parameters(t)["parameters"], before[t])
    # backward_pass_only: no Recv, Send applies the gradients exactly like a training step
    _arbitrary("backward_pass_only")
    with pytest.raises(me.StateError, match="backward_pass_only"):
        me.ops.recv_tpu_embedding_activations(3)
    grads = _grads([a.shape for a in acts])
    me.ops.send_tpu_embedding_gradients(grads)
    feats, weights = _engine_inputs()
    direct.enqueue(feats, weights, mode_override="training")
    direct.dequeue()
    direct.apply_gradients(grads)
    for t in direct.table_names:
        np.testing.assert_array_equal(engine.retrieve_parameters(t)["parameters"],
                                      direct.retrieve_parameters(t)["parameters"])
