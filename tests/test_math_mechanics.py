"""Registry, shared mechanics (spec §4.1), quantization, CustomOptimizer, unsupported rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

import array_api_compat.numpy as xp
import meshembed.math as mm
from meshembed.math import OPTIMIZERS, apply_update

RTOL = {np.float32: 1e-6, np.float64: 1e-14}

PROTO_ONEOF = {
    "adagrad", "adagrad_momentum", "bounded_adagrad", "frequency_aware_adagrad",
    "stochastic_gradient_descent", "ftrl", "adam", "momentum", "lion", "rms_prop",
    "centered_rms_prop", "mdl_adagrad_light", "adadelta", "proximal_adagrad", "online_yogi",
    "proximal_yogi", "frequency_estimator", "user_defined_program", "assign",
}
#: spec §2.6, Load/Retrieve order.
SLOT_NAMES = {
    "adagrad": ("accumulators",), "adagrad_momentum": ("accumulators", "momenta"),
    "bounded_adagrad": ("accumulators",), "frequency_aware_adagrad": ("accumulators", "counters"),
    "stochastic_gradient_descent": (), "ftrl": ("accumulators", "linears"),
    "adam": ("momenta", "velocities"), "momentum": ("momenta",), "lion": ("momenta",),
    "rms_prop": ("ms", "mom"), "centered_rms_prop": ("ms", "mom", "mg"),
    "mdl_adagrad_light": ("accumulators", "weights", "benefits"),
    "adadelta": ("accumulators", "updates"), "proximal_adagrad": ("accumulators",),
    "online_yogi": ("vs", "linears"), "proximal_yogi": ("v", "m"),
    "frequency_estimator": ("last_hit_step",), "user_defined_program": (), "assign": (),
}


def test_registry_covers_the_proto_oneof_with_tpu_slot_names() -> None:
    assert set(OPTIMIZERS) == PROTO_ONEOF
    for name, entry in OPTIMIZERS.items():
        assert entry.algorithm == name
        assert entry.slot_names == SLOT_NAMES[name], name
        assert len(entry.default_initial_values) == len(entry.slot_names)


def test_adadelta_slots_and_signature() -> None:
    assert mm.AdadeltaSlots._fields == ("accumulators", "updates")
    p = np.array([1.0, -2.0], np.float32)
    out, slots = mm.adadelta(xp, p, p, mm.AdadeltaSlots(p * 0, p * 0), lr=np.asarray(1.0),
                             rho=0.95, epsilon=1e-7)
    assert out.dtype == np.float32 and isinstance(slots, mm.AdadeltaSlots)


def test_apply_update_order_clip_grad_then_decay_then_opt_then_clip_weights() -> None:
    p = np.array([1.0, -1.0, 0.5, 3.0])
    g = np.array([10.0, -10.0, 0.1, 0.0])
    lr, wd = 0.5, 0.1
    out, _ = apply_update(xp, "stochastic_gradient_descent", p, g, (), lr=lr,
                          gradient_clip=(-1.0, None), weight_clip=(-2.0, 2.0), weight_decay=wd)
    gc = np.clip(g, -1.0, np.inf)
    np.testing.assert_allclose(out, np.clip(p - wd * p - lr * gc, -2.0, 2.0), rtol=1e-15)


def test_weight_decay_is_applied_before_the_optimizer() -> None:
    """Pinned choice: p ← p − wd·p, then the optimizer sees the decayed weights."""
    p = np.array([0.3, -0.7, 1.2])
    g = np.array([0.2, 0.1, -0.4])
    hp = {"l1": 0.01, "l2": 0.02, "lr_power": -0.5, "beta": 0.0,
          "multiply_linear_by_lr": False}
    slots = mm.FtrlSlots(np.full(3, 0.1), np.zeros(3))
    out, new = apply_update(xp, "ftrl", p, g, slots, lr=0.1, hyperparameters=hp,
                            weight_decay=0.05)
    ref, ref_slots = mm.ftrl(xp, p - 0.05 * p, g, slots, lr=0.1, **hp)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(new.linears, ref_slots.linears)
    # multiply_weight_decay_by_lr: wd = factor · lr
    out2, _ = apply_update(xp, "stochastic_gradient_descent", p, g, (), lr=0.5,
                           weight_decay=0.2, multiply_weight_decay_by_lr=True)
    np.testing.assert_allclose(out2, p - 0.1 * p - 0.5 * g, rtol=1e-15)


def test_apply_update_keeps_float32_with_array_scalars() -> None:
    p = np.ones(4, np.float32)
    out, slots = apply_update(xp, "adadelta", p, p, (p * 0, p * 0), lr=np.float64(0.1),
                              hyperparameters={"rho": np.float64(0.9), "epsilon": 1e-6},
                              gradient_clip=(np.asarray(-0.5), np.asarray(0.5)),
                              weight_clip=(-math.inf, math.inf), weight_decay=np.asarray(0.01))
    assert out.dtype == np.float32 and slots.accumulators.dtype == np.float32
    assert isinstance(slots, mm.AdadeltaSlots)


def test_unknown_algorithm_message() -> None:
    with pytest.raises(ValueError, match=r"Invalid `algorithm`. Expected one of"):
        apply_update(xp, "adamw", np.ones(2), np.ones(2), (), lr=0.1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantize_formula(dtype) -> None:
    x = np.array([-3.0, -1.0, -0.26, 0.0, 0.24, 0.26, 0.9, 5.0], dtype)
    lo, hi, n = -1.0, 1.0, 5
    out = mm.quantize(xp, x, lo, hi, n)
    q = (hi - lo) / (n - 1)
    expected = [math.floor((min(max(float(v), lo), hi) - lo) / q + 0.5) * q + lo for v in x]
    assert out.dtype == dtype
    np.testing.assert_allclose(out, expected, rtol=RTOL[dtype])
    with pytest.raises(ValueError, match="num_buckets"):
        mm.quantize(xp, x, lo, hi, 1)


def test_initial_slots() -> None:
    p = np.zeros((2, 3), np.float32)
    slots = mm.initial_slots(xp, "ftrl", p)
    assert isinstance(slots, mm.FtrlSlots)
    assert slots.accumulators.dtype == np.float32 and float(slots.accumulators[0, 0]) == pytest.approx(0.1)
    assert mm.GRADIENT_ACCUMULATOR_INITIAL_VALUE == np.frombuffer(
        np.uint32(1).tobytes(), np.float32)[0]


def test_mdl_adagrad_light_is_explicitly_unsupported() -> None:
    assert not OPTIMIZERS["mdl_adagrad_light"].supported
    p = np.ones(2)
    with pytest.raises(NotImplementedError, match="no public update formula"):
        apply_update(xp, "mdl_adagrad_light", p, p, (p, p, p), lr=0.1)


def test_user_defined_program_needs_an_hlo_runner() -> None:
    p = np.ones(2, np.float32)
    with pytest.raises(NotImplementedError, match="has no HLO compiler"):
        mm.user_defined_program(xp, p, p, (p,), lr=0.1, program=b"")
    assert mm.user_defined_slot_names(2) == ("Slot_0", "Slot_1")


def test_user_defined_program_runner_hook() -> None:
    """The hook receives (g, p, slots..., lr) in the HLO's argument order."""
    seen = []

    def runner(program, g, p, s0, lr):
        seen.append(program)
        return p - lr * g, s0 + g * g

    p, g = np.ones(3, np.float32), np.full(3, 0.5, np.float32)
    out, slots = apply_update(xp, "user_defined_program", p, g, (np.zeros(3, np.float32),),
                              lr=0.1, hyperparameters={"program": b"hlo", "hlo_runner": runner})
    assert seen == [b"hlo"]
    np.testing.assert_allclose(out, 0.95, rtol=1e-6)
    np.testing.assert_allclose(slots[0], 0.25)


