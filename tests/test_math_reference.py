"""Rules no framework ships, against a second, plainly written transcription of the spec
formula (spec §4.2): Python scalars, one element at a time, multi-step, float32/float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import array_api_compat.numpy as xp
import meshembed.math as mm

#: The element loop runs in float64 Python arithmetic; meshembed runs in the array dtype.
RTOL = {np.float32: 2e-5, np.float64: 1e-12}
STEPS = 8
SHAPE = (4, 3)


def sign(x: float) -> float:
    return (x > 0) - (x < 0)


# --- element-wise transcriptions: (p, g, *slots, **hp) -> (p', *slots') ------------------

def adam_ref(p, g, m, v, *, lr, beta1, beta2, epsilon, use_sum_inside_sqrt, **_):
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if use_sum_inside_sqrt:
        p = p - lr * m / math.sqrt(v + epsilon * epsilon)
    else:
        p = p - lr * m / (math.sqrt(v) + epsilon)
    return p, m, v


def adagrad_momentum_ref(p, g, acc, m, *, lr, momentum, use_nesterov, exponent, beta2, epsilon):
    if beta2 == 1:
        acc = acc + g * g
    else:
        acc = beta2 * acc + (1 - beta2) * g * g
    s = g * (acc + epsilon) ** (-1.0 / exponent)
    m = momentum * m + s
    update = momentum * m + s if use_nesterov else m
    return p - lr * update, acc, m


def lion_ref(p, g, m, *, lr, beta1, beta2, **_):
    c = beta1 * m + (1 - beta1) * g
    p = p - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g
    return p, m


def online_yogi_ref(p, g, v, lin, *, lr, l1, l2, beta2):
    v_new = v - (1 - beta2) * sign(v - g * g) * g * g
    sigma = (math.sqrt(v_new) - math.sqrt(v)) / lr
    lin = lin + g - sigma * p
    if abs(lin) > l1:
        p = (sign(lin) * l1 - lin) / (math.sqrt(v_new) / lr + 2 * l2)
    else:
        p = 0.0
    return p, v_new, lin


def proximal_yogi_ref(p, g, v, m, *, lr, l1, l2, beta1, beta2, epsilon):
    m = beta1 * m + (1 - beta1) * g
    v = v - (1 - beta2) * sign(v - g * g) * g * g
    eta = lr / (math.sqrt(v) + epsilon)
    x = p - eta * m
    if l1 > 0:
        x = sign(x) * max(abs(x) - eta * l1, 0.0)
    return x / (1 + eta * l2), v, m


def frequency_estimator_ref(d, g, last, *, lr, tau, max_delta, outlier_threshold, **_):
    step = lr
    delta = step - last
    cd = min(delta, max_delta)
    if delta >= outlier_threshold * d:
        d = cd
    else:
        d = d * (1 - tau) + cd * tau
    return d, step


def bounded_adagrad_ref(p, g, acc, *, lr, update_accumulator_first, max_var_update,
                        max_accumulator):
    new_acc = acc + g * g
    if max_accumulator > 0:
        new_acc = min(new_acc, max_accumulator)
    denom = new_acc if update_accumulator_first else acc
    delta = lr * g / math.sqrt(denom)
    if max_var_update > 0:
        delta = min(max(delta, -max_var_update), max_var_update)
    return p - delta, new_acc


def frequency_aware_adagrad_ref(p, g, acc, counter, *, lr, step_counter,
                                l1_regularization_strength, l2_regularization_strength,
                                max_lr_multiplier, probability_exponent, accumulator_decay,
                                initial_accumulator_value):
    counter = counter + 1
    acc = max(accumulator_decay * acc + g * g, initial_accumulator_value)
    lr_scale = min((step_counter / counter) ** probability_exponent, max_lr_multiplier)
    update = g * lr_scale / math.sqrt(acc)
    if l1_regularization_strength > 0:
        update += l1_regularization_strength * sign(p)
    if l2_regularization_strength > 0:
        update += l2_regularization_strength * p
    return p - lr * update, acc, counter


def assign_ref(p, g, **_):
    return (g,)


CASES = [
    ("adam", "adam", adam_ref, (0.0, 0.0),
     dict(beta1=0.9, beta2=0.999, epsilon=1e-7, use_non_lazy_adam=False,
          use_sum_inside_sqrt=True)),
    ("adam_eps_outside", "adam", adam_ref, (0.0, 0.0),
     dict(beta1=0.8, beta2=0.95, epsilon=1e-3, use_non_lazy_adam=True,
          use_sum_inside_sqrt=False)),
    ("adagrad_momentum", "adagrad_momentum", adagrad_momentum_ref, (0.0, 0.0),
     dict(momentum=0.9, use_nesterov=False, exponent=2.0, beta2=1.0, epsilon=1e-10)),
    ("adagrad_momentum_nesterov_beta2", "adagrad_momentum", adagrad_momentum_ref, (0.1, 0.0),
     dict(momentum=0.7, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=1e-4)),
    ("lion", "lion", lion_ref, (0.0,), dict(beta1=0.9, beta2=0.99, use_non_lazy_lion=False)),
    ("online_yogi", "online_yogi", online_yogi_ref, (1e-6, 0.0),
     dict(l1=0.01, l2=0.1, beta2=0.9)),
    ("proximal_yogi", "proximal_yogi", proximal_yogi_ref, (1e-6, 0.0),
     dict(l1=0.01, l2=0.1, beta1=0.9, beta2=0.999, epsilon=1e-3)),
    ("proximal_yogi_no_l1", "proximal_yogi", proximal_yogi_ref, (0.5, 0.0),
     dict(l1=0.0, l2=0.0, beta1=0.5, beta2=0.9, epsilon=1e-3)),
    ("bounded_adagrad", "bounded_adagrad", bounded_adagrad_ref, (0.1,),
     dict(update_accumulator_first=True, max_var_update=0.05, max_accumulator=2.0)),
    ("bounded_adagrad_old_acc_unbounded", "bounded_adagrad", bounded_adagrad_ref, (0.1,),
     dict(update_accumulator_first=False, max_var_update=0.0, max_accumulator=0.0)),
    ("frequency_aware_adagrad", "frequency_aware_adagrad", frequency_aware_adagrad_ref,
     (0.1, 0.0),
     dict(step_counter=40.0, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
          max_lr_multiplier=5.0, probability_exponent=0.5, accumulator_decay=0.95,
          initial_accumulator_value=0.1)),
    ("assign", "assign", assign_ref, (), {}),
]


def _run_reference(ref, p0, grads, init, hp, lr):
    p = p0.astype(np.float64)
    slots = [np.full(p.shape, v, np.float64) for v in init]
    out = []
    for g in grads:
        new_p, new_slots = np.empty_like(p), [np.empty_like(s) for s in slots]
        for idx in np.ndindex(p.shape):
            res = ref(float(p[idx]), float(g[idx]), *(float(s[idx]) for s in slots), lr=lr, **hp)
            new_p[idx] = res[0]
            for s, value in zip(new_slots, res[1:]):
                s[idx] = value
        p, slots = new_p, new_slots
        out.append((p, slots))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("cid", "algorithm", "ref", "init", "hp"), CASES, ids=[c[0] for c in CASES])
def test_matches_scalar_transcription(cid, algorithm, ref, init, hp, dtype) -> None:
    rng = np.random.default_rng(len(cid))
    p0 = rng.normal(size=SHAPE).astype(dtype)
    grads = rng.normal(size=(STEPS,) + SHAPE).astype(dtype)
    grads[3, 0] = 0  # touched with zero gradient
    lr = 0.05
    expected = _run_reference(ref, p0.astype(np.float64), grads.astype(np.float64), init, hp, lr)
    entry = mm.OPTIMIZERS[algorithm]
    p, slots = p0, entry.slots_type(*(np.full_like(p0, v) for v in init))
    for s, (ref_p, ref_slots) in enumerate(expected):
        p, slots = entry.update(xp, p, grads[s], slots, lr=lr, **hp)
        assert p.dtype == dtype and all(x.dtype == dtype for x in slots)
        for name, actual, want in zip(("params", *entry.slot_names), (p, *slots),
                                      (ref_p, *ref_slots)):
            atol = RTOL[dtype] * float(np.max(np.abs(want)))
            np.testing.assert_allclose(actual, want, rtol=RTOL[dtype], atol=atol,
                                       err_msg=f"{cid} {name} step {s}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_frequency_estimator_against_transcription(dtype) -> None:
    """D is a width-1 table; the "lr" is the global step; hits at irregular steps."""
    hp = dict(tau=0.2, max_delta=10.0, outlier_threshold=3.0, weight_exponent=1.0)
    d = np.full((4, 1), hp["max_delta"], dtype)
    last = np.zeros((4, 1), dtype)
    ref_d, ref_last = d.astype(np.float64), last.astype(np.float64)
    for step, rows in ((1, [0, 1]), (2, [0]), (5, [0, 2]), (30, [1, 2, 3]), (31, [3]),
                       (33, [0, 3])):
        ids = np.array(rows)
        new_d, slots = mm.frequency_estimator(xp, d[ids], np.zeros_like(d[ids]),
                                              mm.FrequencyEstimatorSlots(last[ids]),
                                              lr=float(step), **hp)
        d, last = d.copy(), last.copy()
        d[ids], last[ids] = new_d, slots.last_hit_step
        for r in rows:
            ref_d[r, 0], ref_last[r, 0] = frequency_estimator_ref(
                float(ref_d[r, 0]), 0.0, float(ref_last[r, 0]), lr=float(step), **hp)
        assert d.dtype == dtype
        np.testing.assert_allclose(d, ref_d, rtol=RTOL[dtype])
        np.testing.assert_array_equal(last, ref_last)


def test_adam_has_no_bias_correction_and_sum_inside_sqrt_differs() -> None:
    p, g = np.array([1.0]), np.array([0.5])
    slots = mm.AdamSlots(np.zeros(1), np.zeros(1))
    out, _ = mm.adam(xp, p, g, slots, lr=0.1, beta1=0.9, beta2=0.999, epsilon=0.0)
    # first step without bias correction: m = 0.05, v = 0.00025 -> step 0.05/sqrt(0.00025)
    np.testing.assert_allclose(out, 1.0 - 0.1 * 0.05 / math.sqrt(0.00025), rtol=1e-14)
    a, _ = mm.adam(xp, p, g, slots, lr=0.1, beta1=0.9, beta2=0.999, epsilon=0.1,
                   use_sum_inside_sqrt=True)
    b, _ = mm.adam(xp, p, g, slots, lr=0.1, beta1=0.9, beta2=0.999, epsilon=0.1,
                   use_sum_inside_sqrt=False)
    assert not np.allclose(a, b)


def test_adagrad_momentum_follows_hardware_form_not_proto_comment() -> None:
    """Momentum runs over g·(acc+ε)^(-1/k) (spec §7.9): after two steps with momentum the
    proto comment's form (momentum over (acc+ε)^(-1/k), then ·g) differs."""
    p, slots = np.array([0.0]), mm.AdagradMomentumSlots(np.zeros(1), np.zeros(1))
    hp = dict(momentum=0.9, use_nesterov=False, exponent=2.0, beta2=1.0, epsilon=0.0)
    p1, slots = mm.adagrad_momentum(xp, p, np.array([1.0]), slots, lr=1.0, **hp)
    p2, slots = mm.adagrad_momentum(xp, p1, np.array([-1.0]), slots, lr=1.0, **hp)
    s1, s2 = 1.0, -1.0 / math.sqrt(2.0)
    np.testing.assert_allclose(p2, -s1 - (0.9 * s1 + s2), rtol=1e-14)
    comment_form = -1.0 * 1.0 - (-1.0) * (0.9 * 1.0 + 1 / math.sqrt(2.0))
    assert not np.isclose(float(p2[0]), comment_form)
