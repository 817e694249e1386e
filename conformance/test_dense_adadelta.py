"""Dense ``me.optimizers.Adadelta`` on every backend against other frameworks.

Golden trajectories (``golden/adadelta_dense`` and the clip/EMA cases in
``golden/adadelta_dense_keras``) from TF raw ops, tf_keras (eager and XLA), legacy Keras,
torch and Optax; the sparse (IndexedSlices) cases against TF's dedup kernel; and live runs
of ``torch.optim.Adadelta`` and ``optax.adadelta`` with matching hyper-parameters.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import meshembed as me
from conformance.tolerances import assert_close

GOLDEN = pathlib.Path(__file__).parent / "golden"

#: Known flavour differences: (framework, key prefix) -> why it is not compared.
NOT_COMPARED = {
    ("optax_lr_none", ""): "optax with learning_rate=None moves along g (no sign flip), another rule",
    ("torch", "ema"): "torch's AveragedModel starts the average at the first step, tf_keras at build",
    ("torch", "final_var"): "torch's AveragedModel starts the average at the first step, tf_keras at build",
}
#: tf_keras keeps the learning rate in a float32 variable, so its float64 runs need ~2e-11.
KERAS_F64_RTOL = 2e-11


def _cases(folder: str) -> list[dict]:
    path = GOLDEN / folder / "cases.json"
    return json.loads(path.read_text())["cases"] if path.exists() else []


def _dense_params() -> list:
    params = []
    for case in _cases("adadelta_dense") + _cases("adadelta_dense_keras"):
        for result in case["results"]:
            if (result["framework"], "") in NOT_COMPARED:
                continue
            params.append(pytest.param(case, result, id=f"{case['id']}-{result['framework']}"))
    return params


def _skip_float64(backend, dtype: str) -> None:
    if dtype == "float64" and not backend.capabilities.float64:
        pytest.skip(f"backend {backend.name!r} declares no float64 support")


def _optimizer(case: dict) -> me.optimizers.Adadelta:
    o = case.get("options", {})
    clip = {k: o[k] for k in ("clipnorm", "clipvalue", "global_clipnorm") if k in o}
    ema = {k: o[k] for k in ("use_ema", "ema_momentum", "ema_overwrite_frequency") if k in o}
    return me.optimizers.Adadelta(
        **case["hparams"],
        gradients_clip_option=me.optimizers.GradientsClipOption(**clip),
        ema_option=me.optimizers.EMAOption(**ema),
    )


def _train_dense(backend_name: str, case: dict) -> dict[str, np.ndarray]:
    """Run the case; per-step arrays stacked like the golden files (x[s] after step s+1)."""
    inputs = np.load(GOLDEN / case["inputs_file"])
    n = sum(1 for k in inputs.files if k.startswith("init_var_"))
    variables = [me.Variable(inputs[f"init_var_{i}"], name=f"var_{i}", backend=backend_name) for i in range(n)]
    opt = _optimizer(case)
    opt.build(variables)
    slots = {v.name: v for v in opt.variables}
    traj: dict[str, list[np.ndarray]] = {}
    for s in range(inputs["grads_0"].shape[0]):
        opt.apply_gradients([(inputs[f"grads_{i}"][s], v) for i, v in enumerate(variables)])
        for i, v in enumerate(variables):
            traj.setdefault(f"var_{i}", []).append(v.numpy())
            traj.setdefault(f"accum_grad_{i}", []).append(slots[f"accumulated_grad/var_{i}"].numpy())
            traj.setdefault(f"accum_delta_{i}", []).append(slots[f"accumulated_delta_var/var_{i}"].numpy())
            if opt.use_ema:
                traj.setdefault(f"ema_{i}", []).append(slots[f"average/var_{i}"].numpy())
    out = {k: np.stack(v) for k, v in traj.items()}
    out["iterations"] = opt.iterations.numpy()
    opt.finalize_variable_values(variables)
    for i, v in enumerate(variables):
        out[f"final_var_{i}"] = v.numpy()
    return out


@pytest.mark.parametrize("case,result", _dense_params())
def test_dense_trajectory_matches_golden(backend, case, result):
    _skip_float64(backend, case["dtype"])
    actual = _train_dense(backend.name, case)
    expected = np.load(GOLDEN / result["file"])
    keras = result["framework"].startswith(("tf_keras", "keras"))
    rtol = KERAS_F64_RTOL if case["dtype"] == "float64" and keras else result["rtol"]
    compared = 0
    for key in expected.files:
        if key not in actual or any(result["framework"] == f and key.startswith(p) for f, p in NOT_COMPARED if p):
            continue
        if key == "iterations":
            assert int(actual[key]) == int(expected[key])
            continue
        assert actual[key].dtype == np.dtype(case["dtype"]), key
        assert_close(actual[key], expected[key], rtol=rtol, what=f"{result['framework']}:{key}", against="golden")
        compared += 1
    assert compared >= 3


def _sparse_params() -> list:
    return [pytest.param(c, r, id=f"{c['id']}-{r['framework']}") for c in _cases("adadelta_sparse") for r in c["results"]]


@pytest.mark.parametrize("case,result", _sparse_params())
def test_sparse_gradients_sum_duplicates_and_touch_only_their_rows(backend, case, result):
    """IndexedSlices: duplicates summed, one update per touched row, others unchanged."""
    _skip_float64(backend, case["dtype"])
    inputs = np.load(GOLDEN / case["inputs_file"])
    var = me.Variable(inputs["init_var"], name="table", backend=backend.name)
    opt = me.optimizers.Adadelta(**case["hparams"])
    expected = np.load(GOLDEN / result["file"])
    for s in range(len(case["steps_indices"])):
        before = var.numpy()
        idx = inputs[f"indices_{s}"]
        opt.apply_gradients([(me.IndexedSlices(inputs[f"values_{s}"], idx, var.shape), var)])
        untouched = np.setdiff1d(np.arange(var.shape[0]), idx)
        np.testing.assert_array_equal(var.numpy()[untouched], before[untouched])
        slots = {v.name: v.numpy() for v in opt.variables}
        for key, actual in (("var", var.numpy()), ("accum_grad", slots["accumulated_grad/table"]),
                            ("accum_delta", slots["accumulated_delta_var/table"])):
            assert_close(actual, expected[key][s], dtype=case["dtype"], what=f"step {s} {key}", against="golden")


# -- live comparisons with matching hyper-parameters ---------------------------------------

def _random_problem(seed: int, dtype: str = "float32", steps: int = 12):
    rng = np.random.default_rng(seed)
    init = [rng.normal(size=(7, 3)).astype(dtype), rng.normal(size=(5,)).astype(dtype)]
    grads = [[rng.normal(size=p.shape).astype(dtype) * 0.7 for p in init] for _ in range(steps)]
    return init, grads


def _run_meshembed(backend_name, init, grads, lr, rho, eps, **opts):
    vs = [me.Variable(p, name=f"p{i}", backend=backend_name) for i, p in enumerate(init)]
    opt = me.optimizers.Adadelta(learning_rate=lr, rho=rho, epsilon=eps, **opts)
    for step in grads:
        opt.apply_gradients(zip(step, vs))
    return [v.numpy() for v in vs], opt


@pytest.mark.parametrize("clip", [None, "clipvalue"])
def test_matches_torch_optim_adadelta_live(backend, clip):
    torch = pytest.importorskip("torch")
    init, grads = _random_problem(1)
    lr, rho, eps = 1.0, 0.9, 1e-6  # torch's defaults, passed explicitly on both sides
    params = [torch.nn.Parameter(torch.tensor(p)) for p in init]
    topt = torch.optim.Adadelta(params, lr=lr, rho=rho, eps=eps, foreach=False)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = torch.tensor(g)
        if clip:
            torch.nn.utils.clip_grad_value_(params, clip_value=0.3)
        topt.step()
    options = {"gradients_clip_option": me.optimizers.GradientsClipOption(clipvalue=0.3)} if clip else {}
    ours, opt = _run_meshembed(backend.name, init, grads, lr, rho, eps, **options)
    slots = {v.name: v.numpy() for v in opt.variables}
    for i, p in enumerate(params):
        assert_close(ours[i], p.detach().numpy(), dtype="float32", against="golden", what=f"p{i}")
        state = topt.state[p]
        assert_close(slots[f"accumulated_grad/p{i}"], state["square_avg"].numpy(), dtype="float32", against="golden")
        assert_close(slots[f"accumulated_delta_var/p{i}"], state["acc_delta"].numpy(), dtype="float32", against="golden")


@pytest.mark.parametrize("clip", [None, "global_clipnorm"])
def test_matches_optax_adadelta_live(backend, clip):
    pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    init, grads = _random_problem(2)
    lr, rho, eps = 0.3, 0.9, 1e-6
    tx = optax.adadelta(learning_rate=lr, rho=rho, eps=eps)
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(1.5), tx)
    params = [jnp.asarray(p) for p in init]
    state = tx.init(params)
    for step in grads:
        updates, state = tx.update([jnp.asarray(g) for g in step], state, params)
        params = optax.apply_updates(params, updates)
    options = {"gradients_clip_option": me.optimizers.GradientsClipOption(global_clipnorm=1.5)} if clip else {}
    ours, _ = _run_meshembed(backend.name, init, grads, lr, rho, eps, **options)
    for i, p in enumerate(params):
        assert_close(ours[i], np.asarray(p), dtype="float32", against="golden", what=f"p{i}")
