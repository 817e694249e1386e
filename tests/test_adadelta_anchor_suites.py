"""The dense Adadelta against its anchors' own test suites (issue 35, item 15).

Ported, not copied: the cases of torch's ``test_optim`` for Adadelta
(``torch/testing/_internal/common_optimizers.py``: ``optim_inputs_func_adadelta`` and
``optim_error_inputs_func_adadelta``; the generic complex, no-grad, direction, param-group and
state-dict tests) and of tf_keras' ``optimizers/legacy/adadelta_test.py`` (basic over dtypes
including complex, callable params, the sparse minimize, epsilon=None), each run against the
anchor itself where it is installed (torch in the venv; tf_keras/Keras 3 skip if absent).

Complex parameters follow torch (``view_as_real``: real and imaginary parts independent reals).
Keras 3 and tf_keras also accept complex variables but apply the formula in complex arithmetic
(``g·g``, complex square roots): ``test_keras_complex_is_complex_arithmetic`` pins what they do.

Tolerances: float32 rtol 1e-6 (a few ulps: torch orders ``addcmul``/``sqrt`` differently),
float64 rtol 1e-14; float16 rtol 1e-3 (tf_keras' ``assertAllCloseAccordingToType``).
Not ported: torch's ``weight_decay`` inputs (torch adds an L2 term to the gradient;
``me.torch.Adadelta``'s is Keras' decoupled decay, a different rule documented there),
``foreach``/``fused``/``capturable``/``differentiable`` (torch implementation flags) and
tf_keras' ``lr=`` constructor alias (deprecated there).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import meshembed as me  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.float64: dict(rtol=1e-14, atol=1e-15),
       torch.complex64: dict(rtol=1e-6, atol=1e-7), torch.complex128: dict(rtol=1e-14, atol=1e-15)}
TORCH_HP = dict(lr=1.0, rho=0.9, eps=1e-6)  # torch's defaults (me.torch's are Keras')


def _twins(dtype, shape=(5, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, dtype=dtype, generator=g)
    return p.clone().requires_grad_(), p.clone().requires_grad_(), g


# -- complex parameters: torch.optim.Adadelta is the oracle ----------------------------------
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("maximize", [False, True])
def test_torch_front_end_complex_matches_torch_optim(dtype, maximize):
    a, b, gen = _twins(dtype)
    ref = torch.optim.Adadelta([a], maximize=maximize, **TORCH_HP)
    ours = me.torch.Adadelta([b], maximize=maximize, **TORCH_HP)
    for _ in range(20):
        grad = torch.randn(a.shape, dtype=dtype, generator=gen)
        a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(b, a, **TOL[dtype])
    for name in ("square_avg", "acc_delta"):  # complex like the parameter, as torch keeps them
        assert ours.state[b][name].dtype == dtype
        torch.testing.assert_close(ours.state[b][name], ref.state[a][name], **TOL[dtype])


def test_complex_is_its_real_view_bit_for_bit():
    """torch's test_complex idea: a complex parameter trains exactly as its view_as_real."""
    z, _, gen = _twins(torch.complex64)
    r = torch.view_as_real(z.detach()).clone().requires_grad_()
    oz, orl = me.torch.Adadelta([z], lr=0.5), me.torch.Adadelta([r], lr=0.5)
    for _ in range(5):
        grad = torch.randn(z.shape, dtype=z.dtype, generator=gen)
        z.grad, r.grad = grad, torch.view_as_real(grad).clone()
        oz.step()
        orl.step()
    assert torch.equal(torch.view_as_real(z.detach()), r.detach())
    assert torch.equal(torch.view_as_real(oz.state[z]["square_avg"]), orl.state[r]["square_avg"])


def test_complex_state_dict_round_trip():
    p, q, gen = _twins(torch.complex64)
    opt = me.torch.Adadelta([p], **TORCH_HP)
    for _ in range(3):
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        opt.step()
    q.data.copy_(p.detach())
    other = me.torch.Adadelta([q], **TORCH_HP)
    other.load_state_dict(opt.state_dict())
    grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
    p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    other.step()
    assert torch.equal(p, q)
    assert torch.equal(other.state[q]["acc_delta"], opt.state[p]["acc_delta"])


