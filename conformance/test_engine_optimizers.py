"""Every optimizer through ``TPUEmbedding`` on every backend against ``reference.py``.

One table (V=11, dim 3, mean combiner) looked up by two features (a weighted multi-hot
ragged feature and a dense one, duplicate ids in and across samples), 2 shards MOD, three
steps with fixed random gradients. The reference is dense NumPy: ``A_f`` combination
matrices, ``G = Σ_f A_fᵀ·dact_f``, one update per looked-up row (every row when non-lazy).
Tables, every slot and the activations are compared after every step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import meshembed as me
from conformance.tolerances import assert_close
from conformance import reference

E = me.embedding
V, D, B, STEPS = 11, 3, 4, 3
LRS = (0.3, 0.2, 0.25)  # per step; the dynamic-lr variants send these via `learning_rates`
# Rows 9 and 10 are never looked up: lazy optimizers must leave them alone.
RAGGED = [[[1, 1, 4], [2], [], [8, 1]], [[0, 3, 3, 3], [5, 6], [6], [1]], [[7], [2, 2], [4, 0, 8], []]]
DENSE = [[1, 4, 4, 2], [3, 3, 0, 6], [5, 5, 5, 7]]
# Duplicate-id weights include a zero: that id is still "looked up" (touched).
WEIGHTS = [[0.5, 2.0, 1.0, 1.5, 1.0, 0.0], [1.0, 0.25, 0.5, 2.0, 1.0, 1.5, 0.75, 1.0], [1.0, 0.5, 3.0, 1.0, 2.0, 0.5]]


def _sgd_velocity(xp, params, grads, slots, *, lr, decay):
    """A user rule for CustomOptimizer: velocity SGD."""
    v = decay * slots.velocity + grads
    return params - lr * v, type(slots)(v)


def _ref_sgd_velocity(p, g, slots, lr, decay):
    (v,) = slots
    v = decay * v + g
    return p - lr * v, (v,)


def _case(spec, rule, init, hp=None, non_lazy=False, dynamic=(), grad_scale=1.0, table_init=None, row_slots=()):
    """spec(lr) -> optimizer; reference rule; initial slot values; reference hyper-parameters;
    ``row_slots``: indices of the slots holding one value per row (row-wise optimizers)."""
    return dict(spec=spec, rule=rule, init=init, hp=hp or {}, non_lazy=non_lazy, dynamic=dynamic,
                grad_scale=grad_scale, table_init=table_init, row_slots=row_slots)


CASES = {
    "sgd": _case(lambda lr, **kw: E.SGD(lr, **kw), "sgd", ()),
    "adagrad": _case(lambda lr, **kw: E.Adagrad(lr, initial_accumulator_value=0.2, **kw), "adagrad", (0.2,)),
    "adagrad_momentum": _case(
        lambda lr, **kw: E.AdagradMomentum(lr, momentum=0.8, exponent=3.0, beta2=1.0, epsilon=1e-6, **kw),
        "adagrad_momentum", (0.0, 0.0), dict(momentum=0.8, exponent=3.0, beta2=1.0, epsilon=1e-6)),
    "adagrad_momentum_nesterov_beta2": _case(
        lambda lr, **kw: E.AdagradMomentum(lr, momentum=0.7, use_nesterov=True, exponent=2.0, beta2=0.9,
                                           epsilon=1e-4, **kw),
        "adagrad_momentum", (0.0, 0.0), dict(momentum=0.7, use_nesterov=True, exponent=2.0, beta2=0.9, epsilon=1e-4)),
    "bounded_adagrad": _case(
        lambda lr, **kw: E.BoundedAdagrad(lr, max_var_update=0.05, max_accumulator=1.5, **kw),
        "bounded_adagrad", (0.1,), dict(max_var_update=0.05, max_accumulator=1.5)),
    "bounded_adagrad_accumulator_first": _case(
        lambda lr, **kw: E.BoundedAdagrad(lr, update_accumulator_first=True, max_var_update=0.2, **kw),
        "bounded_adagrad", (0.1,), dict(update_accumulator_first=True, max_var_update=0.2)),
    "frequency_aware_adagrad": _case(
        lambda lr, **kw: E.FrequencyAwareAdagrad(
            lr, step_counter=E.DynamicLearningRate(kw.pop("_tag", 0)), l1_regularization_strength=0.01,
            l2_regularization_strength=0.02, max_lr_multiplier=3.0, probability_exponent=0.5,
            accumulator_decay=0.9, initial_accumulator_value=0.2, **kw),
        "frequency_aware_adagrad", (0.2, 0.0),
        dict(l1_regularization_strength=0.01, l2_regularization_strength=0.02, max_lr_multiplier=3.0,
             probability_exponent=0.5, accumulator_decay=0.9, initial_accumulator_value=0.2),
        dynamic=("step_counter",)),
    "ftrl": _case(
        lambda lr, **kw: E.FTRL(lr, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1,
                                learning_rate_power=-0.5, initial_accumulator_value=0.1, **kw),
        "ftrl", (0.1, 0.0), dict(l1=0.01, l2=0.02, beta=0.1, lr_power=-0.5)),
    "ftrl_multiply_linear_by_lr": _case(
        lambda lr, **kw: E.FTRL(lr, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1,
                                learning_rate_power=-0.6, multiply_linear_by_learning_rate=True,
                                initial_accumulator_value=0.1, **kw),
        "ftrl_lr_linear", (0.1, 0.0), dict(l1=0.01, l2=0.02, beta=0.1, lr_power=-0.6)),
    "adam_lazy_sum_inside_sqrt": _case(
        lambda lr, **kw: E.Adam(lr, beta_1=0.8, beta_2=0.9, epsilon=1e-3, sum_inside_sqrt=True, **kw),
        "adam", (0.0, 0.0), dict(beta1=0.8, beta2=0.9, epsilon=1e-3, sum_inside_sqrt=True)),
    "adam_lazy_eps_outside": _case(
        lambda lr, **kw: E.Adam(lr, beta_1=0.8, beta_2=0.9, epsilon=1e-3, sum_inside_sqrt=False, **kw),
        "adam", (0.0, 0.0), dict(beta1=0.8, beta2=0.9, epsilon=1e-3, sum_inside_sqrt=False)),
    "adam_non_lazy_sum_inside_sqrt": _case(
        lambda lr, **kw: E.Adam(lr, beta_1=0.8, beta_2=0.9, epsilon=1e-3, lazy_adam=False, **kw),
        "adam", (0.0, 0.0), dict(beta1=0.8, beta2=0.9, epsilon=1e-3, sum_inside_sqrt=True), non_lazy=True),
    "adam_non_lazy_eps_outside": _case(
        lambda lr, **kw: E.Adam(lr, beta_1=0.8, beta_2=0.9, epsilon=1e-3, lazy_adam=False, sum_inside_sqrt=False,
                                **kw),
        "adam", (0.0, 0.0), dict(beta1=0.8, beta2=0.9, epsilon=1e-3, sum_inside_sqrt=False), non_lazy=True),
    # TF's defaults: 1 - 0.999 computed from the float32 beta (0.00099998713) differs from the
    # float64 difference (0.001) by 1.3e-5, so a backend that traces hyper-parameters as float32
    # values while NumPy folds them as Python floats shows it here (beta 0.9 hides it: 2.4e-7).
    "adam_tf_defaults": _case(
        lambda lr, **kw: E.Adam(lr, **kw),
        "adam", (0.0, 0.0), dict(beta1=0.9, beta2=0.999, epsilon=1e-7, sum_inside_sqrt=True)),
    "momentum": _case(lambda lr, **kw: E.Momentum(lr, momentum=0.8, **kw), "momentum", (0.0,), dict(momentum=0.8)),
    "momentum_nesterov": _case(lambda lr, **kw: E.Momentum(lr, momentum=0.8, use_nesterov=True, **kw), "momentum",
                               (0.0,), dict(momentum=0.8, use_nesterov=True)),
    "lion_lazy": _case(lambda lr, **kw: E.Lion(lr, beta1=0.8, beta2=0.95, **kw), "lion", (0.0,),
                       dict(beta1=0.8, beta2=0.95)),
    "lion_non_lazy": _case(lambda lr, **kw: E.Lion(lr, beta1=0.8, beta2=0.95, use_non_lazy_lion=True, **kw), "lion",
                           (0.0,), dict(beta1=0.8, beta2=0.95), non_lazy=True),
    "rms_prop": _case(lambda lr, **kw: E.RMSProp(lr, rho=0.8, momentum=0.5, epsilon=1e-4, **kw), "rms_prop",
                      (0.0, 0.0), dict(rho=0.8, momentum=0.5, epsilon=1e-4)),
    "centered_rms_prop": _case(lambda lr, **kw: E.CenteredRMSProp(lr, rho=0.8, momentum=0.5, epsilon=1e-2, **kw),
                               "centered_rms_prop", (0.0, 0.0, 0.0), dict(rho=0.8, momentum=0.5, epsilon=1e-2)),
    "adadelta": _case(lambda lr, **kw: E.Adadelta(lr, rho=0.9, epsilon=1e-4, **kw), "adadelta", (0.0, 0.0),
                      dict(rho=0.9, epsilon=1e-4)),
    "proximal_adagrad": _case(lambda lr, **kw: E.ProximalAdagrad(lr, l1=0.05, l2=0.1, **kw), "proximal_adagrad",
                              (0.1,), dict(l1=0.05, l2=0.1)),
    "proximal_adagrad_l2_only": _case(lambda lr, **kw: E.ProximalAdagrad(lr, l2=0.1, **kw), "proximal_adagrad",
                                      (0.1,), dict(l2=0.1)),
    "online_yogi": _case(lambda lr, **kw: E.OnlineYogi(lr, l1=0.01, l2=0.02, beta2=0.9, **kw), "online_yogi",
                         (1e-6, 0.0), dict(l1=0.01, l2=0.02, beta2=0.9)),
    "proximal_yogi": _case(
        lambda lr, **kw: E.ProximalYogi(lr, l1=0.01, l2=0.02, beta1=0.8, beta2=0.9, epsilon=1e-3, **kw),
        "proximal_yogi", (1e-6, 0.0), dict(l1=0.01, l2=0.02, beta1=0.8, beta2=0.9, epsilon=1e-3)),
    "assign": _case(lambda lr, **kw: E.Assign(**kw), "assign", ()),
    # row-wise extensions (fbgemm's TBE optimizers): one accumulator / velocity per row
    "row_wise_adagrad": _case(lambda lr, **kw: E.RowWiseAdagrad(lr, initial_accumulator_value=0.05, epsilon=1e-3, **kw),
                              "row_wise_adagrad", (0.05,), dict(epsilon=1e-3), row_slots=(0,)),
    "row_wise_adam": _case(lambda lr, **kw: E.RowWiseAdam(lr, beta_1=0.8, beta_2=0.9, epsilon=1e-3, **kw),
                           "row_wise_adam", (0.0, 0.0), dict(beta1=0.8, beta2=0.9, epsilon=1e-3), row_slots=(1,)),
    "custom": _case(lambda lr, **kw: E.CustomOptimizer(_sgd_velocity, ("velocity",), (0.5,), learning_rate=lr,
                                                       hyperparameters={"decay": 0.7}, **kw),
                    _ref_sgd_velocity, (0.5,), dict(decay=0.7)),
}

# Shared options (spec §4.1), added to an optimizer's own arguments.
OPTIONS = {
    "plain": {},
    "gradient_clip": dict(clipvalue=(-0.4, 0.6)),
    "weight_clip": dict(clip_weight_min=-0.15, clip_weight_max=0.2),
    "weight_decay": dict(weight_decay_factor=0.1),
    "weight_decay_by_lr": dict(weight_decay_factor=0.3, multiply_weight_decay_factor_by_learning_rate=True),
    "dynamic_lr": {},
}
# Every optimizer runs plain and with a dynamic lr; every option runs on a representative set.
OPTION_OPTIMIZERS = ("sgd", "adagrad", "ftrl", "adam_lazy_sum_inside_sqrt", "momentum", "adadelta", "custom", "assign",
                     "row_wise_adagrad")
PARAMS = [(c, "plain") for c in CASES] + [(c, "dynamic_lr") for c in CASES if c != "assign"] + [
    (c, o) for o in OPTIONS if o not in ("plain", "dynamic_lr") for c in OPTION_OPTIMIZERS]


def _config(opt, dim=D, vocab=V):
    tables = [me.TableConfig("t", vocab, dim, optimizer=opt, combiner="mean")]
    features = [me.FeatureConfig("t", (B,), name="multi"), me.FeatureConfig("t", (B,), name="dense")]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy="mod")


def _inputs(step):
    rows = RAGGED[step]
    ragged = me.RaggedIds.from_lists(rows)
    weights = me.RaggedIds(ragged.row_splits, np.asarray(WEIGHTS[step], np.float32))
    return [ragged, np.asarray(DENSE[step], np.int32)], [weights, None]


def _matrices(step, vocab=V):
    """Reference combination matrices of both features (built from the lists, not inputs.py)."""
    rows = RAGGED[step]
    slots = np.array([b for b, r in enumerate(rows) for _ in r])
    ids = np.array([i for r in rows for i in r])
    a_multi = reference.combination_matrix(slots, ids, np.asarray(WEIGHTS[step]), B, vocab, "mean")
    a_dense = reference.combination_matrix(np.arange(B), np.asarray(DENSE[step]), np.ones(B), B, vocab, "mean")
    touched = reference.touched([ids, DENSE[step]], vocab)
    return (a_multi, a_dense), touched


def _gradients(step, scale, dim=D):
    rng = np.random.default_rng(100 + step)
    return [(rng.normal(size=(B, dim)) * scale).astype(np.float32) for _ in range(2)]


def _reference_run(case, option, table0, dim=D, vocab=V, lrs=None):
    """(activations per step, (params, slots) after every step) by the dense reference;
    the lr is ``LRS[step]`` for the dynamic-lr option, else the constant ``LRS[0]``."""
    if lrs is None:
        lrs = LRS if option == "dynamic_lr" else (LRS[0],) * STEPS
    rule = case["rule"] if callable(case["rule"]) else reference.UPDATES[case["rule"]]
    opts = OPTIONS[option]
    mech = dict(
        gradient_clip=opts["clipvalue"] if "clipvalue" in opts else None,
        weight_clip=(opts["clip_weight_min"], opts["clip_weight_max"]) if "clip_weight_min" in opts else None,
        weight_decay=opts.get("weight_decay_factor", 0.0),
        decay_by_lr=opts.get("multiply_weight_decay_factor_by_learning_rate", False))
    p = table0.astype(np.float64)
    slots = tuple(np.full((vocab, 1 if k in case["row_slots"] else dim), v, np.float64)
                  for k, v in enumerate(case["init"]))
    acts, states = [], []
    for s in range(STEPS):
        (a1, a2), touched = _matrices(s, vocab)
        acts.append([a1 @ p, a2 @ p])
        g1, g2 = _gradients(s, case["grad_scale"], dim)
        grad = a1.T @ g1 + a2.T @ g2
        mask = np.ones(vocab, bool) if case["non_lazy"] else touched
        hp = dict(case["hp"])
        for name in case["dynamic"]:
            hp[name] = float(10 + s)
        p, slots = reference.lazy_step(
            lambda pp, gg, ss, **kw: reference.with_mechanics(rule, pp, gg, ss, **kw), p, slots, grad, mask,
            lr=lrs[s], **mech, **hp)
        states.append((p, slots))
    return acts, states


def _engine_run(backend, case, option, table0):
    dynamic = option == "dynamic_lr"
    kw = dict(OPTIONS[option])
    n_tags = 0
    if dynamic:
        lr, n_tags = E.DynamicLearningRate(0), 1
    else:
        lr = LRS[0]
    if case["dynamic"]:
        kw["_tag"] = n_tags
        n_tags += 1
    opt = case["spec"](lr, **kw)
    emb = me.TPUEmbedding(_config(opt), backend=backend, num_shards=2, initializers={"t": table0})
    acts, states = [], []
    for s in range(STEPS):
        feats, weights = _inputs(s)
        emb.enqueue(feats, weights)
        acts.append([emb.backend.to_numpy(a) for a in emb.dequeue()])
        values = []
        if dynamic:
            values.append(np.float32(LRS[s]))
        if case["dynamic"]:
            values.append(np.float32(10 + s))
        emb.apply_gradients(_gradients(s, case["grad_scale"]), learning_rates=values)
        states.append(emb.retrieve_parameters("t"))
    return emb, acts, states


@pytest.mark.parametrize("name,option", PARAMS, ids=[f"{c}-{o}" for c, o in PARAMS])
def test_optimizer_matches_reference(backend, name, option):
    case = CASES[name]
    table0 = np.random.default_rng(7).uniform(-0.5, 0.5, (V, D)).astype(np.float32)
    emb, acts, states = _engine_run(backend, case, option, table0)
    slot_names = emb.table_slot_names("t")
    assert len(slot_names) == len(case["init"])
    ref_acts, ref_states = _reference_run(case, option, table0)
    for s in range(STEPS):
        for f in range(2):
            assert_close(acts[s][f], ref_acts[s][f], what=f"step {s} activation {f}")
        p, slots = ref_states[s]
        assert_close(states[s]["parameters"], p, what=f"step {s} parameters")
        for slot_name, ref in zip(slot_names, slots):
            assert_close(states[s][slot_name], ref, what=f"step {s} {slot_name}")
    if not case["non_lazy"]:  # rows 9 and 10 are never looked up: lazy leaves them bit-identical
        np.testing.assert_array_equal(states[-1]["parameters"][9:], table0[9:])


def test_options_change_the_numbers():
    """The option cases are not vacuous: each one moves the reference away from plain."""
    table0 = np.random.default_rng(7).uniform(-0.5, 0.5, (V, D)).astype(np.float32)
    plain = _reference_run(CASES["adagrad"], "plain", table0)[1][-1][0]
    for option in ("gradient_clip", "weight_clip", "weight_decay", "weight_decay_by_lr"):
        other = _reference_run(CASES["adagrad"], option, table0)[1][-1][0]
        assert np.max(np.abs(other - plain)) > 1e-3, option


# -- FrequencyEstimator: the lr is the global step, the table is D (width 1) ----------------
def test_frequency_estimator_matches_reference(backend):
    opt = E.FrequencyEstimator(E.DynamicLearningRate(0), tau=0.25, max_delta=6.0, outlier_threshold=2.0)
    d0 = np.full((V, 1), 6.0, np.float32)  # D starts at max_delta
    emb = me.TPUEmbedding(_config(opt, dim=1), backend=backend, num_shards=2, initializers={"t": d0})
    hp = dict(tau=0.25, max_delta=6.0, outlier_threshold=2.0)
    p, (last,) = d0.astype(np.float64), (np.zeros((V, 1)),)
    steps = (1.0, 2.0, 5.0, 20.0)
    for s, global_step in enumerate(steps):
        k = s % STEPS
        feats, weights = _inputs(k)
        emb.enqueue(feats, weights)
        emb.dequeue()
        emb.apply_gradients([np.zeros((B, 1), np.float32)] * 2, learning_rates=[np.float32(global_step)])
        _, touched = _matrices(k)
        p, (last,) = reference.lazy_step(reference.frequency_estimator, p, (last,), np.zeros((V, 1)), touched,
                                         lr=global_step, **hp)
        got = emb.retrieve_parameters("t")
        assert_close(got["parameters"], p, what=f"step {s} D")
        assert_close(got["last_hit_step"], last, what=f"step {s} last_hit_step")
    assert np.any(p[:, 0] < 6.0) and np.any(p[:, 0] == 6.0)  # both branches taken


def test_frequency_estimator_table_starts_at_max_delta(backend):
    """Spec §4.2 "D starts at max_delta": the default when no initializer is given (not
    TF2's truncated normal, which would make D a meaningless random estimate)."""
    opt = E.FrequencyEstimator(E.DynamicLearningRate(0), tau=0.25, max_delta=6.0, outlier_threshold=2.0)
    emb = me.TPUEmbedding(_config(opt, dim=1), backend=backend, num_shards=2, seed=3)
    got = emb.retrieve_parameters("t")
    np.testing.assert_array_equal(got["parameters"], np.full((V, 1), 6.0, np.float32))
    np.testing.assert_array_equal(got["last_hit_step"], np.zeros((V, 1), np.float32))
    feats, weights = _inputs(0)
    emb.enqueue(feats, weights)
    emb.dequeue()
    emb.apply_gradients([np.zeros((B, 1), np.float32)] * 2, learning_rates=[np.float32(4.0)])
    _, touched = _matrices(0)
    p, (last,) = reference.lazy_step(reference.frequency_estimator, np.full((V, 1), 6.0), (np.zeros((V, 1)),),
                                     np.zeros((V, 1)), touched, lr=4.0, tau=0.25, max_delta=6.0,
                                     outlier_threshold=2.0)
    got = emb.retrieve_parameters("t")
    assert_close(got["parameters"], p, what="D after one step")
    assert_close(got["last_hit_step"], last, what="last_hit_step after one step")
    # an explicit initializer (TableConfig or engine override) still wins; other optimizers
    # keep the truncated normal
    table = me.TableConfig("t", V, 1, optimizer=opt, combiner="mean", initializer=lambda shape: np.ones(shape))
    cfg = me.EmbeddingConfig(tables=[table], features=[me.FeatureConfig("t", (B,), name="f")])
    np.testing.assert_array_equal(
        me.TPUEmbedding(cfg, backend=backend, num_shards=2).retrieve_parameters("t")["parameters"], 1.0)
    zeros = me.TPUEmbedding(_config(opt, dim=1), backend=backend, num_shards=2, initializers={"t": "zeros"})
    np.testing.assert_array_equal(zeros.retrieve_parameters("t")["parameters"], 0.0)
    sgd = me.TPUEmbedding(_config(E.SGD(0.1), dim=1), backend=backend, num_shards=2, seed=3)
    assert len(np.unique(sgd.retrieve_parameters("t")["parameters"])) == V


# -- optimizers that cannot run -----------------------------------------------------------
def _two_table_config(opt):
    tables = [me.TableConfig("ok", 7, 2, optimizer=E.SGD(0.1), combiner="sum"),
              me.TableConfig("bad", 7, 2, optimizer=opt, combiner="sum")]
    features = [me.FeatureConfig("ok", (B,), name="f_ok"), me.FeatureConfig("bad", (B,), name="f_bad")]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy="mod")


