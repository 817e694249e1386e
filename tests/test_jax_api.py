"""me.jax: the functional API inside jax.jit against TPUEmbedding(backend="jax") (bits), no
recompilation, the same input checks, portable checkpoints, and the optax Adadelta.

Runs on 1 device here and on 8 CPU devices (a user Mesh) in a subprocess
(``test_eight_devices`` sets ``MESHEMBED_JAX_EXPECT_DEVICES=8``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.errors import CapacityError, InputError  # noqa: E402
from tests.test_jax_backend import CompileCounter  # noqa: E402

E = me.embedding
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPECT = int(os.environ.get("MESHEMBED_JAX_EXPECT_DEVICES", "0") or 0)


def _config(sharding: str = "mod") -> me.EmbeddingConfig:
    """Tables on the fused CPU kernels (Adagrad, Adadelta, SGD) and on the core functions
    (Adam, FTRL, non-lazy Adam, clipped Adagrad), dynamic and constant learning rates, pooled
    and sequence features, two features on one table, all three combiners."""
    dyn0, dyn1 = E.DynamicLearningRate(0), E.DynamicLearningRate(1)
    tables = [
        me.TableConfig(name="ada", vocabulary_size=97, dimension=8, optimizer=E.Adagrad(learning_rate=dyn0), combiner="mean"),
        me.TableConfig(name="adam", vocabulary_size=50, dimension=4, optimizer=E.Adam(learning_rate=0.01), combiner="sum"),
        me.TableConfig(name="ftrl", vocabulary_size=40, dimension=4, optimizer=E.FTRL(learning_rate=dyn1), combiner="sqrtn"),
        me.TableConfig(name="delta", vocabulary_size=33, dimension=4,
                       optimizer=E.Adadelta(learning_rate=dyn1, rho=0.9, epsilon=1e-6), combiner="sum"),
        me.TableConfig(name="sgd", vocabulary_size=30, dimension=4, optimizer=E.SGD(learning_rate=0.3), combiner="mean"),
        me.TableConfig(name="dense_adam", vocabulary_size=24, dimension=4,
                       optimizer=E.Adam(learning_rate=dyn0, lazy_adam=False), combiner="sum"),
        me.TableConfig(name="clipped", vocabulary_size=26, dimension=4,
                       optimizer=E.Adagrad(learning_rate=0.2, clipvalue=0.5), combiner="mean"),
    ]
    features = [
        me.FeatureConfig(table="ada", input_shape=(16,), name="ada1"),
        me.FeatureConfig(table="ada", input_shape=(16, 3), name="ada_seq"),
        me.FeatureConfig(table="adam", input_shape=(16,), name="adam"),
        me.FeatureConfig(table="ftrl", input_shape=(16,), name="ftrl"),
        me.FeatureConfig(table="delta", input_shape=(16,), name="delta"),
        me.FeatureConfig(table="sgd", input_shape=(16,), name="sgd"),
        me.FeatureConfig(table="dense_adam", input_shape=(16,), name="dense_adam"),
        me.FeatureConfig(table="clipped", input_shape=(16,), name="clipped"),
    ]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy=sharding)


def _features(cfg: me.EmbeddingConfig, rng: np.random.Generator, sparse: bool) -> dict:
    """One batch; ``sparse``: ragged ids (a varying number per sample) for the pooled features."""
    out = {}
    vocab = {t.name: t.vocabulary_size for t in cfg.tables}
    for f in cfg.features:
        v = vocab[f.table]
        if sparse and len(f.input_shape) == 1:
            lengths = rng.integers(0, 4, f.input_shape[0])
            out[f.name] = me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, v, lengths.sum()))
        else:
            out[f.name] = rng.integers(0, v, f.input_shape)
    return out


def _mesh():
    """A user's 2-D mesh over every device (8 here: 2 x 4)."""
    from jax.sharding import Mesh

    n = len(jax.devices())
    shape = (2, n // 2) if n % 2 == 0 and n > 1 else (1, n)
    return Mesh(np.asarray(jax.devices(), dtype=object).reshape(shape), ("data", "model"))


def _loss(acts: dict) -> jax.Array:
    return sum(jnp.sum(jnp.sin(a) * a) for a in acts.values())


def _step(state, batch, lrs):
    acts = me.jax.lookup(state, batch)
    loss, grads = jax.value_and_grad(_loss)(acts)
    return me.jax.apply_gradients(state, batch, grads, lrs), acts, grads, loss


def _same(got, want, what: str) -> None:
    """Bit for bit, on 1 and 8 devices."""
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


def test_devices_as_expected():
    if EXPECT:
        assert len(jax.devices()) == EXPECT


@pytest.mark.parametrize("sharding", ["mod", "div"])
@pytest.mark.parametrize("use_mesh", [False, True])
def test_jitted_steps_are_bit_identical_to_the_engine(sharding, use_mesh):
    """Five jitted me.jax steps (donated state, changing learning rates, dense and ragged
    batches) against TPUEmbedding(backend="jax"): activations and every table and slot equal
    bit for bit, on the fused CPU kernels and on the core functions."""
    cfg = _config(sharding)
    emb = me.TPUEmbedding(cfg, backend="jax", seed=3)
    state = me.jax.init(cfg, mesh=_mesh() if use_mesh else None, seed=3)
    step = jax.jit(_step, donate_argnums=0)
    rng = np.random.default_rng(1)
    for i in range(5):
        feats = _features(cfg, rng, sparse=i % 2 == 1)
        lrs = [np.float32(0.1 / (i + 1)), np.float32(0.05 * (i + 1))]  # what a jitted step gets without x64
        batch = me.jax.prepare(cfg, feats, capacity=64, unique_capacity={"adam": 50, "ftrl": 40, "clipped": 26})
        state, acts, grads, _ = step(state, batch, lrs)
        emb.enqueue(feats)
        expected = emb.dequeue()
        for k, f in enumerate(cfg.features):
            _same(acts[f.name], expected[k], f.name)
        emb.apply_gradients([grads[f.name] for f in cfg.features], learning_rates=lrs)
    assert int(state.step) == emb.step == 5
    for t in cfg.tables:
        got, want = state.parameters(t.name), emb.retrieve_parameters(t.name)
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k], f"{t.name}/{k}")
    if use_mesh:  # tables sharded over the user's devices; slots co-sharded with their table
        leaf = state.tables["ada"]
        assert leaf["parameters"].sharding == leaf["accumulators"].sharding
        assert leaf["parameters"].sharding.device_set == set(jax.devices())


