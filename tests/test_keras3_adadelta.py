"""Keras 3's optimizer surface on ``me.optimizers.Adadelta``, against the real libraries.

Golden files (``tests/golden_keras/*.json``, written by ``generate.py`` there with Keras 3 and
tf_keras) hold each library's config, the trajectory it took and its variable store: the
config must load with ``from_config`` and give the same trajectory on every backend, and a
store saved mid-way must resume identically. Also ported here (our own code; the expected
numbers are the peers'): Keras 3's ``adadelta_test.py`` / ``optimizer_test.py`` cases,
tf_keras' ``optimizer_test.py`` / legacy ``adadelta_test.py``, torch's ``test_optim.py``
Adadelta cases, and the findings (a)-(h) of issue #21 and the dense items of issue #17.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import pathlib
import warnings

import numpy as np
import pytest

import meshembed as me
from meshembed.errors import BackendUnavailableError, ConfigError, InputError, StateError
from meshembed.optimizers import EMAOption, GradientsClipOption, schedules

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden_keras"
CASES = sorted(p.stem for p in GOLDEN.glob("*.json"))


def _backends(names=("numpy", "torch", "jax")) -> list:
    out = []
    for name in names:
        try:
            me.get_backend(name)
        except BackendUnavailableError as exc:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=str(exc)), id=name))
        else:
            out.append(pytest.param(name, id=name))
    return out


@pytest.fixture(params=_backends())
def bk(request) -> str:
    return request.param


def _load(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def _vars(case: dict, bk: str, values=None) -> list:
    values = values or [case["initial"]["w"], case["initial"]["b"]]
    return [me.Variable(np.asarray(x, np.float32), name=n, backend=bk) for n, x in zip("wb", values)]


def _grad(g):
    """A gradient of a golden file: a list (dense) or {indices, values, dense_shape}."""
    if isinstance(g, dict):
        return me.IndexedSlices(np.asarray(g["values"], np.float32), np.asarray(g["indices"]), g["dense_shape"])
    return np.asarray(g, np.float32)


def _keras_store(case: dict, key: str) -> dict:
    return {str(i): np.asarray(x) for i, x in enumerate(case[key])}


def _ours_from_keras(case: dict, store: list) -> list:
    """Keras 3's store without its learning-rate variable (meshembed keeps lr a float)."""
    names = case["store_names"]
    return [x for x, n in zip(store, names) if n != "learning_rate"]


