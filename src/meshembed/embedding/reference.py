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
