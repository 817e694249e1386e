"""The dense optimizer hands backends an UpdateRule + call-time values (issue #18).

* the rule is data: algorithm, slots, static rho/epsilon, dtype; for dense gradients inside
  ``apply_gradients`` also Keras' element-wise terms (``clipvalue``, decoupled weight decay);
  the learning rate is a call-time float, never part of the rule;
* backends receive only rules and floats (no step functions with attributes);
* the generated fused kernels (torch: ``native.dense_update``, one C call for all tensors; JAX: one FFI
  call) equal the NumPy backend bit for bit, float32 and float64, plain / clipvalue / weight
  decay;
* a learning rate changing every step compiles nothing after warm-up on torch and JAX, on
  the in-place path and on the pure path (EMA).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import meshembed as me
from meshembed.math.rule import UpdateRule
from meshembed.optimizers import schedules

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONS = {"plain": {}, "clipvalue": {"clipvalue": 0.3}, "weight_decay": {"weight_decay": 0.1},
           "both": {"weight_decay": 0.05, "clipvalue": 0.2}}


def _usable(name: str) -> bool:
    try:
        me.get_backend(name)
    except me.BackendUnavailableError:
        return False
    return True


def _schedule():
    return schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.9)  # a new value each step


def _train(backend: str, shapes, steps=3, dtype="float32", lr=None, **kwargs) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    variables = [me.Variable(rng.standard_normal(s).astype(dtype), name=f"v{i}", backend=backend)
                 for i, s in enumerate(shapes)]
    opt = me.optimizers.Adadelta(_schedule() if lr is None else lr, rho=0.9, epsilon=1e-6, **kwargs)
    for _ in range(steps):
        grads = [rng.standard_normal(s).astype(dtype) for s in shapes]
        grads[0][0] = 5.0  # beyond any clipvalue here
        opt.apply_gradients(list(zip(grads, variables)))
    return [v.numpy() for v in variables] + [v.numpy() for v in opt.variables[1:]]


def test_the_rule_is_data_and_the_learning_rate_is_not_in_it():
    w = me.Variable(np.ones((2, 3), np.float32), name="w", backend="numpy")
    opt = me.optimizers.Adadelta(0.1, rho=0.8, epsilon=1e-5, weight_decay=0.01, clipvalue=0.5)
    plain, folded = opt._rule(w, folded=False), opt._rule(w, folded=True)
    assert isinstance(plain, UpdateRule) and plain.algorithm == "adadelta" and plain.plain
    assert plain.slot_names == ("accumulators", "updates") and plain.dynamic == ("lr",)
    assert dict(plain.static) == {"rho": 0.8, "epsilon": 1e-5} and plain.dtype == "float32" and not plain.lazy
    assert folded.gradient_clip == (-0.5, 0.5) and folded.weight_decay == 0.01 and folded.multiply_weight_decay_by_lr
    other = me.optimizers.Adadelta(0.7, rho=0.8, epsilon=1e-5, weight_decay=0.01, clipvalue=0.5)
    assert other._rule(w, folded=True) == folded and hash(other._rule(w, folded=True)) == hash(folded)
    # a norm clip is not per element: it stays around the rule
    norm = me.optimizers.Adadelta(0.1, clipnorm=1.0)._rule(w, folded=True)
    assert norm.gradient_clip is None
    # a variable excluded from weight decay gets a rule without it
    opt.exclude_from_weight_decay(var_names=["w"])
    assert opt._rule(w, folded=True).weight_decay == 0.0


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_backends_receive_only_rules_and_floats(monkeypatch, option):
    """What crosses to the backend: ``compile_update(rule, n)`` and float values per tensor;
    sparse gradients and update_step on its own get the plain rule (clipvalue on the
    slices before summing, weight decay of every row, as TF/Keras)."""
    backend = me.get_backend("numpy")
    seen = []
    real = type(backend).compile_update

    def spy(self, rule, count):
        run = real(self, rule, count)

        def wrapped(grads, values, *targets):
            seen.append((rule, [tuple(v) for v in values]))
            return run(grads, values, *targets)

        return wrapped

    monkeypatch.setattr(type(backend), "compile_update", spy)
    w = me.Variable(np.ones((4, 2), np.float32), name="w", backend="numpy")
    opt = me.optimizers.Adadelta(_schedule(), **OPTIONS[option])
    for _ in range(2):
        opt.apply_gradients([(np.full((4, 2), 0.5, np.float32), w)])
    assert [v for _, v in seen] == [[(0.5,)], [(0.45,)]]
    rule = seen[0][0]
    assert all(r is rule for r, _ in seen)
    assert (rule.gradient_clip is not None) == ("clipvalue" in OPTIONS[option] or option == "both")
    assert (rule.weight_decay != 0) == (option in ("weight_decay", "both"))
    opt.update_step(np.ones((4, 2), np.float32), w)  # Keras: no clipping or decay here
    assert seen[-1][0].plain


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_folding_keeps_the_numbers(option):
    """Clipvalue and weight decay inside the rule give what applying them around it gives
    (update_step after hand-made clipping and decay, the Keras order)."""
    from meshembed.math.common import decay_weights

    kw = OPTIONS[option]
    rng = np.random.default_rng(0)
    init, grads = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32) * 3
    a = me.Variable(init, name="a", backend="numpy")
    b = me.Variable(init.copy(), name="b", backend="numpy")
    opt_a = me.optimizers.Adadelta(0.5, rho=0.9, epsilon=1e-6, **kw)
    opt_a.apply_gradients([(grads, a)])
    opt_b = me.optimizers.Adadelta(0.5, rho=0.9, epsilon=1e-6)
    opt_b.build([b])
    g = np.clip(grads, -kw["clipvalue"], kw["clipvalue"]) if "clipvalue" in kw else grads
    if kw.get("weight_decay"):
        b.assign(decay_weights(np, b.numpy(), kw["weight_decay"] * 0.5))
    opt_b.update_step(g, b)
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_infinite_gradients_clipped_by_value_are_applied_nan_is_refused():
    """clipvalue inside the rule: ±Inf gradients become ±clipvalue (applied, as Keras); a NaN
    still raises and changes nothing."""
    w = me.Variable(np.ones(3, np.float32), name="w", backend="numpy")
    opt = me.optimizers.Adadelta(1.0, clipvalue=0.5)
    ref = me.Variable(np.ones(3, np.float32), name="w", backend="numpy")
    me.optimizers.Adadelta(1.0, clipvalue=0.5).apply_gradients([(np.array([0.5, -0.5, 0.1], np.float32), ref)])
    opt.apply_gradients([(np.array([np.inf, -np.inf, 0.1], np.float32), w)])
    np.testing.assert_array_equal(w.numpy(), ref.numpy())
    before = w.numpy()
    with pytest.raises(me.InputError, match="NaN or Inf"):
        opt.apply_gradients([(np.array([np.nan, 0.0, 0.0], np.float32), w)])
    np.testing.assert_array_equal(w.numpy(), before)


def test_no_backend_reads_function_attributes_of_the_dense_step():
    """The dense step crosses as data: nothing in the backends or the optimizer sets or reads
    ``step.elementwise`` / ``step.registered``."""
    offenders = []
    for path in [*(ROOT / "backends").rglob("*.py"), *(ROOT / "src/meshembed/optimizers").rglob("*.py")]:
        text = path.read_text()
        for needle in ('"elementwise"', '"registered"', ".elementwise = ", ".registered = ", "_step_fn"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders


# -- generated fused kernels: bit-identical to the NumPy backend ---------------------------------
@pytest.mark.skipif(not _usable("torch"), reason="torch is not installed")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_torch_generated_dense_kernel_equals_numpy(dtype, option):
    from meshembed_torch import native

    shapes = [(70, 9), (600_003,), (5,)]  # > 512K elements: two threads where torch has two, chunk tails
    before = me.get_backend("torch").stats().get("fused_dense_updates", 0)
    got = _train("torch", shapes, dtype=dtype, **OPTIONS[option])
    if native.dense_kernel_for(me.optimizers.Adadelta()._rule(
            me.Variable(np.ones(1, dtype), backend="torch"), folded=False)) is None:
        pytest.skip("no generated kernel here (no compiler)")
    assert me.get_backend("torch").stats().get("fused_dense_updates", 0) == before + 3, "one C call per step for the three tensors"
    for a, b in zip(got, _train("numpy", shapes, dtype=dtype, **OPTIONS[option])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not _usable("jax"), reason="jax is not installed")
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_jax_generated_dense_kernel_equals_numpy(option):
    before = me.get_backend("jax").stats().get("fused_dense_updates", 0)
    shapes = [(70, 9), (30_001,)]
    got = _train("jax", shapes, **OPTIONS[option])
    if me.get_backend("jax").stats().get("fused_dense_updates", 0) == before:
        pytest.skip("no generated kernel / FFI kernels here")
    assert me.get_backend("jax").stats().get("fused_dense_updates", 0) == before + 3
    for a, b in zip(got, _train("numpy", shapes, **OPTIONS[option])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not _usable("torch"), reason="torch is not installed")
def test_torch_sixty_four_tensors_in_one_call_in_place():
    shapes = [(257,)] * 64
    rng = np.random.default_rng(0)
    variables = [me.Variable(rng.standard_normal(s).astype(np.float32), name=f"v{i}", backend="torch")
                 for i, s in enumerate(shapes)]
    tensors = [v.value for v in variables]
    opt = me.optimizers.Adadelta(1.0)
    before = me.get_backend("torch").stats().get("fused_dense_updates", 0)
    opt.apply_gradients([(rng.standard_normal(s).astype(np.float32), v) for s, v in zip(shapes, variables)])
    if me.get_backend("torch").stats().get("fused_dense_updates", 0) == before:
        pytest.skip("no generated kernel here (no compiler)")
    assert me.get_backend("torch").stats().get("fused_dense_updates", 0) == before + 1
    assert all(v.value is t for v, t in zip(variables, tensors))  # written in place


# -- no recompilation when the learning rate changes ----------------------------------------------
STEPS = 30
WARM_UP = 3


@pytest.mark.skipif(not _usable("torch"), reason="torch is not installed")
@pytest.mark.parametrize("path", ["in_place", "ema"])
def test_torch_changing_learning_rate_compiles_nothing_after_warm_up(monkeypatch, path):
    """The compiled core function (generated kernels off, compiling always): a learning rate
    new at every step for 30 steps compiles nothing after warm-up, in place and on the pure
    path that EMA takes; the numbers are NumPy's."""
    import torch
    from torch._dynamo.testing import CompileCounter

    from meshembed_torch.backend import TorchBackend

    counter = CompileCounter()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", "0")
    backend = TorchBackend(device="cpu", compile="always")
    kw = {"use_ema": True, "ema_momentum": 0.9} if path == "ema" else {"weight_decay": 0.01, "clipvalue": 1.0}
    lr = schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.95)

    def run(bk):
        rng = np.random.default_rng(2)
        vs = [me.Variable(rng.standard_normal(s).astype(np.float32), name=f"v{i}", backend=bk)
              for i, s in enumerate([(40, 3), (17,)])]
        opt = me.optimizers.Adadelta(lr, rho=0.9, epsilon=1e-6, **kw)
        counts = []
        for _ in range(STEPS):
            opt.apply_gradients([(rng.standard_normal(v.shape).astype(np.float32), v) for v in vs])
            counts.append(counter.frame_count)
        return [v.numpy() for v in vs] + [v.numpy() for v in opt.variables[1:]], counts

    got, counts = run(backend)
    assert counts[0] >= 1, "the compiled path was not taken"
    assert counts[-1] == counts[WARM_UP - 1], f"recompiled after warm-up: {counts}"
    want, _ = run("numpy")
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.skipif(not _usable("jax"), reason="jax is not installed")
@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("path", ["in_place", "ema"])
def test_jax_changing_learning_rate_compiles_nothing_after_warm_up(monkeypatch, fused, path):
    import jax

    compiles = [0]

    def count(event, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    monkeypatch.setenv("MESHEMBED_JAX_FUSED", fused)
    kw = {"use_ema": True, "ema_momentum": 0.9} if path == "ema" else {"weight_decay": 0.01, "clipvalue": 1.0}
    rng = np.random.default_rng(2)
    be = me.get_backend("jax")
    vs = [me.Variable(rng.standard_normal(s).astype(np.float32), name=f"v{i}", backend="jax")
          for i, s in enumerate([(40, 3), (17,)])]
    opt = me.optimizers.Adadelta(schedules.ExponentialDecay(0.5, 1, 0.95), rho=0.9, epsilon=1e-6, **kw)
    counts = []
    grads = [[be.asarray(rng.standard_normal(v.shape).astype(np.float32)) for v in vs] for _ in range(STEPS)]
    for g in grads:
        opt.apply_gradients(list(zip(g, vs)))
        counts.append(compiles[0])
    assert counts[-1] == counts[WARM_UP - 1], f"recompiled after warm-up: {counts}"


@pytest.mark.skipif(not _usable("torch"), reason="torch is not installed")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_nan_policy_in_one_pass_finds_any_bad_element(bad, dtype):
    """The NaN policy's one C pass over all 64 gradients finds a single bad element in any
    tensor (first, last, any position); large finite values pass; a non-contiguous tensor
    takes the framework's reductions (same answer); the step then changes nothing."""
    import torch

    from meshembed_torch import native

    be = me.get_backend("torch")
    dt = getattr(torch, dtype)
    grads = [torch.randn(1000 + 7 * i, dtype=dt) for i in range(64)]
    assert bool(be.finite_guard(grads))
    assert native.all_finite([torch.full((9,), torch.finfo(dt).max, dtype=dt)], 2) in (True, None)
    for n, j in ((0, 0), (63, -1), (31, 500)):
        hit = [g.clone() for g in grads]
        hit[n][j] = bad
        assert not bool(be.finite_guard(hit)), (n, j)
    strided = torch.randn(40, dtype=dt)[::2].clone()[::1]
    strided[3] = bad
    assert not bool(be.finite_guard([torch.randn(80, dtype=dt)[::2], strided]))
    variables = [me.Variable(np.ones(g.shape, dtype), name=f"v{i}", backend="torch") for i, g in enumerate(grads)]
    hit = [g.clone() for g in grads]
    hit[40][3] = bad
    with pytest.raises(me.InputError, match="v40"):
        me.optimizers.Adadelta(1.0).apply_gradients(list(zip(hit, variables)))
    assert all(np.array_equal(v.numpy(), np.ones(v.shape, dtype)) for v in variables)
