"""Keras' clipping and EMA written once (``meshembed.optimizers.options.clip`` / ``ema``) and the
front ends that call them: ``me.optimizers.Adadelta`` (host), ``me.jax.adadelta`` (optax,
``meshembed_jax.frontend.adadelta``) and ``me.torch.Adadelta``; their argument checks; and the optimizer
state moving both ways between meshembed and a real Keras 3 ``keras.optimizers.Adadelta``.

The NaN/Inf cases are compared with the real TensorFlow (``tf.clip_by_norm``,
``tf.clip_by_global_norm``, ``tf.clip_by_value``) and with Keras 3's and tf_keras' own clipping.
A library that is not installed skips its cases with the reason.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

import meshembed as me
from meshembed.errors import CheckpointError, ConfigError, InputError
from meshembed.optimizers import EMAOption, GradientsClipOption
from meshembed.optimizers.options import clip, ema


def _need(module: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here (make test installs it)")
    return pytest.importorskip(module)


INF, NAN = np.inf, np.nan
#: name -> two float32 gradients (the TF cases of issue #30 item 4)
CASES = {
    "normal": [[3.0, 4.0], [1.0, 2.0, 2.0]],
    "one_plus_inf": [[INF, 4.0], [1.0, 2.0, 2.0]],
    "one_nan": [[NAN, 4.0], [1.0, 2.0, 2.0]],
    "all_zeros": [[0.0, 0.0], [0.0, 0.0, 0.0]],
    "minus_inf_and_nan": [[-INF, 4.0], [NAN, 2.0, 2.0]],
    "tiny": [[1e-30, 0.0], [0.0, -1e-30, 0.0]],  # Σg² underflows to 0 in float32
}
OPTIONS = {"clipnorm": dict(clipnorm=0.7), "global_clipnorm": dict(global_clipnorm=0.7),
           "clipvalue": dict(clipvalue=0.7)}


def _grads(case: str) -> list[np.ndarray]:
    return [np.asarray(g, np.float32) for g in CASES[case]]


def _tf_clip(tf, grads: list, option: str) -> list[np.ndarray]:
    ts = [tf.constant(g) for g in grads]
    if option == "clipnorm":
        return [tf.clip_by_norm(t, 0.7).numpy() for t in ts]
    if option == "global_clipnorm":
        return [t.numpy() for t in tf.clip_by_global_norm(ts, 0.7)[0]]
    return [tf.clip_by_value(t, -0.7, 0.7).numpy() for t in ts]


def _assert_like_tf(ours: list, theirs: list, what: str) -> None:
    assert len(ours) == len(theirs)
    for o, t in zip(ours, theirs):
        o = np.asarray(o)
        np.testing.assert_array_equal(np.isnan(o), np.isnan(t), err_msg=f"{what}: NaN positions")
        np.testing.assert_allclose(o, t, rtol=1e-6, atol=0, equal_nan=True, err_msg=what)


def _namespaces() -> list:
    """(name, to-array, xp, jit) for every library the shared function must work on."""
    out = [pytest.param("numpy", id="numpy"), pytest.param("numpy_host_sums", id="numpy-host-sums")]
    for name in ("torch", "jax", "jax_jit", "array_api_strict"):
        module = name.removesuffix("_jit")
        marks = () if importlib.util.find_spec(module) else pytest.mark.skip(reason=f"{module} not installed")
        out.append(pytest.param(name, id=name, marks=marks))
    return out


def _run_clip(namespace: str, grads: list, option: GradientsClipOption) -> list[np.ndarray]:
    """``clip`` eager on each library, with host sums (Python floats, as the host optimizer
    passes them) and traced under ``jax.jit``."""
    if namespace.startswith("numpy"):
        import array_api_compat.numpy as xp

        sums = [float(np.sum(g * g)) for g in grads] if namespace == "numpy_host_sums" else None
        with np.errstate(invalid="ignore", divide="ignore"):
            return [np.asarray(x) for x in clip(xp, grads, option, sums)]
    if namespace == "torch":
        import array_api_compat.torch as xp
        import torch

        return [x.numpy() for x in clip(xp, [torch.tensor(g) for g in grads], option)]
    if namespace == "array_api_strict":
        import array_api_strict as xp

        with np.errstate(invalid="ignore", divide="ignore"):
            return [np.asarray(x) for x in clip(xp, [xp.asarray(g) for g in grads], option)]
    import jax
    import jax.numpy as jnp

    fn = (lambda gs: clip(jnp, gs, option))
    fn = jax.jit(fn) if namespace == "jax_jit" else fn
    return [np.asarray(x) for x in fn([jnp.asarray(g) for g in grads])]


# -- the shared function against TensorFlow --------------------------------------------------
@pytest.mark.parametrize("namespace", _namespaces())
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_clip_matches_tensorflow(namespace, option, case):
    """tf.clip_by_norm / clip_by_global_norm / clip_by_value, NaN and Inf included: with
    global_clipnorm one Inf or NaN makes every gradient NaN; with clipnorm an Inf element is NaN
    and the rest of its gradient 0; clipvalue maps ±Inf to ±v and keeps NaN."""
    tf = _need("tensorflow")
    grads = _grads(case)
    ours = _run_clip(namespace, grads, GradientsClipOption(**OPTIONS[option]))
    _assert_like_tf(ours, _tf_clip(tf, grads, option), f"{namespace} {option} {case}")


@pytest.mark.parametrize("library", ["keras", "tf_keras"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_clip_matches_the_kerases_own_clipping(library, option, case):
    """The optimizers' own ``_clip_gradients`` (Keras 3 has its own clip_by_norm and
    clip_by_global_norm; tf_keras calls TF's), so the option means what it means there."""
    keras = _need(library)
    grads = _grads(case)
    kopt = keras.optimizers.Adadelta(**OPTIONS[option])
    theirs = [np.asarray(t) for t in kopt._clip_gradients([keras.ops.convert_to_tensor(g) if library == "keras"
                                                           else _need("tensorflow").constant(g) for g in grads])]
    import array_api_compat.numpy as xp

    with np.errstate(invalid="ignore", divide="ignore"):
        ours = clip(xp, grads, GradientsClipOption(**OPTIONS[option]))
    _assert_like_tf(ours, theirs, f"{library} {option} {case}")


