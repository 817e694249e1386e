"""me.jax as its users expect it (issues #35 JAX items, #31 items 2 and 9): ``jax.export``
artifacts that serialize, clear errors for ``jax.grad``/``jvp``/``vmap`` through the tables,
tables on one axis of a user's mesh, ``optax.inject_hyperparams(me.jax.adadelta)``, an opt-in
NaN/Inf flag under ``jax.jit``, and the engine's checks (learning rates, gradients, batches of
another config, state pytrees, save, capacities) with the state unchanged after each refusal.

The 8-device parts run in a subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.errors import CheckpointError, ConfigError, InputError, StateError  # noqa: E402
from tests.test_jax_api import _config, _features, _step  # noqa: E402

E = me.embedding
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _small(vocab: int = 20, dim: int = 4, optimizer=None) -> me.EmbeddingConfig:
    optimizer = optimizer or E.Adagrad(learning_rate=E.DynamicLearningRate(0))
    return me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=vocab, dimension=dim, optimizer=optimizer, combiner="sum")],
        features={"f": me.FeatureConfig(table="t", input_shape=(4,), name="f")})


def _leaves(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def _unchanged(state, before: list[np.ndarray]) -> None:
    for got, want in zip(_leaves(state), before):
        np.testing.assert_array_equal(got, want)


def _run(script: str, env_extra: dict, timeout: int = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


# -- #35.1: jax.export ------------------------------------------------------------------------
def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def test_exported_step_serializes_and_deserializes():
    """A jitted lookup + apply_gradients exported for TPU: ``serialize()`` /
    ``jax.export.deserialize`` carry EmbeddingState and Batch; the deserialized trees equal the
    live ones (so ``Exported.call(state, batch, lrs)`` accepts this process's state) and the
    state they rebuild works here (parameters, a step)."""
    from jax import export

    cfg = _config()
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, _features(cfg, np.random.default_rng(0), sparse=False), capacity=64)
    lrs = [jax.ShapeDtypeStruct((), jnp.float32)] * 2
    exported = export.export(jax.jit(lambda s, b, lr: _step(s, b, lr)[0]), platforms=("tpu",))(
        _spec(state), _spec(batch), lrs)
    blob = exported.serialize()
    back = export.deserialize(blob)
    assert back.in_tree == exported.in_tree and back.out_tree == exported.out_tree
    assert back.in_tree == jax.tree.structure(((state, batch, [0.1, 0.1]), {}))
    assert back.platforms == ("tpu",) and back.mlir_module() == exported.mlir_module()
    rebuilt = jax.tree.unflatten(back.out_tree, jax.tree.leaves(state))  # the static part rebuilt here
    assert isinstance(rebuilt, me.jax.EmbeddingState) and rebuilt.config.to_proto() == cfg.to_proto()
    np.testing.assert_array_equal(rebuilt.parameters("ada")["parameters"], state.parameters("ada")["parameters"])
    assert [t.combiner for t in rebuilt._static.layout.tables] == [t.combiner for t in state._static.layout.tables]
    assert me.jax.init(cfg)._static != state._static  # live states: compared by identity (traces stay apart)
    # the me.jax wrapper gives the same artifact
    again = me.jax.export(lambda s, b, lr: _step(s, b, lr)[0], platforms=("tpu",))(_spec(state), _spec(batch), lrs)
    assert export.deserialize(again.serialize()).in_tree == exported.in_tree


def test_a_config_the_proto_cannot_carry_is_not_serialized():
    """A learning-rate callable is no data: the artifact would hold its value at export time."""
    from jax import export

    cfg = _small(optimizer=E.SGD(learning_rate=lambda: 0.1))
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, {"f": np.array([1, 2, 3, 1])})
    exported = export.export(jax.jit(lambda s, b: _step(s, b, ())[0]), platforms=("tpu",))(_spec(state), _spec(batch))
    with pytest.raises(InputError, match="learning-rate callables"):
        exported.serialize()


def test_cpu_export_says_why_or_runs():
    """On CPU the step calls meshembed's FFI kernels: me.jax.export says why that cannot be
    exported and what to do; with MESHEMBED_JAX_CPU_KERNELS=0 (the pure-XLA kernels) the CPU
    artifact serializes, deserializes and runs with the jitted step's bits (a subprocess)."""
    from meshembed_jax import native

    cfg = _small()
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, {"f": np.array([1, 2, 3, 1])})
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    if native.usable("cpu", np.float32):
        with pytest.raises(ConfigError, match=r"platform 'cpu'.*C\+\+ row kernels.*platforms=\('tpu',\).*"
                                              r"MESHEMBED_JAX_CPU_KERNELS=0"):
            me.jax.export(lambda s, b, lr: _step(s, b, [lr])[0], platforms=("cpu",))(_spec(state), _spec(batch), lr)
    out = _run("""
        import numpy as np, jax, jax.numpy as jnp
        from jax import export
        import meshembed as me
        from tests.test_jax_api import _step
        from tests.test_jax_frontend_round3 import _small
        cfg = _small()
        fn = lambda s, b, lr: _step(s, b, [lr])[0]
        state = me.jax.init(cfg, seed=1)
        batch = me.jax.prepare(cfg, {"f": np.array([1, 2, 3, 1])})
        blob = me.jax.export(fn, platforms=("cpu",))(state, batch, jnp.float32(0.1)).serialize()
        back = export.deserialize(blob)
        got = back.call(state, batch, jnp.float32(0.1))
        want = jax.jit(fn)(state, batch, jnp.float32(0.1))
        for k in ("parameters", "accumulators"):
            np.testing.assert_array_equal(got.parameters("t")[k], want.parameters("t")[k])
        assert int(got.step) == int(want.step) == 1
        print("CPU EXPORT OK")
    """, {"MESHEMBED_JAX_CPU_KERNELS": "0"})
    assert "CPU EXPORT OK" in out


