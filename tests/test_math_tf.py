"""meshembed.math against TensorFlow's CPU training kernels (``tf.raw_ops.ResourceApply*`` /
``ResourceSparseApply*``) wherever TF computes the same rule; multi-step, float32/float64.

TPU-only twists are mapped onto TF's parameters: FTRL ``beta`` = an extra ``l2`` of
``beta/(2·lr)``; TPU Adam (no bias correction) = TF Adam with ``beta1_power = beta2_power = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

import array_api_compat.numpy as xp
import meshembed.math as mm

tf = pytest.importorskip("tensorflow", reason="TensorFlow CPU kernels are the reference here")

#: rtol per dtype; atol = rtol·max|expected| per array (the vectors' convention).
RTOL = {np.float32: 2e-6, np.float64: 1e-13}
STEPS = 6
SHAPE = (5, 3)


@dataclass
class Case:
    """One rule: meshembed name/hyper-parameters and how TF's kernel is called."""

    id: str
    algorithm: str
    hp: dict[str, Any]
    op: str  # tf.raw_ops name without the Resource/ResourceSparse prefix
    tf_args: Callable[[dict[str, Any], float], dict[str, Any]]
    tf_slots: tuple[str, ...]  # TF slot argument names, mapped in order to meshembed slots
    slot_order: tuple[int, ...] = ()  # meshembed slot index for each TF slot
    init: tuple[float, ...] = ()
    lr: float = 0.1
    sparse: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _ftrl_tf(hp, lr):
    return dict(l1=hp["l1"], l2=hp["l2"] + hp["beta"] / (2 * lr), lr_power=hp["lr_power"],
                lr=lr, _attrs=dict(multiply_linear_by_lr=hp["multiply_linear_by_lr"]))


CASES = [
    Case("sgd", "stochastic_gradient_descent", {}, "ApplyGradientDescent",
         lambda hp, lr: dict(alpha=lr), (), sparse=False),
    Case("adagrad", "adagrad", {}, "ApplyAdagrad",
         lambda hp, lr: dict(lr=lr, _attrs=dict(update_slots=True)), ("accum",), (0,), (0.1,)),
    Case("adadelta", "adadelta", {"rho": 0.9, "epsilon": 1e-6}, "ApplyAdadelta",
         lambda hp, lr: dict(lr=lr, rho=hp["rho"], epsilon=hp["epsilon"]),
         ("accum", "accum_update"), (0, 1), (0.0, 0.0), lr=1.0),
    Case("ftrl", "ftrl", {"l1": 0.05, "l2": 0.1, "lr_power": -0.5, "beta": 0.0,
                          "multiply_linear_by_lr": False}, "ApplyFtrl", _ftrl_tf,
         ("accum", "linear"), (0, 1), (0.1, 0.0)),
    Case("ftrl_power_beta", "ftrl", {"l1": 0.02, "l2": 0.0, "lr_power": -0.7, "beta": 0.3,
                                     "multiply_linear_by_lr": False}, "ApplyFtrl", _ftrl_tf,
         ("accum", "linear"), (0, 1), (0.1, 0.0), lr=0.2),
    Case("ftrl_mul_lr", "ftrl", {"l1": 0.05, "l2": 0.1, "lr_power": -0.5, "beta": 0.2,
                                 "multiply_linear_by_lr": True}, "ApplyFtrl", _ftrl_tf,
         ("accum", "linear"), (0, 1), (0.1, 0.0), lr=0.3),
    Case("momentum", "momentum", {"momentum": 0.9, "use_nesterov": False}, "ApplyMomentum",
         lambda hp, lr: dict(lr=lr, momentum=hp["momentum"], _attrs=dict(use_nesterov=False)),
         ("accum",), (0,), (0.0,)),
    Case("nesterov", "momentum", {"momentum": 0.8, "use_nesterov": True}, "ApplyMomentum",
         lambda hp, lr: dict(lr=lr, momentum=hp["momentum"], _attrs=dict(use_nesterov=True)),
         ("accum",), (0,), (0.0,)),
    Case("rms_prop", "rms_prop", {"rho": 0.9, "momentum": 0.5, "epsilon": 1e-3}, "ApplyRMSProp",
         lambda hp, lr: dict(lr=lr, rho=hp["rho"], momentum=hp["momentum"],
                             epsilon=hp["epsilon"]), ("ms", "mom"), (0, 1), (0.0, 0.0)),
    Case("centered_rms_prop", "centered_rms_prop", {"rho": 0.8, "momentum": 0.3,
                                                    "epsilon": 1e-2},
         "ApplyCenteredRMSProp",
         lambda hp, lr: dict(lr=lr, rho=hp["rho"], momentum=hp["momentum"],
                             epsilon=hp["epsilon"]), ("mg", "ms", "mom"), (2, 0, 1),
         (0.0, 0.0, 0.0)),
    Case("proximal_adagrad", "proximal_adagrad", {"l1": 0.05, "l2": 0.2},
         "ApplyProximalAdagrad", lambda hp, lr: dict(lr=lr, l1=hp["l1"], l2=hp["l2"]),
         ("accum",), (0,), (0.1,)),
    Case("proximal_adagrad_l2_only", "proximal_adagrad", {"l1": 0.0, "l2": 0.2},
         "ApplyProximalAdagrad", lambda hp, lr: dict(lr=lr, l1=hp["l1"], l2=hp["l2"]),
         ("accum",), (0,), (0.1,)),
    Case("adam_no_bias_correction", "adam",
         {"beta1": 0.9, "beta2": 0.99, "epsilon": 1e-3, "use_sum_inside_sqrt": False},
         "ApplyAdam",
         lambda hp, lr: dict(lr=lr, beta1=hp["beta1"], beta2=hp["beta2"], epsilon=hp["epsilon"],
                             beta1_power=0.0, beta2_power=0.0),
         ("m", "v"), (0, 1), (0.0, 0.0), sparse=False),
]