def _state(opt, variables) -> list:
    return [v.numpy() for v in variables] + [v.numpy() for v in opt.variables]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# -- golden trajectories of the real libraries ---------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_config_of_the_library_gives_its_trajectory(bk, name):
    case = _load(name)
    opt = me.optimizers.Adadelta.from_config(dict(case["config"]))
    assert opt.keras3 == name.startswith("keras3")
    variables = _vars(case, bk)
    for step, (grads, expected) in enumerate(zip(case["grads"], case["trajectory"]), start=1):
        opt.apply_gradients([(_grad(g), v) for g, v in zip(grads, variables)])
        for v, e in zip(variables, expected):
            np.testing.assert_allclose(v.numpy(), np.asarray(e, np.float32), rtol=2e-6, atol=2e-7,
                                       err_msg=f"{name} step {step} {v.name}")
    ours = [v.numpy() for v in opt.variables]
    theirs = _ours_from_keras(case, case["store_end"])
    assert len(ours) == len(theirs), [v.name for v in opt.variables]
    for x, y in zip(ours, theirs):
        np.testing.assert_allclose(x, np.asarray(y, x.dtype), rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("name", [c for c in CASES if c.startswith("keras3")])
def test_keras3_store_resumes_with_the_same_numbers(bk, name):
    """A Keras 3 ``save_own_variables`` store (with its learning-rate entry) loads and the
    next steps are Keras 3's."""
    case = _load(name)
    opt = me.optimizers.Adadelta.from_config(dict(case["config"]))
    variables = _vars(case, bk, case["trajectory"][2])
    opt.build(variables)
    opt.load_own_variables(_keras_store(case, "store_mid"))
    assert int(opt.variables[0].numpy()) == 3
    for grads, expected in zip(case["grads"][3:], case["trajectory"][3:]):
        opt.apply_gradients([(_grad(g), v) for g, v in zip(grads, variables)])
        for v, e in zip(variables, expected):
            np.testing.assert_allclose(v.numpy(), np.asarray(e, np.float32), rtol=2e-6, atol=2e-7)


def _mesh_variables(bk: str, values: list) -> tuple:
    """Variables laid out on a 2-way mesh (logical on NumPy; JAX needs two devices, else it is
    skipped with the reason; torch's mesh in one process has one rank)."""
    if bk == "jax":
        import jax

        if len(jax.devices()) < 2:
            pytest.skip("one JAX device here (XLA_FLAGS=--xla_force_host_platform_device_count=2 for a mesh)")
    mesh = me.Mesh(["model"], shape=(1,) if bk == "torch" else (2,), backend=bk)  # torch: one rank here
    layouts = [me.Layout([me.UNSHARDED, "model"], mesh), me.Layout(["model"], mesh)]
    return mesh, [me.Variable(np.asarray(x, np.float32), name=n, layout=l) for n, x, l in zip("wb", values, layouts)]


@pytest.mark.parametrize("target", _backends())
@pytest.mark.parametrize("name", ["keras3_everything", "keras3_accumulation_ema", "tf_keras_ema_overwrite"])
def test_saved_variables_load_on_another_backend_and_mesh(bk, target, name):
    case = _load(name)
    opt = me.optimizers.Adadelta.from_config(dict(case["config"]))
    variables = _vars(case, bk)
    for grads in case["grads"][:3]:
        opt.apply_gradients([(_grad(g), v) for g, v in zip(grads, variables)])
    store: dict = {}
    opt.save_own_variables(store)
    config = opt.get_config()

    mesh, moved = _mesh_variables(target, [v.numpy() for v in variables])
    other = me.optimizers.Adadelta.from_config(config, mesh=mesh)
    other.build(moved)
    other.load_own_variables(store)
    for grads in case["grads"][3:]:
        for o, vs in ((opt, variables), (other, moved)):
            o.apply_gradients([(_grad(g), v) for g, v in zip(grads, vs)])
        tol = dict(rtol=0, atol=0) if target == bk else dict(rtol=1e-6, atol=1e-7)  # 1-ulp kernels differ
        for a, b in zip(variables, moved):
            np.testing.assert_allclose(b.numpy(), a.numpy(), **tol)
    _assert_close_lists([v.numpy() for v in other.variables], [v.numpy() for v in opt.variables])


def _assert_close_lists(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_load_refuses_a_store_that_does_not_fit_and_changes_nothing():
    w = me.Variable(np.ones(3, np.float32), name="w")
    opt = me.optimizers.Adadelta(1.0)
    with pytest.raises(StateError, match="build"):
        opt.load_own_variables({"0": np.asarray(0)})
    opt.apply_gradients([(np.ones(3), w)])
    before = _state(opt, [w])
    bad = [{"0": np.asarray(5)}, {"0": np.asarray(5), "1": np.zeros(4, np.float32), "2": np.zeros(3, np.float32)},
           {"0": np.asarray(5), "1": np.zeros(3, np.float32), "2": np.array(["x"] * 3)}]
    for store in bad:
        with pytest.raises(me.errors.CheckpointError, match="store"):
            opt.load_own_variables(store)
        _assert_same(before, _state(opt, [w]))


# -- Keras 3's constructor arguments ----------------------------------------------------------

def test_both_forms_of_an_option_or_two_clip_arguments_raise():
    with pytest.raises(ConfigError, match="not both"):
        me.optimizers.Adadelta(clipnorm=1.0, gradients_clip_option=GradientsClipOption(clipnorm=1.0))
    with pytest.raises(ConfigError, match="not both"):
        me.optimizers.Adadelta(use_ema=True, ema_option=EMAOption(use_ema=True))
    with pytest.raises(ConfigError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"):
        me.optimizers.Adadelta(clipnorm=1.0, clipvalue=0.5)  # (f): Keras 3 raises
    with pytest.raises(ConfigError, match="Only one of"):
        me.optimizers.Adadelta(global_clipnorm=1.0, clipvalue=0.5)
    with pytest.warns(UserWarning, match="clipvalue"):  # tf_keras' option: warns, norm wins
        GradientsClipOption(clipnorm=1.0, clipvalue=0.5)
    for kwargs in ({"gradient_accumulation_steps": 1}, {"loss_scale_factor": 0.0}, {"weight_decay": -1.0},
                   {"ema_momentum": 1.5, "use_ema": True}, {"allow_nonfinite": "False"}, {"epsilon": math.inf}):
        with pytest.raises(ConfigError, match="Invalid"):
            me.optimizers.Adadelta(**kwargs)


def test_keras3_config_round_trips_and_keras3_reads_it():
    opt = me.optimizers.Adadelta(0.5, rho=0.9, epsilon=1e-3, global_clipnorm=2.0, use_ema=True,
                                 ema_momentum=0.9, weight_decay=0.05, gradient_accumulation_steps=2)
    config = opt.get_config()
    assert {"loss_scale_factor", "gradient_accumulation_steps"} <= set(config) and "jit_compile" not in config
    again = me.optimizers.Adadelta.from_config(config)
    assert again.get_config() == config and again.keras3
    tf_form = me.optimizers.Adadelta(ema_option=EMAOption(use_ema=True)).get_config()
    assert "jit_compile" in tf_form and not me.optimizers.Adadelta.from_config(tf_form).keras3
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras not installed")
    keras = pytest.importorskip("keras")
    theirs = keras.optimizers.Adadelta.from_config(dict(config))
    assert theirs.get_config()["global_clipnorm"] == 2.0 and theirs.gradient_accumulation_steps == 2


def test_iterations_count_updates_with_gradient_accumulation(bk):
    w = me.Variable(np.ones(2, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(1.0, gradient_accumulation_steps=3)
    seen = []
    for _ in range(7):
        opt.apply_gradients([(np.ones(2), w)])
        seen.append(int(opt.iterations.numpy()))
    assert seen == [0, 0, 1, 1, 1, 2, 2] and int(opt.variables[0].numpy()) == 7
    assert [v.name for v in opt.variables] == ["iteration", "gradient_accumulator/w", "accumulated_grad/w",
                                               "accumulated_delta_var/w"]


def test_learning_rate_setter_and_a_new_schedule():
    """(d): a schedule may be replaced by a schedule (tf_keras, Keras 3); only a float over
    a schedule is refused; a float optimizer may take a schedule."""
    opt = me.optimizers.Adadelta(learning_rate=schedules.ExponentialDecay(0.5, 2, 0.5))
    opt.learning_rate = schedules.PiecewiseConstantDecay([1], [0.25, 0.125])
    assert opt.learning_rate == 0.25
    with pytest.raises(TypeError, match="schedule"):
        opt.learning_rate = 0.1
    flt = me.optimizers.Adadelta(learning_rate=0.1)
    flt.learning_rate = 0.2
    assert flt.learning_rate == 0.2
    flt.learning_rate = schedules.ExponentialDecay(0.4, 1, 0.5)
    assert flt.learning_rate == 0.4
    with pytest.raises(ConfigError, match="learning_rate"):
        flt.learning_rate = -1.0


class CustomLRSchedule(schedules.LearningRateSchedule):
    def __init__(self, initial_learning_rate: float) -> None:
        self.initial_learning_rate = initial_learning_rate

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate / (step + 1)

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate}


def test_custom_schedule_config_is_written_as_tf_keras_does():
    """(c): ``{"module": None, "registered_name": "CustomLRSchedule"}``, read back through
    ``custom_objects``."""
    opt = me.optimizers.Adadelta(learning_rate=CustomLRSchedule(0.5))
    lr = opt.get_config()["learning_rate"]
    assert lr == {"module": None, "class_name": "CustomLRSchedule", "config": {"initial_learning_rate": 0.5},
                  "registered_name": "CustomLRSchedule"}
    again = me.optimizers.Adadelta.from_config(opt.get_config(), custom_objects={"CustomLRSchedule": CustomLRSchedule})
    assert again.learning_rate == 0.5
    with pytest.raises(ConfigError, match="custom_objects"):
        me.optimizers.Adadelta.from_config(opt.get_config())
    built_in = me.optimizers.Adadelta(learning_rate=schedules.ExponentialDecay(0.5, 2, 0.5)).get_config()
    assert built_in["learning_rate"]["module"] == "keras.optimizers.schedules"


def test_schedule_returning_a_string_is_a_config_error_and_nothing_changes():
    w = me.Variable(np.ones(2, np.float32), name="w")
    opt = me.optimizers.Adadelta(learning_rate=lambda step: "0.1")
    with pytest.raises(ConfigError, match="learning rate"):
        opt.apply_gradients([(np.ones(2), w)])
    np.testing.assert_array_equal(w.numpy(), np.ones(2, np.float32))


# -- stateless_apply ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"use_ema": True, "ema_momentum": 0.5, "global_clipnorm": 1.0},
                                    {"gradient_accumulation_steps": 2, "weight_decay": 0.1}])
def test_stateless_apply_is_pure_and_equals_apply_gradients(bk, kwargs):
    rng = np.random.default_rng(1)
    values = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(2,)).astype(np.float32)]
    a = [me.Variable(x, name=n, backend=bk) for n, x in zip("wb", values)]
    b = [me.Variable(x, name=n, backend=bk) for n, x in zip("wb", values)]
    stateful = me.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-3, **kwargs)
    pure = me.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-3, **kwargs)
    pure.build(b)
    train = [v.value for v in b]
    opt_vals = [v.value for v in pure.variables]
    before = _state(pure, b)
    for _ in range(3):
        grads = [rng.normal(size=x.shape).astype(np.float32) for x in values]
        stateful.apply_gradients(list(zip(grads, a)))
        snapshot_arrays = [*train, *opt_vals]
        snapshot = [np.array(me.get_backend(bk).to_numpy(x)) for x in snapshot_arrays]
        train, opt_vals = pure.stateless_apply(opt_vals, grads, train)
        # the stateful step may run a fused in-place kernel, 1 ulp from the core function
        tol = dict(rtol=0, atol=0) if bk == "numpy" else dict(rtol=1e-6, atol=1e-7)
        for x, y in zip([*a, *stateful.variables], [*train, *opt_vals]):
            np.testing.assert_allclose(me.get_backend(bk).to_numpy(y), x.numpy(), **tol)
        # the arrays given to stateless_apply were neither written nor donated
        _assert_same(snapshot, [np.array(me.get_backend(bk).to_numpy(x)) for x in snapshot_arrays])
    _assert_same(before, _state(pure, b))  # the optimizer and its variables never moved


