"""``me.tpu``: TF2's ``tf.tpu.experimental.embedding`` programs run with only the import changed.

Numbers are compared with ``me.TPUEmbedding`` on the equivalent ``me.EmbeddingConfig`` (same
seed, so the same initial tables), and, where TensorFlow is installed, with TensorFlow's own
CPU lookup (``TPUEmbeddingForServing``) and a TF sparse optimizer update.
"""

from __future__ import annotations

import collections
import inspect

import numpy as np
import pytest

import meshembed as me

TF_REASON = "tensorflow-cpu (extra [tf-interop]) is needed to compare with TensorFlow"
B = 4


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow", reason=TF_REASON)


def _flat(acts, names):
    """The engine's activations by feature name (a list in config order, or a dict)."""
    return dict(acts) if isinstance(acts, dict) else dict(zip(names, acts))


def _doc_example(optimizer):
    """TensorFlow's TPUEmbedding docstring example: two tables, three features, the first two
    sharing table one (with ``tf.tpu.experimental.embedding`` replaced by ``me.tpu``)."""
    table_config_one = me.tpu.TableConfig(vocabulary_size=13, dim=4)
    table_config_two = me.tpu.TableConfig(vocabulary_size=7, dim=3)
    feature_config = {
        "feature_one": me.tpu.FeatureConfig(table=table_config_one),
        "feature_two": me.tpu.FeatureConfig(table=table_config_one),
        "feature_three": me.tpu.FeatureConfig(table=table_config_two)}
    embedding = me.tpu.TPUEmbedding(feature_config=feature_config, optimizer=optimizer)
    return embedding, feature_config, (table_config_one, table_config_two)


def _reference(optimizer, shapes=None):
    """The same setup written for ``me.TPUEmbedding`` directly."""
    one = me.TableConfig("table_0", 13, 4)
    two = me.TableConfig("table_1", 7, 3)
    shapes = shapes or {}
    feats = {n: me.FeatureConfig(table=t, input_shape=shapes.get(n, (B,)))
             for n, t in (("feature_one", one), ("feature_two", one), ("feature_three", two))}
    return me.TPUEmbedding(me.EmbeddingConfig(features=feats, optimizer=optimizer))


def _batches(steps=3, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 4, size=B)
        out.append({
            "feature_one": rng.integers(0, 13, size=B),
            "feature_two": me.RaggedIds.from_lists([list(rng.integers(0, 13, size=n)) for n in lengths]),
            "feature_three": me.SparseIds(np.array([[0, 0], [0, 1], [2, 0], [3, 2]]),
                                          rng.integers(0, 7, size=4), np.array([B, 3]))})
    return out


def _loss_grads(acts, seed):
    """d(sum(act * w))/d act = w: a fixed 'model' so both runs get the same gradients."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(np.shape(v)).astype(np.float32) for k, v in sorted(acts.items())}


@pytest.mark.parametrize("optimizer", [me.tpu.SGD(0.1), me.tpu.Adagrad(0.5), me.tpu.Adam(0.05)],
                         ids=["SGD", "Adagrad", "Adam"])
def test_tf_doc_example_trains_like_the_engine(optimizer):
    embedding, _, (t1, t2) = _doc_example(optimizer)
    ref = _reference(optimizer)
    for step, embedding_features in enumerate(_batches()):
        embedding.enqueue(embedding_features, training=True)
        activations = embedding.dequeue()
        assert isinstance(activations, dict) and list(activations) == ["feature_one", "feature_two", "feature_three"]
        embedding_gradients = _loss_grads(activations, step)
        embedding.apply_gradients(embedding_gradients)

        ref.enqueue(embedding_features)
        expected = _flat(ref.dequeue(), ref.feature_names)
        for name, act in activations.items():
            np.testing.assert_array_equal(act, expected[name])
        ref.apply_gradients(embedding_gradients)
    tables = embedding.embedding_tables
    assert set(tables) == {t1, t2}
    np.testing.assert_array_equal(tables[t1], ref.embedding_tables["table_0"])
    np.testing.assert_array_equal(tables[t2], ref.embedding_tables["table_1"])
    assert not np.array_equal(tables[t1], _reference(optimizer).embedding_tables["table_0"])  # it trained


def test_tf_doc_example_with_gradient_tape(tf):
    """The docstring's training step as written (eagerly; the strategy lines dropped): TF
    inputs give tf.Tensor activations, the tape's gradients go straight back."""
    embedding, _, (t1, t2) = _doc_example(me.tpu.SGD(0.1))
    ref = _reference(me.tpu.SGD(0.1))
    weights = {"feature_one": tf.constant(np.linspace(-1, 1, 4), tf.float32),
               "feature_two": tf.constant(np.linspace(1, 2, 4), tf.float32),
               "feature_three": tf.constant(np.linspace(0, 1, 3), tf.float32)}
    for step, batch in enumerate(_batches()):
        embedding_features = {
            "feature_one": tf.constant(batch["feature_one"]),
            "feature_two": tf.RaggedTensor.from_row_splits(batch["feature_two"].values,
                                                           batch["feature_two"].row_splits),
            "feature_three": tf.SparseTensor(batch["feature_three"].indices, batch["feature_three"].values,
                                             batch["feature_three"].dense_shape)}
        embedding.enqueue(embedding_features, training=True)
        with tf.GradientTape() as tape:
            activations = embedding.dequeue()
            tape.watch(activations)
            loss = tf.add_n([tf.reduce_sum(a * weights[k]) for k, a in activations.items()])
        embedding_gradients = tape.gradient(loss, activations)
        embedding.apply_gradients(embedding_gradients)

        ref.enqueue(batch)
        expected = _flat(ref.dequeue(), ref.feature_names)
        for name, act in activations.items():
            assert isinstance(act, tf.Tensor)
            np.testing.assert_array_equal(act.numpy(), expected[name])
        ref.apply_gradients({k: np.broadcast_to(weights[k].numpy(), expected[k].shape) for k in expected})
    np.testing.assert_array_equal(embedding.embedding_tables[t1], ref.embedding_tables["table_0"])
    np.testing.assert_array_equal(embedding.embedding_tables[t2], ref.embedding_tables["table_1"])


