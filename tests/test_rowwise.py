"""Row-wise Adagrad / Adam (#36.5): the math against a per-row transcription of fbgemm's
kernels, the specs, their refusal by the TF proto, (V, 1) slots through load, checkpoints,
me.torch and me.jax. The engine on every backend: conformance/test_engine_optimizers.py;
fbgemm's own CPU kernel: tests/test_interop_rowwise.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import meshembed as me
from meshembed import math as me_math
from meshembed.interop import ulp_distance

E = me.embedding
V, D = 12, 5


def _fbgemm_rowwise_adagrad(p, g, acc, lr, eps):
    """fbgemm's CPU ``split_weight_update_cpu`` of rowwise_adagrad transcribed one row at a time
    in the rows' dtype (its ``at::acc_type<float, true>`` is float): a sequential sum of squares,
    ``/ D``, ``multiplier = lr / (sqrt(acc) + eps)``, ``p - g * multiplier``."""
    t = p.dtype.type
    p, acc = p.copy(), acc.copy()
    for r in range(p.shape[0]):
        s = t(0)
        for d in range(p.shape[1]):
            s = t(s + g[r, d] * g[r, d])
        acc[r, 0] = t(acc[r, 0] + t(s / t(p.shape[1])))
        multiplier = t(t(lr) / t(np.sqrt(acc[r, 0]) + t(eps)))
        for d in range(p.shape[1]):
            p[r, d] = t(p[r, d] - t(g[r, d] * multiplier))
    return p, acc


def _fbgemm_partial_rowwise_adam(p, g, m, v, lr, b1, b2, eps):
    """fbgemm's partial_rowwise_adam (CUDA template; no CPU kernel) with its bias corrections at
    1, one row at a time in the rows' dtype, without the FMA of ``m_t.fma_``."""
    t = p.dtype.type
    p, m, v = p.copy(), m.copy(), v.copy()
    for r in range(p.shape[0]):
        s = t(0)
        for d in range(p.shape[1]):
            s = t(s + g[r, d] * g[r, d])
        v[r, 0] = t(t(v[r, 0] * t(b2)) + t(t(s / t(p.shape[1])) * t(1.0 - b2)))
        for d in range(p.shape[1]):
            m[r, d] = t(t(m[r, d] * t(b1)) + t(g[r, d] * t(1.0 - b1)))
            p[r, d] = t(p[r, d] - t(t(lr) * t(m[r, d] / t(np.sqrt(v[r, 0]) + t(eps)))))
    return p, m, v


