"""Issue #17 (engine inputs): what was validated is what is used, every bad input is a
meshembed error naming the argument and the fix, and a failed call leaves the engine exactly
as it was — the tables, slots and pending batch are bit-identical afterwards, and the next
good step equals a fresh engine's. Issue #21: a dict of features comes back as a dict."""

from __future__ import annotations

import types

import numpy as np
import pytest

import meshembed as me

BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in me.available_backends(), reason=f"{name} not installed"))
    for name in ("numpy", "torch", "jax")
]
B = 4


def config(lr: float | me.embedding.DynamicLearningRate = 0.5, features: object = None) -> me.EmbeddingConfig:
    tables = [me.TableConfig("a", 20, 4, optimizer=me.embedding.Adagrad(lr, initial_accumulator_value=0.1),
                             combiner="mean"),
              me.TableConfig("b", 12, 3, optimizer=me.embedding.SGD(0.25), combiner="sum")]
    if features is None:
        features = [me.FeatureConfig("a", (B,), name="fa"), me.FeatureConfig("a", (B, 2), name="seq"),
                    me.FeatureConfig("b", (B,), name="fb")]
    return me.EmbeddingConfig(tables=tables, features=features)


def engine(backend: str, **kw) -> me.TPUEmbedding:
    cfg = kw.pop("cfg", None) or config()
    return me.TPUEmbedding(cfg, backend=backend, num_shards=kw.pop("num_shards", 1), seed=3, **kw)


def ids(step: int = 0) -> list:
    return [(np.array([1, 2, 2, 19]) + step) % 20, me.RaggedIds.from_lists([[3, 4, 5], [], [6], [7, 7]]),
            me.SparseIds(np.array([[0, 0], [0, 1], [3, 0]]), np.array([1, 11, 2]), [B, 2])]


def grads(emb: me.TPUEmbedding, scale: float = 1.0) -> list:
    return [np.linspace(-1, 1, int(np.prod(emb.output_shape(f))), dtype=np.float32).reshape(emb.output_shape(f))
            * scale for f in emb.feature_names]


def snapshot(emb: me.TPUEmbedding) -> dict:
    """Every table and slot as raw bits, plus the pending batch and the step."""
    snap = {"step": emb.step}
    for t in emb.table_names:
        for name, arr in emb.retrieve_parameters(t).items():
            snap[f"{t}/{name}"] = np.asarray(arr).view(np.uint32).copy()
    p = emb._pending
    snap["pending"] = None if p is None else (p.batch.mode, p.dequeued, [
        (d.ids.copy(), d.slots.copy(), d.scale.copy(), d.num_slots) for d in p.batch.features])
    return snap


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "pending":
            assert (a[k] is None) == (b[k] is None)
            if a[k] is not None:
                assert a[k][:2] == b[k][:2]
                for x, y in zip(a[k][2], b[k][2]):
                    assert all(np.array_equal(u, v) for u, v in zip(x[:3], y[:3])) and x[3] == y[3]
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def step(emb: me.TPUEmbedding, s: int = 1, **kw) -> None:
    emb.enqueue(ids(s))
    emb.dequeue()
    emb.apply_gradients(grads(emb, 0.5 + s), **kw)


def check_recovers(emb: me.TPUEmbedding, backend: str, lrs=(), **kw) -> None:
    """The engine's next good step equals a fresh engine's with the same good history (the
    same batch pending, when one is)."""
    fresh = engine(backend, **kw)
    if emb.pending is not None:
        pending_step(fresh)
    for e in (emb, fresh):
        if e.pending is not None:
            if e.pending.mode == "training" and not e._pending.dequeued:
                e.dequeue()
            e.apply_gradients(grads(e), learning_rates=lrs)
        step(e, 2, learning_rates=lrs)
    assert_same(snapshot(emb), snapshot(fresh))


def refused(emb: me.TPUEmbedding, call, error: type, *match: str) -> None:
    before = snapshot(emb)
    with pytest.raises(error) as info:
        call()
    for m in match:
        assert m in str(info.value), (m, str(info.value))
    assert isinstance(info.value, me.MeshembedError)
    assert_same(snapshot(emb), before)