Pair = collections.namedtuple("Pair", ["query", "doc"])


def _nested_configs():
    user = me.tpu.TableConfig(vocabulary_size=11, dim=2, name="user")
    item = me.tpu.TableConfig(vocabulary_size=9, dim=3, name="item")
    f = me.tpu.FeatureConfig
    return {
        "dict_of_dicts": ({"towers": {"user": f(user), "item": f(item)}, "extra": f(user)},
                          {"towers": {"user": 1, "item": 2}, "extra": 3}),
        "tuple": ((f(user), f(item), f(item)), (1, 2, 3)),
        "list_in_dict": ({"a": [f(user), f(item)], "b": f(item)}, {"a": [1, 2], "b": 3}),
        "namedtuple": (Pair(f(user), {"x": f(item)}), Pair(1, {"x": 2})),
        "single": (f(item), 2),
    }


@pytest.mark.parametrize("case", list(_nested_configs()))
def test_nests_come_back_as_given(case):
    config, seeds = _nested_configs()[case]
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD(0.1))
    leaf = lambda s: np.random.default_rng(s).integers(0, 9, size=B)  # noqa: E731
    features = _map(seeds, leaf)
    emb.enqueue(features)
    acts = emb.dequeue()
    assert _structure(acts) == _structure(features)
    # every activation is its own feature's rows: compare with each leaf's table lookup
    tables = {t.name: v for t, v in emb.embedding_tables.items()}
    for (cfg_leaf, ids), act in zip(_leaves(config, features), _leaves(acts)):
        np.testing.assert_array_equal(act, tables[cfg_leaf.table.name][ids])
    emb.apply_gradients(_map(acts, np.ones_like))


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map(v, fn) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return fn(tree)


def _structure(tree):
    if isinstance(tree, dict):
        return ("dict", tuple((k, _structure(tree[k])) for k in tree))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(_structure(v) for v in tree))
    return "leaf"


def _leaves(tree, other=None):
    """Leaves in sorted-key order, paired with ``other``'s when given."""
    if isinstance(tree, me.tpu.FeatureConfig) or not isinstance(tree, (dict, list, tuple)):
        return [tree] if other is None else [(tree, other)]
    keys = sorted(tree) if isinstance(tree, dict) else range(len(tree))
    out = []
    for k in keys:
        out += _leaves(tree[k], None if other is None else other[k])
    return out


