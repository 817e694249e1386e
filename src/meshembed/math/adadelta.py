"""Adadelta (spec §4.2; TF ``training_ops.cc`` ``ApplyAdadelta``; Keras ``Adadelta``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, scalar


class AdadeltaSlots(NamedTuple):
    """TPU slot names in Load/Retrieve order (Keras: accumulated_grad, accumulated_delta_var)."""

    accumulators: Array  # E[g²]
    updates: Array  # E[Δx²]


def adadelta(
    xp: Any, params: Array, grads: Array, slots: AdadeltaSlots, *,
    lr: Scalar, rho: Scalar, epsilon: Scalar,
) -> tuple[Array, AdadeltaSlots]:
    """One Adadelta step; the rule TF raw ops, tf_keras, Keras 3, torch and Optax share.

    ``a' = ρ·a + (1−ρ)·g²``; ``d = sqrt(u + ε)/sqrt(a' + ε)·g``;
    ``u' = ρ·u + (1−ρ)·d²``; ``p' = p − lr·d``.
    ε sits inside both roots and ``u`` takes the unscaled ``d`` (not ``lr·d``). The embedding
    engine (sparse rows) and the dense Keras-style optimizer both call this function; ``lr``
    may be a Python float or a 0-d array (cast to the dtype of ``params``).
    """
    lr, rho, eps = (scalar(xp, v, params) for v in (lr, rho, epsilon))
    a = rho * slots.accumulators + (1 - rho) * (grads * grads)
    d = xp.sqrt(slots.updates + eps) / xp.sqrt(a + eps) * grads
    u = rho * slots.updates + (1 - rho) * (d * d)
    return params - lr * d, AdadeltaSlots(a, u)
