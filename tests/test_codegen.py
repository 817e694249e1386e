"""Generated row kernels (meshembed_native.codegen) equal the NumPy reference of the core's
math: every element-wise optimizer × float32/float64 × {none, gradient clipping, weight
clipping, weight decay, weight decay × lr} and the static variants that change the code, bit
for bit. Where a formula calls pow/exp/log the kernel calls the C library's function (float64)
or the generated float32 one (``codegen.float32_math``) and NumPy its own SIMD one: the reference
then takes the kernel's too (``conformance.kernel_cases.LibmNumpy``), and the difference from NumPy is the stated bound
``LIBM_ULP``, tested on its own (the float32 functions also against the correctly rounded result)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import warnings
from dataclasses import replace

import numpy as np
import pytest

from meshembed.errors import InputError
from meshembed.math.custom import CustomOptimizer
from conformance.kernel_cases import (  # the cases the fused-kernel conformance module runs too
    IDS, LIBM, LIBM_NUMPY, OPTIONS, RULES, make_rule, mixture, ulp_distance, values_for)
from meshembed.math.registry import OPTIMIZERS, get_math
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed_native import codegen

_LIBM = LIBM

#: Measured bound, in ulp of the result, of the kernels' pow/exp/log against NumPy's
#: (docs/internals.md "Generated kernels"; this machine: NumPy's AVX-512 code): float64 calls the
#: C library (glibc), float32 the generated source's own vectorizable versions
#: (``codegen.float32_math``, <= 1 ulp of the correctly rounded result, tested below).
LIBM_ULP = {"pow": 1, "exp": 2, "log": 2}


def reference(rule, values, grads, arrays):
    with np.errstate(all="ignore"):
        return [np.asarray(w) for w in apply_rule(LIBM_NUMPY, rule, values, grads, *arrays)]


@pytest.fixture(scope="module")
def kernels():
    """Every case's kernel, compiled in one compiler run (cached on disk afterwards)."""
    built = codegen.prebuild([(rule, 1 + len(rule.slot_names)) for rule in RULES])
    return dict(zip(IDS, built))