def test_structure_mismatches_name_the_path():
    config, _ = _nested_configs()["dict_of_dicts"]
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD(0.1))
    ids = np.arange(B)
    with pytest.raises(me.InputError, match=r"Expected keys \['item', 'user'\].*unknown: \['usr'\]") as err:
        emb.enqueue({"towers": {"usr": ids, "item": ids}, "extra": ids})
    assert "`features` at path 'towers'" in str(err.value) and "at path 'towers/user'" in str(err.value)
    with pytest.raises(me.InputError, match=r"`features`: expected a dict .* Received: a list"):
        emb.enqueue([ids, ids, ids])  # a list for a dict config: never paired by position
    with pytest.raises(me.InputError, match=r"`features` at path 'towers': expected a dict"):
        emb.enqueue({"towers": [ids, ids], "extra": ids})
    assert not emb.built  # rejected before anything was created
    emb.enqueue({"towers": {"user": ids, "item": ids}, "extra": ids})
    acts = emb.dequeue()
    with pytest.raises(me.InputError, match=r"`gradients` at path 'towers'"):
        emb.apply_gradients({"towers": (acts["towers"]["item"], acts["towers"]["user"]), "extra": acts["extra"]})
    tconfig, _ = _nested_configs()["tuple"]
    temb = me.tpu.TPUEmbedding(tconfig, me.tpu.SGD(0.1))
    with pytest.raises(me.InputError, match=r"expected 3 entries"):
        temb.enqueue((ids, ids))
    with pytest.raises(me.InputError, match=r"expected a tuple of 3 entries .* Received: a dict"):
        temb.enqueue({"0": ids, "1": ids, "2": ids})


def test_failed_calls_change_nothing():
    embedding, _, (t1, _) = _doc_example(me.tpu.Adagrad(0.5))
    ref = _reference(me.tpu.Adagrad(0.5))
    good = _batches(1)[0]
    embedding.enqueue(good)
    acts = embedding.dequeue()
    grads = _loss_grads(acts, 0)
    bad = dict(grads, feature_two=np.ones((B + 1, 4), np.float32))
    with pytest.raises(me.InputError, match="feature_two"):
        embedding.apply_gradients(bad)
    embedding.apply_gradients(grads)
    with pytest.raises(me.InputError, match="Inconsistent shape for input feature 'feature_one'"):
        embedding.enqueue(dict(good, feature_one=np.arange(B + 2)))
    with pytest.raises(me.InputError, match=r"feature_three"):
        embedding.enqueue(dict(good, feature_three=me.SparseIds(np.array([[0, 0]]), np.array([99]),
                                                                  np.array([B, 3]))))
    ref.enqueue(good)
    ref.dequeue()
    ref.apply_gradients(grads)
    np.testing.assert_array_equal(embedding.embedding_tables[t1], ref.embedding_tables["table_0"])
    # and the object still trains
    embedding.enqueue(good)
    embedding.dequeue()


def test_config_errors_name_the_culprit():
    t = me.tpu.TableConfig(vocabulary_size=5, dim=2, name="same")
    u = me.tpu.TableConfig(vocabulary_size=6, dim=2, name="same")
    with pytest.raises(me.ConfigError, match="unique name"):
        me.tpu.TPUEmbedding({"a": me.tpu.FeatureConfig(t), "b": me.tpu.FeatureConfig(u)}, me.tpu.SGD(0.1))
    with pytest.raises(me.ConfigError, match=r"path 'a/1'"):
        me.tpu.TPUEmbedding({"a": [me.tpu.FeatureConfig(t), "oops"]}, me.tpu.SGD(0.1))
    serving = me.tpu.TPUEmbedding(me.tpu.FeatureConfig(t))  # no optimizer: built for lookups only (#35)
    with pytest.raises(me.ConfigError, match=r"table 'same' has no optimizer.*TPUEmbedding\(optimizer=...\)"):
        serving.enqueue(np.arange(2))
    with pytest.raises(me.ConfigError, match="vocabulary_size"):
        me.tpu.TableConfig(vocabulary_size=0, dim=2)
    with pytest.raises(me.ConfigError, match="combiner"):
        me.tpu.TableConfig(vocabulary_size=3, dim=2, combiner="max")
    with pytest.raises(me.ConfigError, match="max_sequence_length"):
        me.tpu.FeatureConfig(t, max_sequence_length=-1)
    with pytest.raises(me.ConfigError, match="table"):
        me.tpu.FeatureConfig("same")
    with pytest.raises(me.ConfigError, match="slot_variable_creation_fn"):
        me.tpu.Adagrad(0.1, slot_variable_creation_fn=lambda *a: {})
    with pytest.raises(me.ConfigError, match="`momentum`.*Adagrad"):
        me.tpu.Adagrad(0.1, momentum=0.9)
    with pytest.raises(me.ConfigError, match="learning_rate"):
        me.tpu.SGD(0.1, learning_rate=0.2)
    emb = me.tpu.TPUEmbedding(me.tpu.FeatureConfig(t), me.tpu.SGD(0.1))
    with pytest.raises(me.ConfigError, match="no output shape yet"):
        emb.embedding_tables  # noqa: B018 - shapes unknown: TF's build raises the same
    with pytest.raises(me.StateError, match="unbuilt"):
        emb.dequeue()


