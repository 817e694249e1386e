"""Complex variables in ``me.optimizers.Adadelta`` (issue #35, item 15): optimised as
``torch.optim.Adadelta`` optimises a complex parameter, as its real view ``[..., 2]`` (real and
imaginary parts two independent reals); the slots stay complex (``accumulated_grad`` holds
``E[re(g)²] + i·E[im(g)²]``, torch's ``square_avg``), and so do the EMA averages, the gradient
accumulators and what ``save_own_variables`` writes. Clipping takes the real view too: the norm
of a complex gradient is the norm over both parts (torch's ``clip_grad_norm_``), ``clipvalue``
clamps each part.

Tolerances against ``torch.optim.Adadelta`` (25 steps, lr 1, rho 0.9, eps 1e-6; measured on
CPU: complex64 at most 6e-7 relative, complex128 at most 1e-15): ``rtol`` 1e-6 for complex64
and 2e-15 for complex128, ``atol`` 0 (the two libraries round ``ρa + (1−ρ)g²`` differently:
torch's ``addcmul``). Between meshembed's own backends and against the real view of the same
numbers as float variables the tests ask for identical bits.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import meshembed as me
from meshembed.errors import BackendUnavailableError
from meshembed.optimizers import GradientsClipOption

torch = pytest.importorskip("torch")

STEPS = 25
HP = dict(learning_rate=1.0, rho=0.9, epsilon=1e-6)  # torch's defaults, the same rule
TORCH_HP = dict(lr=1.0, rho=0.9, eps=1e-6)
RTOL = {"complex64": 1e-6, "complex128": 2e-15}
REAL = {"complex64": np.float32, "complex128": np.float64}
BACKENDS = ("numpy", "torch", "jax", "array_api_strict")


def _available(name: str) -> bool:
    try:
        me.get_backend(name)
    except (BackendUnavailableError, ImportError):
        return False
    return True


def _backends(names=BACKENDS) -> list:
    return [pytest.param(n, id=n, marks=() if _available(n) else pytest.mark.skip(reason=f"no {n} backend"))
            for n in names]


@contextlib.contextmanager
def _wide(bk: str, dtype: str):
    """complex128 on JAX needs x64 (meshembed never turns it on), scoped to the test."""
    if bk == "jax" and dtype == "complex128":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


def _complex(rng, shape, dtype):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def _data(dtype: str, shape=(5, 3), steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return _complex(rng, shape, dtype), [_complex(rng, shape, dtype) for _ in range(steps)]


def _host(v) -> np.ndarray:
    return np.asarray(v.backend.to_numpy(v.value))


def _as_real(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x[..., None].view(REAL[x.dtype.name]) if x.dtype.kind == "c" else x


def _run(bk, w0, grads, **kwargs):
    """``me.optimizers.Adadelta`` over ``grads`` (a list per step: one gradient, or a list for
    several variables) on ``bk``: every variable and every optimizer variable, on the host."""
    inits = w0 if isinstance(w0, list) else [w0]
    variables = [me.Variable(np.array(x, copy=True), name=f"v{k}", backend=bk) for k, x in enumerate(inits)]
    opt = me.optimizers.Adadelta(**{**HP, **kwargs})
    for g in grads:
        opt.apply_gradients(list(zip(g if isinstance(g, list) else [g], variables)))
    return [_host(v) for v in variables] + [_host(v) for v in opt.variables[1:]], opt


@pytest.mark.parametrize("bk", _backends())
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_matches_torch_optim_adadelta(bk, dtype):
    w0, grads = _data(dtype)
    p = torch.tensor(w0, requires_grad=True)
    ref = torch.optim.Adadelta([p], **TORCH_HP)
    for g in grads:
        p.grad = torch.tensor(g)
        ref.step()
    with _wide(bk, dtype):
        (w, acc, delta), opt = _run(bk, w0, grads)
    assert w.dtype == acc.dtype == delta.dtype == np.dtype(dtype)
    assert [v.name for v in opt.variables[1:]] == ["accumulated_grad/v0", "accumulated_delta_var/v0"]
    for got, want in ((w, p), (acc, ref.state[p]["square_avg"]), (delta, ref.state[p]["acc_delta"])):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL[dtype], atol=0)
    # the slots hold each part's own average: E[re(g)²] + i·E[im(g)²], never g·g
    a = np.zeros_like(w0)
    for g in grads:
        a = 0.9 * a + 0.1 * (g.real ** 2 + 1j * g.imag ** 2)
    np.testing.assert_allclose(acc, a, rtol=RTOL[dtype] * 10)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_same_bits_on_every_backend_and_as_the_real_view(dtype):
    """The fast paths (NumPy and torch write through views, JAX donates its real views) and
    the pure step (Array API namespaces) give the NumPy reference's bits, which are those of
    float variables holding the real views."""
    w0, grads = _data(dtype)
    want, _ = _run("numpy", _as_real(w0), [_as_real(g) for g in grads])
    for bk in BACKENDS:
        if not _available(bk):
            continue
        with _wide(bk, dtype):
            got, _ = _run(bk, w0, grads)
        assert len(got) == len(want)
        for x, y in zip(got, want):
            assert x.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(_as_real(x), y, err_msg=bk)


def _option_cases() -> list:
    return [
        pytest.param(dict(clipnorm=0.5), id="clipnorm"),
        pytest.param(dict(global_clipnorm=0.7), id="global_clipnorm"),
        pytest.param(dict(clipvalue=0.3), id="clipvalue"),
        pytest.param(dict(gradients_clip_option=GradientsClipOption(clipnorm=0.5)), id="option-clipnorm"),
        pytest.param(dict(gradients_clip_option=GradientsClipOption(clipvalue=0.3)), id="option-clipvalue"),
        pytest.param(dict(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=4), id="ema"),
        pytest.param(dict(weight_decay=0.1), id="weight_decay"),
        pytest.param(dict(gradient_accumulation_steps=3), id="accumulation"),
        pytest.param(dict(loss_scale_factor=3.0, clipnorm=0.5), id="loss_scale-clipnorm"),
        pytest.param(dict(clipvalue=0.3, sparse=True), id="sparse-keras3-clipvalue"),
        pytest.param(dict(gradients_clip_option=GradientsClipOption(clipvalue=0.3), weight_decay=0.1, sparse=True),
                     id="sparse-touched-rows"),
    ]


def _sparse(g: np.ndarray, rows=(3, 0, 3)) -> me.IndexedSlices:
    idx = np.asarray(rows)
    return me.IndexedSlices(g[idx], idx, g.shape)


@pytest.mark.parametrize("bk", _backends())
@pytest.mark.parametrize("options", _option_cases())
def test_options_take_the_real_view(bk, options):
    """Clipping (norms over both parts; ``clipvalue`` each part), EMA, weight decay, gradient
    accumulation and sparse gradients: a complex variable (beside a real one, which shares the
    global norm) moves as float variables holding its real view, bit for bit."""
    options = dict(options)
    sparse = options.pop("sparse", False)
    dtype = "complex64"
    z0, zg = _data(dtype, steps=8)
    rng = np.random.default_rng(1)
    r0 = rng.standard_normal(4).astype(np.float32)
    rg = [rng.standard_normal(4).astype(np.float32) for _ in zg]

    def grads(view):
        out = []
        for z, r in zip(zg, rg):
            z = _as_real(z) if view else z
            out.append([_sparse(z) if sparse else z, r])
        return out

    got, _ = _run(bk, [z0, r0], grads(False), **options)
    want, _ = _run(bk, [_as_real(z0), r0], grads(True), **options)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(_as_real(x), y)


def _torch_clipped_run(w0, grads, clip):
    p = torch.tensor(w0, requires_grad=True)
    ref = torch.optim.Adadelta([p], **TORCH_HP)
    for g in grads:
        p.grad = clip(torch.tensor(g))
        ref.step()
    return p.detach().numpy()


@pytest.mark.parametrize("bk", _backends())
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_clipping_against_torch(bk, dtype):
    """``clipnorm=c`` scales a complex gradient by ``c/‖g‖`` with torch's norm of a complex
    tensor (``torch.linalg.vector_norm``, what ``clip_grad_norm_`` takes: both parts);
    ``clipvalue=v`` clamps each part (torch has no complex clamp: its real view clamped)."""
    w0, grads = _data(dtype, steps=STEPS)
    c, v = 1.5, 0.4

    def by_norm(g):
        n = torch.linalg.vector_norm(g)
        return g * (c / n) if n > c else g

    def by_value(g):
        return torch.view_as_complex(torch.view_as_real(g).clamp(-v, v).contiguous())

    for kwargs, clip in ((dict(clipnorm=c), by_norm), (dict(global_clipnorm=c), by_norm),
                         (dict(clipvalue=v), by_value)):
        want = _torch_clipped_run(w0, grads, clip)
        with _wide(bk, dtype):
            (w, *_), _ = _run(bk, w0, grads, **kwargs)
        np.testing.assert_allclose(w, want, rtol=RTOL[dtype] * 4, atol=0, err_msg=str(kwargs))


@pytest.mark.parametrize("bk", _backends())
@pytest.mark.parametrize("target", _backends())
def test_checkpoint_round_trip(bk, target):
    """``save_own_variables`` writes the complex slots (and averages) as complex arrays of the
    variable's shape; they load on another backend and the training continues identically."""
    w0, grads = _data("complex64", steps=8)
    kwargs = dict(HP, use_ema=True, ema_momentum=0.9)
    first = me.Variable(w0.copy(), name="z", backend=bk)
    opt = me.optimizers.Adadelta(**kwargs)
    for g in grads[:3]:
        opt.apply_gradients([(g, first)])
    store: dict = {}
    opt.save_own_variables(store)
    assert sorted(store, key=int) == ["0", "1", "2", "3", "4"]  # iteration, Keras 3's lr, average, slots
    assert all(np.asarray(store[k]).dtype == np.complex64 and np.asarray(store[k]).shape == w0.shape
               for k in ("2", "3", "4"))

    moved = me.Variable(_host(first), name="z", backend=target)
    other = me.optimizers.Adadelta(**kwargs)
    other.build([moved])
    other.load_own_variables(store)
    for g in grads[3:]:
        opt.apply_gradients([(g, first)])
        other.apply_gradients([(g, moved)])
    # the EMA step is each backend's compiled pure step: the same bits on one backend, within
    # float32 rounding between two (as for float variables: tests/test_keras3_adadelta.py)
    tol = dict(rtol=0, atol=0) if bk == target else dict(rtol=1e-6, atol=0)
    assert int(_host(other.variables[0])) == int(_host(opt.variables[0])) == 8
    for a, b in zip([first, *opt.variables[1:]], [moved, *other.variables[1:]]):
        assert _host(b).dtype == _host(a).dtype == np.complex64
        np.testing.assert_allclose(_host(b), _host(a), **tol)


