"""The fused kernels generated from the core's math, on every backend that runs them
(``capabilities.generated_kernels``: torch and JAX on CPU), against the NumPy reference — bits,
always — and against the same backend with them off (``type(backend)(fused=False)``: the core
function, compiled, within the conformance tolerance). Where a formula calls pow/exp/log the
reference takes the kernels' own (``kernel_cases.LIBM_NUMPY``), so the comparison stays exact.
That the fused path ran is read from ``backend.stats()`` (``fused_updates``,
``fused_dense_updates``).

* engine training runs: SGD/Adagrad/Adadelta on ragged Zipf batches over 1, 3 MOD and 2 DIV
  shards, sum and mean combiners; every optimizer of the engine suite x {plain, gradient
  clipping, weight decay}; representative optimizers with clipping, weight decay and a learning
  rate that changes every step; where the fused path is (not) taken;
* ``update_rows`` directly: every generated case of the codegen's tests (``kernel_cases.RULES``,
  float32 and float64, plain and the combiner's backward form), and the engine suite's
  optimizers on 3 DIV shards;
* the dense optimizer (``me.optimizers.Adadelta``): one fused call per step for every variable.

What only one backend has (its build fallback, JAX's capacity and donation, torch's kernel
selection) stays in tests/test_torch_fused.py and tests/test_jax_fused.py; x64 for JAX's float64
cases: tests/test_jax_x64.py runs this suite's float64 cases with the user's x64 on.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from conformance.kernel_cases import (IDS, LIBM_NUMPY, RULES, TRAIN_OPTIMIZERS, mixture, train, ulp_distance,
                                      values_for)
from conformance.test_engine_optimizers import CASES, OPTIONS as ENGINE_OPTIONS, STEPS, V, _config, _gradients, _inputs
from meshembed.embedding.layout import build_layout
from meshembed.embedding.updates import make_rule, rule_values
from meshembed.math.rule import apply_rule
from meshembed.sharding import Placement
from meshembed_native import codegen

E = me.embedding
_OFF: dict[type, object] = {}


@pytest.fixture
def fused(backend):
    """The backend under test where it runs generated kernels (else the test is skipped)."""
    if not backend.capabilities.generated_kernels:
        pytest.skip(f"backend {backend.name!r} runs no generated kernels here (capabilities.generated_kernels)")
    if codegen.row_kernel(RULES[0], 1) is None:
        pytest.skip("the generated kernels cannot be built here (no C++ compiler)")
    return backend


def _off(backend):
    """The same kind of backend with the generated kernels off (one per kind: its caches stay warm)."""
    kind = type(backend)
    if kind not in _OFF:
        _OFF[kind] = kind(fused=False)
    off = _OFF[kind]
    assert not off.capabilities.generated_kernels
    return off


def _count(backend, name: str = "fused_updates") -> int:
    return backend.stats().get(name, 0)


def _skip_dtype(backend, dtype: str) -> None:
    if dtype == "float64" and not backend.capabilities.float64:
        pytest.skip(f"backend {backend.name!r} declares no float64 support here")


def _numpy_like(rule, n_arrays: int):
    """The NumPy reference computing what ``rule``'s kernel computes: NumPy's own pow/exp/log
    unless the kernel calls them (then the kernels' ones, ``LIBM_NUMPY``)."""
    numpy = me.get_backend("numpy")
    kernel = codegen.row_kernel(rule, n_arrays)
    if not any(n.op in ("pow", "exp", "log") and n.varying for n in kernel.graph.nodes):
        return numpy

    class LibmNumpyBackend(type(numpy)):
        @property
        def xp(self):
            return LIBM_NUMPY

    return LibmNumpyBackend()


def _engine(backend, optimizer, combiner: str = "sum", shards: int = 1, dim: int = 8, strategy: str = "mod",
            vocab: int = 1000, batch: int = 64):
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", vocab, dim, optimizer=optimizer, combiner=combiner)],
        features=[me.FeatureConfig("t", (batch,), name="f")],
        sharding_strategy=strategy,
    )
    return me.TPUEmbedding(cfg, backend=backend, num_shards=shards, seed=3)