def test_stateless_apply_does_not_write_or_donate_the_given_arrays(bk):
    w = me.Variable(np.ones((4, 4), np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(1.0)
    opt.build([w])
    backend = me.get_backend(bk)
    given = [backend.asarray(np.ones((4, 4), np.float32))]
    opt_given = [v.value for v in opt.variables]
    opt.stateless_apply(opt_given, [np.ones((4, 4), np.float32)], given)
    np.testing.assert_array_equal(backend.to_numpy(given[0]), np.ones((4, 4), np.float32))  # not deleted/written
    np.testing.assert_array_equal(backend.to_numpy(opt_given[1]), np.zeros((4, 4), np.float32))


def test_stateless_apply_errors():
    w = me.Variable(np.ones(2, np.float32), name="w")
    opt = me.optimizers.Adadelta(1.0)
    with pytest.raises(StateError, match="build"):
        opt.stateless_apply([], [np.ones(2)], [w.value])
    opt.build([w])
    with pytest.raises(InputError, match="optimizer_variables"):
        opt.stateless_apply([np.asarray(0)], [np.ones(2)], [w.value])
    with pytest.raises(InputError, match="trainable_variables"):
        opt.stateless_apply([v.value for v in opt.variables], [np.ones(2)], [])


# -- (b) deepcopy, (e) slot names, (g) vector loss, (h) bfloat16, (a) complex ----------------

def test_deepcopy_of_variables_and_a_built_optimizer(bk):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    c = copy.deepcopy(w)
    assert c.backend is w.backend and c.value is not w.value
    opt = me.optimizers.Adadelta(1.0, use_ema=True)
    opt.apply_gradients([(np.ones(3), w)])
    model, twin = copy.deepcopy((w, opt))
    before = _state(opt, [w])
    twin.apply_gradients([(np.ones(3), model)])
    _assert_same(before, _state(opt, [w]))  # the original did not move
    opt.apply_gradients([(np.ones(3), w)])
    _assert_same(_state(opt, [w]), _state(twin, [model]))  # and the copy took the same step


def test_slot_names_keep_the_seed_checkpoint_names():
    """(e), a documented difference: tf_keras' DTensor optimizer names slots
    ``Adadelta/accumulated_grad/<var>``; meshembed keeps the seed's names (its checkpoints use
    them) and the store is positional, as Keras 3's."""
    w = me.Variable(np.ones(2, np.float32), name="dense/kernel")
    opt = me.optimizers.Adadelta(ema_option=EMAOption(use_ema=True))
    opt.build([w])
    assert [v.name for v in opt.variables] == ["iteration", "average/dense/kernel",
                                               "accumulated_grad/dense/kernel", "accumulated_delta_var/dense/kernel"]


@pytest.mark.parametrize("bk", _backends(("torch", "jax")))
def test_vector_loss_is_summed_as_tf_keras_does(bk):
    """(g): the gradient of a vector loss is that of its sum (tf.GradientTape)."""
    w = me.Variable(np.array([1.0, 2.0, 3.0], np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(1.0)
    ((g, _),) = opt.compute_gradients(lambda x: x * x, [w])
    np.testing.assert_allclose(me.get_backend(bk).to_numpy(g), [2.0, 4.0, 6.0])
    with pytest.raises(InputError, match="loss"):
        opt.compute_gradients(lambda x: "loss", [w])


def test_torch_bfloat16_variable_from_numpy():
    """(h) and #17: ``me.Variable(numpy bfloat16, backend="torch")``."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    pytest.importorskip("torch")
    values = np.array([1.5, -2.25, 3.0], ml_dtypes.bfloat16)
    w = me.Variable(values, name="w", backend="torch")
    assert w.dtype == "bfloat16"
    np.testing.assert_array_equal(w.numpy().astype(np.float32), values.astype(np.float32))
    opt = me.optimizers.Adadelta(1.0, rho=0.5, epsilon=1e-2)
    opt.apply_gradients([(np.ones(3, ml_dtypes.bfloat16), w)])
    assert w.dtype == "bfloat16" and not np.array_equal(w.numpy().astype(np.float32), values.astype(np.float32))


def test_integer_variables_are_refused_with_the_fix_and_complex_ones_are_taken(bk):
    """(a): integer variables (whose updates were truncated) raise before anything is built. A
    complex variable (torch once crashed in ``_densify``; then refused) is optimised as
    torch.optim does, on its real view: tests/test_adadelta_complex.py checks the numbers."""
    dtypes = [np.int32] if bk == "jax" else [np.int64, np.int32]
    for dt in dtypes:
        v = me.Variable(np.ones(3, dt), name="odd", backend=bk)
        opt = me.optimizers.Adadelta(1.0)
        with pytest.raises(InputError, match="'odd'.*floating dtype") as info:
            opt.apply_gradients([(me.IndexedSlices(np.ones((1,), np.float32), np.array([0]), (3,)), v)])
        assert "float dtype" in str(info.value)
        assert not opt.built
        np.testing.assert_array_equal(v.numpy(), np.ones(3, dt))
    v = me.Variable(np.ones(3, np.complex64), name="z", backend=bk)
    opt = me.optimizers.Adadelta(1.0)
    opt.apply_gradients([(me.IndexedSlices(np.ones((1,), np.float32), np.array([0]), (3,)), v)])
    assert opt.built and v.dtype == "complex64"
    changed = v.numpy() != np.ones(3, np.complex64)
    assert changed.tolist() == [True, False, False] and v.numpy()[0].imag == 0


# -- issue #17: dense validation and the NaN policy --------------------------------------------

@pytest.mark.parametrize("bad", ["string", "complex", "object", "bool"])
def test_non_float_gradients_raise_naming_the_variable_and_change_nothing(bk, bad):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    b = me.Variable(np.ones(3, np.float32), name="bias", backend=bk)
    opt = me.optimizers.Adadelta(1.0, use_ema=True)
    opt.apply_gradients([(np.ones(3), w), (np.ones(3), b)])
    before = _state(opt, [w, b])
    grads = {"string": np.array(["1", "2", "3"]), "complex": np.ones(3, np.complex64),
             "object": np.array([1.0, None, 2.0], dtype=object), "bool": np.ones(3, bool)}
    with pytest.raises(InputError, match="'bias'"):
        opt.apply_gradients([(np.ones(3), w), (grads[bad], b)])
    _assert_same(before, _state(opt, [w, b]))


def test_native_complex_and_bool_gradients_are_refused(bk):
    backend = me.get_backend(bk)
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(1.0)
    for g in (np.ones(3, np.complex64), np.ones(3, bool)):
        with pytest.raises(InputError, match="'w'"):
            opt.apply_gradients([(backend.asarray(g), w)])
    np.testing.assert_array_equal(w.numpy(), np.ones(3, np.float32))


@pytest.mark.parametrize("key", ["learning_rate", "epsilon", "weight_decay"])
def test_scalars_finite_in_float64_but_infinite_in_float32_raise(bk, key):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(**{"learning_rate": 1.0, key: 1e39})
    with pytest.raises(ConfigError, match=f"`{key}` for variable 'w'.*float32"):
        opt.apply_gradients([(np.ones(3), w)])
    np.testing.assert_array_equal(w.numpy(), np.ones(3, np.float32))
    assert not any(v.numpy().any() for v in opt.variables)
    if bk == "numpy":  # float64 holds 1e39: a float64 variable steps (into NaN/Inf the user asked for)
        w64 = me.Variable(np.ones(3), name="w64", backend=bk)
        with np.errstate(all="ignore"):
            me.optimizers.Adadelta(**{"learning_rate": 1e-3, key: 1e39} if key != "learning_rate" else
                                   {"learning_rate": 1e39}, allow_nonfinite=True).apply_gradients([(np.ones(3), w64)])


def test_a_schedule_value_is_checked_in_the_variable_dtype():
    w = me.Variable(np.ones(2, np.float32), name="w")
    opt = me.optimizers.Adadelta(learning_rate=schedules.PiecewiseConstantDecay([0], [0.1, 1e39]))
    opt.apply_gradients([(np.ones(2), w)])
    before = _state(opt, [w])
    with pytest.raises(ConfigError, match="learning_rate"):
        opt.apply_gradients([(np.ones(2), w)])
    _assert_same(before, _state(opt, [w]))


@pytest.mark.parametrize("clip", [{}, {"clipnorm": 1.0}, {"global_clipnorm": 1.0}, {"clipvalue": 1.0}])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_gradients_raise_unless_allowed(bk, clip, bad):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    b = me.Variable(np.ones(2, np.float32), name="bias", backend=bk)
    opt = me.optimizers.Adadelta(1.0, **clip)
    opt.apply_gradients([(np.ones(3), w), (np.ones(2), b)])
    before = _state(opt, [w, b])
    g_bad = np.array([1.0, bad], np.float32)
    if clip.get("clipvalue") and bad == math.inf:  # clip_by_value makes Inf finite (Keras, TF)
        opt.apply_gradients([(np.ones(3), w), (g_bad, b)])
        return
    with pytest.raises(InputError, match="NaN or Inf") as info:
        opt.apply_gradients([(np.ones(3), w), (g_bad, b)])
    assert "'bias'" in str(info.value) and "allow_nonfinite" in str(info.value)
    if clip.get("global_clipnorm"):  # one bad gradient makes every clipped gradient NaN
        assert "'w'" in str(info.value) and "global_clipnorm" in str(info.value)
    _assert_same(before, _state(opt, [w, b]))
    allowed = me.optimizers.Adadelta(1.0, allow_nonfinite=True, **clip)
    with np.errstate(invalid="ignore"):
        allowed.apply_gradients([(np.ones(3), w), (g_bad, b)])
    assert not np.isfinite(b.numpy()).all()
    assert np.isfinite(w.numpy()).all() != bool(clip.get("global_clipnorm"))


def test_global_clipnorm_matches_tf_clip_by_global_norm():
    """#17 item 9: a NaN or Inf in one gradient gives NaN everywhere, as TF."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow not installed (the tf-interop extra): nothing to compare with")
    tf = pytest.importorskip("tensorflow")
    xp = me.get_backend("numpy").xp
    cases = [[np.array([3.0, 4.0], np.float32), np.array([12.0], np.float32)],
             [np.array([0.1, 0.2], np.float32), np.array([0.0], np.float32)],
             [np.zeros(2, np.float32), np.zeros(1, np.float32)],
             [np.array([1.0, np.nan], np.float32), np.array([2.0], np.float32)],
             [np.array([1.0, np.inf], np.float32), np.array([2.0], np.float32)],
             [np.array([1.0, -np.inf], np.float32), np.array([np.nan], np.float32)]]
    for grads in cases:
        ours = GradientsClipOption(global_clipnorm=1.0).clip(xp, grads)
        theirs, _ = tf.clip_by_global_norm([tf.constant(g) for g in grads], 1.0)
        for o, t in zip(ours, theirs):
            np.testing.assert_allclose(o, t.numpy(), rtol=1e-6, equal_nan=True)


# -- ported peer cases ---------------------------------------------------------------------

def test_keras3_single_step(bk):
    """Keras 3 ``adadelta_test.py::test_single_step``."""
    w = me.Variable(np.array([1.0, 2.0, 3.0, 4.0], np.float32), name="w", backend=bk)
    me.optimizers.Adadelta(learning_rate=0.5).apply_gradients([(np.array([1.0, 6.0, 7.0, 2.0]), w)])
    np.testing.assert_allclose(w.numpy(), [0.9993, 1.9993, 2.9993, 3.9993], rtol=1e-4, atol=1e-4)


def test_keras3_weight_decay_and_exclusions(bk):
    """Keras 3 ``adadelta_test.py::test_weight_decay``."""
    var1 = me.Variable(np.float32(2.0), name="var1", backend=bk)
    var2 = me.Variable(np.float32(2.0), name="exclude", backend=bk)
    var3 = me.Variable(np.float32(2.0), name="var3", backend=bk)
    zero = np.zeros((), np.float32)
    me.optimizers.Adadelta(learning_rate=1.0, weight_decay=0.004).apply_gradients([(zero, var1)])
    opt2 = me.optimizers.Adadelta(learning_rate=1.0, weight_decay=0.004)
    opt2.exclude_from_weight_decay(var_names=["exclude"])
    opt2.apply_gradients([(zero, var1), (zero, var2)])
    opt3 = me.optimizers.Adadelta(learning_rate=1.0, weight_decay=0.004)
    opt3.exclude_from_weight_decay(var_list=[var3])
    opt3.apply_gradients([(zero, var1), (zero, var3)])
    np.testing.assert_allclose(var1.numpy(), 1.9760959, atol=1e-6)
    assert var2.numpy() == 2.0 and var3.numpy() == 2.0
    with pytest.raises(StateError, match="after the optimizer was built"):
        opt3.exclude_from_weight_decay(var_names=["x"])


def test_keras3_correctness_with_golden(bk):
    """Keras 3 ``adadelta_test.py::test_correctness_with_golden`` (also tf_keras' legacy test shape)."""
    opt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.8, epsilon=1e-6)
    x = me.Variable(np.ones(10, np.float32), name="x", backend=bk)
    grads = np.arange(0.1, 1.1, 0.1, dtype=np.float32)[:10]
    golden = np.tile([[0.9978], [0.9947], [0.9915], [0.9882], [0.9849]], (1, 10))
    opt.apply_gradients([(np.full(10, 0.01, np.float32), x)])
    for i in range(5):
        np.testing.assert_allclose(x.numpy(), golden[i], rtol=5e-4, atol=5e-4)
        opt.apply_gradients([(grads, x)])


def test_keras3_clip_norm_and_clip_value():
    """Keras 3 ``adadelta_test.py::test_clip_norm`` / ``test_clip_value``."""
    xp = me.get_backend("numpy").xp
    g = [np.array([100.0, 100.0])]
    np.testing.assert_allclose(GradientsClipOption(clipnorm=1).clip(xp, g)[0], [2**0.5 / 2, 2**0.5 / 2])
    np.testing.assert_allclose(GradientsClipOption(clipvalue=1).clip(xp, g)[0], [1.0, 1.0])


def test_keras3_ema_first_step_starts_from_the_variable(bk):
    """Keras 3 ``optimizer_test.py::test_ema``: after one step the average is the variable;
    tf_keras' DTensor option averages from the initial value."""
    v = me.Variable(np.ones((1, 2), np.float32), name="v", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0, use_ema=True, ema_momentum=0.9)
    opt.apply_gradients([(np.array([[1.0, 1.0]], np.float32), v)])
    avg = {x.name: x for x in opt.variables}["average/v"]
    np.testing.assert_array_equal(avg.numpy(), v.numpy())
    w = me.Variable(np.ones((1, 2), np.float32), name="v", backend=bk)
    old = me.optimizers.Adadelta(learning_rate=1.0, ema_option=EMAOption(use_ema=True, ema_momentum=0.9))
    old.apply_gradients([(np.array([[1.0, 1.0]], np.float32), w)])
    avg = {x.name: x for x in old.variables}["average/v"].numpy()
    np.testing.assert_allclose(avg, 0.9 * 1.0 + 0.1 * w.numpy(), rtol=1e-6)


def test_keras3_constraint_free_gradient_accumulation_matches_mean_of_gradients(bk):
    """Keras 3 ``optimizer_test.py::test_gradient_accumulation``: nothing moves until the n-th
    call, which updates with the mean."""
    v = me.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), name="v", backend=bk)
    ref = me.Variable(v.numpy(), name="v", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0, gradient_accumulation_steps=3)
    plain = me.optimizers.Adadelta(learning_rate=1.0)
    gs = [np.full((2, 2), x, np.float32) for x in (1.0, 2.0, 6.0)]
    for g in gs[:2]:
        opt.apply_gradients([(g, v)])
        np.testing.assert_array_equal(v.numpy(), ref.numpy())
    opt.apply_gradients([(gs[2], v)])
    plain.apply_gradients([(np.full((2, 2), 3.0, np.float32), ref)])
    np.testing.assert_allclose(v.numpy(), ref.numpy(), rtol=1e-6)
    acc = {x.name: x for x in opt.variables}["gradient_accumulator/v"].numpy()
    np.testing.assert_array_equal(acc, np.zeros((2, 2), np.float32))


def test_keras3_loss_scale_factor_divides_the_gradients(bk):
    """Keras 3 ``optimizer_test.py::test_loss_scale_factor`` style: lsf=4 with 4·g is g."""
    a = me.Variable(np.ones(3, np.float32), name="a", backend=bk)
    b = me.Variable(np.ones(3, np.float32), name="a", backend=bk)
    me.optimizers.Adadelta(1.0, loss_scale_factor=4.0).apply_gradients([(np.full(3, 8.0, np.float32), a)])
    me.optimizers.Adadelta(1.0).apply_gradients([(np.full(3, 2.0, np.float32), b)])
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_torch_optim_adadelta_cases_match():
    """torch ``test_optim.py`` Adadelta configurations (lr, rho, eps, weight decay is L2 in
    torch — not ported: Keras' decay is decoupled — a documented difference)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    for kwargs in ({"lr": 1.0}, {"lr": 0.1, "rho": 0.95}, {"lr": 0.5, "rho": 0.8, "eps": 1e-3}):
        start = rng.normal(size=(5, 3)).astype(np.float32)
        p = torch.nn.Parameter(torch.tensor(start))
        topt = torch.optim.Adadelta([p], **kwargs)
        w = me.Variable(start, name="p", backend="torch")
        opt = me.optimizers.Adadelta(kwargs["lr"], rho=kwargs.get("rho", 0.9), epsilon=kwargs.get("eps", 1e-6))
        for _ in range(5):
            g = rng.normal(size=start.shape).astype(np.float32)
            p.grad = torch.tensor(g)
            topt.step()
            opt.apply_gradients([(g, w)])
        np.testing.assert_allclose(w.numpy(), p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_stateless_apply_inside_jax_jit():
    """The JAX front end's use: pure under ``jax.jit`` (float lr, no EMA/accumulation/norm
    clipping, which need host values); those raise a StateError with the fix."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    w = me.Variable(np.ones(3, np.float32), name="w", backend="jax")
    opt = me.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-3, weight_decay=0.1, clipvalue=0.5)
    opt.build([w])
    args = ([v.value for v in opt.variables], [jnp.full(3, 2.0)], [w.value])
    jitted = jax.jit(opt.stateless_apply)(*args)
    eager = opt.stateless_apply(*args)
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    ema = me.optimizers.Adadelta(1.0, use_ema=True)
    ema.build([w])
    with pytest.raises(StateError, match="EMA.*outside jit"):
        jax.jit(ema.stateless_apply)([v.value for v in ema.variables], [jnp.ones(3)], [w.value])


