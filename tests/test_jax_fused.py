"""The JAX backend's registered fused CPU updates (``meshembed_fused_update`` in
``meshembed_jax/cpu_kernels.cc``, formulas shared with the torch backend in
``meshembed_native/row_kernels.h``) against the core functions they stand in for: every
registered algorithm, plain and weighted (mean combiner) gradients, 1 shard, 3 MOD shards and
2 DIV shards, on JAX with the kernel, on JAX without it (the core function compiled by XLA)
and on the NumPy reference. The 8-device runs are in test_jax_conformance_devices.py and
test_jax_multidevice.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'meshembed[jax]'")

import meshembed as me  # noqa: E402
from meshembed.embedding.updates import REGISTERED_FUSED, make_update_fn  # noqa: E402
from meshembed_jax import backend as jax_backend  # noqa: E402
from meshembed_jax import cpu_kernels  # noqa: E402
from tests.fused_cases import OPTIMIZERS, train  # noqa: E402
from tests.jax_x64 import x64_where_named  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not cpu_kernels.usable("cpu", np.float32),
                                reason="the JAX CPU kernels could not be built here (no C++ compiler)")

def test_every_registered_kernel_is_tested():
    assert set(REGISTERED_FUSED) == set(OPTIMIZERS)


def _engine(backend: str, optimizer, combiner: str = "sum", shards: int = 1, dim: int = 8, strategy: str = "mod",
            vocab: int = 1000, batch: int = 64):
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", vocab, dim, optimizer=optimizer, combiner=combiner)],
        features=[me.FeatureConfig("t", (batch,), name="f")],
        sharding_strategy=strategy,
    )
    return me.TPUEmbedding(cfg, backend=backend, num_shards=shards, seed=3)


@pytest.mark.parametrize("algorithm", sorted(OPTIMIZERS))
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("shards,dim,strategy", [(1, 64, "mod"), (3, 7, "mod"), (2, 16, "div")])
def test_fused_kernel_equals_the_core_function(monkeypatch, algorithm, combiner, shards, dim, strategy):
    before = jax_backend.fused_calls[0]
    fused = train("jax", algorithm, combiner, shards, dim, strategy)
    assert jax_backend.fused_calls[0] == before + 3, "the fused kernel did not run"
    monkeypatch.setenv("MESHEMBED_JAX_FUSED", "0")
    core = train("jax", algorithm, combiner, shards, dim, strategy)
    assert jax_backend.fused_calls[0] == before + 3
    reference = train("numpy", algorithm, combiner, shards, dim, strategy)
    for name in reference:
        # Same float32 operations in the same order (batch-order sums, no fused multiply-add)
        # as the NumPy reference: equal to the last bit. XLA's compilation of the core
        # function may reorder roundings (it turns a/sqrt(b) into a*rsqrt(b)): 2e-6.
        np.testing.assert_array_equal(fused[name], reference[name], err_msg=name)
        np.testing.assert_allclose(core[name], reference[name], rtol=2e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("algorithm", sorted(OPTIMIZERS))
def test_plain_update_rows_equals_numpy(algorithm):
    """``update_rows`` without the combiner (one gradient row per id): duplicates summed in
    batch order (the engine's batches pad with ids the kernel skips: the tests above)."""
    rng = np.random.default_rng(0)
    ids = np.array([5, 3, 5, 999, 3, 5, 0, 42, 998], np.int64)
    grads = rng.standard_normal((ids.size, 16)).astype(np.float32)
    results = []
    for name in ("jax", "numpy"):
        emb = _engine(name, OPTIMIZERS[algorithm](), dim=16, shards=2)
        be = emb.backend
        fn = make_update_fn(be.xp, emb.layout.tables[0], [])
        before = jax_backend.fused_calls[0]
        state = be.update_rows(emb._state[0], be.asarray(ids), be.asarray(grads), fn)
        if name == "jax":
            assert jax_backend.fused_calls[0] == before + 1
        results.append([np.asarray(be.unshard(t)) for t in state])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


def test_nonfinite_gradient_writes_nothing():
    """The device guard skips the fused call: the error names the feature, tables unchanged."""
    emb = _engine("jax", me.embedding.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6), batch=4)
    before = {k: v.copy() for k, v in emb.retrieve_parameters("t").items()}
    emb.enqueue([np.array([1, 2, 2, 3])])
    emb.dequeue()
    grad = np.ones((4, 8), np.float32)
    grad[2, 5] = np.nan
    calls = jax_backend.fused_calls[0]
    with pytest.raises(me.errors.InputError, match="'f'"):
        emb.apply_gradients([emb.backend.asarray(grad)])
    assert jax_backend.fused_calls[0] == calls + 1  # the kernel was dispatched, and wrote nothing
    for name, value in emb.retrieve_parameters("t").items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