# -- engine runs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", sorted(TRAIN_OPTIMIZERS))
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("shards,dim,strategy", [(1, 64, "mod"), (3, 7, "mod"), (2, 16, "div")])
def test_fused_kernel_equals_the_core_function(fused, algorithm, combiner, shards, dim, strategy):
    before = _count(fused)
    got = train(fused, algorithm, combiner, shards, dim, strategy)
    assert _count(fused) == before + 3, "the fused kernel did not run"
    off = _off(fused)
    core = train(off, algorithm, combiner, shards, dim, strategy)
    assert _count(off) == 0
    reference = train("numpy", algorithm, combiner, shards, dim, strategy)
    for name in reference:
        # Same float32 operations in the same order (batch-order sums, no fused multiply-add)
        # as the NumPy reference: equal to the last bit. A compiler of the core function may
        # reorder roundings (XLA turns a/sqrt(b) into a*rsqrt(b)): 2e-6.
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)
        np.testing.assert_allclose(core[name], reference[name], rtol=2e-6, atol=1e-7, err_msg=name)


#: (optimizer, vocabulary, width, gradients of the 4 ids [1, 2, 2, 3]): clipping and weight decay
#: are recorded with the formula, so the generated kernel runs them too.
PATH_CASES = {
    "clipping": (lambda: E.SGD(learning_rate=0.1, clipvalue=0.5), 1000, 8, np.full((4, 8), 2.0, np.float32)),
    "clipping_small": (lambda: E.SGD(learning_rate=0.1, clipvalue=0.5), 100, 4,
                       np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)),
    "weight_decay": (lambda: E.Adagrad(learning_rate=0.1, weight_decay_factor=0.01), 1000, 8,
                     np.full((4, 8), 2.0, np.float32)),
    "off": (lambda: E.SGD(learning_rate=0.1), 1000, 8, np.full((4, 8), 2.0, np.float32)),
}


@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_where_the_fused_path_is_taken(fused, case):
    """Clipping and weight decay take the generated kernel (bit-identical to NumPy); with the
    kernels off the core function runs (within float32 rounding)."""
    make, vocab, dim, grads = PATH_CASES[case]
    be = _off(fused) if case == "off" else fused

    def run(backend):
        emb = _engine(backend, make(), vocab=vocab, dim=dim, batch=4)
        emb.enqueue([np.array([1, 2, 2, 3])])
        emb.dequeue()
        emb.apply_gradients([emb.backend.asarray(grads)])
        return emb.retrieve_parameters("t")["parameters"]

    calls = _count(be)
    got = run(be)
    assert _count(be) == calls + (case != "off")
    want = run("numpy")
    if case == "off":
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(got, want)


def test_nonfinite_gradient_writes_nothing(fused):
    """A NaN gradient: the error names the feature and every table is unchanged — with a
    device guard (``guarded_updates``) the fused step is dispatched and writes nothing, with a
    checked update (``checked_updates``) the kernel refuses while it sums, before any write."""
    emb = _engine(fused, E.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6), batch=4)
    before = {k: v.copy() for k, v in emb.retrieve_parameters("t").items()}
    emb.enqueue([np.array([1, 2, 2, 3])])
    emb.dequeue()
    grad = np.ones((4, 8), np.float32)
    grad[2, 5] = np.nan
    calls = _count(fused)
    with pytest.raises(me.errors.InputError, match="'f'"):
        emb.apply_gradients([emb.backend.asarray(grad)])
    assert _count(fused) == calls + (1 if fused.capabilities.guarded_updates else 0)
    for name, value in emb.retrieve_parameters("t").items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


#: Optimizers with options and a learning rate that is constant or changes every step.
ENGINE_CASES = {
    "adam_clip": lambda lr: E.Adam(learning_rate=lr, clipvalue=0.05, sum_inside_sqrt=False),
    "adam_non_lazy": lambda lr: E.Adam(learning_rate=lr, lazy_adam=False),
    "ftrl_decay": lambda lr: E.FTRL(learning_rate=lr, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                                    beta=0.1, weight_decay_factor=0.01,
                                    multiply_weight_decay_factor_by_learning_rate=True),
    "momentum_nesterov_wclip": lambda lr: E.Momentum(learning_rate=lr, use_nesterov=True, clip_weight_min=-0.05,
                                                     clip_weight_max=0.05),
    "lion": lambda lr: E.Lion(learning_rate=lr),
    "centered_rms_prop": lambda lr: E.CenteredRMSProp(learning_rate=lr, momentum=0.5),
    "proximal_yogi": lambda lr: E.ProximalYogi(learning_rate=lr, l1=0.001, l2=0.002),
    "adagrad_decay": lambda lr: E.Adagrad(learning_rate=lr, weight_decay_factor=0.05),
}