# -- docs/optimizers.md: every cell of the Adadelta mapping table -----------------------------

def _docs_table() -> dict:
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "optimizers.md").read_text()
    block = text[text.index("| | TPU (meshembed tables) |"):]
    rows = [line for line in block.splitlines()[2:] if line.startswith("|")][:5]
    table = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = dict(zip(["tpu", "keras", "optax", "torch"], cells[1:]))
    return table


def _codes(cell: str) -> list:
    import re

    return re.findall(r"`([^`]+)`", cell)


def test_docs_adadelta_table_matches_the_frameworks():
    import inspect

    table = _docs_table()
    assert set(table) == {"E[g²] slot", "E[Δx²] slot", "learning rate", "ρ", "ε"}
    from meshembed.math import OPTIMIZERS

    assert OPTIMIZERS["adadelta"].slot_names == (_codes(table["E[g²] slot"]["tpu"])[0],
                                                   _codes(table["E[Δx²] slot"]["tpu"])[0])
    sig = inspect.signature(me.optimizers.Adadelta)
    keras_defaults = (float(table["learning rate"]["keras"]), float(table["ρ"]["keras"]), float(table["ε"]["keras"]))
    assert (sig.parameters["learning_rate"].default, sig.parameters["rho"].default,
            sig.parameters["epsilon"].default) == keras_defaults
    checked = []
    if importlib.util.find_spec("optax") is not None:
        import jax.numpy as jnp
        import optax

        osig = inspect.signature(optax.adadelta)
        assert _codes(table["learning rate"]["optax"]) == [str(osig.parameters["learning_rate"].default)]
        assert (osig.parameters["rho"].default, osig.parameters["eps"].default) == (
            float(table["ρ"]["optax"]), float(table["ε"]["optax"]))
        fields = optax.ScaleByAdaDeltaState._fields
        assert [_codes(table["E[g²] slot"]["optax"])[0], _codes(table["E[Δx²] slot"]["optax"])[0]] == list(fields)
        # the sign: optax.adadelta(learning_rate=1.0) is meshembed's lr=1.0; learning_rate=None ascends
        w = me.Variable(np.ones(3, np.float32), name="w")
        me.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-6).apply_gradients([(np.ones(3, np.float32), w)])
        for lr, sign in ((1.0, 1.0), (None, -1.0)):
            tx = optax.adadelta(learning_rate=lr)
            updates, _ = tx.update(jnp.ones(3), tx.init(jnp.ones(3)), jnp.ones(3))
            moved = np.asarray(optax.apply_updates(jnp.ones(3), updates))
            np.testing.assert_allclose(1.0 + sign * (moved - 1.0), w.numpy(), rtol=1e-6)
        checked.append("optax")
    if importlib.util.find_spec("torch") is not None:
        import torch

        tsig = inspect.signature(torch.optim.Adadelta)
        assert (tsig.parameters["lr"].default, tsig.parameters["rho"].default, tsig.parameters["eps"].default) == (
            float(table["learning rate"]["torch"]), float(table["ρ"]["torch"]), float(table["ε"]["torch"]))
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.Adadelta([p])
        p.grad = torch.ones(2)
        opt.step()
        state = set(opt.state[p])
        assert {_codes(table["E[g²] slot"]["torch"])[0], _codes(table["E[Δx²] slot"]["torch"])[0]} <= state
        checked.append("torch")
    if importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("keras") is not None:
        import keras

        ksig = inspect.signature(keras.optimizers.Adadelta)
        assert (ksig.parameters["learning_rate"].default, ksig.parameters["rho"].default,
                ksig.parameters["epsilon"].default) == keras_defaults
        v = keras.Variable(np.ones(2, np.float32), name="v")
        kopt = keras.optimizers.Adadelta()
        kopt.build([v])
        names = [x.name for x in kopt.variables]
        for row in ("E[g²] slot", "E[Δx²] slot"):
            assert any(n.endswith(_codes(table[row]["keras"])[0]) for n in names), names
        checked.append("keras")
    if importlib.util.find_spec("tf_keras") is not None:
        import tensorflow as tf
        import tf_keras

        tsig = inspect.signature(tf_keras.optimizers.Adadelta)
        assert (tsig.parameters["learning_rate"].default, tsig.parameters["rho"].default,
                tsig.parameters["epsilon"].default) == keras_defaults
        legacy = tf_keras.optimizers.legacy.Adadelta()
        v = tf.Variable(np.ones(2, np.float32))
        legacy.apply_gradients([(tf.ones(2), v)])
        assert legacy.get_slot_names() == [_codes(table["E[g²] slot"]["keras"])[1], _codes(table["E[Δx²] slot"]["keras"])[1]]
        checked.append("tf_keras")
    if not checked:
        pytest.skip("none of optax, torch, keras, tf_keras installed: only meshembed's cells checked")