def _data(dtype, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.uniform(-1, 1, (V, D)).astype(dtype)
    g = (rng.normal(size=(V, D)) * rng.uniform(0.01, 10, (V, 1))).astype(dtype)
    return p, g


# D = 5 < 8: NumPy's pairwise sum is then the sequential loop, so the sums agree exactly; the
# interop test compares fbgemm's own kernel at D = 64 in ulps.
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_wise_adagrad_matches_fbgemm_formula(dtype):
    """Each of three steps, from the same state: bit-identical to the transcription."""
    p, g = _data(dtype)
    slots = me_math.initial_slots(np, "row_wise_adagrad", p, (0.1,))
    assert slots.accumulators.shape == (V, 1) and slots.accumulators.dtype == dtype
    for step in range(3):
        gs = g * dtype(step + 1)
        want_p, want_acc = _fbgemm_rowwise_adagrad(p, gs, slots.accumulators, 0.05, 1e-6)
        p, slots = me_math.apply_update(np, "row_wise_adagrad", p, gs, slots, lr=0.05,
                                        hyperparameters={"epsilon": 1e-6})
        assert p.dtype == dtype and slots.accumulators.shape == (V, 1)
        np.testing.assert_array_equal(slots.accumulators, want_acc)
        np.testing.assert_array_equal(p, want_p)
    assert np.max(np.abs(p - _data(dtype)[0])) > 1e-3  # the steps moved the rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_wise_adam_matches_fbgemm_formula(dtype):
    """Within 1 ulp of the transcription per step (``1 − β`` rounds once in double here, in
    the dtype there)."""
    p, g = _data(dtype, seed=1)
    slots = me_math.initial_slots(np, "row_wise_adam", p)
    assert [s.shape for s in slots] == [(V, D), (V, 1)]
    for step in range(3):
        gs = g * dtype(0.5 + step)
        want = _fbgemm_partial_rowwise_adam(p, gs, *slots, 0.02, 0.8, 0.95, 1e-5)
        p, slots = me_math.apply_update(np, "row_wise_adam", p, gs, slots, lr=0.02,
                                        hyperparameters={"beta1": 0.8, "beta2": 0.95, "epsilon": 1e-5})
        for got, ref, what in zip((p, *slots), want, ("parameters", "momenta", "velocities")):
            assert got.shape == ref.shape and got.dtype == dtype, what
            assert ulp_distance(got, ref).max() <= 1, what


@pytest.mark.parametrize("xp_name", ["torch", "jax"])
def test_math_is_framework_neutral(xp_name):
    """The same function over torch / jax arrays: float32 rows within 2 ulps of NumPy's."""
    p, g = _data(np.float32, seed=2)
    fresh = me_math.initial_slots(np, "row_wise_adagrad", p, (0.2,))
    ref_p, ref_slots = me_math.apply_update(np, "row_wise_adagrad", p, g, fresh, lr=0.1,
                                            hyperparameters={"epsilon": 1e-8})
    if xp_name == "torch":
        torch = pytest.importorskip("torch", reason="torch is an optional extra")
        xp, conv = me_math.common.namespace(torch.ones(1)), torch.from_numpy
    else:
        jnp = pytest.importorskip("jax.numpy", reason="jax is an optional extra")
        xp, conv = me_math.common.namespace(jnp.ones(1)), jnp.asarray
    got_p, got_slots = me_math.apply_update(xp, "row_wise_adagrad", conv(p), conv(g),
                                            me_math.initial_slots(xp, "row_wise_adagrad", conv(p), (0.2,)),
                                            lr=0.1, hyperparameters={"epsilon": 1e-8})
    assert ulp_distance(np.asarray(got_p), ref_p).max() <= 2
    assert ulp_distance(np.asarray(got_slots.accumulators), ref_slots.accumulators).max() <= 2


def test_rules_are_not_elementwise_and_slots_are_per_row():
    for name, row in (("row_wise_adagrad", ("accumulators",)), ("row_wise_adam", ("velocities",))):
        m = me_math.get_math(name)
        assert m.row_slots == row and name not in me_math.OPTIMIZERS  # an extension, not a proto field
        betas = {"beta1": 0.9, "beta2": 0.99} if "adam" in name else {}
        rule = me_math.rule.build_rule(name, {"epsilon": 1e-3, **betas})
        assert not rule.elementwise


# -- specs ----------------------------------------------------------------------------------
def _config(opt, name="t"):
    return me.EmbeddingConfig(tables=[me.TableConfig(name, V, D, optimizer=opt, combiner="sum")],
                              features=[me.FeatureConfig(name, (4,), name="f")])


def test_spec_defaults_follow_fbgemm_and_bad_values_are_refused():
    a = E.RowWiseAdagrad()
    assert (a.learning_rate, a.initial_accumulator_value, a.epsilon) == (0.01, 0.0, 1e-8)
    assert a.slot_names == ("accumulators",) and a.slot_initial_values() == (0.0,)
    assert a.hyperparameters() == {"epsilon": 1e-8}
    b = E.RowWiseAdam(0.002)
    assert (b.beta_1, b.beta_2, b.epsilon) == (0.9, 0.999, 1e-8) and b.slot_names == ("momenta", "velocities")
    with pytest.raises(me.ConfigError, match="epsilon.*> 0 when initial_accumulator_value is 0"):
        E.RowWiseAdagrad(0.1, epsilon=0.0)
    E.RowWiseAdagrad(0.1, epsilon=0.0, initial_accumulator_value=0.1)  # fine: no 0/0
    with pytest.raises(me.ConfigError, match="epsilon"):
        E.RowWiseAdam(0.1, epsilon=0.0)
    with pytest.raises(me.ConfigError, match="beta_2"):
        E.RowWiseAdam(0.1, beta_2=1.0)
    with pytest.raises(me.ConfigError, match="use_gradient_accumulation"):
        E.RowWiseAdagrad(0.1, use_gradient_accumulation=False)
    with pytest.raises(me.ConfigError, match="precision.*table 't'.*row-wise"):
        me.TableConfig("t", V, D, optimizer=E.RowWiseAdagrad(0.1), precision=E.Precision("bfloat16"))


@pytest.mark.parametrize("opt", [E.RowWiseAdagrad(0.1), E.RowWiseAdam(0.1)], ids=["adagrad", "adam"])
def test_tf_serialization_is_refused_naming_the_table(opt):
    cfg = _config(opt, name="clicks")
    for write in (cfg.to_proto, cfg.to_text, cfg.to_message):
        with pytest.raises(me.ConfigError, match=rf"table 'clicks'.*{type(opt).__name__}.*must stay meshembed-side"):
            write()
    from meshembed.config import proto_io

    with pytest.raises(me.ConfigError, match="cannot carry"):
        proto_io.optimizer_to_message(opt)


# -- engine state ---------------------------------------------------------------------------
def _train(emb, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        emb.enqueue([rng.integers(0, V - 2, 4)])
        emb.dequeue()
        emb.apply_gradients([rng.normal(size=(4, D)).astype(np.float32)])


def test_slot_memory_and_load_shapes():
    emb = me.TPUEmbedding(_config(E.RowWiseAdagrad(0.1, initial_accumulator_value=0.1)), backend="numpy", num_shards=2)
    got = emb.retrieve_parameters("t")
    assert got["accumulators"].shape == (V, 1) and got["accumulators"].nbytes == 4 * V  # 1/D of Adagrad's
    np.testing.assert_array_equal(got["accumulators"], np.float32(0.1))
    with pytest.raises(me.errors.InputError, match=r"`accumulators` for table 't'.*expected shape \(12, 1\)"):
        emb.load_parameters("t", accumulators=np.ones((V, D), np.float32))
    np.testing.assert_array_equal(emb.retrieve_parameters("t")["accumulators"], np.float32(0.1))  # unchanged
    emb.load_parameters("t", accumulators=np.full((V, 1), 2.0, np.float32))
    _train(emb, steps=1)
    acc = emb.retrieve_parameters("t")["accumulators"]
    assert np.all(acc[:V - 2][acc[:V - 2] != 2.0] > 2.0) and np.all(acc[V - 2:] == 2.0)  # lazy rows untouched


@pytest.mark.parametrize("opt", [E.RowWiseAdagrad(E.DynamicLearningRate(0), initial_accumulator_value=0.1,
                                                  clipvalue=(-1.0, None), weight_decay_factor=0.01),
                                 E.RowWiseAdam(0.05, beta_2=0.9)], ids=["adagrad", "adam"])
def test_checkpoint_round_trip_across_backends_and_shards(opt, tmp_path):
    """numpy with 2 shards -> torch and numpy with 3: the spec comes back equal, every array bit
    for bit, and one more step gives the same tables as the uninterrupted run."""
    lrs = [0.1] if opt.is_dynamic else []
    a = me.TPUEmbedding(_config(opt), backend="numpy", num_shards=2)
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, V, 4), rng.normal(size=(4, D)).astype(np.float32)) for _ in range(3)]
    for ids, g in batches[:2]:
        a.enqueue([ids]), a.dequeue(), a.apply_gradients([g], learning_rates=lrs)
    path = a.save(tmp_path / "ck")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tables"][0]["row_wise"]["class"] == type(opt).__name__
    t = me.TPUEmbedding.restore(path, backend="torch", num_shards=3)
    for k, v in a.retrieve_parameters("t").items():
        np.testing.assert_array_equal(t.retrieve_parameters("t")[k], v, err_msg=k)
    b = me.TPUEmbedding.restore(path, backend="numpy", num_shards=3)
    assert b.config.tables[0].optimizer == t.config.tables[0].optimizer == opt
    for emb in (a, b):
        ids, g = batches[2]
        emb.enqueue([ids]), emb.dequeue(), emb.apply_gradients([g], learning_rates=lrs)
    x, y = a.retrieve_parameters("t"), b.retrieve_parameters("t")
    assert x.keys() == y.keys()
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_checkpoint_with_a_bad_row_wise_entry_is_refused(tmp_path):
    from meshembed.embedding import checkpoint

    emb = me.TPUEmbedding(_config(E.RowWiseAdagrad(0.1)), backend="numpy")
    path = emb.save(tmp_path / "ck")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tables"][0]["row_wise"]["fields"]["epsilon"] = -1.0
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    import hashlib

    manifest["manifest_sha256"] = hashlib.sha256(checkpoint._canonical(body)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(me.errors.CheckpointError, match=r"row_wise.*table 't'.*epsilon"):
        me.TPUEmbedding.restore(path, backend="numpy")


# -- front ends -----------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 3])
def test_torch_module_trains_like_the_engine(shards):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    cfg = _config(E.RowWiseAdam(0.05))
    ec = me.torch.EmbeddingCollection(cfg, num_shards=shards, seed=4)
    emb = me.TPUEmbedding(cfg, backend="torch", num_shards=shards, seed=4)
    rng = np.random.default_rng(5)
    for _ in range(3):
        ids = rng.integers(0, V, 4)
        out = ec({"f": torch.from_numpy(ids)})["f"]
        ((out - 0.3) ** 2).sum().backward()
        emb.enqueue([ids])
        act = emb.dequeue()[0].requires_grad_()
        ((act - 0.3) ** 2).sum().backward()
        emb.apply_gradients([act.grad])
    state = ec.state_dict()
    assert tuple(state["t.velocities"].shape) == (V, 1)
    for k, v in emb.retrieve_parameters("t").items():
        np.testing.assert_array_equal(state[f"t.{k}"].numpy(), v, err_msg=k)
    other = me.torch.EmbeddingCollection(cfg, num_shards=1)
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.engine.retrieve_parameters("t")["velocities"], state["t.velocities"].numpy())


