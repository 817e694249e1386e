"""OnlineYogi and ProximalYogi (spec §4.2: no formula in public TF).

Both use the Yogi second-moment step of Zaheer et al. 2018 (Algorithm 2),
``v' = v − (1−β2)·sign(v − g²)·g²``, which moves ``v`` toward ``g²`` by at most
``(1−β2)·g²``. Bias correction goes through the dynamic learning rate, as for Adam.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, maximum, minimum, scalar


class OnlineYogiSlots(NamedTuple):
    vs: Array
    linears: Array


class ProximalYogiSlots(NamedTuple):
    v: Array
    m: Array


def _yogi_v(xp: Any, v: Array, grads: Array, beta2: Scalar) -> Array:
    g2 = grads * grads
    return v - (1 - beta2) * xp.sign(v - g2) * g2


def online_yogi(
    xp: Any, params: Array, grads: Array, slots: OnlineYogiSlots, *, lr: Scalar,
    l1: Scalar = 0.0, l2: Scalar = 0.0, beta2: Scalar,
) -> tuple[Array, OnlineYogiSlots]:
    """OnlineYogi: FTRL-proximal driven by the Yogi accumulator (meshembed's reading).

    ``v' = v − (1−β2)·sign(v − g²)·g²``; ``σ = (sqrt(v') − sqrt(v))/lr``;
    ``lin' = lin + g − σ·p``; ``p' = (clamp(lin', −l1, l1) − lin')/(sqrt(v')/lr + 2·l2)``.
    This is TPU FTRL (``lr_power = −0.5``, ``beta = 0``) with ``acc + g²`` replaced by the
    Yogi step; the slot names (``vs``, ``linears``) and fields (l1, l2, beta2) fit exactly
    this shape, but the TPU kernel is closed, so treat it as unverified.
    """
    lr, l1, l2, b2 = (scalar(xp, v, params) for v in (lr, l1, l2, beta2))
    v = _yogi_v(xp, slots.vs, grads, b2)
    sqrt_v = xp.sqrt(v)
    sigma = (sqrt_v - xp.sqrt(slots.vs)) / lr
    lin = slots.linears + grads - sigma * params
    numer = minimum(xp, maximum(xp, lin, -l1), l1) - lin
    return numer / (sqrt_v / lr + 2 * l2), OnlineYogiSlots(v, lin)


def proximal_yogi(
    xp: Any, params: Array, grads: Array, slots: ProximalYogiSlots, *, lr: Scalar,
    l1: Scalar = 0.0, l2: Scalar = 0.0, beta1: Scalar, beta2: Scalar, epsilon: Scalar,
) -> tuple[Array, ProximalYogiSlots]:
    """ProximalYogi (Yogi Algorithm 2 with a proximal l1/l2 step; TF v1 defaults match it).

    ``m' = β1·m + (1−β1)·g``; ``v' = v − (1−β2)·sign(v − g²)·g²``;
    ``η = lr/(sqrt(v') + ε)``; ``x = p − η·m'``;
    ``p' = sign(x)·max(|x| − η·l1, 0)/(1 + η·l2)``.
    The TF v1 defaults (lr 0.01, β1 0.9, β2 0.999, ε 1e-3, v₀ 1e-6) are those of the public
    Yogi implementation with this proximal form. Unverified against TPU hardware.
    """
    lr, l1, l2, b1, b2, eps = (scalar(xp, v, params) for v in (lr, l1, l2, beta1, beta2, epsilon))
    m = b1 * slots.m + (1 - b1) * grads
    v = _yogi_v(xp, slots.v, grads, b2)
    eta = lr / (xp.sqrt(v) + eps)
    x = params - eta * m
    shrunk = xp.sign(x) * xp.maximum(xp.abs(x) - eta * l1, xp.zeros_like(x))
    return shrunk / (1 + eta * l2), ProximalYogiSlots(v, m)