def pending_step(emb: me.TPUEmbedding) -> None:
    emb.enqueue(ids())
    emb.dequeue()


# -- 1. enqueue owns a private copy of ids and weights ------------------------------------------
def _buffer(backend: str, values: np.ndarray):
    if backend == "torch":
        import torch

        return torch.from_numpy(values.copy())
    return values.copy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_refilling_the_callers_buffers_after_enqueue_changes_nothing(backend):
    emb, ref = engine(backend), engine(backend)
    dense = _buffer(backend, np.array([1, 2, 2, 19], np.int64))
    values = _buffer(backend, np.array([3, 4, 5, 6, 7, 7], np.int64))
    weights = _buffer(backend, np.array([1, 2, 3, 4, 5, 6], np.float32))
    splits = np.array([0, 3, 3, 4, 6])
    sp_vals = _buffer(backend, np.array([1, 11, 2], np.int64))
    sp = me.SparseIds(np.array([[0, 0], [0, 1], [3, 0]]), sp_vals, [B, 2])
    emb.enqueue([dense, me.RaggedIds(splits, values), sp], [None, me.RaggedIds(splits, weights), None])
    ref.enqueue([np.array([1, 2, 2, 19]), me.RaggedIds(splits.copy(), np.array([3, 4, 5, 6, 7, 7])),
                 me.SparseIds(np.array([[0, 0], [0, 1], [3, 0]]), np.array([1, 11, 2]), [B, 2])],
                [None, me.RaggedIds(splits.copy(), np.array([1, 2, 3, 4, 5, 6], np.float32)), None])
    # what a prefetching loader does: the next batch into the same buffers (ids out of range too)
    dense[:] = 10**9
    values[:] = 0
    weights[:] = 100.0
    sp_vals[:] = 10**9
    splits[:] = 0
    a, r = emb.dequeue(), ref.dequeue()
    for x, y in zip(a, r):
        np.testing.assert_array_equal(emb.backend.to_numpy(x), ref.backend.to_numpy(y))
    emb.apply_gradients(grads(emb))
    ref.apply_gradients(grads(ref))
    assert_same(snapshot(emb), snapshot(ref))


def test_refilling_after_raw_op_integer_batch_changes_nothing():
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(n, 10, 2, optimizer=me.embedding.SGD(1.0), combiner="sum",
                                                    num_features=1) for n in ("t", "u")],
                             batch_size_per_tensor_core=3)
    engines = []
    for refill in (False, True):
        emb = me.ops.configure_tpu_embedding(cfg)
        buf = [np.array([1, 2, 3]), np.array([4, 5, 6])]
        me.ops.enqueue_tpu_embedding_integer_batch(buf)
        if refill:
            buf[0][:] = 9
            buf[1][:] = 10**6
        acts = me.ops.recv_tpu_embedding_activations(2)
        me.ops.send_tpu_embedding_gradients([np.ones_like(emb.backend.to_numpy(a)) for a in acts])
        engines.append(emb)
        me.ops.shutdown_tpu_embedding()
    assert_same(snapshot(engines[0]), snapshot(engines[1]))


@pytest.mark.parametrize("weights,match", [(["1", "2", "3", "4"], "expected a float array"),
                                           ([1e39, 1, 1, 1], "finite")])
def test_raw_op_weights_are_checked_not_parsed(weights, match):
    emb = me.ops.configure_tpu_embedding(config(), num_shards=1)
    try:
        refused(emb, lambda: me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch(
            [[], [], []], [np.array([1, 2, 3, 4]), np.arange(8), np.array([1, 2, 3, 4])],
            [np.array(weights), [], []]), me.InputError, "aggregation_weights", "'fa'", match)
    finally:
        me.ops.shutdown_tpu_embedding()


def test_pending_ids_never_alias_the_callers_buffer():
    """The copy is made at enqueue: nothing the pending batch holds shares the caller's memory."""
    emb = engine("numpy")
    buf = np.array([1, 2, 2, 19], np.int64)
    emb.enqueue([buf, *ids()[1:]])
    held = emb.pending.features[0].ids
    assert not np.shares_memory(held, buf)