def _apply_once(emb):
    emb.enqueue([np.array([0, 1, 1, 6]), np.array([2, 3, 3, 5])])
    emb.dequeue()
    emb.apply_gradients([np.ones((B, 2), np.float32)] * 2)


def _snapshot(emb):
    return {t: {k: v.copy() for k, v in emb.retrieve_parameters(t).items()} for t in emb.table_names}


def _assert_unchanged(before, emb):
    after = _snapshot(emb)
    for t in before:
        for k in before[t]:
            np.testing.assert_array_equal(after[t][k], before[t][k], err_msg=f"{t}/{k}")


def test_mdl_adagrad_light_raises_and_changes_nothing(backend):
    with pytest.raises(me.errors.UntrainableError, match="MDLAdagradLight.*no public update formula"):
        me.TPUEmbedding(_two_table_config(E.MDLAdagradLight(0.1)), backend=backend, num_shards=2)
    assert isinstance(me.errors.UntrainableError(""), (me.ConfigError, NotImplementedError))


def _hlo_adagrad_program(with_lr: bool) -> bytes:
    """A TPU-style user program (g, p, acc[, lr]) -> (p', acc') serialized as HloModuleProto."""
    jax = pytest.importorskip("jax", reason="building an HLO program needs jax")
    jnp = jax.numpy
    one = jnp.zeros((1, 1), jnp.float32)

    def step(g, p, acc, lr):
        acc = acc + g * g
        return p - lr * g / jnp.sqrt(acc), acc

    if with_lr:
        return jax.jit(step).lower(one, one, one, jnp.float32(0)).compiler_ir("hlo").as_serialized_hlo_module_proto()
    fixed = jax.jit(lambda g, p, acc: step(g, p, acc, 0.3))
    return fixed.lower(one, one, one).compiler_ir("hlo").as_serialized_hlo_module_proto()


