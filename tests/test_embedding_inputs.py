"""Host-side normalisation of enqueued ids (dense, SparseIds, RaggedIds) and combiner factors."""

from __future__ import annotations

import types

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import combiners, inputs

INFO = inputs.FeatureInfo("f", "t", 10, (3,))
SEQ = inputs.FeatureInfo("s", "t", 10, (2, 3))


def test_dense_ids_one_per_slot():
    b = inputs.normalize(np.array([[4], [5], [6]]), None, INFO)
    assert b.ids.tolist() == [4, 5, 6] and b.slots.tolist() == [0, 1, 2] and b.num_slots == 3


def test_sparse_combined_and_sequence_truncated():
    sp = me.SparseIds(np.array([[0, 0], [0, 1], [2, 0]]), np.array([1, 2, 3]), [3, 2])
    b = inputs.normalize(sp, np.array([0.5, 1.5, 1.0]), INFO)
    assert b.slots.tolist() == [0, 0, 2] and b.weights.tolist() == [0.5, 1.5, 1.0]
    seq = me.SparseIds(np.array([[0, 0], [0, 3], [1, 2]]), np.array([1, 2, 3]), [2, 5])
    b = inputs.normalize(seq, None, SEQ)
    assert b.ids.tolist() == [1, 3] and b.slots.tolist() == [0, 5]  # position 3 >= M=3 dropped


def test_ragged_combined_and_sequence():
    rg = me.RaggedIds.from_lists([[1, 2], [], [3]])
    assert inputs.normalize(rg, None, INFO).slots.tolist() == [0, 0, 2]
    rg = me.RaggedIds.from_lists([[1, 2, 3, 4], [5]])
    b = inputs.normalize(rg, None, SEQ)
    assert b.ids.tolist() == [1, 2, 3, 5] and b.slots.tolist() == [0, 1, 2, 3]
    assert b.offsets is None  # positions past M dropped: the splits are not the slots' offsets


def test_ragged_rows_give_their_slots_offsets():
    """One slot per ragged row: the row splits are the slots' offsets (a pooled lookup reads
    them instead of scanning the slots); the other forms have none."""
    b = inputs.normalize(me.RaggedIds.from_lists([[1, 2], [], [3]]), None, INFO)
    assert b.offsets.tolist() == [0, 2, 2, 3]
    assert np.array_equal(np.repeat(np.arange(3), np.diff(b.offsets)), b.slots)
    assert inputs.normalize(np.array([4, 5, 6]), None, INFO).offsets is None
    assert inputs.normalize(me.SparseIds(np.array([[0, 0], [2, 0]]), np.array([1, 3]), [3, 1]), None, INFO).offsets is None


def test_duck_typed_tensorflow_like_inputs():
    sp = types.SimpleNamespace(indices=np.array([[1, 0]]), values=np.array([7]), dense_shape=np.array([3, 1]))
    assert inputs.normalize(sp, None, INFO).slots.tolist() == [1]
    rg = types.SimpleNamespace(row_splits=np.array([0, 1, 1, 2]), values=np.array([7, 8]))
    assert inputs.normalize(rg, None, INFO).slots.tolist() == [0, 2]


@pytest.mark.parametrize("bad,match", [
    (np.array([1, 2, 10]), r"\[0, 10\)"),
    (np.array([1, -1, 2]), "id=-1"),
    (np.array([1, 2]), "shape"),
    (me.RaggedIds(np.array([0, 2, 1, 3]), np.array([1, 2, 3])), "non-decreasing"),
    (me.RaggedIds(np.array([0, 1, 2, 4]), np.array([1, 2, 3])), "last split"),
    (me.SparseIds(np.array([[0, 0]]), np.array([1]), [4, 2]), "batch size"),
    (me.SparseIds(np.array([[0, 5]]), np.array([1]), [3, 2]), "outside"),
])
def test_bad_ids_name_the_feature(bad, match):
    with pytest.raises(me.InputError, match=match) as info:
        inputs.normalize(bad, None, INFO)
    assert "feature 'f' (table 't')" in str(info.value)


