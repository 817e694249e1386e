"""A dense NumPy transcription of the engine's semantics, independent of its code path.

Each feature becomes an explicit combination matrix ``A [num_slots, V]`` (``A[s, i] += w/N_s``)
so the forward pass is ``A @ E`` and the table gradient ``Aᵀ @ dact`` — no gather, no segment
sum, no sharding. Tests compare the engine against it (and it against TensorFlow), which
catches placement, dedup and combiner bugs that would hide in shared code.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def combination_matrix(
    slots: np.ndarray, ids: np.ndarray, weights: np.ndarray, num_slots: int, vocab: int, combiner: str
) -> np.ndarray:
    """``A[s, i] = Σ_k w_k / N_s`` over ids ``k`` in slot ``s`` equal to ``i`` (float64)."""
    a = np.zeros((num_slots, vocab))
    w = np.asarray(weights, dtype=np.float64)
    for s, i, wk in zip(slots, ids, w):
        a[s, i] += wk
    if combiner == "mean":
        norm = a.sum(axis=1, keepdims=True)
    elif combiner == "sqrtn":
        norm = np.zeros((num_slots, 1))
        for s, wk in zip(slots, w):
            norm[s] += wk * wk
        norm = np.sqrt(norm)
    else:
        return a
    return np.divide(a, norm, out=np.zeros_like(a), where=norm != 0)


def touched(slots_ids: Sequence[np.ndarray], vocab: int) -> np.ndarray:
    """Boolean mask of rows looked up by any of the id arrays."""
    mask = np.zeros(vocab, dtype=bool)
    for ids in slots_ids:
        mask[np.asarray(ids, dtype=np.int64)] = True
    return mask


def sgd(p, g, slots, lr):
    return p - lr * g, slots


def adagrad(p, g, slots, lr):
    (acc,) = slots
    acc = acc + g * g
    return p - lr * g / np.sqrt(acc), (acc,)


def adam(p, g, slots, lr, beta1=0.9, beta2=0.999, epsilon=1e-7, sum_inside_sqrt=True):
    m, v = slots
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = np.sqrt(v + epsilon * epsilon) if sum_inside_sqrt else np.sqrt(v) + epsilon
    return p - lr * m / denom, (m, v)


def ftrl(p, g, slots, lr, l1=0.0, l2=0.0, lr_power=-0.5, beta=0.0):
    acc, lin = slots
    power = -lr_power
    new_acc = acc + g * g
    delta = new_acc**power - acc**power
    lin = lin + g - delta / lr * p
    num = np.clip(lin, -l1, l1) - lin
    p = num / ((new_acc**power + beta) / lr + 2 * l2)
    return p, (new_acc, lin)


def adadelta(p, g, slots, lr, rho=0.95, epsilon=1e-6):
    a, u = slots
    a = rho * a + (1 - rho) * g * g
    d = np.sqrt(u + epsilon) / np.sqrt(a + epsilon) * g
    u = rho * u + (1 - rho) * d * d
    return p - lr * d, (a, u)


def lazy_step(update, params, slots, grad, mask, **hp):
    """Apply ``update`` to the rows in ``mask`` only (TPU laziness)."""
    p_new, s_new = update(params[mask], grad[mask], tuple(s[mask] for s in slots), **hp)
    params = params.copy()
    params[mask] = p_new
    out = []
    for s, sn in zip(slots, s_new):
        s = s.copy()
        s[mask] = sn
        out.append(s)
    return params, tuple(out)


UPDATES = {"sgd": sgd, "adagrad": adagrad, "adam": adam, "ftrl": ftrl, "adadelta": adadelta}

__all__ = ["UPDATES", "combination_matrix", "lazy_step", "touched", "math"]


# -- the remaining rules of spec §4.2, written from the spec's formulas --------------------
def ftrl_lr_linear(p, g, slots, lr, l1=0.0, l2=0.0, lr_power=-0.5, beta=0.0):
    """FTRL with ``multiply_linear_by_lr``: the linear slot stores ``lin·lr``."""
    acc, lin = slots
    power = -lr_power
    new_acc = acc + g * g
    delta = new_acc**power - acc**power
    lin = lin + lr * g - delta * p
    p = (np.clip(lin, -lr * l1, lr * l1) - lin) / (new_acc**power + 2 * lr * l2 + beta)
    return p, (new_acc, lin)


def adagrad_momentum(p, g, slots, lr, momentum=0.0, use_nesterov=False, exponent=2.0, beta2=1.0, epsilon=1e-10):
    acc, m = slots
    acc = acc + g * g if beta2 == 1 else beta2 * acc + (1 - beta2) * g * g
    s = g * (acc + epsilon) ** (-1.0 / exponent)
    m = momentum * m + s
    step = momentum * m + s if use_nesterov else m
    return p - lr * step, (acc, m)


def bounded_adagrad(p, g, slots, lr, update_accumulator_first=False, max_var_update=0.0, max_accumulator=0.0):
    """meshembed's documented reading: cap the stored accumulator, bound the weight change."""
    (acc,) = slots
    new_acc = acc + g * g
    if max_accumulator > 0:
        new_acc = np.minimum(new_acc, max_accumulator)
    step = lr * g / np.sqrt(new_acc if update_accumulator_first else acc)
    if max_var_update > 0:
        step = np.clip(step, -max_var_update, max_var_update)
    return p - step, (new_acc,)