def inputs(rule: UpdateRule, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (5, 37)  # an odd width: the vector loop's remainder runs too
    grads = mixture(rng, shape, rule.dtype)
    arrays = [mixture(rng, shape, rule.dtype)] + [mixture(rng, shape, rule.dtype, signed=False)
                                                  for _ in rule.slot_names]
    for a in arrays[1:]:
        a[4] = -a[4]  # one row of negative slots (NaN paths of sqrt and pow must agree too)
    return grads, arrays


def assert_same(got: np.ndarray, want: np.ndarray, ulps: int, what: str) -> None:
    d = ulp_distance(got, want)
    assert d.max() <= ulps, f"{what}: {int((d > ulps).sum())} elements differ, worst {d.max()} ulp"


@pytest.mark.parametrize("index", range(len(RULES)), ids=IDS)
def test_generated_kernel_equals_the_numpy_reference(kernels, index):
    rule = RULES[index]
    kernel = kernels[IDS[index]]
    assert kernel is not None and kernel.dtype == rule.dtype and kernel.n_params == len(rule.dynamic)
    grads, arrays = inputs(rule, seed=index)
    values = values_for(rule)
    want = [a.copy() for a in arrays]
    for _ in range(2):
        want = reference(rule, values, grads, want)
        kernel.apply(arrays, grads, values)
    for k, (got, ref) in enumerate(zip(arrays, want)):
        assert got.dtype == ref.dtype
        assert_same(got, ref, 0, f"array {k}")
        assert np.isfinite(ref).mean() > 0.5, "too few finite values for the comparison to mean much"


def test_the_comparison_catches_a_one_ulp_change(kernels):
    """Bits, not a tolerance: a kernel of a rule 1 ulp apart in one constant fails it."""
    rule = RULES[IDS.index("adam-base-none-float32")]
    bumped = float(np.nextafter(np.float32(0.9), np.float32(1.0)))  # beta1 one float32 ulp up
    other = replace(rule, static=tuple((k, bumped if k == "beta1" else v) for k, v in rule.static))
    grads, arrays = inputs(rule, seed=1)
    want = reference(other, values_for(rule), grads, arrays)
    kernels["adam-base-none-float32"].apply(arrays, grads, values_for(rule))
    assert ulp_distance(arrays[1], want[1]).max() > 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_libm_calls_are_within_the_stated_ulp_bound_of_numpy(dtype):
    """The kernels' pow/exp/log (float64: C library, float32: generated) against NumPy's own."""
    def fn(xp, params, grads, slots, *, lr):
        return params ** lr, type(slots)(xp.exp(grads), xp.log(xp.abs(slots.b)), 2.0 ** xp.minimum(grads, 60.0))
    opt = CustomOptimizer(fn, ("a", "b", "c"), (0.0,) * 3)
    rule = UpdateRule(math=get_math(opt), slot_names=("a", "b", "c"), dtype=dtype)
    kernel = codegen.row_kernel(rule, 4)
    rng = np.random.default_rng(4)
    n = 20000
    p = (np.abs(rng.standard_normal(n)) * 10).astype(dtype) ** 3
    g = (rng.standard_normal(n) * 20).astype(dtype)
    arrays = [p, np.zeros(n, dtype), (rng.standard_normal(n) * 1e3).astype(dtype), np.zeros(n, dtype)]
    for lr in (-2.7, 0.3, 1.7):
        with np.errstate(all="ignore"):
            want = [np.asarray(w) for w in apply_rule(np, rule, (lr,), g, *arrays)]
        got = [a.copy() for a in arrays]
        kernel.apply(got, g, (lr,))
        for name, a, b in zip(("pow", "exp", "log", "pow"), got, want):
            assert ulp_distance(a, b).max() <= LIBM_ULP[name], (name, lr)


_SPECIAL = np.float32([0, -0.0, 1, -1, 2, -2, 0.5, -0.5, 3, -3, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40,
                       3.4e38, -3.4e38, 2.0**24, 2.0**24 + 2, 1e30, -1e30, 0.3, 7, -7, 88.7, 89, -103, -104, -150])


def _worst_points(err: np.ndarray, grid: np.ndarray, count: int = 12) -> np.ndarray:
    """The grid points of the ``count`` largest local maxima of |err| (an approximation's worst cases)."""
    a = np.abs(err)
    peak = np.flatnonzero((a[1:-1] >= a[:-2]) & (a[1:-1] >= a[2:])) + 1
    peak = np.concatenate([[0], peak, [a.size - 1]])
    return grid[peak[np.argsort(a[peak])[-count:]]]


@functools.lru_cache(maxsize=1)
def _core_errors():
    """Relative errors of the float32 math's double cores on dense grids, against long double:
    log2 on z in [sqrt(1/2), sqrt(2)) (the reduced range, float values), exp2 on u in [-150, 128]."""
    if np.finfo(np.longdouble).nmant < 60:
        pytest.skip("no extended-precision long double here for the reference")
    z = np.unique(np.linspace(np.sqrt(0.5), np.sqrt(2), 1_000_001).astype(np.float32)).astype(np.float64)
    z = z[(z >= np.sqrt(0.5)) & (z < np.sqrt(2))]
    want = np.log2(z.astype(np.longdouble))
    log_err = ((codegen._float32_math_core("log2", z) - want) / np.where(want == 0, 1, want)).astype(np.float64)
    u = np.linspace(-150, 128, 2_780_001)
    exp_err = (codegen._float32_math_core("exp2", u) / np.exp2(u.astype(np.longdouble)) - 1).astype(np.float64)
    return (z, log_err), (u, exp_err)


def test_float32_math_cores_meet_their_error_bounds():
    """The bounds the 1-ulp argument in codegen's PREAMBLE rests on: log2 <= 4.3e-12, exp2 <= 1.9e-9
    relative (a degree less in either polynomial: 6.9e-10, 7.5e-8, too much for that argument)."""
    (z, log_err), (u, exp_err) = _core_errors()
    assert np.abs(log_err).max() <= 4.3e-12
    assert np.abs(exp_err).max() <= 1.9e-9
    assert np.abs(log_err).max() > 1e-13 and np.abs(exp_err).max() > 1e-10  # the grids reach the error
    # the worst reduced arguments in every binade of float (subnormal ones included): the
    # exponent split is exact, so the bound holds there too
    a = (_worst_points(log_err, z)[:, None] * np.exp2(np.arange(-149.0, 128.0))[None, :]).ravel()
    want = np.log2(a.astype(np.longdouble))
    got = codegen._float32_math_core("log2", a)
    assert (np.abs((got - want) / want).astype(np.float64) <= 4.3e-12).all()


def test_float32_math_is_within_one_ulp_of_the_correctly_rounded_result():
    """The generated float32 pow/exp/log: <= 1 ulp of float64 NumPy rounded to float32 over
    the whole range (2M points each and a sweep at the worst cases of the cores'
    polynomials), and the C library's (C99) result bit for bit on every special case."""
    rng = np.random.default_rng(7)
    n = 500_000
    x = np.concatenate([np.exp(rng.uniform(-103, 88, n)), rng.uniform(0, 2, n), -np.exp(rng.uniform(-20, 20, n)),
                        np.float32(1e-41) * rng.uniform(0, 100, n)]).astype(np.float32)
    y = np.concatenate([rng.uniform(-3, 3, n), rng.standard_normal(n) * 30, rng.integers(-20, 20, n),
                        rng.uniform(-1.2, 1.2, n)]).astype(np.float32)
    e = np.concatenate([rng.uniform(-110, 90, 3 * n), rng.standard_normal(n), _SPECIAL]).astype(np.float32)
    # The sweep: x at the log2 core's worst reduced arguments in every binade (and 1 + a few
    # ulps), y so that y log2|x| is large (the log error times |u|), near the overflow and
    # underflow edges and the subnormal results; exp at the exp2 core's worst r in every binade.
    (zs, log_err), (us, exp_err) = _core_errors()
    near = np.arange(-3, 4)
    zw = np.concatenate([_worst_points(log_err, zs), [1.0]])
    xw = (zw[:, None, None] * np.exp2(np.arange(-149, 128))[None, :, None]).astype(np.float32)
    xw = (xw.view(np.int32) + near[None, None, :].astype(np.int32)).view(np.float32).ravel()
    xw = xw[np.isfinite(xw) & (xw > 0)]
    edge = rng.choice([127.99, 127.5, -126.0, -149.0, -149.9, 100.0, -100.0, 1e-3], xw.size) + rng.uniform(-1e-3, 1e-3, xw.size)
    lx = np.log2(xw.astype(np.float64))
    yw = np.where(lx == 0, 1.0, edge / np.where(lx == 0, 1.0, lx)).astype(np.float32)
    rw = np.concatenate([_worst_points(exp_err, us - np.round(us)), [-0.5, 0.5]])
    ew = ((np.arange(-150, 128)[:, None] + np.unique(rw)[None, :]) * np.log(2)).astype(np.float32)
    ew = (ew[..., None].view(np.int32) + near.astype(np.int32)).view(np.float32).ravel()
    x, y = np.concatenate([x, xw, -xw]), np.concatenate([y, yw, np.round(yw)])
    e = np.concatenate([e, ew])
    with np.errstate(all="ignore"):
        exact = {"pow": np.power(x.astype(np.float64), y.astype(np.float64)).astype(np.float32),
                 "exp": np.exp(e.astype(np.float64)).astype(np.float32),
                 "log": np.log(np.abs(x).astype(np.float64)).astype(np.float32)}
    got = {"pow": codegen.float32_math("pow", x, y), "exp": codegen.float32_math("exp", e),
           "log": codegen.float32_math("log", np.abs(x))}
    for name in got:
        assert ulp_distance(got[name], exact[name]).max() <= 1, name
    sx, sy = (a.ravel() for a in np.meshgrid(_SPECIAL, _SPECIAL))
    for name, args in (("pow", (sx, sy)), ("exp", (_SPECIAL,)), ("log", (_SPECIAL,))):
        fn = getattr(_LIBM, name + "f")
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float] * len(args)
        want = np.array([fn(*v) for v in zip(*(a.tolist() for a in args))], np.float32)
        mine = codegen.float32_math(name, *args)
        close = ulp_distance(mine, want) <= 1  # every result within 1 ulp; C99's special cases: the same bits
        special = np.any([(a == 0) | np.isinf(a) | (np.abs(a) == 1) | (name != "pow") & (a < 0) for a in args], axis=0)
        assert close.all(), (name, [a[~close][:5] for a in args])
        assert (mine.view(np.int32) == want.view(np.int32))[special & ~np.isnan(want)].all(), name
        assert (np.isnan(mine) == np.isnan(want)).all(), name