@pytest.mark.parametrize("with_lr", [True, False], ids=["program_takes_lr", "program_without_lr"])
def test_user_defined_program(backend, with_lr):
    """Runs on JAX (XLA's CPU client) and matches Adagrad; elsewhere a NotImplementedError
    naming the backend, with every table untouched."""
    program = _hlo_adagrad_program(with_lr)
    opt = E.UserDefinedProgram(0.3, program=program, num_slots=1)
    if backend.name != "jax":  # refused when the training engine is built, before any table exists
        with pytest.raises(NotImplementedError, match=f"UserDefinedProgram.*'{backend.name}' backend"):
            me.TPUEmbedding(_two_table_config(opt), backend=backend, num_shards=2)
        return
    table0 = np.random.default_rng(3).uniform(-0.5, 0.5, (V, D)).astype(np.float32)
    emb = me.TPUEmbedding(_config(opt), backend=backend, num_shards=2, initializers={"t": table0})
    emb.load_parameters("t", Slot_0=np.full((V, D), 0.2, np.float32))
    case = dict(CASES["adagrad"], init=(0.2,))
    for s in range(2):
        feats, weights = _inputs(s)
        emb.enqueue(feats, weights)
        emb.dequeue()
        emb.apply_gradients(_gradients(s, 1.0))
    got = emb.retrieve_parameters("t")
    _, states = _reference_run(case, "plain", table0, lrs=(0.3,) * STEPS)
    p, (acc,) = states[1]
    assert_close(got["parameters"], p, what="parameters")
    assert_close(got["Slot_0"], acc, what="Slot_0")