# -- #35.2: transformations --------------------------------------------------------------------
def test_grad_jvp_vmap_through_the_tables_say_what_is_differentiable():
    cfg = _small()
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, {"f": np.array([1, 2, 3, 1])})
    static = state._static

    def loss(s, b):
        return jnp.sum(me.jax.lookup(s, b)["f"] ** 2)

    def of_tables(tables):
        return loss(me.jax.EmbeddingState(tables, state.step, static), batch)

    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
    grads = {"f": jnp.ones((4, 4))}
    differentiate = {
        "grad": lambda: jax.grad(loss, allow_int=True)(state, batch),
        "grad of tables": lambda: jax.grad(of_tables)(state.tables),
        "jit(grad)": lambda: jax.jit(jax.grad(of_tables))(state.tables),
        "grad(jit)": lambda: jax.grad(jax.jit(of_tables))(state.tables),
        "jvp": lambda: jax.jvp(of_tables, (state.tables,), (jax.tree.map(jnp.ones_like, state.tables),)),
        "grad of apply_gradients": lambda: jax.grad(lambda g: jnp.sum(me.jax.apply_gradients(
            state, batch, {"f": g}, [0.1]).tables["t"]["parameters"]))(grads["f"]),
    }
    for name, call in differentiate.items():
        with pytest.raises(InputError, match="What is differentiable: the activations") as info:
            call()
        assert "meshembed_" not in str(info.value), name
    batched = {
        "vmap(lookup)": lambda: jax.vmap(me.jax.lookup, in_axes=(None, 0))(state, stacked),
        "vmap(jit(lookup))": lambda: jax.vmap(jax.jit(me.jax.lookup), in_axes=(None, 0))(state, stacked),
        "vmap(apply_gradients)": lambda: jax.vmap(lambda g: me.jax.apply_gradients(state, batch, {"f": g}, [0.1]).tables)(
            jnp.ones((2, 4, 4))),
    }
    for name, call in batched.items():
        with pytest.raises(InputError, match="Cannot jax.vmap me.jax"):
            call()
    # what is differentiable works, under jit too: the activations, and dense parameters
    w = jnp.ones((4, 1))

    @jax.jit
    def dense_step(w, state, batch):
        acts = me.jax.lookup(state, batch)
        gw, ga = jax.grad(lambda w, a: jnp.sum((a["f"] @ w) ** 2), argnums=(0, 1))(w, acts)
        return gw, me.jax.apply_gradients(state, batch, ga, [0.1])

    gw, new = dense_step(w, state, batch)
    assert gw.shape == (4, 1) and int(new.step) == 1


