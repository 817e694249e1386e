"""Property tests: every update agrees across NumPy, array-api-strict, torch and JAX
(under ``jax.jit`` with every numeric hyper-parameter traced), keeps the dtype, and keeps
slots finite on zero-gradient rows. Namespaces and their skip reasons live in NAMESPACES.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="property tests need hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import array_api_compat  # noqa: E402
import meshembed.math as mm  # noqa: E402

#: One step from identical inputs: libraries differ only by rounding (and XLA's fused ops).
RTOL = {"float32": 1e-5, "float64": 1e-12}
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# --- namespaces: name -> module to import, with the reason to skip when missing ----------
NAMESPACES = {
    "array_api_strict": ("array_api_strict", "array-api-strict is not installed"),
    "torch": ("torch", "torch is not installed"),
    "jax": ("jax", "jax is not installed"),
}


def _available(name: str):
    module, reason = NAMESPACES[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(reason)


# --- strategies -----------------------------------------------------------------------------
def f(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Floats in [lo, hi] that are exact in float32 and never subnormal (XLA on CPU flushes
    subnormals to zero, NumPy and torch keep them)."""
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False).map(
        lambda v: float(np.float32(v)) if abs(v) >= 1e-30 else 0.0)


POS, ANY, COUNT = "pos", "any", "count"

ALGORITHMS: dict[str, tuple[tuple[str, ...], dict[str, st.SearchStrategy]]] = {
    "stochastic_gradient_descent": ((), {}),
    "assign": ((), {}),
    "adagrad": ((POS,), {}),
    "adagrad_momentum": ((POS, ANY), dict(
        momentum=f(0, 0.99), use_nesterov=st.booleans(), exponent=f(1, 4),
        beta2=st.one_of(st.just(1.0), f(0.5, 0.999)), epsilon=f(1e-10, 1e-3))),
    "bounded_adagrad": ((POS,), dict(
        update_accumulator_first=st.booleans(),
        max_var_update=st.one_of(st.just(0.0), f(0.01, 1)),
        max_accumulator=st.one_of(st.just(0.0), f(1, 100)))),
    "frequency_aware_adagrad": ((POS, COUNT), dict(
        step_counter=f(1, 1000), l1_regularization_strength=f(0, 0.1),
        l2_regularization_strength=f(0, 0.1), max_lr_multiplier=f(1, 10),
        probability_exponent=f(0, 1), accumulator_decay=f(0.5, 1),
        initial_accumulator_value=f(0.01, 1))),
    "ftrl": ((POS, ANY), dict(
        l1=f(0, 0.1), l2=f(0, 0.1), lr_power=st.one_of(st.just(-0.5), f(-1, -0.1)),
        beta=f(0, 1), multiply_linear_by_lr=st.booleans())),
    "adam": ((ANY, POS), dict(
        beta1=f(0, 0.999), beta2=f(0, 0.999), epsilon=f(1e-8, 1e-3),
        use_sum_inside_sqrt=st.booleans())),
    "momentum": ((ANY,), dict(momentum=f(0, 0.99), use_nesterov=st.booleans())),
    "lion": ((ANY,), dict(beta1=f(0, 0.99), beta2=f(0, 0.999))),
    "rms_prop": ((POS, ANY), dict(rho=f(0, 0.99), momentum=f(0, 0.99), epsilon=f(1e-8, 1e-2))),
    # rho >= 0.5 keeps ms' - mg'^2 away from catastrophic cancellation (with rho = 0 it is
    # g^2 - g^2 and FMA-fused XLA legitimately differs from NumPy by ulp(g^2)/eps)
    "centered_rms_prop": ((POS, ANY, "small"), dict(
        rho=f(0.5, 0.99), momentum=f(0, 0.99), epsilon=f(1e-6, 1e-2))),
    "adadelta": ((POS, POS), dict(rho=f(0, 0.99), epsilon=f(1e-8, 1e-3))),
    "proximal_adagrad": ((POS,), dict(l1=f(0, 0.1), l2=f(0, 0.1))),
    "online_yogi": ((POS, ANY), dict(l1=f(0, 0.1), l2=f(0, 0.1), beta2=f(0.5, 0.999))),
    "proximal_yogi": ((POS, ANY), dict(
        l1=f(0, 0.1), l2=f(0, 0.1), beta1=f(0, 0.99), beta2=f(0.5, 0.999),
        epsilon=f(1e-6, 1e-2))),
    "frequency_estimator": ((COUNT,), dict(
        tau=f(0, 1), max_delta=f(1, 100), outlier_threshold=f(0, 10))),
}
ELEMENT = {POS: f(0.01, 10), ANY: f(-3, 3), COUNT: st.integers(0, 50).map(float),
           "small": f(-0.05, 0.05)}