def test_user_defined_program_with_wrong_arity_is_a_config_error(backend):
    if backend.name != "jax":
        pytest.skip("only the jax backend runs HLO programs; elsewhere NotImplementedError is tested above")
    program = _hlo_adagrad_program(True)
    with pytest.raises(me.ConfigError, match="takes 4 parameters"):  # when the training engine is built
        me.TPUEmbedding(_two_table_config(E.UserDefinedProgram(0.3, program=program, num_slots=3)),
                        backend=backend, num_shards=2)


def test_missing_learning_rate_is_a_config_error(backend):
    """Assign ignores its (absent) lr; another optimizer without one (a proto whose
    ``learning_rate`` is unset) gets a clear error."""
    from meshembed._proto import tpu_embedding_configuration_pb2 as pb

    cfg = _two_table_config(E.FrequencyEstimator(E.DynamicLearningRate(0), tau=0.1, max_delta=5.0))
    msg = pb.TPUEmbeddingConfiguration.FromString(cfg.to_proto())
    msg.table_descriptor[1].optimization_parameters.ClearField("learning_rate")
    emb = me.TPUEmbedding(msg.SerializeToString(), backend=backend, num_shards=2)
    before = _snapshot(emb)
    with pytest.raises(me.ConfigError, match="'bad'.*no learning rate"):
        _apply_once(emb)
    _assert_unchanged(before, emb)
    assert math.isfinite(float(emb.retrieve_parameters("ok")["parameters"].sum()))