def _sgd_with_velocity(xp, params, grads, slots, *, lr, decay):
    v = decay * slots.velocity + grads
    return params - lr * v, type(slots)(v)


def test_custom_optimizer_spec_and_update() -> None:
    opt = mm.CustomOptimizer(_sgd_with_velocity, ("velocity",), (0.5,), learning_rate=0.1,
                             hyperparameters={"decay": 0.9}, clipvalue=1.0,
                             clip_weight_min=-1.0)
    assert opt.algorithm == "custom" and opt.slot_names == ("velocity",)
    assert opt.slot_initial_values() == (0.5,) and opt.hyperparameters() == {"decay": 0.9}
    assert opt.gradient_clipping_limits() == (-1.0, 1.0)
    assert opt.clipping_limits() == (-1.0, math.inf)
    assert hash(opt) == hash(opt)
    p = np.array([0.0, 2.0])
    slots = mm.initial_slots(xp, opt, p)
    out, new = apply_update(xp, opt, p, np.array([3.0, 0.0]), slots, lr=opt.learning_rate,
                            hyperparameters=opt.hyperparameters(),
                            gradient_clip=opt.gradient_clipping_limits(),
                            weight_clip=opt.clipping_limits())
    np.testing.assert_allclose(new.velocity, [0.45 + 1.0, 0.45])
    np.testing.assert_allclose(out, [-0.145, 2.0 - 0.045])
    with pytest.raises(ValueError, match="slot_initializers"):
        mm.CustomOptimizer(_sgd_with_velocity, ("velocity",), ())
    with pytest.raises(ValueError, match="use_gradient_accumulation"):
        mm.CustomOptimizer(_sgd_with_velocity, clipvalue=1.0, use_gradient_accumulation=False)


def _hlo_program(fn, n_args: int) -> bytes:
    jax = pytest.importorskip("jax", reason="building and running HLO needs jax")
    jnp = jax.numpy
    one = jnp.zeros((1, 1), jnp.float32)
    args = [one] * (n_args - 1) + [jnp.float32(0)]
    return jax.jit(fn).lower(*args).compiler_ir("hlo").as_serialized_hlo_module_proto()


def test_user_defined_program_runs_real_hlo_under_jax() -> None:
    """An Adagrad HLO (g, p, acc, lr) -> (p', acc') as a TPU user would write it."""
    from meshembed_jax.kernels.hlo import jax_hlo_runner

    def adagrad_hlo(g, p, acc, lr):
        acc = acc + g * g
        return p - lr * g / (acc ** 0.5), acc

    program = _hlo_program(adagrad_hlo, 4)
    rng = np.random.default_rng(0)
    p = rng.normal(size=(3, 2)).astype(np.float32)
    g = rng.normal(size=(3, 2)).astype(np.float32)
    acc = np.full((3, 2), 0.1, np.float32)
    out, slots = apply_update(xp, "user_defined_program", p, g, (acc,), lr=0.5,
                              hyperparameters={"program": program, "hlo_runner": jax_hlo_runner})
    ref, ref_slots = mm.adagrad(xp, p, g, mm.AdagradSlots(acc), lr=0.5)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    np.testing.assert_allclose(slots[0], ref_slots.accumulators, rtol=1e-6)