def _libm_rows(xp, params, grads, slots, *, lr, c):
    return params + 0 * lr, type(slots)(xp.pow(slots.a, c), xp.exp(slots.b), xp.log(slots.d))


# (a constant 1/2 is recorded as NumPy's sqrt fast path, not as pow: run-time only)
@pytest.mark.parametrize("c, static", [(c, s) for c in (2.5, -0.7, 0.5, -0.5, 3.0) for s in (True, False)
                                       if not (s and c == 0.5)])
def test_kernels_compute_float32_math_bit_for_bit_at_every_position(c, static):
    """A kernel's pow (exponent a compile-time constant GCC folds, or a run-time value), exp
    and log are float32_math's bits in the vector body and in the remainder alike."""
    opt = CustomOptimizer(_libm_rows, ("a", "b", "d"), (0.0,) * 3, hyperparameters={"c": c})
    rule = UpdateRule(math=get_math(opt), slot_names=("a", "b", "d"), static=(("c", c),) if static else (),
                      dynamic=("lr",) if static else ("lr", "c"), dtype="float32")
    kernel = codegen.row_kernel(rule, 4)
    rng = np.random.default_rng(5)
    n = 4099  # not a multiple of any vector width
    a = np.concatenate([mixture(rng, (n - len(_SPECIAL),), "float32") * 30, _SPECIAL])
    b = np.concatenate([rng.uniform(-110, 90, n - len(_SPECIAL)).astype(np.float32), _SPECIAL])
    d = np.concatenate([np.exp(rng.uniform(-103, 88, n - len(_SPECIAL))).astype(np.float32), _SPECIAL])
    arrays = [np.zeros(n, np.float32), a.copy(), b.copy(), d.copy()]
    kernel.apply(arrays, np.zeros(n, np.float32), (0.1,) if static else (0.1, c))
    with np.errstate(all="ignore"):
        want = [codegen.float32_math("pow", a, np.float32(c)), codegen.float32_math("exp", b),
                codegen.float32_math("log", d)]
    for got, ref in zip(arrays[1:], want):
        assert_same(got, ref, 0, f"c={c} static={static}")