def test_jax_front_end_complex_matches_torch_optim():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    a, _, gen = _twins(torch.complex64)
    ref = torch.optim.Adadelta([a], **TORCH_HP)
    tx = me.jax.adadelta(1.0, rho=0.9, epsilon=1e-6)
    params = jnp.asarray(a.detach().numpy())
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(10):
        grad = torch.randn(a.shape, dtype=a.dtype, generator=gen)
        a.grad = grad.clone()
        ref.step()
        updates, state = update(jnp.asarray(grad.numpy()), state, params)
        params = optax.apply_updates(params, updates)
    assert params.dtype == jnp.complex64 and state.accumulated_grad.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(params), a.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.accumulated_grad), ref.state[a]["square_avg"].numpy(),
                               rtol=1e-6, atol=1e-7)


def test_keras_complex_is_complex_arithmetic():
    """What Keras does with a complex variable (stated, not followed): the same formula in
    complex arithmetic, so the accumulator holds g·g, not |re|² and |im|² — and its result is
    not torch's. meshembed follows torch: its front ends and the core's complex ``me.Variable``."""
    keras = pytest.importorskip("keras")
    g = np.array([0.5 + 2j, -1 + 0.25j], np.complex64)
    p = np.array([1 + 1j, 2 - 1j], np.complex64)
    var = keras.Variable(p)
    keras.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-6).apply_gradients([(g, var)])
    a = 0.1 * g * g
    complex_formula = p - np.sqrt(np.complex64(1e-6)) / np.sqrt(a + np.complex64(1e-6)) * g
    np.testing.assert_allclose(np.asarray(var), complex_formula, rtol=1e-6)
    t = torch.tensor(p, requires_grad=True)
    opt = me.torch.Adadelta([t], **TORCH_HP)
    t.grad = torch.tensor(g)
    opt.step()
    assert not np.allclose(np.asarray(var), t.detach().numpy(), rtol=1e-3)
    w = me.Variable(p)
    me.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-6).apply_gradients([(g, w)])
    np.testing.assert_array_equal(w.numpy(), t.detach().numpy())  # torch's rule (the real view), not Keras'