# -- 2. learning rates -------------------------------------------------------------------------
def lr_engine(backend: str, **kw) -> me.TPUEmbedding:
    return engine(backend, cfg=config(me.embedding.DynamicLearningRate(0)), **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learning_rates_mapping_equals_sequence(backend):
    a, b, c = lr_engine(backend), lr_engine(backend), lr_engine(backend)
    step(a, learning_rates={0: 0.5})
    step(b, learning_rates=[0.5])
    step(c, learning_rates=np.array([0.5]))
    assert_same(snapshot(a), snapshot(b))
    assert_same(snapshot(a), snapshot(c))
    assert not np.array_equal(a.retrieve_parameters("a")["parameters"],
                              lr_engine(backend).retrieve_parameters("a")["parameters"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lrs,match", [
    (0.1, "expected a sequence"),
    ("0.1", "expected a sequence"),
    (np.float32(0.1), "expected a sequence"),
    ((x for x in [0.1]), "expected a sequence"),
    ({1: 0.5}, "exactly the dynamic tags [0]"),
    ({"0": 0.5}, "exactly the dynamic tags [0]"),
    ({0: 0.5, 1: 0.5}, "exactly the dynamic tags [0]"),
    ({True: 0.5}, "exactly the dynamic tags [0]"),
    (["0.5"], "expected a real number"),
    ([None], "expected a real number"),
    ([True], "expected a real number"),
    ([1e39], "finite number in float32"),
    ([float("nan")], "finite number in float32"),
    ([0.1, 0.2], "expected 1 value(s)"),
    ([[0.1]], "scalar"),
])
def test_bad_learning_rates_are_input_errors(backend, lrs, match):
    emb = lr_engine(backend)
    pending_step(emb)
    refused(emb, lambda: emb.apply_gradients(grads(emb), learning_rates=lrs), me.InputError, "learning_rates", match)
    check_recovers(emb, backend, lrs=[0.3], cfg=config(me.embedding.DynamicLearningRate(0)))


@pytest.mark.parametrize("value", ["0.1", 1e39, None])
def test_learning_rate_callable_returning_a_bad_value(value):
    emb = engine("numpy", cfg=config(lambda: value))
    pending_step(emb)
    refused(emb, lambda: emb.apply_gradients(grads(emb)), me.InputError, "learning-rate callable of tag 0")
    emb.discard()


# -- 3. gradients and constructor arguments ---------------------------------------------------
def _native(backend: str, kind: str, shape):
    if backend == "torch":
        import torch

        return {"complex": torch.zeros(shape, dtype=torch.complex64), "bool": torch.zeros(shape, dtype=torch.bool)}[kind]
    if backend == "jax":
        import jax.numpy as jnp

        return {"complex": jnp.zeros(shape, jnp.complex64), "bool": jnp.zeros(shape, bool)}[kind]
    return {"complex": np.zeros(shape, np.complex64), "bool": np.zeros(shape, bool)}[kind]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["str", "object", "complex", "bool", "native-complex", "native-bool"])
