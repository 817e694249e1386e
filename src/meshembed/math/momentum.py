"""Momentum and the RMSProp pair (spec §4.2; TF ``training_ops.cc``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, scalar


class MomentumSlots(NamedTuple):
    momenta: Array


class RmsPropSlots(NamedTuple):
    ms: Array
    mom: Array


class CenteredRmsPropSlots(NamedTuple):
    ms: Array
    mom: Array
    mg: Array


def momentum(
    xp: Any, params: Array, grads: Array, slots: MomentumSlots, *, lr: Scalar,
    momentum: Scalar, use_nesterov: bool = False,
) -> tuple[Array, MomentumSlots]:
    """Momentum (spec §4.2; TF ``ApplyMomentum``).

    ``a' = momentum·a + g``; ``p' = p − lr·a'``, or with Nesterov
    ``p' = p − lr·g − lr·momentum·a'``.
    """
    lr, mu = scalar(xp, lr, params), scalar(xp, momentum, params)
    a = mu * slots.momenta + grads
    if use_nesterov:
        return params - lr * grads - lr * mu * a, MomentumSlots(a)
    return params - lr * a, MomentumSlots(a)


def rms_prop(
    xp: Any, params: Array, grads: Array, slots: RmsPropSlots, *, lr: Scalar,
    rho: Scalar, momentum: Scalar, epsilon: Scalar,
) -> tuple[Array, RmsPropSlots]:
    """RMSProp (spec §4.2; TF ``ApplyRMSProp``).

    ``ms' = ρ·ms + (1−ρ)·g²``; ``mom' = momentum·mom + lr·g/sqrt(ms' + ε)``; ``p' = p − mom'``.
    """
    lr, rho, mu, eps = (scalar(xp, v, params) for v in (lr, rho, momentum, epsilon))
    ms = rho * slots.ms + (1 - rho) * (grads * grads)
    mom = mu * slots.mom + lr * grads / xp.sqrt(ms + eps)
    return params - mom, RmsPropSlots(ms, mom)


def centered_rms_prop(
    xp: Any, params: Array, grads: Array, slots: CenteredRmsPropSlots, *, lr: Scalar,
    rho: Scalar, momentum: Scalar, epsilon: Scalar,
) -> tuple[Array, CenteredRmsPropSlots]:
    """Centered RMSProp (spec §4.2; TF ``ApplyCenteredRMSProp``).

    ``mg' = ρ·mg + (1−ρ)·g``; ``ms' = ρ·ms + (1−ρ)·g²``;
    ``mom' = momentum·mom + lr·g/sqrt(ms' − mg'² + ε)``; ``p' = p − mom'``.
    """
    lr, rho, mu, eps = (scalar(xp, v, params) for v in (lr, rho, momentum, epsilon))
    mg = rho * slots.mg + (1 - rho) * grads
    ms = rho * slots.ms + (1 - rho) * (grads * grads)
    mom = mu * slots.mom + lr * grads / xp.sqrt(ms - mg * mg + eps)
    return params - mom, CenteredRmsPropSlots(ms, mom, mg)