# -- tf_keras optimizer_test.py / dtensor optimizers_test.py / legacy adadelta_test.py ---------

def test_tf_keras_clip_global_norm():
    """tf_keras ``optimizer_test.py::testClipGlobalNorm``."""
    xp = me.get_backend("numpy").xp
    g = [np.array([100.0, 100.0], np.float32), np.array([100.0, 100.0], np.float32)]
    np.testing.assert_allclose(GradientsClipOption(global_clipnorm=1).clip(xp, g)[0], [0.5, 0.5])


def test_tf_keras_set_learning_rate_iterations_and_weights(bk):
    """tf_keras ``testSetLearningRate`` (incl. the legacy ``lr``), ``testSetIterations``,
    ``testSetWeights``, ``testNoGradients``."""
    opt = me.optimizers.Adadelta(learning_rate=1.0)
    opt.learning_rate = 2.0
    assert opt.learning_rate == 2.0
    opt.lr = 3.0
    assert opt.learning_rate == 3.0 and opt.lr == 3.0
    sched = me.optimizers.Adadelta(learning_rate=schedules.ExponentialDecay(1e-2, 10000, 0.9))
    assert sched.learning_rate == 0.01 and sched.lr == 0.01
    x = me.Variable(np.array([1.0, 2.0], np.float32), name="x", backend=bk)
    for _ in range(2):
        sched.apply_gradients([(np.array([1.0, 2.0], np.float32), x)])
    assert 0.00999 < sched.learning_rate < 0.01
    with pytest.raises(TypeError, match="This optimizer was created with"):
        sched.learning_rate = 2.0

    counted = me.optimizers.Adadelta()
    counted.iterations = me.Variable(np.int32(2), name="it", backend=bk)
    assert int(counted.iterations.numpy()) == 2
    vs = [me.Variable(np.float32(2.0), name=f"v{i}", backend=bk) for i in range(2)]
    it = counted.apply_gradients([(np.float32(1.0), v) for v in vs])
    assert int(it.numpy()) == 3 and int(counted.iterations.numpy()) == 3
    with pytest.raises(RuntimeError, match="Cannot set"):
        counted.iterations = 2
    assert int(counted.apply_gradients([]).numpy()) == 3  # no pairs: nothing happens

    w = me.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), name="w", backend=bk)
    first = me.optimizers.Adadelta()
    first.apply_gradients([(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), w)])
    second = me.optimizers.Adadelta()
    with pytest.raises(StateError, match="You are calling"):
        second.set_weights(first.variables)
    second.build([w])
    second.set_weights(first.variables)
    _assert_same(second.get_weights(), first.get_weights())