@pytest.mark.parametrize("extra", [("-fno-tree-vectorize", "-fno-tree-slp-vectorize", "-mno-avx512f", "-mno-fma"),
                                   ("-mno-avx512f",)],
                         ids=["scalar-no-fma", "avx2"])
def test_float32_math_bits_do_not_depend_on_the_vector_width(monkeypatch, tmp_path, extra):
    """The same source built without vectorization and FMA instructions (the C library's fma)
    or with 256-bit vectors only computes the same bits: no lane- or width-dependent step."""
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path))
    src = tmp_path / "math.cc"
    src.write_text(codegen.PREAMBLE + codegen._MATH_SOURCE)
    try:
        lib = ctypes.CDLL(str(codegen.native.build_library(src, "math_other", flags=(*codegen.FLAGS, *extra))))
    except codegen.native.BuildError as exc:
        pytest.skip(f"this compiler / CPU does not take {extra}: {str(exc)[:200]}")
    rng = np.random.default_rng(3)
    n = 100_003
    x = np.concatenate([mixture(rng, (n,), "float32") * 30, _SPECIAL])
    y = np.concatenate([rng.uniform(-4, 4, n).astype(np.float32), _SPECIAL[::-1]])
    e = np.concatenate([rng.uniform(-110, 90, n).astype(np.float32), _SPECIAL])
    ptr = ctypes.POINTER(ctypes.c_float)
    for name, a, b in (("pow", x, y), ("exp", e, e), ("log", np.abs(x), x)):
        out = np.empty_like(a)
        fn = getattr(lib, f"me_math_{name}")
        fn.restype, fn.argtypes = None, [ptr, ptr, ptr, ctypes.c_int64]
        fn(a.ctypes.data_as(ptr), b.ctypes.data_as(ptr), out.ctypes.data_as(ptr), a.size)
        want = codegen.float32_math(name, a, b) if name == "pow" else codegen.float32_math(name, a)
        assert_same(out, want, 0, f"{name} {extra}")