def test_ema_traced_equals_eager_and_keras3_starts_at_the_variable():
    """One ``ema`` for the host (Python step) and jit (traced step): the same formula; Keras 3's
    first update sets the average to the variable, tf_keras' averages from the start value;
    ``overwrite_frequency=k`` hands the averages back after updates k, 2k, ..."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    avg, var = [jnp.asarray([1.0, 2.0])], [jnp.asarray([3.0, 5.0])]
    for keras3 in (False, True):
        for step in range(4):
            eager = ema(jnp, avg, var, 0.9, step, keras3=keras3, overwrite_frequency=2)
            traced = jax.jit(lambda s: ema(jnp, avg, var, 0.9, s, keras3=keras3, overwrite_frequency=2))(
                jnp.asarray(step, jnp.int32))
            for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced)):  # XLA may contract to an FMA
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.5e-7, atol=0)
            new_avg, new_var = eager
            expect = var[0] if keras3 and step == 0 else 0.9 * avg[0] + (1 - 0.9) * var[0]
            np.testing.assert_allclose(np.asarray(new_avg[0]), np.asarray(expect), rtol=1e-7)
            assert (new_var[0] is new_avg[0]) == ((step + 1) % 2 == 0)


# -- the front ends agree with TF on NaN/Inf ---------------------------------------------------
def _jax_adadelta():
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    from meshembed_jax.frontend.adadelta import adadelta

    return adadelta


@pytest.mark.parametrize("case", ["normal", "one_plus_inf", "one_nan", "all_zeros"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_front_ends_take_the_same_step_as_tf_clipping(option, case):
    """One Adadelta step after clipping, from the host optimizer (every backend, NaN allowed),
    ``me.jax.adadelta`` under jit and ``me.torch.Adadelta``: all equal the step taken on TF's
    clipped gradients (NaN exactly where TF's are). me.torch.Adadelta refuses non-finite
    clipped gradients (InputError naming them) and changes nothing."""
    tf = _need("tensorflow")
    import jax
    import jax.numpy as jnp
    import optax

    adadelta = _jax_adadelta()
    grads = _grads(case)
    params = [np.asarray([0.5, -1.0], np.float32), np.asarray([1.0, 2.0, 3.0], np.float32)]
    kw = dict(learning_rate=0.5, rho=0.9, epsilon=1e-3)
    option_obj = GradientsClipOption(**OPTIONS[option])
    # expected: the unclipped host step on TF's clipped gradients
    ref = [me.Variable(p, name=f"p{i}") for i, p in enumerate(params)]
    with np.errstate(invalid="ignore"):
        me.optimizers.Adadelta(**kw, allow_nonfinite=True).apply_gradients(zip(_tf_clip(tf, grads, option), ref))
    want = [v.numpy() for v in ref]
    nonfinite = not all(np.isfinite(w).all() for w in want)
    for bk in me.available_backends():
        if bk not in ("numpy", "torch", "jax"):
            continue
        vs = [me.Variable(p, name=f"p{i}", backend=bk) for i, p in enumerate(params)]
        with np.errstate(invalid="ignore", divide="ignore"):
            opt = me.optimizers.Adadelta(**kw, gradients_clip_option=option_obj, allow_nonfinite=True)
            opt.apply_gradients(zip(grads, vs))
        _assert_like_tf([v.numpy() for v in vs], want, f"host {bk}")
    tx = adadelta(**kw, gradients_clip_option=option_obj)
    p = {f"p{i}": jnp.asarray(x) for i, x in enumerate(params)}
    updates, _ = jax.jit(tx.update)({f"p{i}": jnp.asarray(g) for i, g in enumerate(grads)}, tx.init(p), p)
    _assert_like_tf([np.asarray(v) for v in jax.tree.leaves(optax.apply_updates(p, updates))], want, "me.jax")
    torch = pytest.importorskip("torch")
    tp = [torch.nn.Parameter(torch.tensor(x)) for x in params]
    topt = me.torch.Adadelta(tp, lr=0.5, rho=0.9, eps=1e-3, gradients_clip_option=option_obj)
    for t, g in zip(tp, grads):
        t.grad = torch.tensor(g)
    if nonfinite:
        with pytest.raises(InputError, match="NaN or Inf after clipping"):
            topt.step()
        for t, x in zip(tp, params):
            np.testing.assert_array_equal(t.detach().numpy(), x)
    else:
        topt.step()
        _assert_like_tf([t.detach().numpy() for t in tp], want, "me.torch")


# -- me.jax.adadelta (meshembed_jax.frontend.adadelta) -------------------------------------------
@pytest.mark.parametrize("options", ["plain", "clipnorm", "global_clipnorm", "clipvalue", "ema"])
def test_jax_adadelta_equals_the_host_optimizer(options):
    import jax
    import jax.numpy as jnp
    import optax

    adadelta = _jax_adadelta()
    kw = {"plain": {}, "clipnorm": dict(gradients_clip_option=GradientsClipOption(clipnorm=0.5)),
          "global_clipnorm": dict(gradients_clip_option=GradientsClipOption(global_clipnorm=0.7)),
          "clipvalue": dict(gradients_clip_option=GradientsClipOption(clipvalue=0.1)),
          "ema": dict(ema_option=EMAOption(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3))}[options]
    rng = np.random.default_rng(4)
    params = {"b": rng.standard_normal(5).astype(np.float32), "w": rng.standard_normal((8, 5)).astype(np.float32)}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()} for _ in range(7)]
    tx = adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6, **kw)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    p = {k: jnp.asarray(v) for k, v in params.items()}
    s = tx.init(p)
    variables = {k: me.Variable(v, name=k, backend="jax") for k, v in params.items()}
    opt = me.optimizers.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6, **kw)
    for g in grads:
        p, s = step(p, s, g)
        opt.apply_gradients([(g[k], variables[k]) for k in sorted(variables)])
    for k in params:  # optax adds p' − p to p: within an ulp or two of p'
        np.testing.assert_allclose(np.asarray(p[k]), variables[k].numpy(), rtol=2e-6, atol=1e-6)
    assert int(s.iteration) == 7


def test_jax_adadelta_matches_gradients_to_params_by_tree():
    """Gradients in another tree (a list for a dict of params, other keys, a missing leaf) or of
    another shape are an InputError, as optax refuses them; before, the leaves were zipped in
    order and a gradient could update the wrong parameter."""
    import jax.numpy as jnp

    adadelta = _jax_adadelta()
    tx = adadelta(learning_rate=0.1)
    params = {"a": jnp.ones(3), "b": jnp.ones(3)}
    state = tx.init(params)
    for bad in ([jnp.ones(3), jnp.ones(3)], {"a": jnp.ones(3), "c": jnp.ones(3)}, {"a": jnp.ones(3)},
                {"a": jnp.ones(3), "b": jnp.ones(4)}, {"a": jnp.ones(3), "b": jnp.ones(3, bool)}):
        with pytest.raises(InputError, match="Invalid (`updates`|gradient for)"):
            tx.update(bad, state, params)
    tx.update({"b": jnp.ones(3), "a": jnp.ones(3)}, state, params)  # a dict's key order is not its tree


@pytest.mark.parametrize("kwargs,match", [
    (dict(rho=1.5), "rho"), (dict(rho=-0.1), "rho"), (dict(epsilon=-1e-7), "epsilon"),
    (dict(epsilon=np.inf), "epsilon"), (dict(rho="0.9"), "rho"), (dict(learning_rate=-0.1), "learning_rate"),
    (dict(learning_rate="x"), "learning_rate"), (dict(learning_rate=np.nan), "learning_rate")])
def test_jax_adadelta_checks_hyperparameters_as_the_host_does(kwargs, match):
    adadelta = _jax_adadelta()
    with pytest.raises(ConfigError, match=match) as ours:
        adadelta(**kwargs)
    with pytest.raises(ConfigError) as host:
        me.optimizers.Adadelta(**kwargs)
    assert str(ours.value) == str(host.value)


def test_jax_adadelta_checks_values_in_the_params_dtype_at_init():
    """1e39 is finite as a Python float and Inf in float32 (the host refuses it at its step)."""
    import jax.numpy as jnp

    adadelta = _jax_adadelta()
    for kw in (dict(learning_rate=1e39), dict(epsilon=1e39)):
        with pytest.raises(ConfigError, match="finite in its dtype float32"):
            adadelta(**kw).init({"w": jnp.ones(2)})


def test_jax_adadelta_under_inject_hyperparams():
    """``optax.inject_hyperparams(me.jax.adadelta)``: the learning rate (and rho, epsilon) as
    traced hyper-parameters of one jitted step; changing the rate in the state takes effect
    without a new trace, and equals a transform built with that rate."""
    import jax
    import jax.numpy as jnp
    import optax

    adadelta = _jax_adadelta()
    tx = optax.inject_hyperparams(adadelta)(learning_rate=0.5, rho=0.9, epsilon=1e-6,
                                            gradients_clip_option=GradientsClipOption(global_clipnorm=1.0))
    plain = {lr: adadelta(learning_rate=lr, rho=0.9, epsilon=1e-6,
                          gradients_clip_option=GradientsClipOption(global_clipnorm=1.0)) for lr in (0.5, 0.25)}
    traces = []

    @jax.jit
    def step(p, s, g):
        traces.append(1)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
    q, qs = dict(p), plain[0.5].init(p)
    s = tx.init(p)
    for i in range(4):
        lr = 0.5 if i < 2 else 0.25
        s.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        g = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
        p, s = step(p, s, g)
        u, qs = plain[lr].update(g, qs, q)
        q = optax.apply_updates(q, u)
        np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(q["w"]), rtol=1e-6, atol=1e-7)
    assert len(traces) == 1
    with pytest.raises(ConfigError, match="rho"):
        optax.inject_hyperparams(adadelta)(rho=2.0).init(p)


# -- me.torch.Adadelta -------------------------------------------------------------------------
def _torch_params(dtype=None):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(3, generator=g, dtype=dtype))]


def _torch_snapshot(opt, params) -> list:
    import copy

    return [p.detach().clone() for p in params] + [copy.deepcopy(opt.state_dict())]


def _assert_torch_same(a: list, b: list) -> None:
    import torch

    for x, y in zip(a[:-1], b[:-1]):
        assert torch.equal(x, y)
    sa, sb = a[-1], b[-1]
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name, t in sa["state"][k].items():
            assert torch.equal(t, sb["state"][k][name]), (k, name)


@pytest.mark.parametrize("lr,match", [("x", "learning_rate"), (1e39, "finite in its dtype float32"),
                                      (-1.0, "learning_rate"), (float("nan"), "learning_rate")])
def test_torch_adadelta_refuses_bad_lr_at_construction(lr, match):
    torch = pytest.importorskip("torch")
    with pytest.raises(ConfigError, match=match):
        me.torch.Adadelta(_torch_params(), lr=lr)
    me.torch.Adadelta(_torch_params(torch.float64), lr=1e39)  # finite in float64
    opt = me.torch.Adadelta(_torch_params(), lr=0.1)
    before = _torch_snapshot(opt, opt.param_groups[0]["params"])
    with pytest.raises(ConfigError):  # a refused group is not kept
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": lr})
    assert len(opt.param_groups) == 1
    _assert_torch_same(before, _torch_snapshot(opt, opt.param_groups[0]["params"]))


def _other_state_dicts(torch) -> dict:
    out = {}
    for name, make in (("SGD", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                       ("Adam", lambda ps: torch.optim.Adam(ps, lr=0.1)),
                       ("torch.optim.Adadelta", lambda ps: torch.optim.Adadelta(ps, weight_decay=0.1))):
        ps = _torch_params()
        other = make(ps)
        for p in ps:
            p.grad = torch.ones_like(p)
        other.step()
        out[name] = other.state_dict()
    return out


def test_torch_adadelta_refuses_another_optimizers_state_dict_and_changes_nothing():
    torch = pytest.importorskip("torch")
    params = _torch_params()
    opt = me.torch.Adadelta(params, lr=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = _torch_snapshot(opt, params)
    mine = opt.state_dict()
    bad = {**_other_state_dicts(torch),
           "wrong shapes": {**mine, "state": {0: {**mine["state"][0], "square_avg": torch.zeros(2)}, 1: mine["state"][1]}},
           "negative step": {**mine, "state": {0: {**mine["state"][0], "step": torch.tensor(-1.0)}, 1: mine["state"][1]}},
           "lr string": {**mine, "param_groups": [{**mine["param_groups"][0], "lr": "x"}]},
           "not a state dict": {"square_avg": 1}}
    for name, sd in bad.items():
        with pytest.raises(ConfigError, match="Invalid `state_dict` for me.torch.Adadelta|Invalid `learning_rate`"):
            opt.load_state_dict(sd)
        _assert_torch_same(before, _torch_snapshot(opt, params))
    opt.step()  # still usable


def test_torch_adadelta_keeps_its_slots_in_opt_state():
    """As torch optimizers do: ``opt.state[p]`` holds ``step``, ``square_avg`` and
    ``acc_delta`` after a step (no state_dict() call needed), the tensors the step updates, with
    torch.optim.Adadelta's values; a loaded state lands there too."""
    torch = pytest.importorskip("torch")
    ours, theirs = _torch_params(), _torch_params()
    opt = me.torch.Adadelta(ours, lr=1.0, rho=0.9, eps=1e-6)
    topt = torch.optim.Adadelta(theirs, lr=1.0, rho=0.9, eps=1e-6)
    for step in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            q.grad = p.grad.clone()
        opt.step()
        topt.step()
    for p, q in zip(ours, theirs):
        state, tstate = opt.state[p], topt.state[q]
        assert {"step", "square_avg", "acc_delta"} <= set(state)
        assert float(state["step"]) == 3.0
        for k in ("square_avg", "acc_delta"):
            torch.testing.assert_close(state[k], tstate[k], rtol=4e-6, atol=1e-7)
    live = opt.state[ours[0]]["square_avg"]
    ours[0].grad = torch.ones_like(ours[0])
    ours[1].grad = None
    opt.step()
    assert opt.state[ours[0]]["square_avg"] is live  # updated in place, as torch's own
    assert float(opt.state[ours[1]]["step"]) == 4.0  # the optimizer's step count
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    again = me.torch.Adadelta(copies, lr=1.0, rho=0.9, eps=1e-6)
    again.load_state_dict(opt.state_dict())
    for p, q in zip(ours, copies):
        for k in ("step", "square_avg", "acc_delta"):
            assert torch.equal(again.state[q][k], opt.state[p][k])


# -- load_own_variables -------------------------------------------------------------------------
def _built(bk: str = "numpy"):
    w = me.Variable(np.ones(3, np.float32), name="w", backend=bk)
    opt = me.optimizers.Adadelta(0.5)
    opt.apply_gradients([(np.ones(3, np.float32), w)])
    return opt, w


@pytest.mark.parametrize("entry,value,match", [
    ("1", np.asarray("x"), "entry '1'"), ("1", np.asarray(np.nan), "entry '1'"),
    ("1", np.asarray(-0.5), "entry '1'"), ("1", np.asarray(True), "entry '1'"),
    ("0", np.asarray(-3), "entry '0'")])
def test_load_own_variables_names_the_bad_entry_and_changes_nothing(entry, value, match):
    opt, w = _built()
    store = {"0": np.asarray(4, np.int64), "1": np.asarray(0.25, np.float32),  # Keras 3's layout, built by hand
             "2": np.ones(3, np.float32), "3": np.ones(3, np.float32), entry: value}
    before = [v.numpy() for v in opt.variables], opt.learning_rate
    with pytest.raises(CheckpointError, match=match):
        opt.load_own_variables(store)
    after = [v.numpy() for v in opt.variables], opt.learning_rate
    assert after[1] == before[1]
    for a, b in zip(before[0], after[0]):
        np.testing.assert_array_equal(a, b)


def test_saved_store_has_keras3_layout_and_round_trips():
    opt, w = _built()
    store: dict = {}
    opt.save_own_variables(store)
    assert sorted(store) == ["0", "1", "2", "3"] and float(store["1"]) == 0.5
    other, _ = _built()
    other.learning_rate = 0.1
    other.load_own_variables(store)
    assert other.learning_rate == 0.5
    sched = me.optimizers.Adadelta(me.optimizers.schedules.ExponentialDecay(0.5, 10, 0.9))
    sched.build([w])
    s2: dict = {}
    sched.save_own_variables(s2)
    assert sorted(s2) == ["0", "1", "2"]  # Keras 3 keeps a schedule out of its variables too


# -- Keras 3 loads meshembed's state and meshembed loads Keras 3's -----------------------------
KERAS3 = {
    "plain": dict(learning_rate=0.5, rho=0.9, epsilon=1e-3),
    "defaults": {},
    "everything": dict(learning_rate=0.5, rho=0.9, epsilon=1e-3, weight_decay=0.05, global_clipnorm=2.0,
                       use_ema=True, ema_momentum=0.9),
    "accumulation": dict(learning_rate=0.5, rho=0.9, epsilon=1e-3, gradient_accumulation_steps=2),
    "schedule": dict(learning_rate="schedule", rho=0.9, epsilon=1e-3),
}


def _pair(keras, name: str):
    kw = dict(KERAS3[name])
    if kw.get("learning_rate") == "schedule":
        kw["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.5, 2, 0.8)
    kopt = keras.optimizers.Adadelta(**kw)
    ours = me.optimizers.Adadelta.from_config(kopt.get_config())
    return kopt, ours


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    init = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(2,)).astype(np.float32)]
    grads = [[(3 * rng.normal(size=x.shape)).astype(np.float32) for x in init] for _ in range(6)]
    return init, grads


