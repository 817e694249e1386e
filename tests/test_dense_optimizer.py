"""The Keras optimizer surface of ``me.optimizers.Adadelta`` and ``me.Variable``.

Parametrised over numpy, torch and jax; a backend that is not usable here is skipped with
the reason. Trajectories against other frameworks live in
``conformance/test_dense_adadelta.py``; multi-device meshes in ``test_mesh_multidevice.py``.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import warnings

import numpy as np
import pytest

import meshembed as me
from meshembed.errors import BackendUnavailableError, ConfigError, InputError
from meshembed.math import AdadeltaSlots, adadelta
from meshembed.math.rule import apply_rule
from meshembed.optimizers import EMAOption, GradientsClipOption, schedules

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _backend_params(names=("numpy", "torch", "jax")) -> list:
    out = []
    for name in names:
        try:
            me.get_backend(name)
        except BackendUnavailableError as exc:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=str(exc)), id=name))
        else:
            out.append(pytest.param(name, id=name))
    return out


@pytest.fixture(params=_backend_params())
def bk(request) -> str:
    return request.param


@pytest.fixture(params=_backend_params(("torch", "jax")))
def autodiff_bk(request) -> str:
    return request.param


def _state(opt, variables) -> dict[str, np.ndarray]:
    out = {f"model:{v.name}": v.numpy() for v in variables}
    out.update({f"opt:{v.name}": v.numpy() for v in opt.variables})
    return out


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# -- Variable ------------------------------------------------------------------------------

def test_variable_surface(bk):
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = me.Variable(src, name="dense/kernel", backend=bk)
    assert v.backend.is_native(v.value)
    assert (v.shape, v.dtype, v.name, v.layout, v.trainable) == ((2, 3), "float32", "dense/kernel", None, True)
    src[0, 0] = 100.0  # the variable holds its own copy
    np.testing.assert_array_equal(v.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    v.assign(np.ones((2, 3)))
    assert v.dtype == "float32"
    np.testing.assert_array_equal(v.numpy(), np.ones((2, 3), np.float32))
    with pytest.raises(InputError, match="Expected shape"):
        v.assign(np.ones((3, 2)))
    np.testing.assert_array_equal(v.numpy(), np.ones((2, 3), np.float32))
    assert me.Variable(lambda: np.zeros(3), backend=bk).shape == (3,)


def test_variable_with_layout_on_logical_mesh(bk):
    mesh = me.Mesh(["batch", "model"], (1, 1), backend=bk)
    layout = me.Layout(["model", me.UNSHARDED], mesh)
    v = me.Variable(np.zeros((4, 2), np.float32), name="w", layout=layout)
    assert v.layout == layout and v.backend is mesh.backend
    with pytest.raises(InputError, match="rank"):
        me.Variable(np.zeros((4,), np.float32), layout=layout)


# -- slots, variables, iterations -----------------------------------------------------------

def test_slots_from_reference_share_name_shape_dtype_layout(bk):
    mesh = me.Mesh(["batch", "model"], (1, 1), backend=bk)
    w = me.Variable(np.ones((4, 3), np.float64 if bk != "jax" else np.float32), name="dense/kernel",
                    layout=me.Layout(["model", me.UNSHARDED], mesh))
    b = me.Variable(np.ones((3,), np.float32), name="dense/bias", layout=me.Layout.replicated(mesh, 1))
    opt = me.optimizers.Adadelta(mesh=mesh, ema_option=EMAOption(use_ema=True))
    opt.build([w, b])
    names = [v.name for v in opt.variables]
    assert names == ["iteration", "average/dense/kernel", "average/dense/bias",  # tf_keras' order
                     "accumulated_grad/dense/kernel", "accumulated_delta_var/dense/kernel",
                     "accumulated_grad/dense/bias", "accumulated_delta_var/dense/bias"]
    by_name = {v.name: v for v in opt.variables}
    for model in (w, b):
        for prefix in ("accumulated_grad", "accumulated_delta_var", "average"):
            slot = by_name[f"{prefix}/{model.name}"]
            assert (slot.shape, slot.dtype, slot.layout) == (model.shape, model.dtype, model.layout)
            assert not slot.trainable
        np.testing.assert_array_equal(by_name[f"average/{model.name}"].numpy(), model.numpy())  # EMA starts at build
        np.testing.assert_array_equal(by_name[f"accumulated_grad/{model.name}"].numpy(), np.zeros(model.shape))
    assert opt.iterations.layout == me.Layout.replicated(mesh, 0)
    assert opt.iterations.dtype in ("int64", "int32")  # jax without x64 has no int64
    extra = opt.add_variable((2, 2), initializer="ones", name="extra")
    assert extra.layout == me.Layout.replicated(mesh, 2) and extra.dtype == "float32"
    np.testing.assert_array_equal(extra.numpy(), np.ones((2, 2)))
    assert opt.variables[-1] is extra
    slot = opt.add_variable_from_reference(w, "momentum", initial_value=np.full(w.shape, 2.0))
    assert slot.name == "momentum/dense/kernel" and slot.layout == w.layout and slot.dtype == w.dtype


def test_iterations_count_and_update_step_does_not(bk):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0)
    for k in range(3):
        assert int(opt.iterations.numpy()) == k
        opt.apply_gradients([(np.ones(3, np.float32), w)])
    before = w.numpy()
    opt.update_step(np.ones(3, np.float32), w)
    assert int(opt.iterations.numpy()) == 3
    assert not np.array_equal(w.numpy(), before)


def test_none_gradients_are_skipped(bk):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    v = me.Variable(np.ones(2, np.float32), name="v", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0)
    opt.apply_gradients([(np.ones(3, np.float32), w), (None, v)])
    np.testing.assert_array_equal(v.numpy(), np.ones(2))
    with pytest.raises(InputError, match="No gradients"):
        opt.apply_gradients([(None, w), (None, v)])


# -- sparse gradients -----------------------------------------------------------------------

def test_sparse_duplicates_summed_and_only_touched_rows_change(bk):
    init = np.arange(15, dtype=np.float32).reshape(5, 3)  # row i holds i·3 + column
    w = me.Variable(init, name="table", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=0.5, rho=0.5, epsilon=1e-3)
    values = np.array([[1, 2, 3], [4, 5, 6], [-1, 0, 1]], np.float32)
    opt.apply_gradients([(me.IndexedSlices(values, np.array([3, 1, 3]), (5, 3)), w)])
    summed = np.zeros((5, 3), np.float32)
    summed[1] = values[1]
    summed[3] = values[0] + values[2]
    slots = AdadeltaSlots(np.zeros_like(init), np.zeros_like(init))
    expected, exp_slots = adadelta(me.get_backend("numpy").xp, init, summed, slots, lr=0.5, rho=0.5, epsilon=1e-3)
    got = w.numpy()
    np.testing.assert_allclose(got[[1, 3]], expected[[1, 3]], rtol=1e-6)
    np.testing.assert_array_equal(got[[0, 2, 4]], init[[0, 2, 4]])
    acc = {v.name: v.numpy() for v in opt.variables}["accumulated_grad/table"]
    np.testing.assert_allclose(acc[[1, 3]], exp_slots.accumulators[[1, 3]], rtol=1e-6)
    np.testing.assert_array_equal(acc[[0, 2, 4]], 0.0)


# -- validation errors leave everything unchanged -------------------------------------------

def _two_var_setup(bk):
    w = me.Variable(np.ones((3, 2), np.float32), name="w", backend=bk)
    b = me.Variable(np.ones((2,), np.float32), name="b", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0, ema_option=EMAOption(use_ema=True),
                                 gradients_clip_option=GradientsClipOption(global_clipnorm=1.0))
    opt.apply_gradients([(np.ones((3, 2)), w), (np.ones(2), b)])
    return w, b, opt


@pytest.mark.parametrize("bad", ["shape", "index_range", "index_dtype", "dense_shape", "unknown_var",
                                 "not_pairs", "text_grad", "duplicate_var"])
def test_invalid_input_raises_in_keras_voice_and_changes_nothing(bk, bad):
    w, b, opt = _two_var_setup(bk)
    before = _state(opt, [w, b])
    other = me.Variable(np.ones(2, np.float32), name="other", backend=bk)
    good = (np.ones((3, 2)), w)
    cases = {
        "shape": [good, (np.ones(3), b)],
        "index_range": [good, (me.IndexedSlices(np.ones((1,)), np.array([2]), (2,)), b)],
        "index_dtype": [good, (me.IndexedSlices(np.ones((1,)), np.array([0.5]), (2,)), b)],
        "dense_shape": [good, (me.IndexedSlices(np.ones((1,)), np.array([0]), (3,)), b)],
        "unknown_var": [good, (np.ones(2), other)],
        "not_pairs": [(np.ones((3, 2)), w, 1)],
        "text_grad": [good, (np.array(["a", "b"]), b)],
        "duplicate_var": [good, good],
    }
    with pytest.raises(InputError, match=r"Invalid|Expected"):
        opt.apply_gradients(cases[bad])
    _assert_state_equal(before, _state(opt, [w, b]))


def test_error_inside_the_update_changes_nothing(bk, monkeypatch):
    w, b, opt = _two_var_setup(bk)
    before = _state(opt, [w, b])
    original = type(opt).update_step
    calls = []

    def failing(self, grad, variable):
        calls.append(variable.name)
        if variable is b:
            raise RuntimeError("boom")
        return original(self, grad, variable)

    monkeypatch.setattr(type(opt), "update_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        opt.apply_gradients([(np.ones((3, 2)), w), (np.ones(2), b)])
    assert calls == ["w", "b"]  # w's update was computed, then discarded
    _assert_state_equal(before, _state(opt, [w, b]))


def test_error_inside_an_in_place_step_changes_nothing(bk, monkeypatch):
    """Without EMA a dense step on torch is staged as an in-place update; it runs only at the
    commit, so a later variable's failure still leaves every variable and slot unchanged."""
    w = me.Variable(np.ones((3, 2), np.float32), name="w", backend=bk)
    b = me.Variable(np.ones((2,), np.float32), name="b", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0)
    opt.apply_gradients([(np.ones((3, 2)), w), (np.ones(2), b)])
    before = _state(opt, [w, b])
    original = type(opt).update_step

    def failing(self, grad, variable):
        if variable is b:
            raise RuntimeError("boom")
        return original(self, grad, variable)

    monkeypatch.setattr(type(opt), "update_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        opt.apply_gradients([(np.full((3, 2), 2.0), w), (np.ones(2), b)])
    _assert_state_equal(before, _state(opt, [w, b]))
    monkeypatch.undo()
    opt.apply_gradients([(np.full((3, 2), 2.0), w), (np.ones(2), b)])  # and it still works
    assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize("fused", ["1", "0"])
def test_torch_dense_steps_run_compiled_in_place_and_match_numpy(monkeypatch, fused):
    """Big enough to compile (2¹⁸ floats × 4 arrays): the step runs in place (the variable
    keeps its tensor) — the generated row kernel (fused on) or the core function compiled
    (off) — grouped over variables, once for a learning-rate schedule, and matches the NumPy
    backend."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", fused)
    rng = np.random.default_rng(5)
    shapes = [(512, 512), (1 << 18,), (1 << 18,)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    schedule = schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    results = {}
    for name in ("numpy", "torch"):
        vs = [me.Variable(x, name=f"v{i}", backend=name) for i, x in enumerate(init)]
        opt = me.optimizers.Adadelta(learning_rate=schedule, rho=0.9, epsilon=1e-6)
        tensors = [v.value for v in vs]
        for step in grads:
            opt.apply_gradients(list(zip(step, vs)))
        if name == "torch":
            assert all(v.value is t for v, t in zip(vs, tensors))  # updated in place
            assert [k[2] for k in opt._compile_cache] == [3]  # one compiled call for the three
            assert not me.get_backend("torch")._compile_broken
        results[name] = [v.numpy() for v in opt.variables[1:]] + [v.numpy() for v in vs]
    for a, b in zip(results["numpy"], results["torch"]):
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=2e-7)


def test_gradients_that_are_variables_arrays(bk):
    """A gradient may be a variable's own array (its own, or another variable's updated in
    the same call, across staged groups of in-place steps): every step reads the values it
    was given, as on NumPy — no aliasing through in-place writes or donated buffers."""
    def run(name):
        rng = np.random.default_rng(4)
        vs = [me.Variable(rng.standard_normal(7).astype(np.float32), name=f"v{i}", backend=name) for i in range(12)]
        opt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6)
        for _ in range(2):
            opt.apply_gradients([(vs[i - 1].value if i % 2 else vs[i].value, vs[i]) for i in range(12)])
        return [v.numpy() for v in vs]

    for got, want in zip(run(bk), run("numpy")):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_jax_dense_steps_donate_run_one_pass_per_output_and_match_numpy(monkeypatch, fused):
    """JAX: the staged step is jitted with every target donated (the old buffers are gone,
    the variables hold the new arrays), with the registered fused kernel (on) or the core
    step compiled by XLA (off; tests/test_jax_fused.py compares the two). Compiled by XLA,
    Adadelta's elementwise step on CPU runs as one compiled pass per output, parameters
    first, then accumulated_delta_var, then accumulated_grad (each pass reads only targets
    not yet written), each one loop fusion with no copy; and every number matches the NumPy
    backend."""
    jax = pytest.importorskip("jax")
    monkeypatch.setenv("MESHEMBED_JAX_FUSED", fused)

    rng = np.random.default_rng(7)
    shapes = [(3100,), (40, 7)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    results = {}
    for name in ("numpy", "jax"):
        vs = [me.Variable(x, name=f"v{i}", backend=name) for i, x in enumerate(init)]
        opt = me.optimizers.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6)
        for step in grads:
            old = [v.value for v in vs] + [s.value for s in opt.variables[1:]]
            opt.apply_gradients(list(zip(step, vs)))
            if name == "jax":
                assert all(o.is_deleted() for o in old), "the step copied instead of donating"
        results[name] = [v.numpy() for v in opt.variables[1:]] + [v.numpy() for v in vs]
    for a, b in zip(results["numpy"], results["jax"]):
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=2e-7)

    be = me.get_backend("jax")
    rule = me.optimizers.Adadelta()._rule(me.Variable(np.ones(3, np.float32), backend="jax"), folded=False)
    x = jax.numpy.ones(3100, jax.numpy.float32)
    lr = (jax.numpy.asarray(0.1, jax.numpy.float32),)

    def step(g, values, *t):
        return apply_rule(be.xp, rule, values, g, *t)

    assert be._pass_order(step, [x], [lr], [[x], [x], [x]]) == [0, 2, 1]
    monkeypatch.setattr(be, "fused", False)  # the XLA passes (the switch is read once, by the constructor)
    run = be.compile_update(rule, 1)
    targets = [[jax.numpy.ones(3100, jax.numpy.float32) * k] for k in (1, 2, 3)]
    run([x], [(0.1,)], *targets)
    passes = _compiled_passes(run)
    assert [k for k, _ in passes] == [0, 2, 1]
    for hlo in (c.as_text() for _, c in passes):
        assert hlo.count("fusion(") == 1 and " copy(" not in hlo
    # a step whose every output reads every target cannot be split: one pass
    def swap(g, values, a, b):
        return b - values[0] * g, a + values[0] * g

    assert be._pass_order(swap, [x], [lr], [[x], [x]]) is None


def _compiled_passes(run):
    """The compiled passes :meth:`JaxDenseMixin.compile_update` cached (its closure)."""
    cache = next(c.cell_contents for c in run.__closure__ if isinstance(c.cell_contents, dict))
    ((fused, pieces),) = cache.values()
    assert fused is None
    ((_, _, plan),) = pieces
    return plan


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_elementwise_steps_in_pieces_are_the_whole_step(monkeypatch, dtype):
    """NumPy runs Adadelta's elementwise step on pieces written in place (small pieces here:
    several and a tail, and a 2-D variable): bit-identical to the step on whole arrays, and
    every variable and slot keeps its own storage."""
    from meshembed_numpy import dense as numpy_dense

    rng = np.random.default_rng(3)
    shapes = [(1000,), (33, 17), (5,)]
    init = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(3)]
    results = []
    for piece in (10**9, 64):
        monkeypatch.setattr(numpy_dense, "PIECE_ELEMENTS", piece)
        vs = [me.Variable(x, name=f"v{i}", backend="numpy") for i, x in enumerate(init)]
        opt = me.optimizers.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6)
        storage = None
        for step in grads:
            opt.apply_gradients(list(zip(step, vs)))
            now = [v.value.ctypes.data for v in opt.variables[1:] + vs]
            assert storage in (None, now), "a step replaced a variable's array instead of writing into it"
            storage = now
        results.append([v.numpy() for v in opt.variables[1:] + vs])
    for whole, pieces in zip(*results):
        np.testing.assert_array_equal(pieces, whole)
    assert not np.array_equal(results[0][-1], init[-1])


@pytest.mark.parametrize("kwargs,match", [
    ({"rho": 1.5}, "Invalid `rho`"),
    ({"epsilon": -1.0}, "Invalid `epsilon`"),
    ({"learning_rate": "fast"}, "Invalid `learning_rate`"),
    ({"learning_rate": -0.1}, "Invalid `learning_rate`"),
    ({"name": ""}, "Invalid `name`"),
    ({"gradients_clip_option": {"clipnorm": 1.0}}, "Invalid `gradients_clip_option`"),
    ({"mesh": "batch"}, "Invalid `mesh`"),
])
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        me.optimizers.Adadelta(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"clipnorm": 1.0, "global_clipnorm": 1.0}, "at most one"),
    ({"clipnorm": 0.0}, "Invalid `clipnorm`"),
    ({"clipvalue": -1}, "Invalid `clipvalue`"),
    ({"global_clipnorm": float("nan")}, "Invalid `global_clipnorm`"),
])
def test_invalid_clip_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GradientsClipOption(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"ema_momentum": 1.5}, "Invalid `ema_momentum`"),
    ({"ema_overwrite_frequency": 0}, "Invalid `ema_overwrite_frequency`"),
    ({"ema_overwrite_frequency": 2.5}, "Invalid `ema_overwrite_frequency`"),
    ({"use_ema": "yes"}, "Invalid `use_ema`"),
])
def test_invalid_ema_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EMAOption(**kwargs)


def test_clipvalue_with_a_norm_warns_it_is_ignored():
    with pytest.warns(UserWarning, match="clipvalue"):
        GradientsClipOption(clipnorm=1.0, clipvalue=0.5)


# -- EMA ------------------------------------------------------------------------------------

def test_ema_overwrite_frequency_and_finalize(bk):
    w = me.Variable(np.full(4, 2.0, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.5, epsilon=1e-2,
                                 ema_option=EMAOption(use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2))
    avg = None
    for step in range(1, 5):
        opt.apply_gradients([(np.ones(4, np.float32), w)])
        avg = {v.name: v for v in opt.variables}["average/w"].numpy()
        if step % 2 == 0:
            np.testing.assert_array_equal(w.numpy(), avg)
        else:
            assert not np.array_equal(w.numpy(), avg)
    opt.apply_gradients([(np.ones(4, np.float32), w)])
    avg = {v.name: v for v in opt.variables}["average/w"].numpy()
    opt.finalize_variable_values([w])
    np.testing.assert_array_equal(w.numpy(), avg)


# -- learning rate and schedules ------------------------------------------------------------

def test_learning_rate_property_and_setter():
    opt = me.optimizers.Adadelta(learning_rate=0.1)
    assert opt.learning_rate == 0.1
    opt.learning_rate = 0.5
    assert opt.get_config()["learning_rate"] == 0.5
    sched = me.optimizers.Adadelta(learning_rate=schedules.PiecewiseConstantDecay([1], [0.5, 0.25]))
    assert sched.learning_rate == 0.5
    with pytest.raises(TypeError, match="schedule"):
        sched.learning_rate = 0.1


def test_schedule_is_evaluated_at_the_step_before_the_update(bk):
    sched = schedules.PiecewiseConstantDecay([0, 1], [1.0, 0.5, 0.1])  # steps 0 / 1 / >=2
    w = me.Variable(np.zeros(2, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=sched, rho=0.9, epsilon=1e-3)
    xp = me.get_backend("numpy").xp
    p, s = np.zeros(2, np.float32), AdadeltaSlots(np.zeros(2, np.float32), np.zeros(2, np.float32))
    g = np.array([1.0, -2.0], np.float32)
    for step in range(4):
        assert opt.learning_rate == sched(step)
        opt.apply_gradients([(g, w)])
        p, s = adadelta(xp, p, g, s, lr=sched(step), rho=0.9, epsilon=1e-3)
        np.testing.assert_allclose(w.numpy(), p, rtol=1e-6)


def test_callable_learning_rate_runs_but_is_not_serialisable():
    opt = me.optimizers.Adadelta(learning_rate=lambda step: 0.1 / (1 + step))
    w = me.Variable(np.zeros(2, np.float32), name="w", backend="numpy")
    opt.apply_gradients([(np.ones(2), w)])
    assert opt.learning_rate == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="Invalid `learning_rate` for get_config"):
        opt.get_config()
    assert me.optimizers.Adadelta(learning_rate=lambda: 0.125).learning_rate == 0.125


# -- configs ----------------------------------------------------------------------------------

def _configs() -> list:
    return [
        pytest.param({}, id="defaults"),
        pytest.param({"learning_rate": 0.25, "rho": 0.9, "epsilon": 1e-6, "name": "dense_opt"}, id="hparams"),
        pytest.param({"gradients_clip_option": GradientsClipOption(clipnorm=1.0, clipvalue=None)}, id="clipnorm"),
        pytest.param({"gradients_clip_option": GradientsClipOption(global_clipnorm=2.0)}, id="global_clipnorm"),
        pytest.param({"gradients_clip_option": GradientsClipOption(clipvalue=0.5)}, id="clipvalue"),
        pytest.param({"ema_option": EMAOption(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)}, id="ema"),
        pytest.param({"learning_rate": schedules.ExponentialDecay(0.1, 10, 0.9, staircase=True)}, id="exp_decay"),
        pytest.param({"learning_rate": schedules.PiecewiseConstantDecay([10, 20], [0.1, 0.01, 0.001])}, id="piecewise"),
        pytest.param({"learning_rate": schedules.InverseTimeDecay(0.1, 10, 0.5)}, id="inverse_time"),
        pytest.param({"learning_rate": schedules.PolynomialDecay(0.1, 10, 0.001, power=2.0, cycle=True)}, id="poly"),
    ]


@pytest.mark.parametrize("kwargs", _configs())
def test_config_round_trips_exactly(kwargs):
    opt = me.optimizers.Adadelta(**kwargs)
    cfg = opt.get_config()
    again = me.optimizers.Adadelta.from_config(cfg)
    assert again.get_config() == cfg
    assert again.gradients_clip_option == opt.gradients_clip_option
    assert again.ema_option == opt.ema_option
    assert set(cfg) == {"name", "weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                        "ema_momentum", "ema_overwrite_frequency", "jit_compile", "is_legacy_optimizer",
                        "learning_rate", "rho", "epsilon"}


def test_options_have_their_own_configs_and_nested_form_is_read():
    clip, ema = GradientsClipOption(clipvalue=0.3), EMAOption(use_ema=True, ema_momentum=0.5)
    assert GradientsClipOption.from_config(clip.get_config()) == clip
    assert EMAOption.from_config(ema.get_config()) == ema
    opt = me.optimizers.Adadelta.from_config(
        {"learning_rate": 0.1, "gradients_clip_option": clip.get_config(), "ema_option": ema.get_config()})
    assert opt.gradients_clip_option == clip and opt.ema_option == ema
    with pytest.raises(ConfigError, match="Invalid `config`"):
        me.optimizers.Adadelta.from_config({"learning_rate": 0.1, "momentum": 0.9})
    assert me.optimizers.Adadelta.from_config({"weight_decay": 0.01}).weight_decay == 0.01  # Keras' decay
    with pytest.raises(ConfigError, match="Invalid `weight_decay`"):
        me.optimizers.Adadelta.from_config({"weight_decay": -0.01})


tf_keras_params = [pytest.param(k, id=i) for k, i in [
    ({}, "defaults"),
    ({"learning_rate": 0.5, "rho": 0.9, "epsilon": 1e-6, "clipnorm": 1.0}, "clipnorm"),
    ({"global_clipnorm": 2.0, "use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 4}, "ema"),
    ({"clipvalue": 0.5}, "clipvalue"),
]]


@pytest.fixture(scope="module")
def tf_keras():
    return pytest.importorskip("tf_keras")


@pytest.mark.parametrize("kwargs", tf_keras_params)
def test_config_moves_between_tf_keras_and_meshembed(tf_keras, kwargs):
    theirs = tf_keras.optimizers.Adadelta(**kwargs, jit_compile=False)
    ours = me.optimizers.Adadelta.from_config(theirs.get_config())
    cfg = ours.get_config()
    expected = dict(theirs.get_config())
    expected["learning_rate"] = float(expected["learning_rate"])  # tf_keras stores lr as a float32 variable
    assert cfg == expected
    back = tf_keras.optimizers.Adadelta.from_config(cfg).get_config()
    assert {k: v for k, v in back.items() if k != "learning_rate"} == {k: v for k, v in cfg.items() if k != "learning_rate"}
    assert math.isclose(float(back["learning_rate"]), cfg["learning_rate"], rel_tol=1e-7)


def test_schedule_configs_move_between_tf_keras_and_meshembed(tf_keras):
    S = tf_keras.optimizers.schedules
    theirs = [S.ExponentialDecay(0.1, 7, 0.8, staircase=False), S.ExponentialDecay(0.1, 7, 0.8, staircase=True),
              S.PiecewiseConstantDecay([3, 9], [0.3, 0.2, 0.1]), S.InverseTimeDecay(0.2, 5, 0.5, staircase=True),
              S.PolynomialDecay(0.1, 12, 0.01, power=0.5), S.PolynomialDecay(0.1, 5, 0.01, power=2.0, cycle=True)]
    for sched in theirs:
        cfg = tf_keras.optimizers.Adadelta(learning_rate=sched).get_config()
        ours = me.optimizers.Adadelta.from_config(cfg)
        assert ours.get_config()["learning_rate"] == cfg["learning_rate"]
        mine = ours._learning_rate
        for step in range(0, 30, 1):
            assert mine(step) == pytest.approx(float(sched(step)), rel=1e-6), (cfg["learning_rate"], step)
        back = tf_keras.optimizers.Adadelta.from_config(ours.get_config())
        assert float(back._learning_rate(11)) == pytest.approx(float(sched(11)), rel=1e-6)


# -- autodiff ---------------------------------------------------------------------------------

def test_numpy_has_no_autodiff_and_points_to_apply_gradients():
    w = me.Variable(np.ones(2, np.float32), name="w", backend="numpy")
    opt = me.optimizers.Adadelta()
    with pytest.raises(NotImplementedError, match="apply_gradients"):
        opt.minimize(lambda: (w.value ** 2).sum(), [w])
    assert not opt.built


def test_compute_gradients_keras_and_positional_styles(autodiff_bk):
    backend = me.get_backend(autodiff_bk)
    xp = backend.xp
    w = me.Variable(np.array([1.0, -2.0, 3.0], np.float32), name="w", backend=autodiff_bk)
    b = me.Variable(np.array([0.5], np.float32), name="b", backend=autodiff_bk)
    opt = me.optimizers.Adadelta()
    keras_style = opt.compute_gradients(lambda: xp.sum(w.value * w.value) + 3 * xp.sum(b.value), [w, b])
    positional = opt.compute_gradients(lambda wv, bv: xp.sum(wv * wv) + 3 * xp.sum(bv), [w, b])
    for grads in (keras_style, positional):
        assert [v for _, v in grads] == [w, b]
        np.testing.assert_allclose(backend.to_numpy(grads[0][0]), [2.0, -4.0, 6.0])
        np.testing.assert_allclose(backend.to_numpy(grads[1][0]), [3.0])
    assert backend.is_native(w.value)  # the variable's value was restored after tracing
    np.testing.assert_array_equal(w.numpy(), [1.0, -2.0, 3.0])
    with pytest.raises(InputError, match="Invalid `tape`"):
        opt.compute_gradients(lambda: xp.sum(w.value), [w], tape=object())


def _load_example():
    spec = importlib.util.spec_from_file_location("logistic_regression", ROOT / "examples" / "logistic_regression.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minimize_trains_logistic_regression(autodiff_bk):
    losses = _load_example().train(autodiff_bk, steps=60)
    assert losses[-1] < 0.5 * losses[0]
    assert all(later <= earlier + 1e-6 for earlier, later in zip(losses[::10], losses[10::10]))


def test_minimize_matches_apply_gradients_with_hand_gradients(autodiff_bk):
    backend = me.get_backend(autodiff_bk)
    xp = backend.xp
    target = backend.asarray(np.array([1.0, 2.0], np.float32))
    w1 = me.Variable(np.zeros(2, np.float32), name="w", backend=autodiff_bk)
    w2 = me.Variable(np.zeros(2, np.float32), name="w", backend="numpy")
    o1 = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-3)
    o2 = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            grad = 2 * (w2.numpy() - np.array([1.0, 2.0], np.float32))
            o1.minimize(lambda: xp.sum((w1.value - target) ** 2), [w1])
            o2.apply_gradients([(grad, w2)])
    np.testing.assert_allclose(w1.numpy(), w2.numpy(), rtol=1e-6)
    assert int(o1.iterations.numpy()) == 5


def test_jit_compile_gives_the_same_trajectory():
    _ = pytest.importorskip("jax")
    try:
        me.get_backend("jax")
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(3)
    init, grads = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(6, 4, 3)).astype(np.float32)
    out = []
    for jit in (False, True):
        w = me.Variable(init, name="w", backend="jax")
        opt = me.optimizers.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-3, jit_compile=jit,
                                     gradients_clip_option=GradientsClipOption(clipnorm=1.0))
        for g in grads:
            opt.apply_gradients([(g, w)])
        out.append(w.numpy())
    np.testing.assert_allclose(out[1], out[0], rtol=1e-6)


def test_invalid_first_step_does_not_build(bk):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta()
    with pytest.raises(InputError, match="Expected shape"):
        opt.apply_gradients([(np.ones(4), w)])
    assert not opt.built and [v.name for v in opt.variables] == ["iteration"]
    np.testing.assert_array_equal(w.numpy(), np.ones(3))


def test_a_step_asks_each_backend_for_its_capabilities_once(bk, monkeypatch):
    """The in-place decision reads ``capabilities.in_place`` once a step, not once per variable
    (64 variables: ~0.1 ms a step on torch), and forgets it after the step: a later step asks again."""
    variables = [me.Variable(np.ones(4, np.float32), name=f"w{i}", backend=bk) for i in range(8)]
    opt = me.optimizers.Adadelta(learning_rate=1.0)
    opt.build(variables)
    backend = variables[0].backend
    asked = []
    real = type(backend).capabilities

    def counted(self):
        asked.append(self)
        return real.__get__(self)

    monkeypatch.setattr(type(backend), "capabilities", property(counted))
    pairs = [(np.full(4, 0.5, np.float32), v) for v in variables]
    for step in (1, 2):
        asked.clear()
        opt.apply_gradients(pairs)
        in_place = sum(1 for b in asked if b is backend)
        assert 1 <= in_place <= 4, (step, len(asked))  # the step's own few asks, not one per variable
        assert opt._in_place_backends == {}
    reference = [me.Variable(np.ones(4, np.float32), name=f"r{i}", backend=bk) for i in range(8)]
    ref = me.optimizers.Adadelta(learning_rate=1.0)
    monkeypatch.undo()
    for _ in range(2):
        ref.apply_gradients([(np.full(4, 0.5, np.float32), v) for v in reference])
    for v, r in zip(variables, reference):
        np.testing.assert_array_equal(v.numpy(), r.numpy())