def test_custom_optimizer_in_a_table_config():
    opt = E.CustomOptimizer(_sgd_velocity, ("velocity",), (0.5,), learning_rate=0.1, hyperparameters={"decay": 0.7})
    t = me.TableConfig("t", V, D, optimizer=opt, combiner="mean")
    assert t.optimizer is opt
    cfg = _config(opt)
    assert isinstance(cfg, me.EmbeddingConfig) and cfg.tables[0].optimizer == opt
    for write in (cfg.to_proto, cfg.to_text, cfg.to_message):
        with pytest.raises(me.ConfigError, match=r"table 't'.*Python-level optimizer with no "
                                                 r"TPUEmbeddingConfiguration form"):
            write()


def test_custom_optimizer_engine_checkpoint_is_a_clear_error(backend, tmp_path):
    """A checkpoint stores the config as proto bytes, which cannot hold a CustomOptimizer:
    save() names the table and the fix and writes nothing; the engine keeps training."""
    opt = E.CustomOptimizer(_sgd_velocity, ("velocity",), (0.5,), learning_rate=0.1, hyperparameters={"decay": 0.7})
    emb = me.TPUEmbedding(_config(opt), backend=backend, num_shards=2)
    feats, weights = _inputs(0)
    emb.enqueue(feats, weights)
    emb.dequeue()
    emb.apply_gradients(_gradients(0, 1.0))
    before = _snapshot(emb)
    with pytest.raises(me.ConfigError, match=r"checkpoint of table 't'.*CustomOptimizer.*Fix: .*retrieve_parameters"):
        emb.save(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []
    _assert_unchanged(before, emb)
    # the documented fix: retrieve_parameters / load_parameters into an engine of the same config
    other = me.TPUEmbedding(_config(opt), backend=backend, num_shards=1)
    other.load_parameters("t", **before["t"])
    _assert_unchanged(before, other)