def test_twenty_steps_compile_once():
    """Changing ids (within capacity) and a learning rate changing every step: one trace,
    and no XLA compilation after the first step."""
    cfg = _config()
    state = me.jax.init(cfg)
    step = jax.jit(lambda *a: _step(*a), donate_argnums=0)  # its own trace cache
    rng = np.random.default_rng(2)
    counter = CompileCounter()
    for i in range(20):
        batch = me.jax.prepare(cfg, _features(cfg, rng, sparse=True), capacity=64)
        with counter:
            state, *_ = step(state, batch, [jnp.float32(0.1 + 0.01 * i), 0.02 * (i + 1)])
            jax.block_until_ready(state)
        if i == 0:
            assert counter.count > 0
        else:
            assert counter.count == 0, f"step {i} compiled"
    assert step._cache_size() == 1
    assert int(state.step) == 20


def test_prepare_checks_inputs_like_enqueue():
    cfg = _config()
    emb = me.TPUEmbedding(cfg, backend="numpy")
    feats = _features(cfg, np.random.default_rng(0), sparse=False)
    bad = dict(feats, adam=np.full(16, 50))
    with pytest.raises(InputError) as engine_error:
        emb.enqueue(bad)
    with pytest.raises(InputError) as api_error:
        me.jax.prepare(cfg, bad)
    assert str(api_error.value) == str(engine_error.value)
    with pytest.raises(InputError, match="Missing"):
        me.jax.prepare(cfg, {k: v for k, v in feats.items() if k != "sgd"})
    with pytest.raises(CapacityError, match=r"Feature 'ada_seq'.*48 ids.*capacity 32"):
        me.jax.prepare(cfg, feats, capacity=32)
    with pytest.raises(CapacityError, match=r"Table 'adam': \d+ distinct ids this batch exceed its unique_capacity 3"):
        me.jax.prepare(cfg, feats, unique_capacity={"adam": 3})
    batch = me.jax.prepare(cfg, feats, capacity={"ada_seq": 48})
    assert batch.ids[1].shape == (48,) and batch.ids[0].shape == (16,)
    state = me.jax.init(cfg)
    grads = {k: jnp.zeros_like(v) for k, v in me.jax.lookup(state, batch).items()}
    with pytest.raises(InputError, match="expected 2 value"):
        me.jax.apply_gradients(state, batch, grads, [0.1])
    with pytest.raises(InputError, match="Invalid gradient for feature 'sgd'"):
        me.jax.apply_gradients(state, batch, dict(grads, sgd=jnp.zeros((3, 4))), [0.1, 0.1])
    assert int(state.step) == 0