def _data(dtype, seed: int):
    rng = np.random.default_rng(seed)
    p0 = rng.normal(size=SHAPE).astype(dtype)
    grads = rng.normal(size=(STEPS,) + SHAPE).astype(dtype)
    grads[2, 1] = 0  # a touched row with zero gradient
    return p0, grads


def _tf_step(case: Case, var, slot_vars, grad, indices=None) -> None:
    args = case.tf_args(case.hp, case.lr)
    attrs = args.pop("_attrs", {})
    dtype = var.dtype
    tensors = {k: tf.constant(v, dtype=dtype) for k, v in args.items()}
    slots = {name: v.handle for name, v in zip(case.tf_slots, slot_vars)}
    if indices is None:
        op = getattr(tf.raw_ops, "Resource" + case.op)
        grad_arg = "delta" if case.op == "ApplyGradientDescent" else "grad"
        op(var=var.handle, **{grad_arg: grad}, **slots, **tensors, **attrs)
    else:
        op = getattr(tf.raw_ops, "ResourceSparse" + case.op)
        op(var=var.handle, grad=grad, indices=indices, **slots, **tensors, **attrs)


def _mm_slots(case: Case, p0):
    entry = mm.OPTIMIZERS[case.algorithm]
    values = [0.0] * len(entry.slot_names)
    for tf_i, mm_i in enumerate(case.slot_order):
        values[mm_i] = case.init[tf_i]
    return entry.slots_type(*(np.full_like(p0, v) for v in values))


def _assert_close(actual, expected, rtol, what):
    atol = rtol * float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_dense_kernel_trajectory(case: Case, dtype) -> None:
    p0, grads = _data(dtype, seed=len(case.id))
    var = tf.Variable(p0)
    slot_vars = [tf.Variable(np.full_like(p0, v)) for v in case.init]
    p, slots = p0, _mm_slots(case, p0)
    for s in range(STEPS):
        _tf_step(case, var, slot_vars, tf.constant(grads[s]))
        p, slots = mm.OPTIMIZERS[case.algorithm].update(xp, p, grads[s], slots, lr=case.lr,
                                                         **case.hp)
        assert p.dtype == dtype
        _assert_close(p, var.numpy(), RTOL[dtype], f"{case.id} params step {s}")
        for tf_i, mm_i in enumerate(case.slot_order):
            _assert_close(slots[mm_i], slot_vars[tf_i].numpy(), RTOL[dtype],
                          f"{case.id} slot {case.tf_slots[tf_i]} step {s}")


SPARSE_CASES = [c for c in CASES if c.sparse]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", SPARSE_CASES, ids=[c.id for c in SPARSE_CASES])
def test_sparse_kernel_rows(case: Case, dtype) -> None:
    """Gather the touched (unique) rows, update them, scatter back: TF's sparse kernels."""
    p0, grads = _data(dtype, seed=100 + len(case.id))
    var = tf.Variable(p0)
    slot_vars = [tf.Variable(np.full_like(p0, v)) for v in case.init]
    table, slots = p0.copy(), _mm_slots(case, p0)
    steps_ids = [np.array([3, 0]), np.array([1, 4, 3]), np.array([2])]
    for s, ids in enumerate(steps_ids):
        g = grads[s][: len(ids)]
        _tf_step(case, var, slot_vars, tf.constant(g), tf.constant(ids, tf.int64))
        rows, new = mm.OPTIMIZERS[case.algorithm].update(
            xp, table[ids], g, type(slots)(*(x[ids] for x in slots)), lr=case.lr, **case.hp)
        table = table.copy()
        table[ids] = rows
        slots = type(slots)(*(x.copy() for x in slots))
        for full, part in zip(slots, new):
            full[ids] = part
        _assert_close(table, var.numpy(), RTOL[dtype], f"{case.id} params step {s}")
        for tf_i, mm_i in enumerate(case.slot_order):
            _assert_close(slots[mm_i], slot_vars[tf_i].numpy(), RTOL[dtype],
                          f"{case.id} slot {case.tf_slots[tf_i]} step {s}")