@pytest.mark.parametrize("bk", _backends())
def test_real_gradient_of_a_complex_variable_is_its_real_part(bk):
    """A real (or integer) gradient of a complex variable is cast (imaginary part 0); a complex
    gradient of a real variable stays refused (tests/test_keras3_adadelta.py)."""
    w0, grads = _data("complex64", steps=4)
    real = [g.real.copy() for g in grads]
    got, _ = _run(bk, w0, real)
    want, _ = _run(bk, w0, [g.astype(np.complex64) for g in real])
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    assert np.array_equal(got[2].imag, np.zeros_like(got[2].imag))  # E[im(g)²] stays 0
    np.testing.assert_array_equal(got[0].imag, w0.imag)


def test_me_torch_adadelta_gives_the_same_bits():
    """``me.torch.Adadelta`` on a complex parameter (real-view variables inside) and a complex
    ``me.Variable`` on the torch backend take the same steps."""
    w0, grads = _data("complex64")
    p = torch.tensor(w0, requires_grad=True)
    opt = me.torch.Adadelta([p], **TORCH_HP)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    (w, acc, delta), _ = _run("torch", w0, grads)
    np.testing.assert_array_equal(w, p.detach().numpy())
    np.testing.assert_array_equal(acc, opt.state[p]["square_avg"].numpy())
    np.testing.assert_array_equal(delta, opt.state[p]["acc_delta"].numpy())