def test_scan_over_batches_equals_step_by_step():
    """What the vmap error recommends: jax.lax.scan over stacked batches (the state as the
    carry) gives the bits of one jitted step per batch."""
    cfg = _config()
    rng = np.random.default_rng(0)
    caps = {"adam": 50, "ftrl": 40, "clipped": 26}
    batches = [me.jax.prepare(cfg, _features(cfg, rng, sparse=False), capacity=64, unique_capacity=caps)
               for _ in range(3)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *batches)
    lrs = jnp.asarray([[0.1, 0.2], [0.05, 0.1], [0.02, 0.3]], jnp.float32)

    def body(state, xs):
        b, lr = xs
        return _step(state, b, [lr[0], lr[1]])[0], None

    scanned, _ = jax.jit(lambda s, bs, lr: jax.lax.scan(body, s, (bs, lr)))(me.jax.init(cfg, seed=1), stacked, lrs)
    state, step = me.jax.init(cfg, seed=1), jax.jit(_step)
    for b, lr in zip(batches, lrs):
        state = step(state, b, [lr[0], lr[1]])[0]
    assert int(scanned.step) == int(state.step) == 3
    for t in cfg.tables:
        for k, v in scanned.parameters(t.name).items():
            np.testing.assert_array_equal(v, state.parameters(t.name)[k], err_msg=f"{t.name}/{k}")


