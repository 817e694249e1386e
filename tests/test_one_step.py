"""The embedding step as functions (``embedding/batch.py``, ``embedding/step.py``) and the
engine as TF's state machine over them: the same bits either way, immutable batches, one
apply per pending batch across threads and re-entry."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import batch as batches
from meshembed.embedding import step as steps

B = 6


def config(lr=0.1, dynamic=False):
    rate = me.embedding.DynamicLearningRate(0) if dynamic else lr
    return me.EmbeddingConfig(
        tables=[me.TableConfig("t", 20, 4, optimizer=me.embedding.Adagrad(learning_rate=rate), combiner="mean")],
        features=[me.FeatureConfig("t", (B,), name="a"), me.FeatureConfig("t", (B, 3), name="b")])


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 20, B), me.RaggedIds.from_lists([list(rng.integers(0, 20, k)) for k in (0, 1, 2, 3, 1, 2)])]


def grads_of(acts, scale=1.0):
    return [np.asarray(a) * scale - 0.25 for a in acts]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_step_functions_give_the_engines_bits(backend):
    pytest.importorskip(backend)
    emb = me.TPUEmbedding(config(), backend=backend, seed=3)
    ref = me.TPUEmbedding(config(), backend=backend, seed=3)
    state = emb.state
    for k in range(3):
        b = batches.prepare(emb.layout, inputs(k))
        acts = steps.lookup(emb.backend, state, b)
        state = steps.apply_gradients(emb.backend, state, b, grads_of(acts), rules=emb.rules)
        ref.enqueue(inputs(k))
        ref_acts = ref.dequeue()
        for x, y in zip(acts, ref_acts):
            np.testing.assert_array_equal(emb.backend.to_numpy(x), ref.backend.to_numpy(y))
        ref.apply_gradients(grads_of(ref_acts))
    assert state.step == ref.step == 3
    emb.state = state
    for name, arr in ref.retrieve_parameters("t").items():
        np.testing.assert_array_equal(emb.retrieve_parameters("t")[name], arr, err_msg=name)


def test_a_batch_is_an_immutable_value():
    layout = me.TPUEmbedding(config()).layout
    ids = np.arange(B)
    b = batches.prepare(layout, [ids, inputs()[1]])
    ids[:] = 0  # the caller's buffer: the batch kept its own copy
    assert b.features[0].ids.tolist() == list(range(B))
    with pytest.raises(ValueError):
        b.features[0].ids[0] = 5
    with pytest.raises(AttributeError):
        b.mode = "inference"


def test_a_batch_of_another_config_is_refused_and_nothing_changes():
    emb = me.TPUEmbedding(config())
    other = me.EmbeddingConfig(tables=[me.TableConfig("t", 200, 4, optimizer=me.embedding.SGD(0.1))],
                               features=[me.FeatureConfig("t", (B,), name="a"), me.FeatureConfig("t", (B, 3), name="b")])
    foreign = batches.prepare(me.TPUEmbedding(other).layout, [np.full(B, 150), inputs()[1]])
    before = emb.embedding_tables["t"].copy()
    with pytest.raises(me.InputError, match="another config"):
        steps.apply_gradients(emb.backend, emb.state, foreign, [np.zeros((B, 4)), np.zeros((B, 3, 4))])
    with pytest.raises(me.InputError, match="this engine's config"):
        emb.enqueue_batch(foreign)
    np.testing.assert_array_equal(emb.embedding_tables["t"], before)
    assert emb.pending is None


def test_two_threads_never_apply_one_pending_batch_twice():
    emb = me.TPUEmbedding(config())
    ref = me.TPUEmbedding(config())
    for e in (emb, ref):
        e.enqueue(inputs())
        g = grads_of(e.dequeue())
    ref.apply_gradients(g)
    outcomes, start = [], threading.Barrier(4)

    def apply():
        start.wait()
        try:
            emb.apply_gradients(g)
            outcomes.append("applied")
        except me.StateError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=apply) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("applied") == 1 and all("no batch is pending" in o for o in outcomes if o != "applied")
    assert emb.step == 1
    np.testing.assert_array_equal(emb.embedding_tables["t"], ref.embedding_tables["t"])


def test_a_learning_rate_callable_that_reenters_apply_gradients_cannot_apply_twice():
    holder = {}

    def lr():
        if "emb" in holder:  # re-entry: the batch is still pending while its rates are read
            holder["emb"].apply_gradients(holder["g"])
        return 0.1

    cfg = config(dynamic=True)
    object.__setattr__(cfg, "learning_rate_fns", (lr,))
    emb = me.TPUEmbedding(cfg)
    emb.enqueue(inputs())
    holder.update(emb=emb, g=grads_of(emb.dequeue()))
    before = emb.embedding_tables["t"].copy()
    with pytest.raises(me.StateError, match="applied twice"):
        emb.apply_gradients(holder["g"])
    np.testing.assert_array_equal(emb.embedding_tables["t"], before)
    assert emb.step == 0 and emb.pending is not None
    holder.clear()
    emb.apply_gradients(grads_of(emb.dequeue()))  # still usable
    assert emb.step == 1


@pytest.mark.parametrize("lrs", [{0: 0.1}, [0.1], np.array([0.1])])
def test_learning_rates_by_tag_in_every_form(lrs):
    emb = me.TPUEmbedding(config(dynamic=True))
    assert steps.check_learning_rates(emb.layout, lrs) == [0.1]


@pytest.mark.parametrize("lrs, match", [({1: 0.1}, "exactly the dynamic tags"), ({"0": 0.1}, "exactly"),
                                        ([float("nan")], "finite"), ([1e39], "finite"), (["x"], "real number"),
                                        ({2**31 - 1: 0.1}, "exactly")])
def test_bad_learning_rates_are_refused_before_anything(lrs, match):
    emb = me.TPUEmbedding(config(dynamic=True))
    with pytest.raises(me.InputError, match=match):
        steps.check_learning_rates(emb.layout, lrs)


@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, "U3"])
def test_gradients_that_are_not_real_are_refused(dtype):
    emb = me.TPUEmbedding(config())
    emb.enqueue(inputs())
    acts = emb.dequeue()
    bad = [np.zeros(a.shape, dtype) for a in acts]
    with pytest.raises(me.InputError, match="real"):
        emb.apply_gradients(bad)
    assert emb.step == 0 and emb.pending is not None


def test_mode_override_bytes_that_are_not_text_are_an_input_error():
    emb = me.TPUEmbedding(config())
    with pytest.raises(me.InputError, match="mode_override"):
        emb.enqueue(inputs(), mode_override=b"\xff\xfe")
    assert emb.pending is None


def test_restore_takes_allow_nonfinite(tmp_path):
    emb = me.TPUEmbedding(config(), allow_nonfinite=True)
    table = emb.embedding_tables["t"]
    table[0, 0] = np.nan
    emb.load_parameters("t", table)
    emb.save(tmp_path / "ck")
    back = me.TPUEmbedding.restore(tmp_path / "ck", allow_nonfinite=True)
    assert np.isnan(back.embedding_tables["t"][0, 0]) and back.allow_nonfinite
    with pytest.raises(me.MeshembedError):
        me.TPUEmbedding.restore(tmp_path / "ck")