# -- callable hyper-parameters: tf_keras' legacy Adadelta is the oracle ------------------------
def _basic_expected(var0, grad, lr, rho, eps, steps):
    """tf_keras' adadelta_test recurrence (float64, numpy): the values after each step."""
    accum = accum_update = 0.0
    total = 0.0
    out = []
    for _ in range(steps):
        accum = accum * rho + grad ** 2 * (1 - rho)
        update = np.sqrt(accum_update + eps) / np.sqrt(accum + eps) * grad
        accum_update = accum_update * rho + update ** 2 * (1 - rho)
        total += update * lr
        out.append(np.asarray(var0) - total)
    return out


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("callable_params", [False, True], ids=["floats", "callables"])
def test_tf_keras_basic(backend, callable_params):
    """tf_keras' doTestBasic (and testBasicCallableParams: lr and rho as lambdas), for the
    real dtypes on every backend (complex: the torch front end, below)."""
    if backend not in me.available_backends():
        pytest.skip(f"backend {backend!r} not installed")
    rho, eps = 0.95, 1e-8
    # tf_keras' tolerances (assertAllCloseAccordingToType): float16 rtol = atol = 1e-3. In float16
    # ε = 1e-8 rounds to 0, so sqrt(u + ε) = 0 and nothing moves, in TF's kernel as here: the
    # expected 0.99864 is within that atol of 1.0 (the TF test passes the same way).
    for dtype, rtol, atol in (("float16", 1e-3, 1e-3), ("float32", 1e-5, 0), ("float64", 1e-5, 0)):
        if dtype == "float16" and backend != "numpy":
            continue  # one low-precision run is enough (float16 is the same path)
        for grad in (0.2, 0.1, 0.01):
            for lr in (1.0, 0.5, 0.1):
                kw = dict(learning_rate=(lambda lr=lr: lr), rho=lambda: rho) if callable_params else \
                    dict(learning_rate=lr, rho=rho)
                opt = me.optimizers.Adadelta(epsilon=eps, **kw)
                var0 = me.Variable(np.array([1.0, 2.0], dtype), backend=backend)
                var1 = me.Variable(np.array([3.0, 4.0], dtype), backend=backend)
                g = np.array([grad, grad], dtype)
                for step, (want0, want1) in enumerate(zip(_basic_expected([1.0, 2.0], grad, lr, rho, eps, 4),
                                                          _basic_expected([3.0, 4.0], grad, lr, rho, eps, 4))):
                    opt.apply_gradients([(g, var0), (g, var1)])
                    np.testing.assert_allclose(var0.numpy().astype(np.float64), want0, rtol=rtol, atol=atol,
                                               err_msg=f"{dtype} step {step}")
                    np.testing.assert_allclose(var1.numpy().astype(np.float64), want1, rtol=rtol, atol=atol,
                                               err_msg=f"{dtype} step {step}")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_tf_keras_basic_complex_dtypes(dtype):
    """tf_keras' basic test also runs complex64/complex128 with real-valued gradients: the
    imaginary parts stay, the real parts follow the real recurrence."""
    var = torch.tensor([1.0, 2.0], dtype=dtype, requires_grad=True)
    opt = me.torch.Adadelta([var], lr=0.5, rho=0.95, eps=1e-8)
    for want in _basic_expected([1.0, 2.0], 0.1, 0.5, 0.95, 1e-8, 4):
        var.grad = torch.full((2,), 0.1, dtype=dtype)
        opt.step()
        np.testing.assert_allclose(var.detach().numpy(), want.astype(np.complex128), rtol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_changing_callable_rho_matches_tf_keras_legacy(backend):
    tf_keras = pytest.importorskip("tf_keras")
    tf = pytest.importorskip("tensorflow")
    rhos, k = [0.9, 0.5, 0.95, 0.7], [0]

    def rho():
        return rhos[k[0]]

    ours = me.optimizers.Adadelta(lambda: 1.0, rho=rho, epsilon=1e-6)
    ref = tf_keras.optimizers.legacy.Adadelta(lambda: 1.0, rho=rho, epsilon=1e-6)
    w = me.Variable(np.array([1.0, 2.0], np.float32), backend=backend)
    v = tf.Variable(np.array([1.0, 2.0], np.float32))
    for i in range(4):
        k[0] = i
        g = np.array([0.5, -1.0], np.float32) * (i + 1)
        ours.apply_gradients([(g, w)])
        ref.apply_gradients([(tf.constant(g), v)])
        np.testing.assert_allclose(w.numpy(), v.numpy(), rtol=1e-6, atol=0)
    assert len(ours._rules) == 1  # the value is a call-time input: one rule, never rebuilt


def test_callable_epsilon_and_rho_of_the_step():
    """epsilon as a callable too (no anchor takes one: tf_keras' legacy converts it to a tensor
    and fails), and a callable of the step: the same numbers as constants, step by step."""
    eps = [1e-6, 1e-4, 1e-2]
    ours = me.optimizers.Adadelta(1.0, rho=lambda step: 0.9 - 0.1 * step, epsilon=lambda: eps[len(seen) - 1])
    w = me.Variable(np.array([1.0, 2.0], np.float32))
    seen = []
    ref_slots = None
    want = np.array([1.0, 2.0], np.float32)
    for step in range(3):
        seen.append(step)
        g = np.array([0.5, -1.0], np.float32) * (step + 1)
        ours.apply_gradients([(g, w)])
        ref = me.optimizers.Adadelta(1.0, rho=0.9 - 0.1 * step, epsilon=eps[step])
        r = me.Variable(want.copy())
        ref.build([r])
        if ref_slots is not None:
            ref.load_own_variables(ref_slots)
        ref.apply_gradients([(g, r)])
        store = {}
        ref.save_own_variables(store)
        ref_slots, want = store, r.numpy()
        np.testing.assert_array_equal(w.numpy(), want)


def test_bad_callable_value_is_refused_and_changes_nothing():
    opt = me.optimizers.Adadelta(1.0, rho=lambda: 1.5)
    w = me.Variable(np.array([1.0, 2.0], np.float32))
    with pytest.raises(me.ConfigError, match="rho"):
        opt.apply_gradients([(np.ones(2, np.float32), w)])
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    assert int(opt.iterations.numpy()) == 0
    with pytest.raises(me.ConfigError, match="rho"):
        me.optimizers.Adadelta(1.0, rho=lambda: 0.9).get_config()  # as a callable learning rate
    opt = me.optimizers.Adadelta(1.0, epsilon=lambda: float("inf"))
    with pytest.raises(me.ConfigError, match="epsilon"):
        opt.apply_gradients([(np.ones(2, np.float32), w)])
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])