def test_jax_stateless_apply_under_jit():
    """``stateless_apply`` traced by ``jax.jit`` takes complex values: the NumPy reference's numbers."""
    if not _available("jax"):
        pytest.skip("no jax backend")
    import jax
    import jax.numpy as jnp

    w0, grads = _data("complex64", steps=5)
    v = me.Variable(w0.copy(), name="z", backend="jax")
    opt = me.optimizers.Adadelta(**HP)
    opt.build([v])
    step = jax.jit(opt.stateless_apply)
    train, state = [v.value], [x.value for x in opt.variables]
    for g in grads:
        train, state = step(state, [jnp.asarray(g)], train)
    want, _ = _run("numpy", w0, grads)
    got = [np.asarray(x) for x in (*train, *state[1:])]
    assert all(x.dtype == np.complex64 for x in got)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # Inf/Inf in the norm clip, as for floats
@pytest.mark.parametrize("bk", _backends())
@pytest.mark.parametrize("part", ["real", "imag"])
def test_nonfinite_complex_gradient_is_refused_and_changes_nothing(bk, part):
    """The NaN policy sees both parts (with a norm clip too: the norm of the real view)."""
    w0, (g,) = _data("complex64", steps=1)
    g = g.copy()
    if part == "real":
        g[1, 2] = complex(np.inf, 1.0)
    else:
        g[1, 2] = complex(1.0, np.nan)
    for kwargs in ({}, dict(clipnorm=1.0)):
        v = me.Variable(w0.copy(), name="z", backend=bk)
        opt = me.optimizers.Adadelta(**{**HP, **kwargs})
        with pytest.raises(me.InputError, match="'z'"):
            opt.apply_gradients([(g, v)])
        np.testing.assert_array_equal(_host(v), w0)
        assert all(not np.any(_host(x)) for x in opt.variables)