def test_non_real_gradients_are_refused_naming_the_feature(backend, kind):
    emb = engine(backend)
    pending_step(emb)
    g = grads(emb)
    shape = g[2].shape
    g[2] = {"str": np.full(shape, "0.5"), "object": np.full(shape, None, dtype=object),
            "complex": np.zeros(shape, np.complex128), "bool": np.ones(shape, bool)}.get(kind)
    if kind.startswith("native"):
        g[2] = _native(backend, kind.split("-")[1], shape)
    refused(emb, lambda: emb.apply_gradients(g), me.InputError, "feature 'fb'", "table 'b'", "Fix")
    check_recovers(emb, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_gradient_overflowing_float32_is_nonfinite(backend):
    emb = engine(backend)
    pending_step(emb)
    g = grads(emb)
    g[0] = np.full(g[0].shape, 1e39)
    refused(emb, lambda: emb.apply_gradients(g), me.InputError, "NaN or Inf", "feature 'fa'")
    check_recovers(emb, backend)


@pytest.mark.parametrize("kw,match", [
    ({"num_shards": 2.5}, "num_shards"), ({"num_shards": True}, "num_shards"), ({"num_shards": "2"}, "num_shards"),
    ({"num_shards": 0}, "> 0"), ({"allow_nonfinite": "False"}, "allow_nonfinite"),
    ({"allow_nonfinite": 0}, "allow_nonfinite"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
])
def test_constructor_arguments_are_checked(kw, match):
    with pytest.raises(me.ConfigError, match=match) as info:
        me.TPUEmbedding(config(), backend="numpy", **kw)
    assert "Received" in str(info.value)
    assert me.TPUEmbedding(config(), backend="numpy", num_shards=np.int64(2), seed=np.int32(1)).num_shards == 2


def test_apply_gradients_allow_nonfinite_must_be_a_bool():
    emb = engine("numpy")
    pending_step(emb)
    refused(emb, lambda: emb.apply_gradients(grads(emb), allow_nonfinite="False"), me.InputError, "allow_nonfinite")


@pytest.mark.skipif("torch" not in me.available_backends(), reason="torch not installed")
def test_numpy_mesh_with_torch_backend():
    mesh = me.Mesh(["x"], (1,), backend="numpy")
    with pytest.raises(me.ConfigError, match="'numpy' mesh but backend='torch'"):
        me.TPUEmbedding(config(), backend="torch", mesh=mesh)
    assert me.TPUEmbedding(config(), mesh=mesh).backend.name == "numpy"


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_vocabulary_says_how_many_bytes(backend):
    import contextlib

    cfg = me.EmbeddingConfig(tables=[me.TableConfig("big", 10**12, 16, optimizer=me.embedding.Adagrad(0.1))],
                             features=[me.FeatureConfig("big", (2,), name="f")])
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if f.read().strip() == "1":  # the allocation could "succeed", then fill and OOM
                pytest.skip("vm.overcommit_memory=1: a 128 TB host allocation is not refused up front")
    except OSError:
        pass
    scope = contextlib.nullcontext()
    if backend == "jax":  # without x64 the jax backend refuses a vocabulary beyond int32 first
        import jax

        scope = jax.enable_x64(True)
    with scope, pytest.raises(me.ResourceError) as info:
        me.TPUEmbedding(cfg, backend=backend, num_shards=1)
    msg = str(info.value)
    assert isinstance(info.value, MemoryError) and "128,000,000,000,000 bytes" in msg and "'big'" in msg and "Fix" in msg


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad,match", [
    ("strings", "expected a real"), ("none", "expected a real"), ("nan", "NaN or Inf"), ("f64inf", "NaN or Inf"),
    ("shape", "expected shape"),
])
def test_load_parameters_refuses_bad_values(backend, bad, match):
    emb = engine(backend)
    good = np.ones((20, 4), np.float32)
    value = {"strings": np.full((20, 4), "1.0"), "none": np.full((20, 4), None, dtype=object),
             "nan": np.where(np.eye(20, 4, dtype=bool), np.nan, good), "f64inf": np.full((20, 4), 1e300),
             "shape": good[:3]}[bad]
    refused(emb, lambda: emb.load_parameters("a", good, accumulators=value), me.InputError, "`accumulators`",
            "table 'a'", match)
    if bad in ("nan", "f64inf"):  # the NaN policy: allowed when asked for
        emb.load_parameters("a", good, accumulators=value, allow_nonfinite=True)
        assert not np.all(np.isfinite(emb.retrieve_parameters("a")["accumulators"]))


def test_load_parameters_shard_arguments_are_integers():
    emb = engine("numpy")
    refused(emb, lambda: emb.load_parameters("a", np.ones((10, 4)), num_shards=2.0, shard_id=0), me.InputError,
            "num_shards")