def test_torch_and_jax_front_ends_take_callables():
    x = torch.ones(3, requires_grad=True)
    y = torch.ones(3, requires_grad=True)
    ours = me.torch.Adadelta([x], lr=1.0, rho=lambda: 0.9, eps=lambda: 1e-6)
    ref = torch.optim.Adadelta([y], **TORCH_HP)
    for _ in range(3):
        x.grad = torch.tensor([0.5, -1.0, 2.0])
        y.grad = x.grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(x, y, **TOL[torch.float32])
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    tx = me.jax.adadelta(1.0, rho=lambda count: jnp.where(count < 2, 0.9, 0.5), epsilon=lambda: 1e-6)
    fixed = [me.jax.adadelta(1.0, rho=r, epsilon=1e-6) for r in (0.9, 0.9, 0.5)]
    p = q = jnp.ones(3)
    state = tx.init(p)
    states = [f.init(q) for f in fixed]
    for i in range(3):
        g = jnp.array([0.5, -1.0, 2.0]) * (i + 1)
        u, state = jax.jit(tx.update)(g, state, p)
        p = optax.apply_updates(p, u)
        v, s = fixed[i].update(g, states[i], q)  # the same slots, the constant of this step
        q = optax.apply_updates(q, v)
        states = [s] * 3
    np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-6)


# -- a single variable --------------------------------------------------------------------------
def test_minimize_takes_one_variable_as_tf_keras_legacy_does():
    tf_keras = pytest.importorskip("tf_keras")
    tf = pytest.importorskip("tensorflow")
    w = me.Variable(np.array([1.0, 2.0], np.float32), backend="torch")
    me.optimizers.Adadelta(1.0).minimize(lambda: (w.value * w.value).sum(), w)
    v = tf.Variable(np.array([1.0, 2.0], np.float32))
    tf_keras.optimizers.legacy.Adadelta(1.0).minimize(lambda: tf.reduce_sum(v * v), v)
    np.testing.assert_allclose(w.numpy(), v.numpy(), rtol=1e-6)


def test_torch_front_end_refuses_a_lone_tensor_as_torch_does():
    with pytest.raises(TypeError) as theirs:
        torch.optim.Adadelta(torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError) as ours:
        me.torch.Adadelta(torch.ones(2, requires_grad=True))
    assert str(ours.value) == str(theirs.value)


def test_jax_front_end_takes_a_lone_array():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    a = torch.tensor([1.0, 2.0], requires_grad=True)
    ref = torch.optim.Adadelta([a], **TORCH_HP)
    tx = me.jax.adadelta(1.0, rho=0.9, epsilon=1e-6)
    p = jnp.array([1.0, 2.0])  # a lone array is a pytree of one leaf, as in optax
    state = tx.init(p)
    for _ in range(3):
        a.grad = torch.tensor([0.5, -1.0])
        ref.step()
        u, state = tx.update(jnp.array([0.5, -1.0]), state, p)
        p = p + u
    np.testing.assert_allclose(np.asarray(p), a.detach().numpy(), rtol=1e-6)
    assert isinstance(jax.tree.leaves(state.accumulated_grad)[0], jax.Array)