def test_save_restore_through_torch_and_back(tmp_path):
    """A state trained here restores on torch (the portable checkpoint) and back."""
    pytest.importorskip("torch")
    cfg = _config()
    state = me.jax.init(cfg, seed=5)
    step = jax.jit(_step, donate_argnums=0)
    rng = np.random.default_rng(3)
    for i in range(2):
        state, *_ = step(state, me.jax.prepare(cfg, _features(cfg, rng, sparse=False)), [0.1, 0.2])
    saved = {t.name: state.parameters(t.name) for t in cfg.tables}
    me.jax.save(state, tmp_path / "ckpt")
    on_torch = me.TPUEmbedding.restore(tmp_path / "ckpt", backend="torch")
    assert on_torch.step == 2
    for t in cfg.tables:
        for k, v in on_torch.retrieve_parameters(t.name).items():
            np.testing.assert_array_equal(v, saved[t.name][k])
    on_torch.save(tmp_path / "back")
    back = me.jax.restore(tmp_path / "back", mesh=_mesh())
    assert int(back.step) == 2
    for t in cfg.tables:
        for k, v in back.parameters(t.name).items():
            np.testing.assert_array_equal(v, saved[t.name][k])
    state, *_ = step(back, me.jax.prepare(cfg, _features(cfg, rng, sparse=False)), [0.1, 0.2])  # trains on
    assert int(state.step) == 3


def _dense_reference(params: dict, grads: list, **kw) -> dict:
    """me.optimizers.Adadelta on the JAX backend, one apply_gradients per step."""
    variables = {k: me.Variable(np.asarray(v), name=k, backend="jax") for k, v in params.items()}
    opt = me.optimizers.Adadelta(**kw)
    for g in grads:
        opt.apply_gradients([(jnp.asarray(g[k]), variables[k]) for k in sorted(variables)])
    return {k: np.asarray(v.numpy()) for k, v in variables.items()}


@pytest.mark.parametrize("options", ["plain", "clipnorm", "global_clipnorm", "clipvalue", "ema"])
def test_optax_adadelta_matches_the_dense_optimizer(options):
    O = me.optimizers
    kw = {"plain": {}, "clipnorm": dict(gradients_clip_option=O.GradientsClipOption(clipnorm=0.5)),
          "global_clipnorm": dict(gradients_clip_option=O.GradientsClipOption(global_clipnorm=0.7)),
          "clipvalue": dict(gradients_clip_option=O.GradientsClipOption(clipvalue=0.1)),
          "ema": dict(ema_option=O.EMAOption(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3))}[options]
    rng = np.random.default_rng(4)
    params = {"w": rng.standard_normal((8, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()} for _ in range(7)]
    tx = me.jax.adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6, **kw)

    @jax.jit
    def update(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = {k: jnp.asarray(v) for k, v in params.items()}
    s = tx.init(p)
    for g in grads:
        p, s = update(p, s, g)
    want = _dense_reference(params, grads, learning_rate=0.5, rho=0.9, epsilon=1e-6, **kw)
    for k in params:  # optax adds p' - p to p: within an ulp or two of p'
        np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=2e-6, atol=1e-6)
    assert int(s.iteration) == 7


def test_optax_adadelta_state_is_sharded_like_the_params():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _mesh()
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    w = jax.device_put(jnp.ones((4, 8 * mesh.shape["model"])), sharding)
    tx = optax.chain(optax.clip_by_global_norm(1.0), me.jax.adadelta(learning_rate=0.1))
    state = tx.init({"w": w})  # eager init: each slot on its param's sharding
    _, state = jax.jit(tx.update)({"w": w}, state, {"w": w})  # and still there after a jitted step
    ada = state[1]
    for slot in (ada.accumulated_grad["w"], ada.accumulated_delta_var["w"]):
        assert slot.sharding.is_equivalent_to(sharding, 2), slot.sharding