@pytest.mark.parametrize("bk", _backends(("numpy", "torch")))
def test_tf_keras_sparse_gradients_work_as_expected(bk):
    """tf_keras ``testSparseGradientsWorkAsExpected`` (Adadelta with EMA, float64): a dense
    gradient with zeros and the IndexedSlices of its non-zero rows move the variable alike."""
    o1 = me.optimizers.Adadelta(0.002, ema_option=EMAOption(use_ema=True))
    o2 = me.optimizers.Adadelta(0.002, ema_option=EMAOption(use_ema=True))
    x1 = me.Variable(np.ones(5), name="x1", backend=bk)
    x2 = me.Variable(np.ones(5), name="x2", backend=bk)
    dense = np.array([0, 1.0, 1.5, 0, 0])
    sparse = me.IndexedSlices(np.array([1.0, 1.5]), np.array([1, 2]), (5,))
    for _ in range(5):
        o1.apply_gradients([(dense, x1)])
        o2.apply_gradients([(sparse, x2)])
        np.testing.assert_allclose(x1.numpy(), x2.numpy())


@pytest.mark.parametrize("bk", _backends(("numpy", "torch")))
def test_tf_keras_regression_against_the_legacy_numbers(bk):
    """tf_keras ``OptimizerRegressionTest.testAdadelta`` shape (float64, defaults, duplicate
    sparse ids); expected numbers from tf_keras' legacy Adadelta where installed."""
    x = me.Variable(np.ones(10), name="x", backend=bk)
    opt = me.optimizers.Adadelta()
    grads = np.arange(0.1, 1.1, 0.1)[:10]
    sparse = me.IndexedSlices(np.array([0, 0.2, 0.4, 0.8, 0.8]), np.array([0, 2, 4, 6, 6]), (10,))
    steps = [np.full(10, 0.01)] + [grads] * 5 + [sparse] * 5
    mine = []
    for g in steps:
        opt.apply_gradients([(g, x)])
        mine.append(x.numpy())
    if importlib.util.find_spec("tf_keras") is None:
        pytest.skip("tf_keras not installed: the legacy optimizer's numbers are not available")
    import tensorflow as tf
    import tf_keras

    legacy = tf_keras.optimizers.legacy.Adadelta()
    y = tf.Variable(np.ones(10), dtype=tf.float64)
    for g, expected in zip(steps, mine):
        if isinstance(g, me.IndexedSlices):
            g = tf.IndexedSlices(tf.constant(g.values), tf.constant(g.indices), tf.constant([10]))
        legacy.apply_gradients([(g, y)])
        np.testing.assert_allclose(expected, y.numpy(), rtol=5e-4, atol=5e-4)