@st.composite
def problems(draw, algorithm: str):
    kinds, hp_strategies = ALGORITHMS[algorithm]
    n, d = 3, 2  # one shape: each jitted function compiles once per dtype
    def arr(elem):
        return np.array(draw(st.lists(elem, min_size=n * d, max_size=n * d))).reshape(n, d)
    params = arr(f(1, 10) if algorithm == "frequency_estimator" else f(-3, 3))
    grads = arr(f(-3, 3))
    zero_rows = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    grads[np.array(zero_rows)] = 0.0
    slots = tuple(arr(ELEMENT[k]) for k in kinds)
    hp = {k: draw(s) for k, s in hp_strategies.items()}
    lr = 1000.0 if algorithm == "frequency_estimator" else draw(f(1e-3, 1))
    return params, grads, slots, lr, hp


# --- runners --------------------------------------------------------------------------------
def _run_numpy(algorithm, dtype, params, grads, slots, lr, hp):
    xp = array_api_compat.array_namespace(np.empty(0))
    entry = mm.OPTIMIZERS[algorithm]
    cast = lambda a: np.asarray(a, dtype=dtype)  # noqa: E731
    p, s = entry.update(xp, cast(params), cast(grads), entry.slots_type(*map(cast, slots)),
                        lr=lr, **hp)
    return [np.asarray(p), *map(np.asarray, s)]


def _run_strict(algorithm, dtype, params, grads, slots, lr, hp):
    xps = _available("array_api_strict")
    entry = mm.OPTIMIZERS[algorithm]
    cast = lambda a: xps.asarray(np.asarray(a, dtype=dtype))  # noqa: E731
    # a 0-d float64 array lr must not upcast float32 rows
    p, s = entry.update(xps, cast(params), cast(grads), entry.slots_type(*map(cast, slots)),
                        lr=xps.asarray(lr, dtype=xps.float64), **hp)
    assert p.dtype == getattr(xps, dtype)
    return [np.asarray(x) for x in (p, *s)]


def _run_torch(algorithm, dtype, params, grads, slots, lr, hp):
    torch = _available("torch")
    xp = array_api_compat.array_namespace(torch.empty(0))
    entry = mm.OPTIMIZERS[algorithm]
    cast = lambda a: torch.asarray(np.asarray(a, dtype=dtype))  # noqa: E731
    p, s = entry.update(xp, cast(params), cast(grads), entry.slots_type(*map(cast, slots)),
                        lr=lr, **hp)
    assert p.dtype == getattr(torch, dtype)
    return [x.numpy() for x in (p, *s)]


@functools.lru_cache(maxsize=None)
def _jitted(algorithm: str, static: tuple[tuple[str, Any], ...]) -> Callable:
    jax = _available("jax")
    entry = mm.OPTIMIZERS[algorithm]

    def step(p, g, slots, lr, numeric):
        xp = array_api_compat.array_namespace(p)
        return entry.update(xp, p, g, entry.slots_type(*slots), lr=lr, **numeric, **dict(static))

    return jax.jit(step)


def _run_jax(algorithm, dtype, params, grads, slots, lr, hp):
    jax = _available("jax")
    jnp = jax.numpy
    static = tuple(sorted((k, v) for k, v in hp.items() if isinstance(v, bool)))
    ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
    with ctx:
        cast = lambda a: jnp.asarray(np.asarray(a, dtype=dtype))  # noqa: E731
        numeric = {k: cast(v) for k, v in hp.items() if not isinstance(v, bool)}
        p, s = _jitted(algorithm, static)(cast(params), cast(grads), tuple(map(cast, slots)),
                                          cast(lr), numeric)
        assert p.dtype == jnp.dtype(dtype)
        return [np.asarray(x) for x in (p, *s)]