# -- torch's test_optim for Adadelta ---------------------------------------------------------
TORCH_INPUTS = {  # optim_inputs_func_adadelta, the cases without torch's L2 weight decay
    "default": {},
    "non-default lr": {"lr": 0.01},
    "maximize": {"maximize": True},
    "rho": {"rho": 0.95},
    "tensor lr": {"lr": torch.tensor(0.001)},
}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


@pytest.mark.parametrize("desc", list(TORCH_INPUTS))
def test_torch_optim_inputs(desc):
    """Each input of optim_inputs_func_adadelta, 10 steps of a real model with autograd, two
    param groups as torch's tests build them: me.torch.Adadelta ≡ torch.optim.Adadelta."""
    kw = {**TORCH_HP, **TORCH_INPUTS[desc]}
    ref_model, our_model = _model(0), _model(0)
    groups = lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 0.5}]  # noqa: E731
    ref = torch.optim.Adadelta(groups(ref_model), **kw)
    ours = me.torch.Adadelta(groups(our_model), **kw)
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(10):
        for model, opt in ((ref_model, ref), (our_model, ours)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        torch.testing.assert_close(q, p, **TOL[torch.float64])


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=1e-2, rho=1.1), "rho"),  # optim_error_inputs_func_adadelta
    (dict(lr=-1.0), "learning_rate"),
    (dict(eps=-1.0), "epsilon"),
])
def test_torch_error_inputs(kwargs, match):
    p = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError):  # torch's type, and ours is a ValueError too
        torch.optim.Adadelta([p], **kwargs)
    with pytest.raises(me.ConfigError, match=match):
        me.torch.Adadelta([p], **kwargs)


def test_step_is_noop_without_grads_and_goes_downhill():
    """torch's test_step_is_noop_when_params_have_no_grad and test_forloop_goes_right_direction."""
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = me.torch.Adadelta([w], **TORCH_HP)
    opt.step()
    assert torch.equal(w, torch.tensor([1.0, -2.0])) and opt.state[w]["step"].item() == 0
    losses = []
    for _ in range(50):
        opt.zero_grad()
        loss = (w - torch.tensor([3.0, 3.0])).square().sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:]))  # every step downhill (Adadelta starts slowly)


# -- tf_keras' other Adadelta tests --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_tf_keras_minimize_sparse(backend):
    """testMinimizeSparseResourceVariable: Adadelta(1, 1, 1) is SGD on the looked-up row:
    pred = [1, 2]·[4, 5] = 14, gradient 2·14·[4, 5], so var0 = [[-111, -138]]."""
    var0 = me.Variable(np.array([[1.0, 2.0]], np.float32), backend=backend)
    opt = me.optimizers.Adadelta(1.0, 1.0, 1.0)
    x = np.array([[4.0], [5.0]], np.float32)
    if backend == "numpy":  # the embedding lookup's gradient, as TF gives it
        grad = me.IndexedSlices(np.array([[112.0, 140.0]], np.float32), np.array([0]), (1, 2))
        opt.apply_gradients([(grad, var0)])
    else:
        opt.minimize(lambda: ((var0.value[torch.tensor([0])] @ torch.tensor(x)) ** 2).sum(), [var0])
    np.testing.assert_allclose(var0.numpy(), [[-111.0, -138.0]], rtol=1e-6)


def test_tf_keras_epsilon_values():
    """testConstructAdadeltaWithEpsilonValues: epsilon=None is 1e-7 (tf_keras' legacy)."""
    assert me.optimizers.Adadelta(epsilon=None).epsilon == 1e-7
    assert me.optimizers.Adadelta(epsilon=1e-8).epsilon == 1e-8
