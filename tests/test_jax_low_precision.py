"""me.jax with low-precision tables (docs/low_precision.md, issue #32): the engine's bits.

A bfloat16 table with stochastic rounding (Adagrad, bfloat16 accumulators) and a float16 one
(Adam: float16 parameters, bfloat16 velocities, float32 momenta) trained through jitted and
eager ``me.jax`` give, bit for bit, what ``TPUEmbedding`` gives on the NumPy backend: on one
device here, and on 8 XLA CPU devices over 8 and 2 shards in a subprocess. Checkpoints go
both ways: ``me.jax.save`` -> ``TPUEmbedding.restore`` and back, and a run resumed from either
continues with the same bits. (Every optimizer, both formats and both roundings are measured
against the engine by the ``jax-functional`` conformance entry and the survey in the report of
#32; ``conformance/test_engine_low_precision.py`` checks the definition itself.)
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import meshembed as me

ROOT = pathlib.Path(__file__).resolve().parents[1]
P = me.embedding.Precision
V, D = 37, 5


def _usable() -> bool:
    try:
        me.get_backend("jax")
    except me.MeshembedError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _usable(), reason="jax not installed")


def _config() -> me.EmbeddingConfig:
    return me.EmbeddingConfig(
        tables=[
            me.TableConfig(name="bf", vocabulary_size=V, dimension=D, combiner="mean",
                           optimizer=me.embedding.Adagrad(learning_rate=0.3),
                           precision=P(parameters="bfloat16", slots="bfloat16", rounding="stochastic", seed=11)),
            me.TableConfig(name="fp", vocabulary_size=V, dimension=D, combiner="sum",
                           optimizer=me.embedding.Adam(learning_rate=0.05),
                           precision=P(parameters="float16", slots={"velocities": "bfloat16"},
                                       rounding="stochastic", seed=12)),
        ],
        features=[
            me.FeatureConfig(table="bf", input_shape=(8,), name="bag"),
            me.FeatureConfig(table="bf", input_shape=(3, 2), name="seq"),
            me.FeatureConfig(table="fp", input_shape=(8,), name="ids"),
        ])


def _batches(steps: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        bag = me.RaggedIds.from_lists([list(rng.integers(0, V, rng.integers(1, 4))) for _ in range(8)])
        feats = [bag, rng.integers(0, V, (3, 2)), rng.integers(0, V, 8)]
        grads = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((8, D), (3, 2, D), (8, D))]
        out.append((feats, grads))
    return out


NAMES = ("bag", "seq", "ids")


def _engine_run(batches, emb=None) -> tuple[dict, list]:
    emb = emb or me.TPUEmbedding(_config(), backend="numpy", num_shards=1, seed=4)
    acts = []
    for feats, grads in batches:
        emb.enqueue(feats)
        acts.append([np.asarray(a) for a in emb.dequeue()])
        emb.apply_gradients(grads)
    return {t: emb.retrieve_parameters(t) for t in emb.table_names}, acts


def _jax_run(state, batches, jit: bool = True) -> tuple:
    import jax

    from meshembed_jax.frontend import step as api

    lookup = jax.jit(api.lookup) if jit else api.lookup
    apply = jax.jit(api.apply_gradients) if jit else api.apply_gradients
    acts = []
    for feats, grads in batches:
        batch = api.prepare(state, feats)
        out = lookup(state, batch)
        acts.append([np.asarray(out[n]) for n in NAMES])
        state = apply(state, batch, dict(zip(NAMES, grads)))
    return state, acts


def _params(state) -> dict:
    return {t.name: state.parameters(t.name) for t in state._static.layout.tables}


def _assert_bits(got: dict, want: dict, what: str) -> None:
    for t in want:
        for k in want[t]:
            a, b = np.asarray(got[t][k], np.float32), np.asarray(want[t][k], np.float32)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
                f"{what}: {t}/{k} differs in {int(np.sum(a.view(np.uint32) != b.view(np.uint32)))} values"


def _assert_acts(got: list, want: list, what: str) -> None:
    for s, (g, w) in enumerate(zip(got, want)):
        for n, a, b in zip(NAMES, g, w):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{what}: step {s} activation {n}"


@pytest.fixture(scope="module")
def reference():
    return _engine_run(_batches(3))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_me_jax_gives_the_engines_bits(reference, jit):
    from meshembed_jax.frontend import step as api

    state, acts = _jax_run(api.init(_config(), num_shards=2, seed=4), _batches(3), jit=jit)
    want, want_acts = reference
    _assert_acts(acts, want_acts, "activations")
    _assert_bits(_params(state), want, "tables")
    assert int(state.step) == 3
    raw = state.tables["fp"]  # stored as 16-bit patterns, float32 where the slot is float32
    assert (raw["parameters"].dtype, raw["velocities"].dtype, raw["momenta"].dtype) == (np.int16, np.int16, np.float32)


def test_checkpoints_round_trip_with_the_engine(tmp_path):
    """me.jax.save -> TPUEmbedding.restore (numpy) and TPUEmbedding.save -> me.jax.restore:
    the stored bits, the step counter, and the steps after the restore, bit for bit."""
    from meshembed_jax.frontend import step as api

    first, then = _batches(2), _batches(2, seed=1)
    state, _ = _jax_run(api.init(_config(), num_shards=2, seed=4), first)
    api.save(state, tmp_path / "from_jax")
    emb = me.TPUEmbedding.restore(tmp_path / "from_jax", backend="numpy")
    assert emb.step == 2
    _assert_bits({t: emb.retrieve_parameters(t) for t in emb.table_names}, _params(state), "me.jax -> engine")
    want, want_acts = _engine_run(then, emb)  # the engine resumes from me.jax's checkpoint
    emb.save(tmp_path / "from_engine")
    back = api.restore(tmp_path / "from_engine")
    _assert_bits(_params(back), want, "engine -> me.jax")
    assert int(back.step) == 4
    resumed, acts = _jax_run(state, then)  # me.jax resumes from its own state: the engine's bits
    _assert_acts(acts, want_acts, "resumed")
    _assert_bits(_params(resumed), want, "resumed")


def test_static_part_carries_the_precision():
    """The serialized static part (jax.export's aux data) keeps each table's Precision (the
    config proto has no field for it) and the arrays' storage dtypes."""
    from meshembed_jax.frontend import step as api

    state = api.init(_config(), num_shards=2, seed=4)
    st = api._deserialize_static(api._serialize_static(state._static))
    assert [t.precision for t in st.layout.tables] == [t.precision for t in state._static.layout.tables]
    assert st.array_dtypes == state._static.array_dtypes
    assert st == state._static


def test_ftrl_with_a_dynamic_learning_rate_gives_the_numpy_bits():
    """Once refused (11 float32 linears a last bit off: XLA divided by the traced rate as a
    multiply by its reciprocal); the division is element-wise now (exact.py): NumPy's bits."""
    import jax

    from meshembed_jax.frontend import step as api

    opt = me.embedding.FTRL(me.embedding.DynamicLearningRate(0))
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", V, D, optimizer=opt, combiner="sum",
                                                    precision=P(parameters="float16", rounding="stochastic", seed=3))],
                             features=[me.FeatureConfig("t", (8,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=1, seed=4)
    state = api.init(cfg, num_shards=1, seed=4)
    apply = jax.jit(api.apply_gradients)
    rng = np.random.default_rng(2)
    for s in range(3):
        ids, g = rng.integers(0, V, 8), (rng.standard_normal((8, D)) * 0.3).astype(np.float32)
        lr = 0.15 / (1 + s)
        emb.enqueue([ids])
        emb.dequeue()
        emb.apply_gradients([g], learning_rates=[lr])
        state = apply(state, api.prepare(state, [ids]), {"f": g}, [np.float32(lr)])
    _assert_bits(_params(state), {"t": emb.retrieve_parameters("t")}, "FTRL, dynamic rate")


def test_dynamic_vocabulary_on_a_low_precision_table_is_refused():
    """map_keys' re-initialisation writes float32 rows: not run on 16-bit storage (the engine runs it)."""
    from meshembed_jax.frontend import step as api

    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", V, D, optimizer=me.embedding.SGD(0.1),
                                                    precision=P(parameters="bfloat16"),
                                                    dynamic=me.embedding.DynamicVocabulary(capacity=V))],
                             features=[me.FeatureConfig("t", (4,), name="f")])
    with pytest.raises(me.ConfigError, match="dynamic vocabulary on a low-precision table"):
        api.init(cfg)