def test_optimizer_classes_take_tf_positional_order():
    a = me.tpu.Adagrad(0.2, 0.3, False)
    assert (a.learning_rate, a.initial_accumulator_value, a.use_gradient_accumulation) == (0.2, 0.3, False)
    f = me.tpu.FTRL(0.1, -0.25, 0.01, 0.02, 0.5, 0.2)
    assert (f.learning_rate_power, f.l1_regularization_strength, f.l2_regularization_strength, f.beta,
            f.initial_accumulator_value) == (-0.25, 0.01, 0.02, 0.5, 0.2)
    s = me.tpu.SGD(0.5, True, -1.0, 1.0)
    assert (s.clip_weight_min, s.clip_weight_max) == (-1.0, 1.0)
    assert isinstance(a, me.embedding.Adagrad) and me.tpu.Adadelta().rho == me.embedding.Adadelta().rho
    assert a.replace(learning_rate=0.4).learning_rate == pytest.approx(0.4)  # the spec interface still works


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "AdagradMomentum", "FTRL", "Adam"])
def test_optimizer_signatures_match_tensorflow(tf, name):
    ours = inspect.signature(getattr(me.tpu, name)).parameters
    theirs = inspect.signature(getattr(tf.tpu.experimental.embedding, name)).parameters
    positional = [p for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == list(theirs)
    for p in positional:
        assert p.default == theirs[p.name].default, p.name
    for cls in ("TableConfig", "FeatureConfig"):  # TF's arguments in TF's order; meshembed's extensions
        ours = [n for n, p in inspect.signature(getattr(me.tpu, cls)).parameters.items()  # (precision=,
                if p.kind is not p.KEYWORD_ONLY]  # dynamic=) are keyword-only, after them
        assert ours == list(inspect.signature(getattr(tf.tpu.experimental.embedding, cls)).parameters)


def test_sequence_features_and_per_table_optimizer():
    shared = me.tpu.TableConfig(vocabulary_size=10, dim=2, name="shared", optimizer=me.tpu.Adagrad(0.5))
    other = me.tpu.TableConfig(vocabulary_size=8, dim=3, name="other")
    config = {"hist": me.tpu.FeatureConfig(shared, max_sequence_length=3),
              "now": me.tpu.FeatureConfig(shared),
              "seq": me.tpu.FeatureConfig(other, max_sequence_length=2)}
    emb = me.tpu.TPUEmbedding(config, optimizer=me.tpu.SGD(0.1))
    ref_tables = [me.TableConfig("shared", 10, 2, optimizer=me.embedding.Adagrad(0.5)),
                  me.TableConfig("other", 8, 3)]
    ref = me.TPUEmbedding(me.EmbeddingConfig(
        tables=ref_tables, optimizer=me.embedding.SGD(0.1),
        features=[me.FeatureConfig("shared", (B, 3), name="hist"), me.FeatureConfig("shared", (B,), name="now"),
                  me.FeatureConfig("other", (B, 2), name="seq")]))
    hist = me.SparseIds(np.array([[0, 0], [0, 4], [1, 1], [3, 2]]), np.array([1, 2, 3, 4]), np.array([B, 5]))
    seq = me.RaggedIds.from_lists([[1, 2, 3], [], [4], [5, 6]])
    batch = {"hist": hist, "now": np.arange(B), "seq": seq}
    emb.enqueue(batch)
    acts = emb.dequeue()
    assert acts["hist"].shape == (B, 3, 2) and acts["seq"].shape == (B, 2, 3) and acts["now"].shape == (B, 2)
    np.testing.assert_array_equal(acts["hist"][0, 1], 0)  # position 4 >= 3 is cut; missing positions are 0
    ref.enqueue(batch)
    expected = _flat(ref.dequeue(), ref.feature_names)
    for k in acts:
        np.testing.assert_array_equal(acts[k], expected[k])
    grads = _loss_grads(acts, 3)
    emb.apply_gradients(grads)
    ref.apply_gradients(grads)
    got = {t.name: v for t, v in emb.embedding_tables.items()}
    for name in ("shared", "other"):
        np.testing.assert_array_equal(got[name], ref.embedding_tables[name])
    assert set(emb.variables[shared]) == {"parameters", "accumulators"}  # the override's slots


def test_build_and_output_shapes():
    t = me.tpu.TableConfig(vocabulary_size=10, dim=2)
    config = [me.tpu.FeatureConfig(t), me.tpu.FeatureConfig(t, max_sequence_length=3),
              me.tpu.FeatureConfig(t, output_shape=[2, 2])]
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD(0.1))
    emb.build(per_replica_input_shapes=[(B, 1), (B, 6), (B, 1)])  # the third keeps its own output_shape
    assert emb.engine.config.output_shapes == ((B, 2), (B, 3, 2), (2, 2, 2))
    assert emb.embedding_tables[t].shape == (10, 2)
    emb.build([(9,)] * 3)  # built: a no-op, as in TF
    by_batch = me.tpu.TPUEmbedding(config, me.tpu.SGD(0.1))
    by_batch.build(per_replica_batch_size=B)
    assert by_batch.engine.config.output_shapes == ((B, 2), (B, 3, 2), (2, 2, 2))
    emb.enqueue([np.arange(B)[:, None], me.RaggedIds.from_lists([[1]] * B), me.RaggedIds.from_lists([[1, 2]] * 4)])
    out = emb.dequeue()
    assert [a.shape for a in out] == [(B, 2), (B, 3, 2), (2, 2, 2)] and isinstance(out, list)
    with pytest.raises(me.InputError, match="last dimension 1"):
        emb.enqueue([np.zeros((B, 2), int), me.RaggedIds.from_lists([[1]] * B), me.RaggedIds.from_lists([[1]] * 4)])


