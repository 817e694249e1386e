"""The JAX backend's fused updates on generated row kernels (``meshembed_native.codegen``
called by ``meshembed_fused_update`` in ``meshembed_jax/cpu_kernels.cc``) equal the NumPy
backend: every optimizer of conformance's engine suite x {none, gradient clipping, weight
decay} in float32 through ``TPUEmbedding(backend="jax")`` (two features, duplicates, a
weighted ragged feature, 2 MOD shards, 3 steps), and in float32 and float64 (x64 on for those
tests only) through ``update_rows`` on both backends, plain and with the combiner's backward
(``grad_index``/``grad_weights``). The fused path is asserted taken (``backend.stats()``).

Bits, always. Where the formula calls pow/exp/log the kernel calls its own float32 function (the
C library's in float64) and NumPy its own SIMD one (they differ by the bound test_codegen.py states, ``LIBM_ULP``): the
NumPy backend of those cases then runs the core's math with those same pow/exp/log
(test_codegen's ``LibmNumpy``), so the comparison stays exact.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'meshembed[jax]'")

import meshembed as me  # noqa: E402
from conformance.test_engine_optimizers import CASES, OPTIONS, STEPS, V, _config, _gradients, _inputs  # noqa: E402
from meshembed.embedding.layout import build_layout  # noqa: E402
from meshembed.embedding.updates import make_rule, rule_values  # noqa: E402
from meshembed.sharding import Placement  # noqa: E402
from meshembed_jax import backend as jax_backend  # noqa: E402
from meshembed_jax import cpu_kernels  # noqa: E402
from meshembed_native import codegen  # noqa: E402
from meshembed_numpy import NumpyBackend  # noqa: E402
from tests.jax_x64 import x64_where_named  # noqa: E402,F401
from tests.test_codegen import LIBM_NUMPY  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kernels.usable("cpu", np.float32),
                                reason="the JAX CPU kernels could not be built here (no C++ compiler)")

E = me.embedding
OPTION_NAMES = ("plain", "gradient_clip", "weight_decay")
ENGINE = [(c, o) for c in CASES for o in OPTION_NAMES]
#: update_rows: a representative set (the engine test above covers every optimizer)
DIRECT = ("sgd", "adagrad", "adagrad_momentum", "ftrl", "adam_lazy_sum_inside_sqrt", "adadelta", "custom")


class LibmNumpyBackend(NumpyBackend):
    """The NumPy reference with the pow/exp/log the kernels call (codegen.float32_math / the C library)."""

    @property
    def xp(self):
        return LIBM_NUMPY


def _optimizer(name: str, option: str):
    case = CASES[name]
    kw = dict(OPTIONS[option])
    if case["dynamic"]:
        kw["_tag"] = 1
    return case["spec"](E.DynamicLearningRate(0), **kw)


def _rule(name: str, option: str, dtype: str):
    return make_rule(build_layout(_config(_optimizer(name, option))).tables[0], "jax", dtype)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    """Every kernel these tests use, compiled in one compiler run."""
    rules = [_rule(n, o, "float32") for n, o in ENGINE] + [_rule(n, o, d) for n in DIRECT for o in OPTION_NAMES
                                                           for d in ("float32", "float64")]
    codegen.prebuild((r, 1 + len(r.slot_names)) for r in rules)


def _calls_libm(rule) -> bool:
    kernel = codegen.row_kernel(rule, 1 + len(rule.slot_names))
    return any(n.op in ("pow", "exp", "log") and n.varying for n in kernel.graph.nodes)


def _reference(rule):
    """The NumPy backend computing what the rule's kernel computes (see the docstring)."""
    return LibmNumpyBackend() if _calls_libm(rule) else NumpyBackend()


def _lrs(name: str, step: int) -> list:
    lrs = [] if name == "assign" else [0.3 / (1 + step)]
    return lrs + ([10.0 + step] if CASES[name]["dynamic"] else [])