# -- #35.3: tables over one mesh axis; dense state placed once ---------------------------------
def test_tables_on_one_axis_of_a_user_mesh():
    """init(config, mesh=Mesh(2 x 4, ("data", "model")), axis="model") on 8 CPU devices:
    each table's shards over the 4 'model' devices, replicated over 'data', the same bits as
    TPUEmbedding(jax, num_shards=4) over 3 jitted steps; dense params placed with
    me.jax.place do not retrace at step 2; restore(mesh=, axis=) places a checkpoint so."""
    out = _run("""
        import numpy as np, jax, jax.numpy as jnp, optax, tempfile, os
        from jax.sharding import Mesh
        import meshembed as me
        from meshembed.errors import ConfigError
        from tests.test_jax_api import _config, _features, _step, _same
        assert len(jax.devices()) == 8
        mesh = Mesh(np.asarray(jax.devices(), dtype=object).reshape(2, 4), ("data", "model"))
        cfg = _config("div")
        state = me.jax.init(cfg, mesh=mesh, axis="model", seed=3)
        emb = me.TPUEmbedding(cfg, backend="jax", num_shards=4, seed=3)
        leaf = state.tables["ada"]["parameters"]
        assert leaf.shape[0] == 4 and leaf.sharding.spec[0] == "shard", leaf.sharding
        assert leaf.sharding.mesh.axis_names == ("data", "shard") and leaf.sharding.device_set == set(jax.devices())
        assert state.tables["ada"]["accumulators"].sharding == leaf.sharding
        w = me.jax.place({"w": jnp.ones((8, 1))}, state)
        tx = optax.sgd(0.01)
        opt = me.jax.place(tx.init(w), state)
        traces = [0]

        @jax.jit
        def step(w, opt, state, batch, lrs):
            traces[0] += 1
            acts = me.jax.lookup(state, batch)
            def loss(w, acts):
                return sum(jnp.sum(jnp.sin(a) * a) for a in acts.values()) + jnp.sum(acts["ada1"] @ w["w"])
            gw, ga = jax.grad(loss, argnums=(0, 1))(w, acts)
            u, opt = tx.update(gw, opt, w)
            return optax.apply_updates(w, u), opt, me.jax.apply_gradients(state, batch, ga, lrs), acts, ga

        rng = np.random.default_rng(1)
        for i in range(3):
            feats = _features(cfg, rng, sparse=False)  # (ragged ones may change a feature's static weighting)
            lrs = [np.float32(0.1 / (i + 1)), np.float32(0.05 * (i + 1))]
            batch = me.jax.prepare(cfg, feats, capacity=64, unique_capacity={"adam": 50, "ftrl": 40, "clipped": 26})
            w, opt, state, acts, grads = step(w, opt, state, batch, lrs)
            emb.enqueue(feats)
            want = emb.dequeue()
            for k, f in enumerate(cfg.features):
                _same(acts[f.name], want[k], f.name)
            emb.apply_gradients([grads[f.name] for f in cfg.features], learning_rates=lrs)
        assert traces[0] == 1, traces
        for t in cfg.tables:
            got, want = state.parameters(t.name), emb.retrieve_parameters(t.name)
            for k in want:
                _same(got[k], want[k], t.name + "/" + k)
        by_index = {}
        for s in state.tables["ada"]["parameters"].addressable_shards:  # the 'data' replicas agree
            by_index.setdefault(str(s.index), []).append(np.asarray(s.data))
        assert len(by_index) == 4 and all(all(np.array_equal(v[0], x) for x in v) for v in by_index.values())
        path = os.path.join(tempfile.mkdtemp(), "ckpt")
        me.jax.save(state, path)
        back = me.jax.restore(path, mesh=mesh, axis="model")
        assert back.tables["ada"]["parameters"].sharding == leaf.sharding and int(back.step) == 3
        for bad, why in (({"axis": "nope"}, "axis names"), ({"axis": "model", "num_shards": 6}, "multiple of 4")):
            try:
                me.jax.init(cfg, mesh=mesh, **bad)
            except ConfigError as exc:
                assert why in str(exc), exc
            else:
                raise AssertionError(bad)
        try:
            me.jax.init(cfg, axis="model")
        except ConfigError as exc:
            assert "without a `mesh`" in str(exc)
        print("AXIS OK")
    """, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert "AXIS OK" in out


def test_placed_dense_state_does_not_retrace():
    """One device: params placed with me.jax.place beside the state, 3 jitted steps, 1 trace."""
    cfg = _small()
    state = me.jax.init(cfg)
    w = me.jax.place(jnp.ones((4, 1)), state)
    traces = [0]

    @jax.jit
    def step(w, state, batch):
        traces[0] += 1
        acts = me.jax.lookup(state, batch)
        gw, ga = jax.grad(lambda w, a: jnp.sum((a["f"] @ w) ** 2), argnums=(0, 1))(w, acts)
        return w - 0.01 * gw, me.jax.apply_gradients(state, batch, ga, [0.1])

    for i in range(3):
        w, state = step(w, state, me.jax.prepare(cfg, {"f": np.arange(4) + i}))
    assert traces[0] == 1 and int(state.step) == 3


# -- #35.4: optax.inject_hyperparams ----------------------------------------------------------
def test_inject_hyperparams_adadelta():
    """optax.inject_hyperparams(me.jax.adadelta): the learning rate a traced hyper-parameter
    (changed between steps without recompiling), the same numbers as a fixed learning rate."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)} for _ in range(4)]
    tx = optax.inject_hyperparams(me.jax.adadelta)(learning_rate=0.5, rho=0.9, epsilon=1e-6)
    fixed = me.jax.adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6)

    traces = [0]

    @jax.jit
    def update(tx_state, p, g):
        traces[0] += 1
        u, tx_state = tx.update(g, tx_state, p)
        return optax.apply_updates(p, u), tx_state

    p, s = params, tx.init(params)
    q, fs = params, fixed.init(params)
    for g in grads:
        p, s = update(s, p, g)
        u, fs = fixed.update(g, fs, q)
        q = optax.apply_updates(q, u)
    np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(q["w"]), rtol=1e-6, atol=1e-7)
    s.hyperparams["learning_rate"] = jnp.asarray(0.05, jnp.float32)
    p2, _ = update(s, p, grads[0])
    assert traces == [1]
    assert not np.array_equal(np.asarray(p2["w"]), np.asarray(p["w"]))


# -- #35.5: NaN/Inf under jit ------------------------------------------------------------------
def _nan_configs():
    off = E.Adagrad(learning_rate=0.1, use_gradient_accumulation=False)
    return {"every kind": _config(), "accumulation off": _small(optimizer=off)}


@pytest.mark.parametrize("which", ["every kind", "accumulation off"])
def test_return_finite_skips_the_step_under_jit(which):
    """apply_gradients(..., return_finite=True) inside jit: (state, True) and the same bits as
    without the flag for finite gradients; NaN in one feature's gradient or a NaN learning
    rate: (state, False) with every table and slot (fused, XLA, non-lazy, in-order updates)
    bit-identical and the step counter unchanged. Outside jit the flag reports, nothing raises."""
    from meshembed.embedding.layout import build_layout

    cfg = _nan_configs()[which]
    n_lr = build_layout(cfg).num_dynamic_inputs
    rng = np.random.default_rng(7)
    feats = _features(cfg, rng, sparse=False) if which == "every kind" else {"f": np.array([1, 2, 1, 1])}
    batch = me.jax.prepare(cfg, feats, capacity=64)

    def step(state, batch, lrs, bad, flag):
        acts = me.jax.lookup(state, batch)
        grads = jax.grad(lambda a: sum(jnp.sum(jnp.sin(x) * x) for x in a.values()))(acts)
        first = next(iter(grads))
        grads = dict(grads, **{first: grads[first] * bad})
        return me.jax.apply_gradients(state, batch, grads, lrs, return_finite=flag) if flag else \
            (me.jax.apply_gradients(state, batch, grads, lrs), None)

    jitted = jax.jit(step, static_argnums=4)
    lrs = [jnp.float32(0.1)] * n_lr
    plain, _ = jitted(me.jax.init(cfg, seed=2), batch, lrs, 1.0, False)
    flagged, ok = jitted(me.jax.init(cfg, seed=2), batch, lrs, 1.0, True)
    assert bool(ok) and int(flagged.step) == 1
    for got, want in zip(_leaves(flagged), _leaves(plain)):
        np.testing.assert_array_equal(got, want)
    cases = [(jnp.nan, lrs), (jnp.inf, lrs)] + ([(1.0, [jnp.float32(np.nan)] + lrs[1:])] if n_lr else [])
    for bad, rates in cases:
        state = me.jax.init(cfg, seed=2)
        before = _leaves(state)
        new, ok = jitted(state, batch, rates, bad, True)
        assert not bool(ok)
        _unchanged(new, before)
    state = me.jax.init(cfg, seed=2)
    before = _leaves(state)
    grads = {k: jnp.full(v.shape, np.nan) for k, v in me.jax.lookup(state, batch).items()}
    new, ok = me.jax.apply_gradients(state, batch, grads, [0.1] * n_lr, return_finite=True)  # eager
    assert not bool(ok) and int(new.step) == 0
    _unchanged(new, before)
    with pytest.raises(InputError, match="pass one of them"):
        me.jax.apply_gradients(new, batch, grads, [0.1] * n_lr, return_finite=True, allow_nonfinite=True)
    with pytest.raises(InputError, match="return_finite"):
        me.jax.apply_gradients(new, batch, grads, [0.1] * n_lr, return_finite="True")


# -- #31.2 / #31.9: the engine's checks ---------------------------------------------------------
def _engine_error(cfg, feats, grads, lrs) -> BaseException:
    emb = me.TPUEmbedding(cfg, backend="jax")
    emb.enqueue(feats)
    emb.dequeue()
    with pytest.raises(Exception) as info:
        emb.apply_gradients(grads, learning_rates=lrs)
    return info.value


def test_learning_rates_checked_as_the_engine():
    cfg = _config()
    feats = _features(cfg, np.random.default_rng(0), sparse=False)
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, feats)
    grads = {k: jnp.ones_like(v) for k, v in me.jax.lookup(state, batch).items()}
    by_tag = me.jax.apply_gradients(me.jax.init(cfg), batch, grads, {1: 0.2, 0: 0.1})  # read by tag
    by_list = me.jax.apply_gradients(me.jax.init(cfg), batch, grads, [0.1, 0.2])
    for got, want in zip(_leaves(by_tag), _leaves(by_list)):
        np.testing.assert_array_equal(got, want)
    before = _leaves(state)
    bad_rates = [{"ada": 0.1, "ftrl": 0.2}, {0: 0.1, 5: 0.2}, [np.nan, 0.1], [0.1, np.inf], [1e39, 0.1],
                 ["0.1", 0.1], [True, 0.1], [np.ones(2), 0.1], [0.1], [0.1 + 1j, 0.1]]
    for lrs in bad_rates:
        want = _engine_error(cfg, feats, [np.ones_like(np.asarray(v)) for v in grads.values()], lrs)
        with pytest.raises(type(want)) as got:
            me.jax.apply_gradients(state, batch, grads, lrs)
        assert str(got.value) == str(want), lrs
        _unchanged(state, before)
    with pytest.raises(InputError, match="expected a scalar"):  # traced: rank and dtype
        jax.jit(lambda s, lr: me.jax.apply_gradients(s, batch, grads, [lr, 0.1]))(state, jnp.ones(2))


def test_gradients_must_be_real_as_in_the_engine():
    cfg = _small(optimizer=E.SGD(0.1))
    feats = {"f": np.array([1, 2, 3, 4])}
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, feats)
    before = _leaves(state)
    for bad in (np.ones((4, 4), np.complex64), np.ones((4, 4), bool), np.full((4, 4), "x"), np.ones((3, 4))):
        want = _engine_error(cfg, feats, {"f": bad}, ())
        with pytest.raises(type(want)) as got:
            me.jax.apply_gradients(state, batch, {"f": bad})
        assert str(got.value) == str(want)
        _unchanged(state, before)
        if bad.dtype.kind in "cb" or bad.shape != (4, 4):  # traced: the same check on its dtype and shape
            with pytest.raises(type(want)) as got:
                jax.jit(lambda s, g: me.jax.apply_gradients(s, batch, {"f": g}))(state, jnp.asarray(bad))
            assert str(got.value) == str(want)


def test_batch_of_another_config_is_refused():
    """Ids prepared for a larger table must not read as zeros (or train nothing) here."""
    cfg = _small(vocab=20)
    bigger = _small(vocab=1000)
    state = me.jax.init(cfg)
    before = _leaves(state)
    far = me.jax.prepare(bigger, {"f": np.array([900, 1, 2, 999])})
    grads = {"f": jnp.ones((4, 4))}
    for call in (lambda: me.jax.lookup(state, far), lambda: me.jax.apply_gradients(state, far, grads, [0.1]),
                 lambda: jax.jit(me.jax.lookup)(state, far)):
        with pytest.raises(InputError, match=r"prepared for another config \(tables \['t'\], features \['f'\]\)"):
            call()
    _unchanged(state, before)
    wider = me.jax.prepare(_small(vocab=20, dim=8), {"f": np.array([1, 2, 3, 4])})
    with pytest.raises(InputError, match="another config"):
        me.jax.lookup(state, wider)
    ok = me.jax.prepare(cfg, {"f": np.array([1, 2, 3, 4])})
    cut = me.jax.Batch(tuple(a[:2] for a in ok.ids), ok.slots, ok.scale, ok.features, ok.unique)
    with pytest.raises(InputError, match=r"feature 'f' `ids` must be a 1-D integer array of its capacity 8"):
        me.jax.lookup(state, cut)
    with pytest.raises(InputError, match="Expected a me.jax Batch"):
        me.jax.lookup(state, {"f": np.array([1, 2, 3, 4])})


def test_state_pytrees_are_validated_before_use():
    cfg = _small()
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, {"f": np.array([1, 2, 3, 4])})
    grads = {"f": jnp.ones((4, 4))}
    before = _leaves(state)
    st, t = state._static, state.tables["t"]
    broken = {
        "a table missing": (me.jax.EmbeddingState({}, state.step, st), r"expected tables \['t'\]"),
        "a slot missing": (me.jax.EmbeddingState({"t": {"parameters": t["parameters"]}}, state.step, st),
                           r"needs the arrays \['parameters', 'accumulators'\]"),
        "sliced": (jax.tree.map(lambda x: x[:, :2] if x.ndim == 3 else x, state), r"`parameters` must be a float32 array"),
        "recast": (jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim == 3 else x, state), "must be a float32"),
        "float step": (me.jax.EmbeddingState(state.tables, jnp.float32(0), st), "integer scalar"),
    }
    for name, (bad, match) in broken.items():
        for call in (lambda: me.jax.lookup(bad, batch), lambda: me.jax.apply_gradients(bad, batch, grads, [0.1]),
                     lambda: jax.jit(me.jax.lookup)(bad, batch)):
            with pytest.raises(InputError, match=match):
                call()
    with pytest.raises(InputError, match="Expected the me.jax EmbeddingState"):
        me.jax.lookup({"t": dict(t)}, batch)
    _unchanged(state, before)


def test_save_writes_only_what_restore_reads(tmp_path):
    cfg = _small()
    state = me.jax.init(cfg)
    with pytest.raises(StateError, match=r"Cannot call `me.jax.save\(\)` inside `jax.jit`.*outside"):
        jax.jit(lambda s: me.jax.save(s, tmp_path / "in_jit") or 0)(state)
    assert not (tmp_path / "in_jit").exists()
    nan = jax.tree.map(lambda x: x.at[0, 0, 0].set(np.nan) if x.ndim == 3 else x, state)
    with pytest.raises(CheckpointError, match="NaN/Inf"):
        me.jax.save(nan, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    me.jax.save(nan, tmp_path / "nan", allow_nonfinite=True)
    with pytest.raises(CheckpointError):
        me.jax.restore(tmp_path / "nan")
    back = me.jax.restore(tmp_path / "nan", allow_nonfinite=True)
    assert np.isnan(back.parameters("t")["parameters"]).any()
    negative = me.jax.EmbeddingState({"t": dict(state.tables["t"], accumulators=-state.tables["t"]["accumulators"])},
                                     state.step, state._static)
    with pytest.raises(CheckpointError, match="accumulators"):
        me.jax.save(negative, tmp_path / "negative")
    assert not (tmp_path / "negative").exists()
    with pytest.raises(InputError, match="step"):
        me.jax.save(me.jax.EmbeddingState(state.tables, jnp.int32(-1), state._static), tmp_path / "step")
    with pytest.raises(InputError, match="expected tables"):
        me.jax.save(me.jax.EmbeddingState({}, state.step, state._static), tmp_path / "empty")
    me.jax.save(state, tmp_path / "ok")
    assert int(me.jax.restore(tmp_path / "ok").step) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 64.0, "64", True, 0, -3, 2**40, 1e20, [64]])
def test_prepare_capacity_must_be_a_positive_integer(bad):
    cfg = _small()
    feats = {"f": np.array([1, 2, 3, 4])}
    with pytest.raises(InputError, match="Invalid `capacity`"):
        me.jax.prepare(cfg, feats, capacity=bad)
    with pytest.raises(InputError, match="Invalid `capacity` for feature 'f'"):
        me.jax.prepare(cfg, feats, capacity={"f": bad})
    with pytest.raises(InputError, match="Invalid `unique_capacity`"):
        me.jax.prepare(cfg, feats, unique_capacity=bad)


def test_prepare_capacity_keys_and_numpy_integers():
    cfg = _small()
    feats = {"f": np.array([1, 2, 3, 4])}
    with pytest.raises(InputError, match=r"unknown features \['g'\]"):
        me.jax.prepare(cfg, feats, capacity={"g": 8})
    with pytest.raises(InputError, match=r"unknown tables \['f'\]"):
        me.jax.prepare(cfg, feats, unique_capacity={"f": 8})
    batch = me.jax.prepare(cfg, feats, capacity=np.int64(16), unique_capacity={"t": np.int32(4)})
    assert batch.ids[0].shape == (16,) and batch.unique == (4,)


def test_tables_me_jax_cannot_read_are_refused():
    """NormBelow evictions run on the engine only: me.jax refuses them at init instead of
    evicting on other norms. (16-bit storage runs under me.jax since #32: its int16 patterns
    are read as 16-bit rows, tests/test_jax_low_precision.py.)"""
    low = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=20, dimension=4, optimizer=E.SGD(0.1),
                               precision=E.Precision(parameters="bfloat16"))],
        features={"f": me.FeatureConfig(table="t", input_shape=(4,), name="f")})
    assert me.jax.init(low).tables["t"]["parameters"].dtype == np.int16
    dyn = me.EmbeddingConfig(  # dynamic vocabularies run under me.jax (test_jax_dynamic_vocab_jit.py) but NormBelow
        tables=[me.TableConfig(name="t", vocabulary_size=20, dimension=4, optimizer=E.SGD(0.1),
                               dynamic=E.DynamicVocabulary(eviction=E.NormBelow(0.1)))],
        features={"f": me.FeatureConfig(table="t", input_shape=(4,), name="f")})
    with pytest.raises(ConfigError, match=r"table 't' evicts with NormBelow"):
        me.jax.init(dyn)