def test_sharded_complex_variable_on_a_jax_mesh():
    """A complex variable laid out on a 2-device JAX mesh (the pure step on its real view, which
    keeps the sharding): the unsharded NumPy numbers, within XLA's rounding."""
    if not _available("jax"):
        pytest.skip("no jax backend")
    import jax

    if len(jax.devices()) < 2:  # this test again in a child given 2 CPU devices (the flag for the child only)
        import os
        import pathlib
        import subprocess
        import sys

        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{__file__}::test_sharded_complex_variable_on_a_jax_mesh"],
                             cwd=pathlib.Path(__file__).resolve().parents[1], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
        assert "1 passed" in out.stdout.splitlines()[-1], out.stdout[-1000:]
        return
    w0, grads = _data("complex64", shape=(4, 3), steps=6)
    mesh = me.Mesh(["model"], shape=(2,), backend="jax")
    v = me.Variable(w0.copy(), name="z", layout=me.Layout(["model", me.UNSHARDED], mesh))
    opt = me.optimizers.Adadelta(**HP, mesh=mesh, clipnorm=2.0)
    for g in grads:
        opt.apply_gradients([(g, v)])
    assert len(v.value.sharding.device_set) == 2 and v.dtype == "complex64"
    assert all(len(s.value.sharding.device_set) == 2 for s in opt.variables[1:])
    want, _ = _run("numpy", w0, grads, clipnorm=2.0)
    for x, y in zip([_host(v), *(_host(s) for s in opt.variables[1:])], want):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=0)