# -- 4. load_all is atomic ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["strings", "none", "nan"])
def test_load_all_validates_every_table_before_writing_any(bad):
    emb = me.ops.configure_tpu_embedding(config(), num_shards=1)
    try:
        params, a1, *rest = me.ops.retrieve_all_tpu_embedding_parameters(num_shards=1, shard_id=0)
        new_params = [p + 1 for p in params]
        new_params[1] = {"strings": np.full(params[1].shape, "2"), "none": np.full(params[1].shape, None, object),
                         "nan": np.full(params[1].shape, np.nan, np.float32)}[bad]
        refused(emb, lambda: me.ops.load_all_tpu_embedding_parameters(new_params, a1, *rest, num_shards=1, shard_id=0),
                me.InputError, "table 'b'")
        new_params[1] = params[1] + 1
        me.ops.load_all_tpu_embedding_parameters(new_params, a1, *rest, num_shards=1, shard_id=0)
        np.testing.assert_array_equal(emb.retrieve_parameters("b")["parameters"], params[1] + 1)
    finally:
        me.ops.shutdown_tpu_embedding()


# -- 5. duplicate feature names -----------------------------------------------------------------
def test_duplicate_feature_names_never_reach_the_engine():
    feats = [me.FeatureConfig("a", (B,), name="x"), me.FeatureConfig("b", (B,), name="x")]
    with pytest.raises(me.ConfigError, match="'x'"):
        me.TPUEmbedding(config(features=feats), backend="numpy")
    # the engine's own check, for any config-like object (and configs read without the check)
    good = config(features=[me.FeatureConfig("a", (B,), name="x"), me.FeatureConfig("b", (B,), name="y")])
    duck = types.SimpleNamespace(tables=good.tables, features=[dict_feature("a", "x"), dict_feature("b", "x")],
                                 sharding_strategy="div", mode="training")
    with pytest.raises(me.ConfigError, match="Duplicate feature name 'x'"):
        me.TPUEmbedding(duck, backend="numpy")


def test_duplicate_feature_names_in_a_proto_are_refused():
    text = config(features=[me.FeatureConfig("a", (B,), name="x"), me.FeatureConfig("b", (B,), name="y")]).to_text()
    assert text.count('name: "y"') == 1
    with pytest.raises(me.ConfigError, match="'x'"):
        me.TPUEmbedding(me.EmbeddingConfig.from_proto(text.replace('name: "y"', 'name: "x"'), combiners="sum"),
                        backend="numpy")


def dict_feature(table: str, name: str):
    return types.SimpleNamespace(table=table, table_name=table, name=name, input_shape=(B,))


# -- 6. tracers at the API boundary, discard() ---------------------------------------------------
@pytest.fixture
def jax_emb():
    pytest.importorskip("jax")
    if "jax" not in me.available_backends():
        pytest.skip("jax backend unavailable")
    return engine("jax")


def test_tracer_given_to_enqueue(jax_emb):
    import jax

    emb = jax_emb

    def f(x):
        emb.enqueue([x, *ids()[1:]])
        return x

    refused(emb, lambda: jax.jit(f)(np.array([1, 2, 3, 4])), me.InputError, "JAX tracer", "me.jax",
            "feature 'fa'")
    check_recovers(emb, "jax")


def test_dequeue_under_jit_is_refused_and_the_batch_kept(jax_emb):
    import jax

    emb = jax_emb
    emb.enqueue(ids())
    refused(emb, lambda: jax.jit(lambda x: emb.dequeue()[0].sum() + x)(1.0), me.StateError, "jax.jit", "me.jax")
    # dequeued once eagerly (the arrays cached), then again under jit: still refused, still intact
    emb.dequeue()
    refused(emb, lambda: jax.jit(lambda x: emb.dequeue()[0].sum() + x)(1.0), me.StateError, "dequeue")
    check_recovers(emb, "jax")