def test_combiner_scales_and_div_no_nan():
    slots, w = np.array([0, 0, 1, 2, 2]), np.array([1.0, 3.0, 2.0, 0.0, 0.0], np.float32)
    np.testing.assert_allclose(combiners.combiner_scale(slots, w, 3, "mean"), [0.25, 0.75, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(combiners.combiner_scale(slots, w, 3, "sqrtn"),
                               [1 / np.sqrt(10), 3 / np.sqrt(10), 1.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(combiners.combiner_scale(slots, w, 3, "sum"), w)
    with pytest.raises(me.InputError, match="combiner"):
        combiners.combiner_scale(slots, w, 3, "max")


def test_mode_spellings():
    assert inputs.parse_mode("train") == inputs.parse_mode("training") == "training"
    assert inputs.parse_mode("unspecified") is None
    assert inputs.parse_mode(b"backward_pass_only") == "backward_pass_only"


def test_initialisers_are_seeded_and_truncated():
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 500, 16, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (2,), name="f")])
    a = me.TPUEmbedding(cfg, seed=1).retrieve_parameters("t")["parameters"]
    b = me.TPUEmbedding(cfg, seed=1, num_shards=3).retrieve_parameters("t")["parameters"]
    c = me.TPUEmbedding(cfg, seed=2).retrieve_parameters("t")["parameters"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.abs(a).max() <= 2 / 4 + 1e-6 and abs(a.std() - 0.88 / 4) < 0.02
    rows = me.TPUEmbedding(cfg, initializers={"t": me.embedding.RowIdInitializer()}, num_shards=4)
    np.testing.assert_array_equal(rows.retrieve_parameters("t")["parameters"][:, 0], np.arange(500))
    const = me.TPUEmbedding(cfg, initializers={"t": 0.5}).retrieve_parameters("t")["parameters"]
    assert np.all(const == 0.5)


def test_truncated_normal_blocks_are_the_whole_array():
    """Drawn block by block (3 blocks here), the same values as the whole-array call, which is
    also what the engine stores for the table."""
    from meshembed.embedding.initializers import TruncatedNormal, table_rng

    shape = (40000, 64)
    whole = TruncatedNormal()(shape, table_rng(7, 0))
    blocks = list(TruncatedNormal().blocks(shape, table_rng(7, 0)))
    assert len(blocks) == 3 and all(b.dtype == np.float32 for b in blocks)
    np.testing.assert_array_equal(np.concatenate(blocks), whole)
    assert np.abs(whole).max() <= 2 / 8 + 1e-7 and abs(whole.std() - 0.88 / 8) < 0.002
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", shape[0], shape[1], optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (2,), name="f")])
    stored = me.TPUEmbedding(cfg, seed=7, num_shards=3).retrieve_parameters("t")["parameters"]
    np.testing.assert_array_equal(stored, whole)


def test_creating_tables_holds_no_second_copy():
    """Tables and slots are made block by block: with the NumPy backend (whose arrays
    tracemalloc sees) the peak while creating a 64 MiB table and its two slots stays near
    the 192 MiB they hold, instead of table + host values (2x, as before)."""
    import tracemalloc

    rows, dim = 262144, 64
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", rows, dim, optimizer=me.embedding.Adadelta(learning_rate=1.0))],
        features=[me.FeatureConfig("t", (2,), name="f")])
    state = 3 * rows * dim * 4
    tracemalloc.start()
    try:
        emb = me.TPUEmbedding(cfg, backend="numpy")
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert emb.table_slot_names("t") == ("accumulators", "updates")
    assert current >= state
    assert peak < state + (24 << 20), (peak / 2**20, state / 2**20)


def test_public_names():
    for name in ("TPUEmbedding", "SparseIds", "RaggedIds", "Adadelta", "Adagrad", "SGD", "FTRL", "Adam",
                 "DynamicLearningRate", "QuantizationConfig", "CustomOptimizer", "FrequencyEstimator"):
        assert hasattr(me.embedding, name), name
    assert me.TPUEmbedding is me.embedding.TPUEmbedding


def test_normalized_batches_never_alias_the_callers_buffers():
    """What was validated is what the engine uses: every array of a FeatureBatch is private."""
    dense = np.array([4, 5, 6], np.int64)
    values, w = np.array([1, 2, 3], np.int64), np.array([0.5, 1.5, 1.0], np.float32)
    splits, idx = np.array([0, 2, 2, 3], np.int64), np.array([[0, 0], [0, 1], [2, 0]], np.int64)
    batches = [(inputs.normalize(dense, None, INFO), [dense]),
               (inputs.normalize(me.RaggedIds(splits, values), me.RaggedIds(splits, w), INFO), [splits, values, w]),
               (inputs.normalize(me.SparseIds(idx, values, [3, 2]), w, INFO), [idx, values, w])]
    for b, given in batches:
        for held in (b.ids, b.slots, b.weights, b.offsets):
            assert held is None or not any(np.shares_memory(held, g) for g in given)


@pytest.mark.parametrize("bad", [np.array(["1", "2", "3"]), np.array([1 + 0j, 2, 3]), np.array([None, 1, 2])])
def test_weights_of_the_wrong_kind_are_refused(bad):
    with pytest.raises(me.InputError, match="expected a float array") as info:
        inputs.normalize(me.RaggedIds(np.array([0, 1, 2, 3]), np.array([1, 2, 3])), bad, INFO)
    assert "feature 'f' (table 't')" in str(info.value)