def _train(backend, name: str, option: str) -> dict:
    table0 = np.random.default_rng(7).uniform(-0.5, 0.5, (V, 3)).astype(np.float32)
    emb = me.TPUEmbedding(_config(_optimizer(name, option)), backend=backend, num_shards=2,
                          initializers={"t": table0})
    for s in range(STEPS):
        feats, weights = _inputs(s)
        emb.enqueue(feats, weights)
        emb.dequeue()
        emb.apply_gradients(_gradients(s, CASES[name]["grad_scale"]), learning_rates=_lrs(name, s))
    return emb.retrieve_parameters("t")


@pytest.mark.parametrize("name,option", ENGINE, ids=[f"{n}-{o}" for n, o in ENGINE])
def test_engine_float32_fused_equals_numpy(name, option):
    calls = me.get_backend("jax").stats().get("fused_updates", 0)
    got = _train("jax", name, option)
    assert me.get_backend("jax").stats().get("fused_updates", 0) - calls == STEPS, "the fused kernel did not run every step"
    want = _train(_reference(_rule(name, option, "float32")), name, option)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


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


DIRECT_CASES = [(n, o, d, c) for n in DIRECT for o in OPTION_NAMES for d in ("float32", "float64") for c in (False, True)]


@pytest.mark.parametrize("name,option,dtype,combined", DIRECT_CASES,
                         ids=[f"{n}-{o}-{d}-{'combined' if c else 'plain'}" for n, o, d, c in DIRECT_CASES])
def test_update_rows_fused_equals_numpy(name, option, dtype, combined):
    be = jax_backend.JaxBackend()  # the test's x64 setting (float64 cases run with x64 on)
    got = _direct(be, name, option, dtype, combined)
    assert be.stats().get("fused_updates", 0) == STEPS, "the fused kernel did not run every step"
    want = _direct(_reference(_rule(name, option, dtype)), name, option, dtype, combined)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b, err_msg=f"array {k}")


def test_fused_path_can_be_turned_off(monkeypatch):
    """``MESHEMBED_JAX_FUSED=0``: the XLA step, no generated kernel looked up."""
    monkeypatch.setenv("MESHEMBED_JAX_FUSED", "0")
    calls = me.get_backend("jax").stats().get("fused_updates", 0)
    got = _train("jax", "adam_lazy_sum_inside_sqrt", "plain")
    assert me.get_backend("jax").stats().get("fused_updates", 0) == calls
    want = _train("numpy", "adam_lazy_sum_inside_sqrt", "plain")
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-7, err_msg=key)  # the conformance float32 tolerance


def test_kernel_address_and_parameter_block_reach_the_ffi():
    """The compiled fused step names the FFI target with the kernel's address; the values
    travel as the doubles' bits, so a float64 value the float32 path could not hold arrives
    unrounded (a changed learning rate compiles nothing: test_update_rule_jax.py)."""
    block = cpu_kernels.hp_block([0.1, 1e-300])
    assert block.dtype == np.uint32 and block.size == 4
    np.testing.assert_array_equal(block.view(np.float64), [0.1, 1e-300])
    be = jax_backend.JaxBackend()
    rule = _rule("adagrad", "plain", "float32")
    layout = be.layout(Placement(V, 1, "mod"))
    step, kernel = be.fused_program(layout, 3, rule, [np.float32] * 2, True, False)
    assert kernel.dtype == "float32" and kernel.n_arrays == 2
    import jax

    datas = tuple(jax.numpy.zeros((1, V, 3), np.float32) for _ in range(2))
    ids = jax.numpy.zeros(8, np.int32)
    text = step.lower(datas, ids, jax.numpy.zeros((8, 3), np.float32), ids, jax.numpy.zeros(1, np.float32),
                      jax.numpy.asarray(True), jax.numpy.asarray(block[:2])).as_text()
    assert "meshembed_fused_update" in text and str(kernel.address) in text


def test_invalid_dedup_is_a_config_error():
    with pytest.raises(me.errors.ConfigError, match="Invalid `dedup`.*Received: dedup='hash'"):
        jax_backend.JaxBackend(dedup="hash")