def test_float32_pow_of_one_half_is_a_correctly_rounded_square_root():
    """pow(x, ±1/2) takes the square-root path (AdagradMomentum's default exponent): +1/2 is
    sqrtf bit for bit, -1/2 within 1 ulp of the correctly rounded 1/sqrt(x), C99's special
    cases (pow(-0, ±1/2) = +0 / +inf, pow(-inf, ±1/2) = +inf / +0) the C library's bits."""
    rng = np.random.default_rng(11)
    x = np.concatenate([np.exp(rng.uniform(-103, 88, 200_000)), np.float32(1e-41) * rng.uniform(0, 100, 1000),
                        -rng.uniform(0, 5, 100), _SPECIAL]).astype(np.float32)
    half = codegen.float32_math("pow", x, np.full_like(x, 0.5))
    with np.errstate(all="ignore"):
        not_minus_inf = x != -np.inf  # pow(-inf, 1/2) = +inf, sqrt(-inf) = NaN (checked below)
        assert ulp_distance(half[not_minus_inf], np.sqrt(x + np.float32(0))[not_minus_inf]).max() == 0
        exact = (1 / np.sqrt(x.astype(np.float64))).astype(np.float32)
    mhalf = codegen.float32_math("pow", x, np.full_like(x, -0.5))
    finite = np.isfinite(x) & (x != 0)
    assert ulp_distance(mhalf[finite], exact[finite]).max() <= 1
    powf = _LIBM.powf
    powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float] * 2
    for y, got in ((0.5, half), (-0.5, mhalf)):
        want = np.array([powf(v, y) for v in _SPECIAL.tolist()], np.float32)
        mine = got[-len(_SPECIAL):]
        assert (np.isnan(mine) == np.isnan(want)).all(), y
        ok = ~np.isnan(want)
        assert (mine.view(np.int32)[ok] == want.view(np.int32)[ok]).all(), y


def test_float32_math_rejects_bad_arguments():
    with pytest.raises(InputError, match="name"):
        codegen.float32_math("sin", np.ones(2, np.float32))
    with pytest.raises(InputError, match="name"):
        codegen.float32_math("pow", np.ones(2, np.float32))