@pytest.mark.parametrize("case", ["clipping", "weight_decay", "fixed_capacity", "float64", "off"])
def test_not_used_where_it_does_not_compute_the_same_function(monkeypatch, case):
    """Clipping and weight decay wrap the formula; a fixed capacity is a promise only the
    capacity-bounded kernels keep; float64 tables have no fused kernel: the core runs."""
    optimizer = {"clipping": me.embedding.SGD(learning_rate=0.1, clipvalue=0.5),
                 "weight_decay": me.embedding.Adagrad(learning_rate=0.1, weight_decay_factor=0.01)
                 }.get(case, me.embedding.SGD(learning_rate=0.1))
    if case == "off":
        monkeypatch.setenv("MESHEMBED_JAX_FUSED", "0")
    emb = _engine("jax", optimizer, batch=4)
    if case == "fixed_capacity":
        monkeypatch.setattr(emb.backend, "capacity", 64)
    if case == "float64":
        fn = make_update_fn(emb.backend.xp, emb.layout.tables[0], [])
        table = emb.backend.create_table(np.zeros((1000, 8)), emb._placements[0])
        calls = jax_backend.fused_calls[0]
        emb.backend.update_rows([table], emb.backend.asarray(np.array([1, 2])),
                                emb.backend.asarray(np.ones((2, 8))), fn)
        assert jax_backend.fused_calls[0] == calls
        return
    calls = jax_backend.fused_calls[0]
    emb.enqueue([np.array([1, 2, 2, 3])])
    emb.dequeue()
    emb.apply_gradients([emb.backend.asarray(np.ones((4, 8), np.float32))])
    assert jax_backend.fused_calls[0] == calls
    reference = _engine("numpy", optimizer, batch=4)
    reference.enqueue([np.array([1, 2, 2, 3])])
    reference.dequeue()
    reference.apply_gradients([np.ones((4, 8), np.float32)])
    np.testing.assert_allclose(emb.retrieve_parameters("t")["parameters"],
                               reference.retrieve_parameters("t")["parameters"], rtol=2e-6, atol=1e-7)


def test_the_tables_are_updated_in_place():
    """The compiled kernel writes into the donated tables: no copy of a table (the call sits
    in a loop of one trip; inline, XLA copied the table twice around it: 90 ms on W1)."""
    emb = _engine("jax", me.embedding.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6), vocab=4096, dim=16, batch=4)
    emb.enqueue([np.array([1, 2, 2, 3])])
    emb.dequeue()
    emb.apply_gradients([emb.backend.asarray(np.ones((4, 16), np.float32))])
    be = emb.backend
    state = emb._state[0]
    layout = state[0].layout
    key = next(k for k in be._kernels if k[:3] == ("fused_update", layout, 16))
    hp = next(v for k, v in be._hp_arrays.items() if k[0] == layout)
    ids = be._replicated_1d(layout, np.array([1, 2, 2, 3]), 8, -1, np.int32)
    segs = be._replicated_1d(layout, np.array([0, 1, 2, 3]), 8, 8, np.int32)
    grads = be._jax.device_put(np.ones((8, 16), np.float32), layout.replicated)
    text = be._kernels[key].lower(tuple(t.data for t in state), ids, grads, segs, be._no_weights(layout, np.float32),
                                  be._guard(layout, None), hp).compile().as_text()
    assert "meshembed_fused_update" in text
    copies = [line for line in text.splitlines() if " copy(" in line and "4096" in line.split("copy(")[0]]
    assert not copies, copies