def _serving_inputs():
    return {"towers": {"user": me.SparseIds(np.array([[0, 0], [0, 1], [1, 0], [3, 0], [3, 2]]),
                                            np.array([1, 2, 3, 4, 5]), np.array([B, 3])),
                       "item": me.RaggedIds.from_lists([[1, 2], [], [3], [4, 5, 6]])},
            "extra": np.array([1, 2, 3, 0])}


def test_serving_matches_the_trained_lookup():
    config, _ = _nested_configs()["dict_of_dicts"]
    emb = me.tpu.TPUEmbedding(config, me.tpu.Adagrad(0.5))
    feats = _serving_inputs()
    emb.enqueue(feats)
    emb.apply_gradients(_map(emb.dequeue(), np.ones_like))
    emb.enqueue(feats, training=False)
    trained = emb.dequeue()
    serving = me.tpu.TPUEmbeddingForServing(config)
    untrained = serving(feats)
    assert not np.allclose(untrained["towers"]["user"], trained["towers"]["user"])
    serving.load_from(emb)
    out = serving(feats)
    for a, b in zip(_leaves(out), _leaves(trained)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # TF's function form, on a subset of the features and with the trained tables
    part = me.tpu.serving_embedding_lookup({"towers": {"item": feats["towers"]["item"]}}, None,
                                           emb.embedding_tables, config)
    np.testing.assert_allclose(part["towers"]["item"], trained["towers"]["item"], rtol=1e-6)
    with pytest.raises(me.InputError, match="not in feature_config"):
        me.tpu.serving_embedding_lookup({"towers": {"usr": feats["extra"]}}, None, emb.embedding_tables, config)
    # validate_weights_and_indices: invalid ids are dropped, as TF's safe lookup does
    neg = me.SparseIds(np.array([[0, 0], [0, 1], [1, 0]]), np.array([1, -1, 3]), np.array([B, 3]))
    clean = me.SparseIds(np.array([[0, 0], [1, 0]]), np.array([1, 3]), np.array([B, 3]))
    np.testing.assert_array_equal(serving({"towers": {"user": neg, "item": feats["towers"]["item"]},
                                           "extra": feats["extra"]})["towers"]["user"],
                                  serving({"towers": {"user": clean, "item": feats["towers"]["item"]},
                                           "extra": feats["extra"]})["towers"]["user"])


def test_serving_from_a_checkpoint(tmp_path):
    embedding, config, (t1, _) = _doc_example(me.tpu.SGD(0.1))
    batch = _batches(1)[0]
    embedding.enqueue(batch)
    embedding.apply_gradients(_loss_grads(embedding.dequeue(), 0))
    embedding.save(tmp_path / "ckpt")
    resumed, _, (r1, _) = _doc_example(me.tpu.SGD(0.1))
    resumed.build(per_replica_batch_size=B)
    resumed.restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(resumed.embedding_tables[r1], embedding.embedding_tables[t1])
    assert resumed.engine.step == 1
    other = me.tpu.TPUEmbedding(me.tpu.FeatureConfig(me.tpu.TableConfig(vocabulary_size=13, dim=5)), me.tpu.SGD())
    other.build(B)
    before = other.embedding_tables
    with pytest.raises(me.InputError, match="table 'table_0'.*shape"):
        other.restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(other.embedding_tables[other._tables[0]], before[other._tables[0]])
    serving = me.tpu.TPUEmbeddingForServing(config)
    serving.load_from(tmp_path / "ckpt")
    np.testing.assert_array_equal(serving.embedding_tables[t1], embedding.embedding_tables[t1])
    with pytest.raises(me.InputError, match="shape"):
        serving.load_from({t1: np.zeros((2, 2))})
    np.testing.assert_array_equal(serving.embedding_tables[t1], embedding.embedding_tables[t1])


# -- against TensorFlow -------------------------------------------------------------------------
def _tf_config(tf, ours):
    """The same nest with TF's own config classes (TF's TableConfig needs its own objects)."""
    E = tf.tpu.experimental.embedding
    tables = {}

    def conv(f):
        t = f.table
        if id(t) not in tables:
            tables[id(t)] = E.TableConfig(vocabulary_size=t.vocabulary_size, dim=t.dim, combiner=t.combiner,
                                          name=t.name)
        return E.FeatureConfig(tables[id(t)], max_sequence_length=f.max_sequence_length, name=f.name)

    return _map_features(ours, conv), tables


def _map_features(tree, fn):
    if isinstance(tree, me.tpu.FeatureConfig):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_features(v, fn) for k, v in tree.items()}
    return type(tree)(_map_features(v, fn) for v in tree)