def _all_ops(xp, params, grads, slots, *, lr, c):
    """Every op the recorder knows, incl. NaN / signed-zero cases of maximum, sign, where."""
    a = slots.a
    t = xp.maximum(params, grads) + xp.minimum(a, params) * xp.sign(grads)
    mask = ((grads > 0) & ~(a < params)) | (params == 0) | xp.isnan(a)
    u = xp.where(mask, xp.abs(params), -a)
    e = xp.exp(xp.minimum(grads, 10.0)) + xp.log(xp.abs(a) + 1) + xp.floor(params * 3) + xp.ceil(grads)
    q = params ** 2 + xp.abs(a) ** 0.5 + 1 / (1 + a ** -1) + a ** 1 + a ** 0  # NumPy's fast ** paths
    q = q + xp.pow(xp.abs(grads), c) + xp.pow(2.0, xp.minimum(grads, 3.0))
    wide = xp.astype(xp.astype(t, xp.float64) * (lr * 3 + 1e-9), params.dtype)  # double, then back
    step = xp.where(lr > 0.5, u, -u)  # a condition on a dynamic value
    flag = xp.astype(xp.isfinite(params) & xp.logical_not(xp.isinf(grads)), params.dtype)
    return t + step + e * lr + q * flag, type(slots)(wide - xp.zeros_like(a) + xp.asarray(0.25, dtype=a.dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_recorded_op_has_numpys_semantics(dtype):
    opt = CustomOptimizer(_all_ops, ("a",), (0.0,), hyperparameters={"c": 1.5})
    rule = UpdateRule(math=get_math(opt), slot_names=("a",), static=(("c", 1.5),), dtype=dtype)
    ops = UpdateRule(math=get_math(opt), slot_names=("a",), static=(), dynamic=("lr", "c"), dtype=dtype)
    specials = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1.0, -1.0], dtype=dtype)
    for r in (rule, ops):
        kernel = codegen.row_kernel(r, 2)
        assert kernel is not None
        for lr in (0.25, 0.75):
            grads, arrays = inputs(r, seed=11)
            grads[0, :8], arrays[0][0, :8], arrays[1][0, 8:16] = specials, specials[::-1], specials
            arrays[0][1, :] = np.resize(specials, grads.shape[1])
            vals = (lr,) if r is rule else (lr, 1.5)
            want = reference(r, vals, grads, arrays)
            kernel.apply(arrays, grads, vals)
            for got, ref in zip(arrays, want):
                assert_same(got, ref, 0, f"{r.dynamic} lr={lr}")
            zeros = (np.asarray(want[0]) == 0) & ~np.isnan(np.asarray(want[0]))
            assert (np.signbit(arrays[0][zeros]) == np.signbit(np.asarray(want[0])[zeros])).all()


def test_signed_zeros_and_nans_of_maximum_minimum_sign_are_numpys():
    def fn(xp, params, grads, slots, *, lr):
        return xp.maximum(params, grads) + 0 * lr, type(slots)(xp.minimum(params, grads) * xp.sign(slots.s))
    opt = CustomOptimizer(fn, ("s",), (0.0,))
    rule = UpdateRule(math=get_math(opt), slot_names=("s",), dtype="float32")
    kernel = codegen.row_kernel(rule, 2)
    p = np.array([-0.0, 0.0, np.nan, 1.0, -0.0, 2.0], np.float32)
    g = np.array([0.0, -0.0, 1.0, np.nan, -0.0, 2.0], np.float32)
    s = np.array([-0.0, 0.0, -3.0, 5.0, np.nan, -0.0], np.float32)
    want = reference(rule, (0.0,), g, [p, s])
    arrays = [p.copy(), s.copy()]
    kernel.apply(arrays, g, (0.0,))
    for got, ref in zip(arrays, want):
        ref = np.asarray(ref)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.signbit(got[~np.isnan(ref)]), np.signbit(ref[~np.isnan(ref)]))
        np.testing.assert_array_equal(got, ref)


def test_custom_elementwise_update_is_generated():
    def scaled_sgd(xp, params, grads, slots, *, lr, scale):
        return params - scale * lr * grads, type(slots)(slots.n + 1)
    opt = CustomOptimizer(scaled_sgd, ("n",), (0.0,), hyperparameters={"scale": 0.5})
    rule = UpdateRule(math=get_math(opt), slot_names=("n",), static=(("scale", 0.5),), dtype="float64",
                      gradient_clip=(-1.0, 1.0))
    kernel = codegen.row_kernel(rule, 2)
    grads, arrays = inputs(rule, seed=2)
    want = reference(rule, (0.1,), grads, arrays)
    kernel.apply(arrays, grads, (0.1,))
    for got, ref in zip(arrays, want):
        assert_same(got, ref, 0, "custom")


def _custom_rule(fn, slots=("s",)):
    opt = CustomOptimizer(fn, slots, (0.0,) * len(slots))
    return UpdateRule(math=get_math(opt), slot_names=slots)


