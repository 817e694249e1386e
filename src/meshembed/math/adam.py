"""TPU Adam (no bias correction) and Lion (spec §4.2)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, scalar


class AdamSlots(NamedTuple):
    momenta: Array  # m
    velocities: Array  # v


class LionSlots(NamedTuple):
    momenta: Array


def adam(
    xp: Any, params: Array, grads: Array, slots: AdamSlots, *, lr: Scalar,
    beta1: Scalar, beta2: Scalar, epsilon: Scalar, use_non_lazy_adam: bool = False,
    use_sum_inside_sqrt: bool = False,
) -> tuple[Array, AdamSlots]:
    """TPU Adam (spec §4.2; TF ``sparse_core_xla_ops`` and the TPU embedding test).

    ``m' = β1·m + (1−β1)·g``; ``v' = β2·v + (1−β2)·g²``;
    ``p' = p − lr·m'/sqrt(v' + ε²)`` if ``use_sum_inside_sqrt`` else
    ``p' = p − lr·m'/(sqrt(v') + ε)``.
    **No bias correction**: pass ``lr·sqrt(1−β2^t)/(1−β1^t)`` as a dynamic lr for it.
    ``use_non_lazy_adam`` only says which rows the engine updates (all rows, g = 0 where
    none) and does not change the per-row rule. The proto default of
    ``use_sum_inside_sqrt`` is false; TF2's ``Adam`` class writes true.
    """
    del use_non_lazy_adam
    lr, b1, b2, eps = (scalar(xp, v, params) for v in (lr, beta1, beta2, epsilon))
    m = b1 * slots.momenta + (1 - b1) * grads
    v = b2 * slots.velocities + (1 - b2) * (grads * grads)
    if use_sum_inside_sqrt:
        denom = xp.sqrt(v + eps * eps)
    else:
        denom = xp.sqrt(v) + eps
    return params - lr * m / denom, AdamSlots(m, v)


def lion(
    xp: Any, params: Array, grads: Array, slots: LionSlots, *, lr: Scalar,
    beta1: Scalar, beta2: Scalar, use_non_lazy_lion: bool = False,
) -> tuple[Array, LionSlots]:
    """Lion (spec §4.2 from the proto comment; Keras Lion; arXiv 2302.06675).

    ``c = β1·m + (1−β1)·g``; ``p' = p − lr·sign(c)``; ``m' = β2·m + (1−β2)·g``.
    ``use_non_lazy_lion`` is an engine concern (which rows are updated).
    """
    del use_non_lazy_lion
    lr, b1, b2 = (scalar(xp, v, params) for v in (lr, beta1, beta2))
    c = b1 * slots.momenta + (1 - b1) * grads
    m = b2 * slots.momenta + (1 - b2) * grads
    return params - lr * xp.sign(c), LionSlots(m)