@pytest.mark.skipif(bool(EXPECT), reason="already the 8-device run")
def test_eight_devices():
    """This module with 8 CPU devices: tables over a 2 x 4 user mesh, same bits as the engine."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["MESHEMBED_JAX_EXPECT_DEVICES"] = "8"
    env.pop("MESHEMBED_JAX_CAPACITY", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "bit_identical or devices_as_expected or sharded or save_restore or device_sets or accumulation_off"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_jitted_steps_export_for_tpu_and_gpu(platform):
    """The jitted me.jax step (lookup + apply_gradients with dynamic learning rates) and the
    dense Adadelta step lower for another platform on this CPU machine: the CPU FFI kernels
    are a CPU-only branch (``lax.platform_dependent``), absent from the exported module."""
    from jax import export

    cfg = _config()
    state = me.jax.init(cfg)
    batch = me.jax.prepare(cfg, _features(cfg, np.random.default_rng(0), sparse=False), capacity=64)
    spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)  # noqa: E731
    lrs = [jax.ShapeDtypeStruct((), jnp.float32)] * 2
    exported = export.export(jax.jit(lambda s, b, lr: _step(s, b, lr)[0]), platforms=(platform,))(
        spec(state), spec(batch), lrs)
    text = exported.mlir_module()
    assert exported.platforms == (platform,) and "custom_call @meshembed" not in text
    tx = me.jax.adadelta(learning_rate=0.01)
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}
    dense = export.export(jax.jit(lambda p, s, g: tx.update(g, s, p)), platforms=(platform,))(
        spec(params), spec(tx.init(params)), spec(params))
    assert dense.platforms == (platform,)
    # and on CPU the same step takes the FFI kernels
    cpu = jax.jit(lambda s, b, lr: _step(s, b, lr)[0]).lower(state, batch, [0.1, 0.1]).as_text()
    from meshembed_jax import native

    if native.usable("cpu", np.float32):
        assert "custom_call @meshembed" in cpu


@pytest.mark.skipif(bool(EXPECT), reason="runs its own 8-device interpreter")
def test_two_tower_example_on_eight_devices():
    """examples/jax_two_tower.py: one jax.jit step (one trace), 8 CPU devices, loss falling,
    the tables restored on torch."""
    pytest.importorskip("torch")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_two_tower.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "devices=8" in out.stdout and "traces=1" in out.stdout and "TWO TOWER OK" in out.stdout


def test_prepare_counts_distinct_ids_without_a_sort():
    """unique_capacity's check counts distinct ids by a row mask (small vocabularies) or a
    sort: both the same count, the same CapacityError."""
    from meshembed_jax.frontend import step as api

    rng = np.random.default_rng(5)
    ids = rng.integers(-1, 300, 1000).astype(np.int32)  # -1: padding, not an id
    want = np.unique(ids[ids >= 0]).size
    assert api._distinct(ids, 300) == want
    assert api._distinct(ids, 1 << 40) == want  # too large for a mask: the sort
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=300, dimension=2, optimizer=E.SGD(0.1))],
                             features=[me.FeatureConfig(table="t", input_shape=(1000,), name="f")])
    clean = np.where(ids < 0, 0, ids)
    n = np.unique(clean).size
    assert me.jax.prepare(cfg, {"f": clean}, unique_capacity=n).unique == (n,)
    with pytest.raises(CapacityError, match=f"{n} distinct ids"):
        me.jax.prepare(cfg, {"f": clean}, unique_capacity=n - 1)


def test_jax_backend_processes_and_agree_in_one_process():
    """The Backend protocol's multi-process hooks: one process, no communication."""
    be = me.get_backend("jax")
    assert jax.process_count() == 1
    assert be.processes == 1
    assert be.agree(0) == (0,) and be.agree(7) == (7,)


_TWO_PROCESSES = """
import sys, jax
port, pid = sys.argv[1], int(sys.argv[2])
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # this child's own setting
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import meshembed as me
be = me.get_backend("jax")
print("AGREE", be.processes, be.agree(10 + pid), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.skipif(bool(EXPECT), reason="runs its own processes")
def test_jax_backend_agree_over_two_processes():
    """jax.distributed on loopback (2 CPU processes, gloo): agree all-gathers each status."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(port), str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-2000:]
        assert "AGREE 2 (10, 11)" in out, out + err[-2000:]


def test_tables_on_different_device_sets_are_refused():
    """A default shard count is capped per table at its rows: on 8 devices a 3-row table
    lives on 3, which one jitted step cannot take with the others, so me.jax says so."""
    if len(jax.devices()) == 1:
        pytest.skip("needs several devices (runs in test_eight_devices)")
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="big", vocabulary_size=64, dimension=2, optimizer=E.SGD(0.1)),
                me.TableConfig(name="tiny", vocabulary_size=3, dimension=2, optimizer=E.SGD(0.1))],
        features=[me.FeatureConfig(table="big", input_shape=(4,), name="a"),
                  me.FeatureConfig(table="tiny", input_shape=(4,), name="b")])
    with pytest.raises(me.ConfigError, match=r"Table 'tiny' is sharded over 3 device\(s\).*same devices"):
        me.jax.init(cfg)