@pytest.mark.parametrize("fn", [
    lambda xp, p, g, s, *, lr: (p - lr * xp.sum(g), s),  # a reduction
    lambda xp, p, g, s, *, lr: (p - lr * g if lr > 0.1 else p, s),  # a branch on a run-time value
    lambda xp, p, g, s, *, lr: (p - lr * g[0], s),  # indexing
    lambda xp, p, g, s, *, lr: (xp.reshape(p, (-1,)), s),  # a shape op
    lambda xp, p, g, s, *, lr: (p - lr * np.sqrt(g), s),  # NumPy itself, not xp
    lambda xp, p, g, s, *, lr: (p - lr * xp.zeros(p.shape), s),  # shapes
    lambda xp, p, g, s, *, lr: (p > g, s),  # a boolean row
    lambda xp, p, g, s, *, lr: (p,),  # one array short
])
def test_rules_that_are_not_one_elementwise_loop_get_none(fn):
    assert codegen.row_kernel(_custom_rule(fn), 2) is None


@pytest.mark.parametrize("algorithm", ["user_defined_program", "mdl_adagrad_light"])
def test_no_kernel_for_the_hlo_program_and_the_formula_less_optimizer(algorithm):
    rule = UpdateRule(math=OPTIMIZERS[algorithm], slot_names=("accumulators", "weights", "benefits"))
    with _no_warning():
        assert codegen.row_kernel(rule, 4) is None


class _no_warning:
    def __enter__(self):
        self._w = warnings.catch_warnings(record=True)
        self.seen = self._w.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
        assert not self.seen, [str(w.message) for w in self.seen]


def test_bad_arguments_are_input_errors():
    rule = RULES[0]
    with pytest.raises(InputError, match="n_arrays"):
        codegen.row_kernel(rule, 0)
    with pytest.raises(InputError, match="rule"):
        codegen.row_kernel("adam", 3)
    kernel = codegen.row_kernel(make_rule("adagrad", {}, (), {}, "float32"), 2)
    grads, arrays = inputs(kernel.rule, seed=0)
    before = [a.copy() for a in arrays]
    with pytest.raises(InputError, match="values"):
        kernel.apply(arrays, grads, (0.1, 0.2))
    with pytest.raises(InputError, match="arrays"):
        kernel.apply([arrays[0], arrays[1].astype(np.float64)], grads, (0.1,))
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)
    assert codegen.row_kernel(rule, codegen.MAX_ARRAYS + 1) is None


def test_no_compiler_gives_none_and_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(codegen, "_kernels", {})
    monkeypatch.setattr(codegen, "_warned", [False])
    with pytest.warns(RuntimeWarning, match="generated row kernels are unavailable"):
        assert codegen.row_kernel(RULES[0], 1) is None
    with _no_warning():
        assert codegen.row_kernel(RULES[2], 2) is None


def test_recorded_graph_is_backend_neutral():
    """The graph names ops, not C++: what a CUDA emitter would read."""
    graph = codegen.record(make_rule("adadelta", {}, (), {}, "float32"), 3)
    ops = {n.op for n in graph.nodes}
    assert ops <= {"row", "grad", "param", "const", "cast", "add", "sub", "mul", "div", "sqrt"}
    assert len(graph.outputs) == 3 and graph.n_params == 1
    assert not any("std::" in str(n.args) for n in graph.nodes)


def test_prebuilt_kernels_are_found_by_their_own_cache_entry(monkeypatch, tmp_path):
    """One compiler run for several kernels; a later process finds each by its own source."""
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path))
    monkeypatch.setattr(codegen, "_kernels", {})
    rules = [make_rule("adagrad", {}, (), OPTIONS["weight_clip"], "float64"),
             make_rule("lion", {}, (), OPTIONS["gradient_clip"], "float64")]
    built = codegen.prebuild([(r, 1 + len(r.slot_names)) for r in rules])
    assert all(built) and len(list(tmp_path.glob("meshembed_rk_batch-*.so"))) == 1
    monkeypatch.setattr(codegen, "_kernels", {})
    monkeypatch.setattr(codegen.native, "build_library", lambda *a, **k: pytest.fail("compiled again"))
    again = codegen.row_kernel(rules[1], 2)
    assert again is not None and again.symbol == built[1].symbol and again.address == built[1].address