def _train_case(backend, make_opt, dynamic: bool, steps: int = 4) -> dict:
    rng = np.random.default_rng(7)
    lr = E.DynamicLearningRate(0) if dynamic else 0.05
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 300, 16, optimizer=make_opt(lr), combiner="mean")],
                             features=[me.FeatureConfig("t", (32,), name="f")])
    emb = me.TPUEmbedding(cfg, backend=backend, seed=3)
    for step in range(steps):
        lengths = rng.integers(0, 6, size=32)
        ids = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % 300
        emb.enqueue([me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), ids)])
        emb.dequeue()
        grads = [emb.backend.asarray(rng.standard_normal((32, 16)).astype(np.float32))]
        emb.apply_gradients(grads, learning_rates=[0.05 / (1 + step)] if dynamic else ())
    return {name: np.asarray(v) for name, v in emb.retrieve_parameters("t").items()}


@pytest.mark.parametrize("dynamic", [False, True], ids=["constant_lr", "lr_every_step"])
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_takes_the_generated_kernel_and_equals_numpy(fused, case, dynamic):
    before = _count(fused)
    got = _train_case(fused, ENGINE_CASES[case], dynamic)
    assert _count(fused) == before + 4, "the generated kernel did not run on every step"
    reference = _train_case("numpy", ENGINE_CASES[case], dynamic)
    for name in reference:
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)


OPTION_NAMES = ("plain", "gradient_clip", "weight_decay")
ENGINE = [(c, o) for c in CASES for o in OPTION_NAMES]


def _optimizer(name: str, option: str):
    case = CASES[name]
    kw = dict(ENGINE_OPTIONS[option])
    if case["dynamic"]:
        kw["_tag"] = 1
    return case["spec"](E.DynamicLearningRate(0), **kw)


def _rule(backend, name: str, option: str, dtype: str, vocab: int = V):
    return make_rule(build_layout(_config(_optimizer(name, option), vocab=vocab)).tables[0], backend, dtype)


def _lrs(name: str, step: int) -> list:
    lrs = [] if name == "assign" else [0.3 / (1 + step)]
    return lrs + ([10.0 + step] if CASES[name]["dynamic"] else [])


def _train_engine_case(backend, name: str, option: str) -> dict:
    table0 = np.random.default_rng(7).uniform(-0.5, 0.5, (V, 3)).astype(np.float32)
    emb = me.TPUEmbedding(_config(_optimizer(name, option)), backend=backend, num_shards=2, initializers={"t": table0})
    for s in range(STEPS):
        feats, weights = _inputs(s)
        emb.enqueue(feats, weights)
        emb.dequeue()
        emb.apply_gradients(_gradients(s, CASES[name]["grad_scale"]), learning_rates=_lrs(name, s))
    return emb.retrieve_parameters("t")


@pytest.mark.parametrize("name,option", ENGINE, ids=[f"{n}-{o}" for n, o in ENGINE])
def test_every_optimizer_through_the_engine_equals_numpy(fused, name, option):
    """Every optimizer of the engine suite x {plain, gradient clipping, weight decay}, float32:
    two features (a weighted ragged one), duplicates, 2 MOD shards, 3 steps."""
    calls = _count(fused)
    got = _train_engine_case(fused, name, option)
    assert _count(fused) - calls == STEPS, "the fused kernel did not run every step"
    rule = _rule(fused, name, option, "float32")
    want = _train_engine_case(_numpy_like(rule, 1 + len(rule.slot_names)), name, option)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


TURNED_OFF = {"lion": lambda be: _train_case(be, ENGINE_CASES["lion"], False, steps=2),
              "adam_lazy_sum_inside_sqrt": lambda be: _train_engine_case(be, "adam_lazy_sum_inside_sqrt", "plain")}


@pytest.mark.parametrize("case", sorted(TURNED_OFF))
def test_turned_off_the_core_function_runs(fused, case):
    """``fused=False`` (``MESHEMBED_<BACKEND>_FUSED=0``): no generated kernel runs; the core
    function within the conformance float32 tolerance."""
    off = _off(fused)
    got = TURNED_OFF[case](off)
    assert _count(off) == 0
    want = TURNED_OFF[case]("numpy")
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-6, atol=1e-7, err_msg=key)


# -- update_rows directly -------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", sorted(TRAIN_OPTIMIZERS))
def test_plain_update_rows_equals_numpy(fused, algorithm):
    """``update_rows`` without the combiner (one gradient row per id): duplicates summed in batch
    order, 2 shards."""
    rng = np.random.default_rng(0)
    ids = np.array([5, 3, 5, 999, 3, 5, 0, 42, 998], np.int64)
    grads = rng.standard_normal((ids.size, 16)).astype(np.float32)
    results = []
    for be in (fused, me.get_backend("numpy")):
        emb = _engine(be, TRAIN_OPTIMIZERS[algorithm](), dim=16, shards=2)
        rule = make_rule(emb.layout.tables[0])
        lr = emb.layout.tables[0].optimizer.learning_rate
        before = _count(be)
        state = be.update_rows(emb.state.tables[0], be.asarray(ids), be.asarray(grads), rule, values=(lr,))
        if be is fused:
            assert _count(be) == before + 1
        results.append([np.asarray(be.unshard(t)) for t in state])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