def _dtensor_scenario(rank: int, world: int, tmp) -> dict:
    """A rank of :func:`test_sharded_complex_variable_over_gloo_ranks` (run by
    tests/test_torch_distributed.py's launcher): DTensor steps and the NumPy reference's."""
    w0, grads = _data("complex64", shape=(4, 3), steps=6)
    mesh = me.Mesh(["model"], shape=(world,), backend="torch")
    out = {}
    for tag, kwargs in (("plain", {}), ("clipnorm", dict(clipnorm=2.0)), ("ema", dict(use_ema=True))):
        v = me.Variable(w0.copy(), name="z", layout=me.Layout(["model", me.UNSHARDED], mesh))
        opt = me.optimizers.Adadelta(**HP, mesh=mesh, **kwargs)
        for g in grads:
            opt.apply_gradients([(g, v)])
        assert type(v.value).__name__ == "DTensor" and v.dtype == "complex64"
        want, _ = _run("numpy", w0, grads, **kwargs)
        for k, (x, y) in enumerate(zip([v.numpy(), *(s.numpy() for s in opt.variables[1:])], want)):
            out[f"{tag}{k}"], out[f"{tag}{k}_want"] = x, y
    return out


def test_sharded_complex_variable_over_gloo_ranks(tmp_path):
    """A complex variable sharded over 2 gloo ranks (torch DTensors: the pure step on the real
    view; the finite check per part, as a DTensor cannot test a complex 0-d sum): the
    unsharded NumPy numbers within float32 rounding on every rank."""
    dist_tests = pytest.importorskip("tests.test_torch_distributed")
    results, codes = dist_tests._launch("tests.test_adadelta_complex:_dtensor_scenario", 2, tmp_path, deadline_s=180.0)
    assert codes == [0, 0] and sorted(results) == [0, 1]
    for out in results.values():
        for key in (k for k in out if not k.endswith("_want")):
            np.testing.assert_allclose(out[key], out[key + "_want"], rtol=1e-6, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("bk", _backends(("numpy", "torch")))
def test_non_contiguous_complex_variable(bk):
    """A transposed complex variable: NumPy's real view of it is a copy, written back after the
    in-place step (the reference's bits); torch's is a strided view, which its generated kernel
    does not take: the compiled core step, within float32 rounding."""
    w0, grads = _data("complex64", shape=(4, 6), steps=6)
    held = np.ascontiguousarray(w0.T).T if bk == "numpy" else torch.tensor(np.ascontiguousarray(w0.T)).T
    v = me.Variable(held, name="z", backend=bk)
    assert not (v.value.flags.c_contiguous if bk == "numpy" else v.value.is_contiguous())
    opt = me.optimizers.Adadelta(**HP)
    for g in grads:
        opt.apply_gradients([(g, v)])
    want, _ = _run("numpy", w0, grads)
    tol = dict(rtol=0, atol=0) if bk == "numpy" else dict(rtol=1e-6, atol=1e-12)
    for x, y in zip([_host(v), *(_host(s) for s in opt.variables[1:])], want):
        np.testing.assert_allclose(x, y, **tol)


@pytest.mark.parametrize("bk", _backends(("torch", "jax")))
def test_minimize_descends_on_both_parts(bk):
    """``minimize`` takes the backend's autodiff gradient in torch's convention on both backends
    (``∂L/∂re + i·∂L/∂im``; JAX's own is its conjugate): the same steps as torch.optim.Adadelta."""
    w0, _ = _data("complex64", shape=(3,), steps=0)
    target = np.array([1 - 2j, 0.5 + 0.5j, -1j], np.complex64)
    p = torch.tensor(w0, requires_grad=True)
    ref = torch.optim.Adadelta([p], **TORCH_HP)
    v = me.Variable(w0.copy(), name="z", backend=bk)
    opt = me.optimizers.Adadelta(**HP)
    xp = me.get_backend(bk).xp
    t = me.get_backend(bk).asarray(target)
    for _ in range(10):
        ref.zero_grad()
        (torch.abs(p - torch.tensor(target)) ** 2).sum().backward()
        ref.step()
        opt.minimize(lambda: xp.sum(xp.abs(v.value - t) ** 2), [v])
    np.testing.assert_allclose(_host(v), p.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(_host(v) - target).sum() < np.abs(w0 - target).sum()