RUNNERS = {"array_api_strict": _run_strict, "torch": _run_torch, "jax": _run_jax}


def _cancelling(algorithm: str, problem, output: int) -> float:
    """The size of the terms output ``output`` of an update subtracts from each other (0 where
    none cancel). FTRL's linear slot (output 2) takes ``(acc'^P - acc^P) / lr * p``: powers
    that differ by a rounding between libraries (torch's ``pow`` vs NumPy's, 1 ulp) are
    amplified by ``|p| / lr`` (hypothesis found 1 ulp of 2.4e-7 x 64 = 1.5e-5 with lr = 1/64).
    The parameters divide that error by ``acc'^P / lr`` again, so only the slot needs it."""
    if algorithm != "ftrl" or output != 2:
        return 0.0
    params, grads, slots, lr, hp = problem
    power = -hp["lr_power"]
    biggest = float(np.max((slots[0] + grads * grads) ** power))
    return float(np.max(np.abs(params))) * biggest / (1.0 if hp["multiply_linear_by_lr"] else lr)


#: Roundings allowed on a cancelling term: each library's ``pow`` is within a few ulps.
CANCEL_ULPS = 8


def _check(algorithm: str, namespace: str, problem, dtype: str) -> None:
    params, grads, slots, lr, hp = problem
    expected = _run_numpy(algorithm, dtype, params, grads, slots, lr, hp)
    actual = RUNNERS[namespace](algorithm, dtype, params, grads, slots, lr, hp)
    zero = np.all(grads == 0, axis=-1)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == np.dtype(dtype)
        assert np.all(np.isfinite(e[zero])), f"{algorithm}: non-finite output {i} on zero rows"
        # The error scale is the magnitude of what went in as much as of what came out: XLA
        # may fuse `p - lr * g` into one multiply-add, so when p and lr * g nearly cancel
        # (hypothesis found p = g = 1.625, lr = 0.99999) a tiny result differs by a rounding
        # of the inputs' size. Floor: results that underflow may be subnormal (NumPy) or
        # flushed to 0 (XLA).
        scale = max(float(np.max(np.abs(e))), float(np.max(np.abs(params))))
        eps = float(np.finfo(dtype).eps)
        atol = max(RTOL[dtype] * scale, CANCEL_ULPS * eps * _cancelling(algorithm, problem, i),
                   1e3 * float(np.finfo(dtype).tiny))
        np.testing.assert_allclose(a, e, rtol=RTOL[dtype], atol=atol,
                                   err_msg=f"{algorithm} output {i} on {namespace}")


@pytest.mark.parametrize("namespace", list(RUNNERS))
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_namespaces_agree(algorithm: str, namespace: str) -> None:
    _available(namespace)

    @SETTINGS
    @given(problem=problems(algorithm), dtype=st.sampled_from(["float32", "float64"]))
    def run(problem, dtype):
        _check(algorithm, namespace, problem, dtype)

    run()


def test_every_supported_algorithm_has_a_property_test() -> None:
    covered = set(ALGORITHMS) | {"mdl_adagrad_light", "user_defined_program"}
    assert covered == set(mm.OPTIMIZERS)


@pytest.mark.parametrize("namespace", list(RUNNERS))
def test_ftrl_linear_slot_cancellation(namespace: str) -> None:
    """The example hypothesis found on torch (a CI run of session 6): sqrt(8.3125) and sqrt(8.25)
    differ by a rounding between libraries, times |p| / lr = 64 in the linear slot."""
    _available(namespace)
    z = np.zeros((3, 2))
    params, grads = z.copy(), z.copy()
    params[1, 0], grads[1, 0] = 1.0, 0.25
    acc = np.ones((3, 2))
    acc[1, 0] = 8.25
    hp = {"l1": 0.0, "l2": 0.0, "lr_power": -0.5, "beta": 0.0, "multiply_linear_by_lr": False}
    _check("ftrl", namespace, (params, grads, (acc, z.copy()), 0.015625, hp), "float32")