def test_return_finite_skips_the_step_on_nan():
    """A NaN gradient under ``return_finite=True``: no 16-bit array written, the counter stays."""
    import jax

    from meshembed_jax.frontend import step as api

    state = api.init(_config(), num_shards=2, seed=4)
    (feats, grads), = _batches(1)
    grads[0][0, 0] = np.nan
    batch = api.prepare(state, feats)
    new, finite = jax.jit(lambda s, b, g: api.apply_gradients(s, b, g, return_finite=True))(
        state, batch, dict(zip(NAMES, grads)))
    assert not bool(finite) and int(new.step) == 0
    _assert_bits(_params(new), _params(state), "after a skipped step")


def _eight(out: str, ckpt: str) -> None:
    """On 8 devices: jitted me.jax over 8 and 2 shards (stored bits to ``out``); the 8-shard
    state saved to ``ckpt``."""
    import jax

    from meshembed_jax.frontend import step as api

    assert len(jax.devices()) == 8, jax.devices()
    results = {}
    for shards in (8, 2):
        state, acts = _jax_run(api.init(_config(), num_shards=shards, seed=4), _batches(3))
        for t, arrays in _params(state).items():
            for k, v in arrays.items():
                results[f"{shards}.{t}.{k}"] = v
        for s, step in enumerate(acts):
            for n, a in zip(NAMES, step):
                results[f"{shards}.act.{s}.{n}"] = a
        if shards == 8:
            api.save(state, ckpt)
    np.savez(out, **results)