def _close(ours: list, theirs: list, what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2e-6, atol=2e-7,
                                   err_msg=f"{what} [{i}]")


@pytest.mark.parametrize("bk", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", sorted(KERAS3))
def test_keras3_loads_our_saved_state_and_we_load_keras3s(bk, name):
    """Both directions against a real ``keras.optimizers.Adadelta``: three steps on one side,
    ``save_own_variables``, ``load_own_variables`` on the other without Keras' "Skipping variable
    loading" warning (which would leave its slots zero), every entry equal, and the next steps
    equal on both sides."""
    keras = _need("keras")
    if bk not in me.available_backends():
        pytest.skip(f"backend {bk} is not available here")
    init, grads = _problem()
    for direction in ("ours->keras", "keras->ours"):
        kopt, ours = _pair(keras, name)
        kvars = [keras.Variable(x) for x in init]
        mvars = [me.Variable(x, name=f"v{i}", backend=bk) for i, x in enumerate(init)]
        src = ours if direction == "ours->keras" else kopt
        for step in grads[:3]:
            if src is ours:
                ours.apply_gradients(zip(step, mvars))
            else:
                kopt.apply_gradients(zip([keras.ops.convert_to_tensor(g) for g in step], kvars))
        store: dict = {}
        src.save_own_variables(store)
        if src is ours:
            kopt.build(kvars)
            for v, x in zip(kvars, mvars):
                v.assign(x.numpy())
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                kopt.load_own_variables(store)
        else:
            ours.build(mvars)
            for v, x in zip(mvars, kvars):
                v.assign(np.asarray(x.numpy()))
            ours.load_own_variables(store)
        theirs: dict = {}
        kopt.save_own_variables(theirs)
        again: dict = {}
        ours.save_own_variables(again)
        assert sorted(theirs, key=int) == sorted(again, key=int), direction
        _close([again[k] for k in sorted(again, key=int)], [theirs[k] for k in sorted(theirs, key=int)], direction)
        for step in grads[3:]:
            ours.apply_gradients(zip(step, mvars))
            kopt.apply_gradients(zip([keras.ops.convert_to_tensor(g) for g in step], kvars))
        _close([v.numpy() for v in mvars], [np.asarray(v.numpy()) for v in kvars], f"{direction} after the steps")
        _close([v.numpy() for v in ours.variables], [np.asarray(v.numpy()) for v in kopt.variables
                                                     if "learning_rate" not in v.path], f"{direction} state")