def test_apply_gradients_under_jit_is_refused(jax_emb):
    import jax
    import jax.numpy as jnp

    emb = jax_emb
    pending_step(emb)
    concrete = [jnp.asarray(g) for g in grads(emb)]

    def traced_grads(x):
        emb.apply_gradients([g * x for g in concrete])
        return x

    def concrete_grads(x):
        emb.apply_gradients(concrete)
        return x

    refused(emb, lambda: jax.jit(traced_grads)(1.0), me.InputError, "JAX tracer", "feature 'fa'")
    refused(emb, lambda: jax.jit(concrete_grads)(1.0), me.StateError, "apply_gradients", "me.jax")
    check_recovers(emb, "jax")


def test_parameters_under_jit(jax_emb):
    import jax
    import jax.numpy as jnp

    emb = jax_emb
    good = np.ones((20, 4), np.float32)
    refused(emb, lambda: jax.jit(lambda x: emb.load_parameters("a", x) or 0)(jnp.asarray(good)), me.InputError,
            "JAX tracer", "`parameters` for table 'a'")
    refused(emb, lambda: jax.jit(lambda x: emb.load_parameters("a", good) or x)(1.0), me.StateError,
            "load_parameters")
    refused(emb, lambda: jax.jit(lambda x: emb.retrieve_parameters("a")["parameters"].sum() + x)(1.0),
            me.StateError, "retrieve_parameters")
    check_recovers(emb, "jax")


def test_tracers_given_to_a_numpy_engine():
    jax = pytest.importorskip("jax")
    emb = engine("numpy")
    refused(emb, lambda: jax.jit(lambda x: emb.enqueue([x, *ids()[1:]]) or x)(np.array([1, 2, 3, 4])),
            me.InputError, "JAX tracer", "feature 'fa'")
    pending_step(emb)
    g = grads(emb)
    refused(emb, lambda: jax.jit(lambda x: emb.apply_gradients([x, *g[1:]]) or x)(g[0]), me.InputError,
            "JAX tracer", "gradient for feature 'fa'")
    check_recovers(emb, "numpy")


def test_training_flag_must_be_a_bool():
    emb = engine("numpy")
    refused(emb, lambda: emb.enqueue(ids(), training="False"), me.InputError, "training")
    emb.enqueue(ids(), training=np.bool_(False))
    assert emb.pending.mode == "inference"


@pytest.mark.parametrize("backend", BACKENDS)
def test_discard_drops_a_pending_batch(backend):
    emb = engine(backend)
    before = snapshot(emb)
    pending_step(emb)
    assert emb.discard() is True and emb.discard() is False
    assert_same(snapshot(emb), before)
    with pytest.raises(me.StateError):
        emb.apply_gradients(grads(emb))
    check_recovers(emb, backend)


# -- 7. a dict of features comes back as a dict ---------------------------------------------------
def dict_config() -> me.EmbeddingConfig:
    # given order (user, item) differs from the sorted order (item, user)
    return config(features={"user": me.FeatureConfig("a", (B,)), "item": me.FeatureConfig("b", (B,))})


@pytest.mark.parametrize("backend", BACKENDS)
def test_dict_config_returns_a_dict_in_the_given_order(backend):
    emb = engine(backend, cfg=dict_config())
    ref = engine(backend, cfg=config(features=[me.FeatureConfig("b", (B,), name="item"),
                                               me.FeatureConfig("a", (B,), name="user")]))
    batch = {"user": np.array([1, 2, 3, 19]), "item": np.array([0, 1, 11, 11])}
    emb.enqueue(batch)
    ref.enqueue([batch["item"], batch["user"]])
    acts, racts = emb.dequeue(), ref.dequeue()
    assert isinstance(acts, dict) and list(acts) == ["user", "item"]
    user_act, item_act = acts.values()
    assert tuple(user_act.shape) == (B, 4) and tuple(item_act.shape) == (B, 3)
    np.testing.assert_array_equal(emb.backend.to_numpy(acts["item"]), ref.backend.to_numpy(racts[0]))
    g = {"user": np.full((B, 4), 0.5, np.float32), "item": np.full((B, 3), 2.0, np.float32)}
    refused(emb, lambda: emb.apply_gradients([g["item"], g["user"]]), me.InputError, "pass a dict keyed by",
            "'user'", "'item'")
    emb.apply_gradients(g)
    ref.apply_gradients([g["item"], g["user"]])
    assert_same(snapshot(emb), snapshot(ref))