def _to_tf(tf, x):
    if isinstance(x, me.SparseIds):
        return tf.SparseTensor(x.indices, tf.constant(x.values, tf.int64), x.dense_shape)
    if isinstance(x, me.RaggedIds):
        return tf.RaggedTensor.from_row_splits(tf.constant(x.values, tf.int64), x.row_splits)
    return tf.constant(x)


@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_activations_match_tensorflow_serving_lookup(tf, combiner):
    user = me.tpu.TableConfig(vocabulary_size=11, dim=2, name="user", combiner=combiner)
    item = me.tpu.TableConfig(vocabulary_size=9, dim=3, name="item", combiner=combiner)
    config = {"towers": {"user": me.tpu.FeatureConfig(user), "item": me.tpu.FeatureConfig(item)},
              "extra": me.tpu.FeatureConfig(user), "seq": me.tpu.FeatureConfig(item, max_sequence_length=2)}
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD(0.1))
    feats = dict(_serving_inputs(), seq=me.RaggedIds.from_lists([[1, 2, 3], [], [4], [5, 6]]))
    tf_feats = {"towers": {k: _to_tf(tf, v) for k, v in feats["towers"].items()},
                "extra": _to_tf(tf, feats["extra"]), "seq": _to_tf(tf, feats["seq"])}
    emb.enqueue(tf_feats, training=False)
    ours = emb.dequeue()
    tf_config, tf_tables = _tf_config(tf, config)
    serving = tf.tpu.experimental.embedding.TPUEmbeddingForServing(tf_config, optimizer=None)
    trained = {t.name: v for t, v in emb.embedding_tables.items()}
    for t, var in serving.embedding_tables.items():
        var.assign(trained[t.name])
    theirs = serving(tf_feats)
    assert isinstance(ours["towers"]["user"], tf.Tensor)
    for key in ("user", "item"):
        np.testing.assert_allclose(ours["towers"][key].numpy(), theirs["towers"][key].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours["seq"].numpy(), theirs["seq"].numpy(), rtol=1e-6)
    # dense ids: TF's serving gathers [B] -> [B, dim], as the TPU path does
    np.testing.assert_allclose(ours["extra"].numpy(), theirs["extra"].numpy(), rtol=1e-6)
    # and our own serving object agrees with TF's on the same inputs
    mine = me.tpu.TPUEmbeddingForServing(config)
    mine.load_from(emb)
    got = mine(tf_feats)
    np.testing.assert_allclose(got["towers"]["user"].numpy(), theirs["towers"]["user"].numpy(), rtol=1e-6)