def test_dtensor_add_variable_from_reference_and_apply_gradients():
    """tf_keras ``dtensor/optimizers_test.py``: slot name, zeros and the reference's layout;
    iterations replicated; one step counts; the slot names (``Adadelta/`` prefix in tf_keras,
    none here: the documented difference (e))."""
    mesh = me.Mesh(["X", "Y"], shape=(2, 2), backend="numpy")
    replicated = me.Layout.replicated(mesh, 2)
    opt = me.optimizers.Adadelta(mesh=mesh)
    tmp = me.Variable(np.ones((4, 4), np.float32), name="tmp", layout=replicated)
    slot = opt.add_variable_from_reference(tmp, "test")
    assert slot.name == "test/tmp" and slot.layout == tmp.layout and not slot.numpy().any()
    opt = me.optimizers.Adadelta(mesh=mesh)
    assert int(opt.iterations.numpy()) == 0 and opt.iterations.layout == me.Layout.replicated(mesh, 0)
    v = me.Variable(np.ones((4, 4), np.float32), name="Variable", layout=replicated)
    opt.apply_gradients([(np.ones((4, 4), np.float32), v)])
    assert int(opt.iterations.numpy()) == 1
    assert sorted(x.name for x in opt.variables) == ["accumulated_delta_var/Variable", "accumulated_grad/Variable",
                                                     "iteration"]


def test_store_moves_onto_a_multi_device_jax_mesh():
    """The store round trip onto a real 2-device JAX mesh: the mesh cases above, run in a
    child process given four CPU devices (the flag is set for the child only)."""
    pytest.importorskip("jax")
    import os
    import subprocess
    import sys

    import jax

    if len(jax.devices()) >= 2:
        pytest.skip("this process already has several JAX devices: the mesh cases ran above")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_keras3_adadelta.py",
         "-k", "load_on_another_backend_and_mesh and jax"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-1000:]