def test_jax_jitted_step_bit_identical_to_the_engine():
    jax = pytest.importorskip("jax", reason="jax is an optional extra")
    cfg = _config(E.RowWiseAdagrad(0.2, initial_accumulator_value=0.1))
    state = me.jax.init(cfg, seed=3)
    emb = me.TPUEmbedding(cfg, backend="jax", seed=3)

    def step(state, batch):
        acts = me.jax.lookup(state, batch)
        grads = jax.grad(lambda a: sum(jax.numpy.sum(jax.numpy.sin(x) * x) for x in a.values()))(acts)
        return me.jax.apply_gradients(state, batch, grads), grads

    step = jax.jit(step)
    rng = np.random.default_rng(6)
    for _ in range(3):
        feats = {"f": rng.integers(0, V, 4)}
        state, grads = step(state, me.jax.prepare(cfg, feats, capacity=8))
        emb.enqueue(feats)
        emb.dequeue()
        emb.apply_gradients([grads["f"]])
    got, want = state.parameters("t"), emb.retrieve_parameters("t")
    assert got["accumulators"].shape == (V, 1)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


# -- generated kernels -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name,hp,init", [("row_wise_adagrad", {"epsilon": 1e-6}, (0.1,)),
                                          ("row_wise_adam", {"epsilon": 1e-6, "beta1": 0.9, "beta2": 0.99}, (0.0, 0.0))])
