"""Row-wise optimizers: one second-moment value per *row* (fbgemm's TBE optimizers).

Documented extensions beside the 19 TPU algorithms (docs/optimizers.md "Row-wise
extensions"): the TPU proto has no form for them. A row-wise slot has shape ``(rows, 1)``
(``row_slots`` in the registry), so it takes ``1/dimension`` of an element-wise slot's
memory; it broadcasts over the row's columns in the formulas below. ``grads`` are the
duplicate-summed row gradients, as for every sparse update.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, scalar


class RowWiseAdagradSlots(NamedTuple):
    accumulators: Array  # (rows, 1)


class RowWiseAdamSlots(NamedTuple):
    momenta: Array  # (rows, dimension)
    velocities: Array  # (rows, 1)


def mean_square(xp: Any, grads: Array) -> Array:
    """``mean(g²)`` over each row's columns, kept as a ``(rows, 1)`` column."""
    return xp.mean(grads * grads, axis=-1, keepdims=True)


def row_wise_adagrad(
    xp: Any, params: Array, grads: Array, slots: RowWiseAdagradSlots, *, lr: Scalar, epsilon: Scalar,
) -> tuple[Array, RowWiseAdagradSlots]:
    """fbgemm ``EXACT_ROWWISE_ADAGRAD`` (its CPU kernel, ``weight_decay_mode`` 0).

    ``acc' = acc + mean(g²)`` (one value per row); ``μ = lr/(sqrt(acc') + ε)``;
    ``p' = p − g·μ``. ε is outside the root, as fbgemm writes it (TPU Adagrad has none).
    Decoupled weight decay (fbgemm's mode 2) is the shared ``weight_decay_factor`` with
    ``multiply_weight_decay_factor_by_learning_rate=True``.
    """
    lr, eps = (scalar(xp, v, params) for v in (lr, epsilon))
    acc = slots.accumulators + mean_square(xp, grads)
    multiplier = lr / (xp.sqrt(acc) + eps)
    return params - grads * multiplier, RowWiseAdagradSlots(acc)


def row_wise_adam(
    xp: Any, params: Array, grads: Array, slots: RowWiseAdamSlots, *, lr: Scalar,
    beta1: Scalar, beta2: Scalar, epsilon: Scalar,
) -> tuple[Array, RowWiseAdamSlots]:
    """fbgemm ``PARTIAL_ROWWISE_ADAM`` without bias correction (TPU Adam's convention).

    ``m' = β1·m + (1−β1)·g`` (per element); ``v' = β2·v + (1−β2)·mean(g²)`` (per row);
    ``p' = p − lr·(m'/(sqrt(v') + ε))`` (fbgemm's order). fbgemm divides ``m'`` by ``1−β1^t`` and ``v'`` by
    ``1−β2^t`` inside the same formula; here, as for :func:`meshembed.math.adam`, a bias
    correction is the caller's dynamic learning rate (exact for ε = 0).
    """
    lr, b1, b2, eps = (scalar(xp, v, params) for v in (lr, beta1, beta2, epsilon))
    m = b1 * slots.momenta + (1 - b1) * grads
    v = b2 * slots.velocities + (1 - b2) * mean_square(xp, grads)
    return params - lr * (m / (xp.sqrt(v) + eps)), RowWiseAdamSlots(m, v)


__all__ = ["RowWiseAdagradSlots", "RowWiseAdamSlots", "mean_square", "row_wise_adagrad", "row_wise_adam"]