def frequency_aware_adagrad(p, g, slots, lr, step_counter, l1_regularization_strength=0.0,
                            l2_regularization_strength=0.0, max_lr_multiplier=1.0, probability_exponent=0.0,
                            accumulator_decay=1.0, initial_accumulator_value=0.1):
    """meshembed's documented reading of the proto comment (step / count, ``p − lr·update``)."""
    acc, count = slots
    count = count + 1
    acc = np.maximum(accumulator_decay * acc + g * g, initial_accumulator_value)
    scale = np.minimum((step_counter / count) ** probability_exponent, max_lr_multiplier)
    update = g * scale / np.sqrt(acc) + l1_regularization_strength * np.sign(p) + l2_regularization_strength * p
    return p - lr * update, (acc, count)


def momentum(p, g, slots, lr, momentum=0.9, use_nesterov=False):
    (a,) = slots
    a = momentum * a + g
    return (p - lr * g - lr * momentum * a if use_nesterov else p - lr * a), (a,)


def lion(p, g, slots, lr, beta1=0.9, beta2=0.99):
    (m,) = slots
    return p - lr * np.sign(beta1 * m + (1 - beta1) * g), (beta2 * m + (1 - beta2) * g,)


def rms_prop(p, g, slots, lr, rho=0.9, momentum=0.0, epsilon=1e-10):
    ms, mom = slots
    ms = rho * ms + (1 - rho) * g * g
    mom = momentum * mom + lr * g / np.sqrt(ms + epsilon)
    return p - mom, (ms, mom)


def centered_rms_prop(p, g, slots, lr, rho=0.9, momentum=0.0, epsilon=1e-10):
    ms, mom, mg = slots
    mg = rho * mg + (1 - rho) * g
    ms = rho * ms + (1 - rho) * g * g
    mom = momentum * mom + lr * g / np.sqrt(ms - mg * mg + epsilon)
    return p - mom, (ms, mom, mg)


def proximal_adagrad(p, g, slots, lr, l1=0.0, l2=0.0):
    (acc,) = slots
    acc = acc + g * g
    eta = lr / np.sqrt(acc)
    v = p - eta * g
    if l1 > 0:
        out = np.sign(v) * np.maximum(np.abs(v) - eta * l1, 0.0) / (1 + eta * l2)
    else:
        out = v / (1 + eta * l2)
    return out, (acc,)


def _yogi_v(v, g, beta2):
    return v - (1 - beta2) * np.sign(v - g * g) * g * g


def online_yogi(p, g, slots, lr, l1=0.0, l2=0.0, beta2=0.999):
    """meshembed's documented reading: TPU FTRL (power 0.5) with the Yogi accumulator."""
    v, lin = slots
    new_v = _yogi_v(v, g, beta2)
    lin = lin + g - (np.sqrt(new_v) - np.sqrt(v)) / lr * p
    return (np.clip(lin, -l1, l1) - lin) / (np.sqrt(new_v) / lr + 2 * l2), (new_v, lin)


def proximal_yogi(p, g, slots, lr, l1=0.0, l2=0.0, beta1=0.9, beta2=0.999, epsilon=1e-3):
    v, m = slots
    m = beta1 * m + (1 - beta1) * g
    v = _yogi_v(v, g, beta2)
    eta = lr / (np.sqrt(v) + epsilon)
    x = p - eta * m
    return np.sign(x) * np.maximum(np.abs(x) - eta * l1, 0.0) / (1 + eta * l2), (v, m)


def frequency_estimator(p, g, slots, lr, tau=0.0, max_delta=0.0, outlier_threshold=0.0, weight_exponent=0.0):
    """``lr`` is the global step; the gradient is ignored."""
    (last,) = slots
    delta = lr - last
    cd = np.minimum(delta, max_delta)
    new_p = np.where(delta >= outlier_threshold * p, cd, p * (1 - tau) + cd * tau)
    return new_p, (np.full_like(last, lr),)


def assign(p, g, slots, lr):
    return g + 0 * p, slots


def with_mechanics(update, p, g, slots, lr, gradient_clip=None, weight_clip=None, weight_decay=0.0,
                   decay_by_lr=False, **hp):
    """Spec §4.1 order: clip g → decoupled decay ``p ← p − wd·p`` → optimizer → clip p."""
    if gradient_clip is not None:
        g = np.clip(g, *gradient_clip)
    wd = weight_decay * (lr if decay_by_lr else 1.0)
    p, slots = update(p - wd * p, g, slots, lr, **hp)
    if weight_clip is not None:
        p = np.clip(p, *weight_clip)
    return p, slots


def row_wise_adagrad(p, g, slots, lr, epsilon=1e-8):
    """fbgemm EXACT_ROWWISE_ADAGRAD (CPU kernel, weight_decay_mode 0): one accumulator per row."""
    (acc,) = slots
    acc = acc + np.sum(g * g, axis=1, keepdims=True) / g.shape[1]
    return p - g * (lr / (np.sqrt(acc) + epsilon)), (acc,)


def row_wise_adam(p, g, slots, lr, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """fbgemm PARTIAL_ROWWISE_ADAM with its bias-correction factors at 1 (TPU Adam's convention)."""
    m, v = slots
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * (np.sum(g * g, axis=1, keepdims=True) / g.shape[1])
    return p - lr * (m / (np.sqrt(v) + epsilon)), (m, v)


UPDATES.update({
    "row_wise_adagrad": row_wise_adagrad, "row_wise_adam": row_wise_adam,
    "ftrl_lr_linear": ftrl_lr_linear, "adagrad_momentum": adagrad_momentum, "bounded_adagrad": bounded_adagrad,
    "frequency_aware_adagrad": frequency_aware_adagrad, "momentum": momentum, "lion": lion,
    "rms_prop": rms_prop, "centered_rms_prop": centered_rms_prop, "proximal_adagrad": proximal_adagrad,
    "online_yogi": online_yogi, "proximal_yogi": proximal_yogi, "frequency_estimator": frequency_estimator,
    "assign": assign,
})
__all__ += ["with_mechanics"]