# -- the dense optimizer (me.optimizers.Adadelta) ------------------------------------------
def _dense(backend: str, shapes: list, steps: int = 3, dtype=np.float32, schedule: bool = False) -> list:
    rng = np.random.default_rng(9)
    variables = [me.Variable(rng.standard_normal(s).astype(dtype), name=f"w{i}", backend=backend)
                 for i, s in enumerate(shapes)]
    lr = (me.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.9) if schedule else 0.5)
    opt = me.optimizers.Adadelta(learning_rate=lr, rho=0.9, epsilon=1e-6)
    opt.build(variables)
    be = me.get_backend(backend)
    for _ in range(steps):
        grads = [be.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]
        opt.apply_gradients(list(zip(grads, variables)))
    return [np.asarray(v.value) for v in variables] + [np.asarray(s.value) for s in opt.variables if s.value.ndim]


@pytest.mark.parametrize("shapes", [[(1000,)], [(7, 33), (5,), (64,)], [(50,)] * 20], ids=["one", "three", "twenty"])
@pytest.mark.parametrize("schedule", [False, True])
def test_dense_fused_update_equals_the_core_function(monkeypatch, shapes, schedule):
    """One FFI call for up to 64 variables (``in_place_group``), bit-identical to the NumPy
    reference; the core step compiled by XLA (groups of 8) within float32 rounding."""
    from meshembed_jax import dense

    before = dense.fused_dense_calls[0]
    fused = _dense("jax", shapes, schedule=schedule)
    assert dense.fused_dense_calls[0] == before + 3, "the fused kernel did not run"
    monkeypatch.setenv("MESHEMBED_JAX_FUSED", "0")
    core = _dense("jax", shapes, schedule=schedule)
    assert dense.fused_dense_calls[0] == before + 3
    reference = _dense("numpy", shapes, schedule=schedule)
    assert len(fused) == len(reference) == 3 * len(shapes)
    for got, xla, want in zip(fused, core, reference):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(xla, want, rtol=2e-6, atol=1e-7)


def test_dense_float64_takes_the_core_function_in_groups_of_eight():
    """float64 has no fused kernel: the group of 20 the fused path would take runs as XLA
    plans of at most 8 variables (compile time), same numbers as NumPy."""
    from meshembed_jax import dense

    before = dense.fused_dense_calls[0]
    got = _dense("jax", [(30,)] * 20, dtype=np.float64)
    assert dense.fused_dense_calls[0] == before
    for g, w in zip(got, _dense("numpy", [(30,)] * 20, dtype=np.float64)):
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)


def test_dense_fused_update_writes_in_place():
    """The compiled call writes into the donated arrays: no copy of a variable or slot."""
    import jax
    import jax.numpy as jnp

    be = me.get_backend("jax")
    step = me.optimizers.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6)._step_fn(be.xp)
    arrays = [[jnp.ones((4096,), jnp.float32) for _ in range(2)] for _ in range(3)]
    grads, lrs = [jnp.ones((4096,), jnp.float32)] * 2, [jnp.asarray(0.5, jnp.float32)] * 2
    compiled = be._fused_dense(step, grads, lrs, arrays)
    assert compiled is not None
    text = compiled.as_text()
    assert "meshembed_dense_update" in text
    assert not [line for line in text.splitlines() if " copy(" in line and "4096" in line.split("copy(")[0]]
    new = be.compile_update(step, 2)(grads, lrs, *arrays)
    jax.block_until_ready(new)
    assert all(a.is_deleted() for t in arrays for a in t)  # donated


@pytest.mark.parametrize("shape", [(4, 6), (3, 8)], ids=["wrong-width", "wrong-rows"])
def test_mismatched_gradients_raise_before_anything_is_written(shape):
    """Called directly with gradients that do not match the ids or the table, ``update_rows``
    leaves the fused kernel (it would read past the gradients) to the core path, which
    raises at trace time, before the donated tables are touched."""
    emb = _engine("jax", me.embedding.Adagrad(learning_rate=0.1), vocab=100, batch=4)
    be = emb.backend
    fn = make_update_fn(be.xp, emb.layout.tables[0], [])
    before = [np.asarray(be.unshard(t)).copy() for t in emb._state[0]]
    calls = jax_backend.fused_calls[0]
    with pytest.raises(TypeError):
        be.update_rows(emb._state[0], be.asarray(np.array([1, 2, 2, 3])), be.asarray(np.ones(shape, np.float32)), fn)
    assert jax_backend.fused_calls[0] == calls
    for t, b in zip(emb._state[0], before):
        np.testing.assert_array_equal(np.asarray(be.unshard(t)), b)