def test_generated_kernel_is_bit_identical_to_numpy(name, hp, init, dtype):
    """The row mean recorded as a reduction and summed in NumPy's pairwise order: the same bits
    as the NumPy reference for widths around the 8- and 128-element boundaries."""
    pytest.importorskip("meshembed_native", reason="the native helpers ship with the backends")
    from meshembed_native import codegen

    rule = me_math.rule.build_rule(name, hp, dtype=dtype)
    kernel = codegen.row_kernel(rule, 1 + len(init))
    if kernel is None:
        pytest.skip("no C++ compiler: the generated kernels are unavailable (the core function runs)")
    assert kernel.widths == tuple(int(n in rule.math.row_slots) for n in ("parameters", *rule.slot_names))
    rng = np.random.default_rng(4)
    for dim in (1, 7, 8, 13, 64, 128, 129, 300):
        p = rng.uniform(-1, 1, (9, dim)).astype(dtype)
        g = (rng.normal(size=(9, dim)) * rng.uniform(0.01, 100, (9, 1))).astype(dtype)
        slots = [np.full((9, 1) if s in rule.math.row_slots else (9, dim), v, dtype)
                 for s, v in zip(rule.slot_names, init)]
        want = me_math.apply_rule(np, rule, (0.05,), g, p, *slots)
        arrays = [p.copy(), *(s.copy() for s in slots)]
        kernel.apply(arrays, g, (0.05,))
        for a, w in zip(arrays, want):
            np.testing.assert_array_equal(a, w, err_msg=f"dim {dim}")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_without_the_fused_path_the_core_function_runs(backend):
    """``fused=False``: the core function (torch's compiled gather -> rule -> scatter, JAX's XLA
    step), no generated kernel, within the conformance float32 tolerance of NumPy (rtol 2e-6,
    atol 1e-7: the row mean is summed in another order, XLA may reassociate)."""
    pytest.importorskip(backend, reason=f"{backend} is an optional extra")
    kind = type(me.get_backend(backend))
    off = kind(fused=False)
    cfg = _config(E.RowWiseAdam(0.05, beta_2=0.9))
    got, want = me.TPUEmbedding(cfg, backend=off, seed=1), me.TPUEmbedding(cfg, backend="numpy", seed=1)
    for emb in (got, want):
        _train(emb, steps=3)
    assert off.stats().get("fused_updates", 0) == 0
    for k, v in want.retrieve_parameters("t").items():
        np.testing.assert_allclose(got.retrieve_parameters("t")[k], v, rtol=2e-6, atol=1e-7, err_msg=k)