def test_accumulation_off_applies_each_occurrence_like_the_engine():
    """use_gradient_accumulation=False inside one jitted step: each id's contributions one
    after another (rounds of the r-th occurrences, as update_rows_in_order), bit for bit with
    TPUEmbedding(jax), on the fused CPU kernel (Adagrad) and the XLA step (Adam, FTRL); the
    number of rounds changes with the batch (up to 12 here) and compiles nothing new."""
    off = {"use_gradient_accumulation": False}
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="ada", vocabulary_size=20, dimension=4, combiner="mean",
                               optimizer=E.Adagrad(learning_rate=E.DynamicLearningRate(0), **off)),
                me.TableConfig(name="adam", vocabulary_size=16, dimension=4, combiner="sqrtn",
                               optimizer=E.Adam(learning_rate=0.01, **off)),
                me.TableConfig(name="ftrl", vocabulary_size=24, dimension=4, combiner="sum",
                               optimizer=E.FTRL(learning_rate=0.2, **off))],
        features=[me.FeatureConfig(table="ada", input_shape=(8,), name="a1"),
                  me.FeatureConfig(table="ada", input_shape=(8, 2), name="a2"),
                  me.FeatureConfig(table="adam", input_shape=(8,), name="adam"),
                  me.FeatureConfig(table="ftrl", input_shape=(8,), name="ftrl")])
    emb = me.TPUEmbedding(cfg, backend="jax", seed=5)
    state = me.jax.init(cfg, seed=5)
    step = jax.jit(_step, donate_argnums=0)
    rng = np.random.default_rng(4)
    counter = CompileCounter()
    for i in range(4):
        lengths = rng.integers(0, 4, 8)
        hot = 1 + i  # ids drawn from few rows: up to 12 occurrences of one id
        feats = {"a1": me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, hot, lengths.sum())),
                 "a2": rng.integers(0, hot, (8, 2)), "adam": rng.integers(0, hot, 8), "ftrl": rng.integers(0, 24, 8)}
        lrs = [np.float32(0.1 / (i + 1))]
        batch = me.jax.prepare(cfg, feats, capacity=32)
        with counter:
            state, acts, grads, _ = step(state, batch, lrs)
            jax.block_until_ready(state)
        assert i == 0 or counter.count == 0, f"step {i} compiled"
        emb.enqueue(feats)
        expected = emb.dequeue()
        for k, f in enumerate(cfg.features):
            _same(acts[f.name], expected[k], f.name)
        emb.apply_gradients([grads[f.name] for f in cfg.features], learning_rates=lrs)
        for t in cfg.tables:
            got, want = state.parameters(t.name), emb.retrieve_parameters(t.name)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {i}: {t.name}/{k}")
    on = me.jax.init(me.EmbeddingConfig(tables=[me.TableConfig(name="ada", vocabulary_size=20, dimension=4,
                                                               optimizer=E.Adagrad(learning_rate=0.1))],
                                        features=[me.FeatureConfig(table="ada", input_shape=(2,), name="a")]))
    ones = {"a": jnp.ones((2, 4))}
    summed = me.jax.apply_gradients(on, me.jax.prepare(on, {"a": np.array([3, 3])}), ones).parameters("ada")
    cfg_off = me.EmbeddingConfig(tables=[me.TableConfig(name="ada", vocabulary_size=20, dimension=4,
                                                        optimizer=E.Adagrad(learning_rate=0.1, **off))],
                                 features=[me.FeatureConfig(table="ada", input_shape=(2,), name="a")])
    one_by_one = me.jax.init(cfg_off)
    one_by_one = me.jax.apply_gradients(one_by_one, me.jax.prepare(cfg_off, {"a": np.array([3, 3])}), ones)
    assert not np.array_equal(summed["parameters"][3], one_by_one.parameters("ada")["parameters"][3])


def test_float32_values_reach_the_fused_kernel_as_exact_doubles():
    """A traced float32 hyper-parameter becomes the float64 bit pattern the engine passes
    (built with integer ops, so without x64 too): normal, subnormal, zero, Inf and NaN."""
    from meshembed_jax.frontend import updater as api

    values = np.array([0.3, -0.0, 0.0, 1e-45, 3e-39, -1.17e-38, 1.1754944e-38, np.inf, -np.inf, np.nan, 3.4e38,
                       -2.5], np.float32)
    bits = jax.jit(jax.vmap(api._f64_bits))(values)
    np.testing.assert_array_equal(np.asarray(bits), values.astype(np.float64).view(np.uint32).reshape(-1, 2))