def test_same_bits_on_eight_devices(tmp_path, reference):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out, ckpt = tmp_path / "eight.npz", tmp_path / "ckpt8"
    run = subprocess.run([sys.executable, __file__, str(out), str(ckpt)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want, want_acts = reference
    with np.load(out) as z:
        for shards in (8, 2):
            got = {t: {k: z[f"{shards}.{t}.{k}"] for k in want[t]} for t in want}
            _assert_bits(got, want, f"{shards} shards on 8 devices")
            _assert_acts([[z[f"{shards}.act.{s}.{n}"] for n in NAMES] for s in range(3)], want_acts,
                         f"{shards} shards on 8 devices")
    emb = me.TPUEmbedding.restore(ckpt, backend="numpy")  # 8 devices' checkpoint on one NumPy shard
    _assert_bits({t: emb.retrieve_parameters(t) for t in emb.table_names}, want, "8-device checkpoint")


if __name__ == "__main__" and len(sys.argv) == 3:
    _eight(sys.argv[1], sys.argv[2])


def test_sealed_division_and_pow_give_numpys_bits():
    """exact.py: a division by a scalar or a row (XLA: a multiply by the float32 reciprocal,
    ~23% of values 1 ulp off) and pow (XLA's is not powf) give NumPy's bits under jit."""
    import jax
    import jax.numpy as jnp

    from meshembed_jax.kernels import exact

    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 8)).astype(np.float32)
    row = (rng.random((1, 8)) + 0.5).astype(np.float32)
    pos = np.abs(x) + np.float32(1e-3)

    def rule(xp, x, row, pos, lr):
        return x / 0.15, x / row, x / lr, 0.15 / x, xp.pow(pos, xp.asarray(np.float32(-0.5))), pos ** 0.7

    def run(x, row, pos, lr, step):
        return exact.call(rule, jnp, jnp.minimum(step, 0), x, row, pos, lr)

    got = jax.jit(run)(x, row, pos, jnp.float32(0.15), jnp.int32(3))
    want = (x / 0.15, x / row, x / np.float32(0.15), 0.15 / x, np.power(pos, np.float32(-0.5)),
            np.power(pos, np.float32(0.7)))
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (k, int(np.sum(g.view(np.uint32) != w.view(np.uint32))))