VOCAB, DIM, N_IDS = 40, 13, 90


@pytest.fixture(scope="module")
def every_kernel():
    """Every generated case's kernel, compiled in one compiler run."""
    return codegen.prebuild([(rule, 1 + len(rule.slot_names)) for rule in RULES])


def _problem(rule, seed: int, weighted: bool):
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.4, size=N_IDS) - 1) % VOCAB  # hot ids repeat
    tables = [mixture(rng, (VOCAB, DIM), rule.dtype)] + [
        mixture(rng, (VOCAB, DIM), rule.dtype, signed=False) for _ in rule.slot_names]
    if weighted:  # the combiner's backward: gradient rows by index, scaled
        grads = rng.standard_normal((30, DIM)).astype(rule.dtype)
        index = rng.integers(0, 30, size=N_IDS)
        weights = rng.uniform(0.1, 2.0, size=N_IDS).astype(np.float32)
    else:
        grads, index, weights = rng.standard_normal((N_IDS, DIM)).astype(rule.dtype), None, None
    return ids, tables, grads, index, weights


def _segment_reference(rule, values, ids, tables, grads, index, weights):
    """The NumPy backend's segment sum, then the core's math with the kernels' pow/exp/log."""
    rows = grads if index is None else grads[index] * (1.0 if weights is None else weights.reshape(-1, 1))
    uids, g = me.get_backend("numpy").segment_sum(ids, rows.astype(rule.dtype))
    with np.errstate(all="ignore"):
        new = apply_rule(LIBM_NUMPY, rule, values, g, *(t[uids] for t in tables))
    out = [t.copy() for t in tables]
    for o, n in zip(out, new):
        o[uids] = n
    return out


#: Every case with one gradient row per id; the weighted (combiner backward) form for the
#: option-free cases of both dtypes (the drivers' sums do not depend on the formula).
UPDATE_CASES = [(i, False) for i in range(len(RULES))] + [
    (i, True) for i, name in enumerate(IDS) if name.endswith(("-none-float32", "-none-float64"))]


@pytest.mark.parametrize("index,weighted", UPDATE_CASES,
                         ids=[f"{IDS[i]}-{'weighted' if w else 'rows'}" for i, w in UPDATE_CASES])
def test_every_generated_case_through_update_rows(fused, every_kernel, index, weighted):
    """Dedup, batch-order sums and the kernel of every case of the codegen's tests, bit for bit."""
    rule = RULES[index]
    _skip_dtype(fused, rule.dtype)
    ids, tables, grads, gindex, weights = _problem(rule, index, weighted)
    values = values_for(rule)
    want = _segment_reference(rule, values, ids, tables, grads, gindex, weights)
    state = [fused.create_table(t.copy(), Placement(VOCAB)) for t in tables]
    before = _count(fused)
    extra = {} if gindex is None else {"grad_index": fused.asarray(gindex), "grad_weights": fused.asarray(weights)}
    state = fused.update_rows(state, fused.asarray(ids), fused.asarray(grads), rule, values=values, **extra)
    assert _count(fused) == before + 1, "the generated kernel did not run"
    for k, (t, w) in enumerate(zip(state, want)):
        got = np.asarray(fused.unshard(t))
        assert got.dtype == w.dtype
        d = ulp_distance(got, w)
        assert d.max() == 0, f"array {k}: {int((d > 0).sum())} elements differ, worst {d.max()} ulp"


#: The engine suite's optimizers through update_rows: a representative set (the engine test
#: above covers every optimizer).
DIRECT = ("sgd", "adagrad", "adagrad_momentum", "ftrl", "adam_lazy_sum_inside_sqrt", "adadelta", "custom")
DIRECT_CASES = [(n, o, d, c) for n in DIRECT for o in OPTION_NAMES for d in ("float32", "float64") for c in (False, True)]