def test_dict_config_refuses_a_list_at_enqueue_and_the_raw_ops_stay_positional():
    emb = engine("numpy", cfg=dict_config())
    refused(emb, lambda: emb.enqueue([np.array([1, 2, 3, 4]), np.array([1, 2, 3, 4])]), me.InputError,
            "features", "dict keyed by ['user', 'item']")
    refused(emb, lambda: emb.enqueue({"user": np.array([1, 2, 3, 4])}), me.InputError, "Missing: ['item']")
    emb = me.ops.configure_tpu_embedding(dict_config(), num_shards=1)
    try:
        me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch([[], []], [np.array([0, 1, 2, 3]), np.array([1, 2, 3, 4])],
                                                            [])
        acts = me.ops.recv_tpu_embedding_activations(2)
        assert isinstance(acts, list) and [tuple(a.shape) for a in acts] == [(B, 3), (B, 4)]  # item, user
        me.ops.send_tpu_embedding_gradients([np.ones((B, 3), np.float32), np.ones((B, 4), np.float32)])
        assert emb.step == 1
    finally:
        me.ops.shutdown_tpu_embedding()


@pytest.mark.skipif("torch" not in me.available_backends(), reason="torch not installed")
def test_torch_front_end_with_a_dict_config():
    """me.torch.EmbeddingCollection feeds the engine its own config-order lists: a dict config
    must keep working there (its output is keyed by feature name)."""
    import torch

    ec = me.torch.EmbeddingCollection(dict_config())
    out = ec({"user": torch.tensor([1, 2, 3, 19]), "item": torch.tensor([0, 1, 11, 11])})
    assert {k: tuple(v.shape) for k, v in out.items()} == {"item": (B, 3), "user": (B, 4)}
    before = ec.engine.retrieve_parameters("b")["parameters"]
    out["item"].sum().backward()
    assert not np.array_equal(ec.engine.retrieve_parameters("b")["parameters"], before)


def test_a_guard_covers_every_gradient_even_with_checked_updates(monkeypatch):
    """A backend with both guarded and checked updates gets one guard over every feature's
    gradients and no ``check_finite`` (the guard already covers them); a NaN anywhere still
    raises the error naming the feature with every table as it was."""
    import dataclasses

    from meshembed_numpy.backend import NumpyBackend

    class Both(NumpyBackend):
        @property
        def capabilities(self):
            return dataclasses.replace(super().capabilities, guarded_updates=True, checked_updates=True)

    be = Both()
    guarded, checked = [], []
    real_guard, real_update = NumpyBackend.finite_guard, NumpyBackend.update_rows
    monkeypatch.setattr(Both, "finite_guard", lambda self, xs: guarded.append(len(xs)) or real_guard(self, xs))
    monkeypatch.setattr(Both, "update_rows",
                        lambda self, *a, **k: checked.append(k.get("check_finite", False)) or real_update(self, *a, **k))
    emb, ref = engine(be), engine("numpy")
    for e in (emb, ref):
        e.enqueue(ids())
        acts = e.dequeue()
        e.apply_gradients([np.ones_like(np.asarray(a)) for a in acts])
    assert guarded == [3] and checked == [False, False]
    for t in ("a", "b"):
        for k, v in ref.retrieve_parameters(t).items():
            np.testing.assert_array_equal(emb.retrieve_parameters(t)[k], v)
    emb.enqueue(ids(1))
    acts = emb.dequeue()
    before = {t: {k: v.copy() for k, v in emb.retrieve_parameters(t).items()} for t in ("a", "b")}
    g = [np.ones_like(np.asarray(a)) for a in acts]
    g[2].reshape(-1)[0] = np.nan
    with pytest.raises(me.InputError, match="feature 'fb'.*NaN or Inf"):
        emb.apply_gradients(g)
    for t in ("a", "b"):
        for k, v in before[t].items():
            np.testing.assert_array_equal(emb.retrieve_parameters(t)[k], v)