def test_one_adagrad_step_matches_a_tensorflow_sparse_update(tf):
    """TPU Adagrad (no epsilon) = TF1's AdagradOptimizer on the IndexedSlices gradient of
    safe_embedding_lookup_sparse (duplicate ids summed first)."""
    table = me.tpu.TableConfig(vocabulary_size=12, dim=3, name="t", combiner="mean")
    config = {"a": me.tpu.FeatureConfig(table), "b": {"c": me.tpu.FeatureConfig(table)}}
    emb = me.tpu.TPUEmbedding(config, me.tpu.Adagrad(0.3, initial_accumulator_value=0.1))
    a = me.SparseIds(np.array([[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [3, 0]]), np.array([1, 1, 4, 5, 7, 1]),
                     np.array([B, 2]))
    c = me.RaggedIds.from_lists([[4], [4, 5], [], [11]])
    emb.enqueue({"a": a, "b": {"c": c}})
    start = emb.embedding_tables[table]
    acts = emb.dequeue()
    w = {"a": np.linspace(-1, 1, 3 * B).reshape(B, 3).astype(np.float32),
         "b": {"c": np.linspace(2, 0, 3 * B).reshape(B, 3).astype(np.float32)}}
    emb.apply_gradients(w)

    var = tf.Variable(start)
    with tf.GradientTape() as tape:
        la = tf.nn.safe_embedding_lookup_sparse(var, _to_tf(tf, a), combiner="mean")
        lc = tf.nn.safe_embedding_lookup_sparse(var, _to_tf(tf, c).to_sparse(), combiner="mean")
        loss = tf.reduce_sum(la * w["a"]) + tf.reduce_sum(lc * w["b"]["c"])
    np.testing.assert_allclose(la.numpy(), acts["a"], rtol=1e-6)
    (grad,) = tape.gradient(loss, [var])
    assert isinstance(grad, tf.IndexedSlices)
    opt = tf.compat.v1.train.AdagradOptimizer(0.3, initial_accumulator_value=0.1)
    opt.apply_gradients([(grad, var)])
    np.testing.assert_allclose(emb.embedding_tables[table], var.numpy(), rtol=2e-6, atol=1e-7)
    acc = opt.get_slot(var, "accumulator").numpy()
    np.testing.assert_allclose(emb.variables[table]["accumulators"], acc, rtol=2e-6)


def test_callable_learning_rate_and_tf_style_initializer():
    lr = [0.5]

    class Init:  # TF's initializer contract: called with the shape (and an optional dtype)
        def __call__(self, shape, dtype=None):
            return np.full(shape, 3.0)

    t = me.tpu.TableConfig(vocabulary_size=5, dim=2, initializer=Init())
    emb = me.tpu.TPUEmbedding({"a": me.tpu.FeatureConfig(t)}, me.tpu.SGD(learning_rate=lambda: lr[0]))
    for rate in (0.5, 1.0):
        lr[0] = rate
        emb.enqueue({"a": np.array([1, 2])})
        emb.dequeue()
        emb.apply_gradients({"a": np.ones((2, 2), np.float32)})
    np.testing.assert_array_equal(emb.embedding_tables[t][[0, 1, 2]], [[3, 3], [1.5, 1.5], [1.5, 1.5]])


def test_tf_objects_and_symbolic_tensors(tf):
    t = me.tpu.TableConfig(vocabulary_size=5, dim=2, dtype=tf.float32,
                           initializer=tf.keras.initializers.Constant(2.0))
    emb = me.tpu.TPUEmbedding({"a": me.tpu.FeatureConfig(t)}, me.tpu.SGD(0.1))
    emb.build(per_replica_input_shapes={"a": tf.TensorShape([3, 1])})
    np.testing.assert_array_equal(emb.embedding_tables[t], np.full((5, 2), 2.0))

    @tf.function(autograph=False)  # autograph would wrap the error in its StagingError
    def traced(x):
        emb.enqueue({"a": x})

    with pytest.raises(me.InputError, match="symbolic .*eagerly"):
        traced(tf.constant([[1], [2], [3]]))
    emb.enqueue({"a": tf.constant([[1], [2], [3]])})
    acts = emb.dequeue()
    assert isinstance(acts["a"], tf.Tensor) and acts["a"].shape == (3, 2)
    with pytest.raises(me.InputError, match="ragged_rank"):
        emb.enqueue({"a": tf.RaggedTensor.from_nested_row_lengths([1, 2, 3], [[1, 1, 1], [1, 1, 1]])})


def test_one_sgd_step_matches_a_keras_sparse_update(tf):
    """Keras 3's SGD on the IndexedSlices gradient of TF's CPU lookup (duplicate ids included)."""
    keras = pytest.importorskip("keras", reason="keras 3 is needed for its sparse SGD update")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("keras runs another backend here; the IndexedSlices update needs its TensorFlow backend")
    table = me.tpu.TableConfig(vocabulary_size=12, dim=3, name="t", combiner="sqrtn")
    config = (me.tpu.FeatureConfig(table), me.tpu.FeatureConfig(table))
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD(0.2))
    ids = (me.RaggedIds.from_lists([[1, 1, 2], [4], [], [2, 9]]), np.array([1, 4, 4, 11]))
    emb.enqueue(ids)
    start = emb.embedding_tables[table]
    acts = emb.dequeue()
    w = tuple(np.random.default_rng(k).standard_normal((B, 3)).astype(np.float32) for k in range(2))
    emb.apply_gradients(w)
    var = tf.Variable(start)
    with tf.GradientTape() as tape:
        first = tf.nn.safe_embedding_lookup_sparse(var, _to_tf(tf, ids[0]).to_sparse(), combiner="sqrtn")
        second = tf.nn.embedding_lookup(var, ids[1])
        loss = tf.reduce_sum(first * w[0]) + tf.reduce_sum(second * w[1])
    np.testing.assert_allclose(first.numpy(), acts[0], rtol=1e-6)
    (grad,) = tape.gradient(loss, [var])
    keras.optimizers.SGD(0.2).apply_gradients([(grad, var)])
    np.testing.assert_allclose(emb.embedding_tables[table], var.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_same_numbers_on_every_backend(backend):
    if backend not in me.available_backends():
        pytest.skip(f"backend {backend!r} is not installed here")
    runs = {}
    for be in ("numpy", backend):
        embedding, _, (t1, t2) = _doc_example(me.tpu.Adagrad(0.5))
        embedding = me.tpu.TPUEmbedding(embedding._feature_config, me.tpu.Adagrad(0.5), backend=be, num_shards=2)
        for step, batch in enumerate(_batches(2)):
            embedding.enqueue(batch)
            acts = embedding.dequeue()
            assert isinstance(acts, dict)
            embedding.apply_gradients(_loss_grads({k: np.asarray(v) for k, v in acts.items()}, step))
        runs[be] = [embedding.embedding_tables[t] for t in (t1, t2)]
    for a, b in zip(runs["numpy"], runs[backend]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_flatten_order_and_table_names_follow_tf_nest():
    t_b, t_a = me.tpu.TableConfig(vocabulary_size=3, dim=2), me.tpu.TableConfig(vocabulary_size=4, dim=2)
    config = {"b": me.tpu.FeatureConfig(t_b), "a": [me.tpu.FeatureConfig(t_a), {"z": me.tpu.FeatureConfig(t_b)}]}
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD())
    assert emb._paths == ["a/0", "a/1/z", "b"]  # sorted keys, as tf.nest.flatten
    assert (emb.table_name(t_a), emb.table_name(t_b)) == ("table_0", "table_1")  # first use in that order
    assert t_a.name is None  # the user's object is left alone


def test_paths_equal_tf_nest_paths(tf):
    from tensorflow.python.util import nest  # the joined-path flatten TF's TPUEmbedding uses

    config, _ = _nested_configs()["namedtuple"]
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD())
    theirs = [p for p, _ in nest.flatten_with_joined_string_paths(config)]
    assert emb._paths == theirs
    config, _ = _nested_configs()["dict_of_dicts"]
    emb = me.tpu.TPUEmbedding(config, me.tpu.SGD())
    assert emb._paths == [p for p, _ in nest.flatten_with_joined_string_paths(config)]


def test_quantization_config_matches_the_engine():
    q = me.tpu.QuantizationConfig(num_buckets=5, lower=-0.5, upper=0.5)
    t = me.tpu.TableConfig(vocabulary_size=6, dim=4, quantization_config=q, name="q")
    emb = me.tpu.TPUEmbedding({"f": me.tpu.FeatureConfig(t)}, me.tpu.SGD(0.1))
    ref_table = me.TableConfig("q", 6, 4, quantization=q)
    ref = me.TPUEmbedding(me.EmbeddingConfig(features={"f": me.FeatureConfig(ref_table, (B,))},
                                             optimizer=me.embedding.SGD(0.1)))
    ids = np.array([0, 1, 2, 5])
    emb.enqueue({"f": ids})
    ref.enqueue({"f": ids})
    got, want = emb.dequeue()["f"], _flat(ref.dequeue(), ref.feature_names)["f"]
    np.testing.assert_array_equal(got, want)
    assert set(np.round(np.unique(got), 6)) <= {-0.5, -0.25, 0.0, 0.25, 0.5}