# -- Keras 3 optimizer_test.py -------------------------------------------------------------------

def test_keras3_empty_gradients_and_clip_args(bk):
    """Keras 3 ``test_empty_gradients`` / ``test_clip_args`` / ``test_global_clip_norm``."""
    v = me.Variable(np.array([[3.0, 4.0], [5.0, 6.0]], np.float32), name="v", backend=bk)
    v2 = me.Variable(np.array([[3.0, 4.0], [5.0, 6.0]], np.float32), name="v2", backend=bk)
    opt = me.optimizers.Adadelta(learning_rate=1.0)
    with pytest.raises(InputError, match="No gradients provided for any variable"):
        opt.apply_gradients([(None, v)])
    with pytest.warns(UserWarning, match="Gradients do not exist for variables \\['v'\\]"):
        opt.apply_gradients([(None, v), (np.ones((2, 2), np.float32), v2)])
    np.testing.assert_array_equal(v.numpy(), [[3.0, 4.0], [5.0, 6.0]])
    assert not np.array_equal(v2.numpy(), [[3.0, 4.0], [5.0, 6.0]])
    for key in ("clipnorm", "clipvalue", "global_clipnorm"):
        assert getattr(me.optimizers.Adadelta(**{key: 0.1}), key) == 0.1
    g = np.array([50.0, 100.0], np.float32)
    xp = me.get_backend("numpy").xp
    np.testing.assert_allclose(GradientsClipOption(global_clipnorm=1).clip(xp, [g])[0], g / np.linalg.norm(g),
                               rtol=1e-6)
    assert me.optimizers.Adadelta(loss_scale_factor=1024.0).scale_loss(1.0) == 1024.0


def test_keras3_gradient_accumulation_with_weight_decay(bk):
    """Keras 3 ``test_gradient_accumulation_with_weigth_decay`` ("adadelta"): 3 accumulated
    calls equal one call with their mean, weight decay included."""
    rng = np.random.default_rng(7)
    opt1 = me.optimizers.Adadelta.from_config({"weight_decay": 0.05, "loss_scale_factor": None})
    opt3 = me.optimizers.Adadelta.from_config({"weight_decay": 0.05, "gradient_accumulation_steps": 3})
    v1 = me.Variable(np.array([[0.9], [0.5]], np.float32), name="v", backend=bk)
    v3 = me.Variable(np.array([[0.9], [0.5]], np.float32), name="v", backend=bk)
    for _ in range(8):
        grads3 = rng.random((3, 2, 1)).astype(np.float32)
        opt1.apply_gradients([(grads3.mean(axis=0), v1)])
        for batch in range(3):
            opt3.apply_gradients([(grads3[batch], v3)])
    np.testing.assert_allclose(v1.numpy(), v3.numpy(), rtol=1e-5, atol=1e-6)


def test_keras3_pickleable_optimizers(bk):
    """Keras 3 ``test_pickleable_optimizers`` ("adadelta"), and (b): a built optimizer with
    its variables pickles, and the copy trains on as the original."""
    import pickle

    opt = me.optimizers.Adadelta()
    assert pickle.loads(pickle.dumps(opt)).get_config() == opt.get_config()
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(1.0, use_ema=True)
    opt.apply_gradients([(np.ones(3), w)])
    w2, opt2 = pickle.loads(pickle.dumps((w, opt)))
    assert w2.backend is w.backend
    opt.apply_gradients([(np.ones(3), w)])
    opt2.apply_gradients([(np.ones(3), w2)])
    _assert_same(_state(opt, [w]), _state(opt2, [w2]))


def test_keras3_callable_learning_rate(bk):
    """Keras 3 ``test_callable_learning_rate``: a zero-argument callable is read each step."""
    v = me.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), name="v", backend=bk)
    ref = me.Variable(v.numpy(), name="v", backend=bk)
    me.optimizers.Adadelta(learning_rate=lambda: 0.1).apply_gradients([(np.ones((2, 2), np.float32), v)])
    me.optimizers.Adadelta(learning_rate=0.1).apply_gradients([(np.ones((2, 2), np.float32), ref)])
    np.testing.assert_array_equal(v.numpy(), ref.numpy())


def test_nonfinite_gradient_is_not_banked_by_gradient_accumulation(bk):
    w = me.Variable(np.ones(2, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(1.0, gradient_accumulation_steps=3)
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    before = _state(opt, [w])
    with pytest.raises(InputError, match="Nothing was accumulated"):
        opt.apply_gradients([(np.array([1.0, np.nan], np.float32), w)])
    _assert_same(before, _state(opt, [w]))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_tf_keras_legacy_basic(bk, dtype):
    """tf_keras ``optimizers/legacy/adadelta_test.py::testBasic``: lr 1.0/0.5/0.1, ρ 0.95,
    ε 1e-8, four steps of constant gradients, against a float64 transcription of the rule."""
    if bk == "jax" and dtype == "float64":
        pytest.skip("JAX without x64 has no float64 (meshembed never turns x64 on)")
    tol = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-10}[dtype]
    for lr in (1.0, 0.5, 0.1):
        var0 = me.Variable(np.array([1.0, 2.0], dtype), name="var0", backend=bk)
        var1 = me.Variable(np.array([3.0, 4.0], dtype), name="var1", backend=bk)
        opt = me.optimizers.Adadelta(learning_rate=lr, rho=0.95, epsilon=1e-8)
        ref = {"var0": (np.array([1.0, 2.0]), 0.1), "var1": (np.array([3.0, 4.0]), 0.01)}
        accum = {k: 0.0 for k in ref}
        accum_update = {k: 0.0 for k in ref}
        for _ in range(4):
            opt.apply_gradients([(np.full(2, 0.1, dtype), var0), (np.full(2, 0.01, dtype), var1)])
            for k, (x, g) in ref.items():
                accum[k] = accum[k] * 0.95 + g * g * 0.05
                update = math.sqrt(accum_update[k] + 1e-8) / math.sqrt(accum[k] + 1e-8) * g
                accum_update[k] = accum_update[k] * 0.95 + update * update * 0.05
                ref[k] = (x - lr * update, g)
        for v in (var0, var1):
            np.testing.assert_allclose(v.numpy().astype(np.float64), ref[v.name][0], rtol=tol, atol=tol)