def _direct(backend, name: str, option: str, dtype: str, combined: bool) -> list:
    """Three update_rows calls of the rule on a 40-row table in 3 DIV shards (duplicates,
    padding-free ids), plain or with the combiner's backward form."""
    spec = build_layout(_config(_optimizer(name, option), vocab=40)).tables[0]
    rule = make_rule(spec, backend, dtype)
    rng = np.random.default_rng(11)
    placement = Placement(40, 3, "div")
    table = rng.uniform(-0.5, 0.5, (40, 5)).astype(dtype)
    init = CASES[name]["init"] or ()
    tables = [backend.create_table(table, placement)]
    tables += [backend.create_table(np.full((40, 5), v, dtype), placement) for v in init[:len(rule.slot_names)]]
    for s in range(STEPS):
        ids = rng.integers(0, 40, 30)
        ids[:6] = ids[6]  # duplicates
        values = rule_values(spec, rule, _lrs(name, s))
        if combined:
            segs = rng.integers(0, 8, 30)
            w = rng.uniform(0.5, 2.0, 30).astype(dtype)
            g = (rng.standard_normal((8, 5)) * CASES[name]["grad_scale"]).astype(dtype)
            tables = backend.update_rows(tables, backend.asarray(ids), backend.asarray(g), rule, values=values,
                                         grad_index=backend.asarray(segs), grad_weights=backend.asarray(w))
        else:
            g = (rng.standard_normal((30, 5)) * CASES[name]["grad_scale"]).astype(dtype)
            tables = backend.update_rows(tables, backend.asarray(ids), backend.asarray(g), rule, values=values)
    return [np.asarray(backend.unshard(t)) for t in tables]


@pytest.mark.parametrize("name,option,dtype,combined", DIRECT_CASES,
                         ids=[f"{n}-{o}-{d}-{'combined' if c else 'plain'}" for n, o, d, c in DIRECT_CASES])
def test_engine_optimizers_through_update_rows(fused, name, option, dtype, combined):
    _skip_dtype(fused, dtype)
    calls = _count(fused)
    got = _direct(fused, name, option, dtype, combined)
    assert _count(fused) - calls == STEPS, "the fused kernel did not run every step"
    rule = _rule(fused, name, option, dtype, vocab=40)
    want = _direct(_numpy_like(rule, 1 + len(rule.slot_names)), name, option, dtype, combined)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b, err_msg=f"array {k}")


# -- the dense optimizer (me.optimizers.Adadelta) -------------------------------------------------
def _dense(backend, shapes: list, steps: int = 3, dtype=np.float32, schedule: bool = False) -> list:
    rng = np.random.default_rng(9)
    be = me.get_backend(backend)
    variables = [me.Variable(rng.standard_normal(s).astype(dtype), name=f"w{i}", backend=be)
                 for i, s in enumerate(shapes)]
    lr = me.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.9) if schedule else 0.5
    opt = me.optimizers.Adadelta(learning_rate=lr, rho=0.9, epsilon=1e-6)
    opt.build(variables)
    for _ in range(steps):
        grads = [be.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]
        opt.apply_gradients(list(zip(grads, variables)))
    return [np.asarray(v.value) for v in variables] + [np.asarray(s.value) for s in opt.variables if s.value.ndim]


@pytest.mark.parametrize("shapes", [[(1000,)], [(7, 33), (5,), (64,)], [(50,)] * 20], ids=["one", "three", "twenty"])
@pytest.mark.parametrize("schedule", [False, True])
def test_dense_fused_update_equals_the_core_function(fused, shapes, schedule):
    """One fused call per step for every variable, bit-identical to the NumPy reference; the
    core step compiled within float32 rounding."""
    before = _count(fused, "fused_dense_updates")
    got = _dense(fused, shapes, schedule=schedule)
    assert _count(fused, "fused_dense_updates") == before + 3, "the fused kernel did not run"
    off = _off(fused)
    core = _dense(off, shapes, schedule=schedule)
    assert _count(off, "fused_dense_updates") == 0
    reference = _dense("numpy", shapes, schedule=schedule)
    assert len(got) == len(reference) == 3 * len(shapes)
    for a, c, want in zip(got, core, reference):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_allclose(c, want, rtol=2e-6, atol=1e-7)


def test_dense_float64_fused_update_equals_numpy(fused):
    """float64 runs the generated kernel too: bit-identical to NumPy."""
    _skip_dtype(fused, "float64")
    before = _count(fused, "fused_dense_updates")
    got = _dense(fused, [(30,)] * 20, dtype=np.float64)
    assert _count(fused, "fused_dense_updates") == before + 3, "the fused kernel did not run"
    for g, w in zip(got, _dense("numpy", [(30,)] * 20, dtype=np.float64)):
        assert g.dtype == np.float64
        np.testing.assert_array_equal(g, w)
