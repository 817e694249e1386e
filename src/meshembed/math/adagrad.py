"""The Adagrad family: Adagrad, AdagradMomentum, BoundedAdagrad, FrequencyAwareAdagrad,
ProximalAdagrad (spec §4.2)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, maximum, minimum, power, scalar, select


class AdagradSlots(NamedTuple):
    accumulators: Array


class AdagradMomentumSlots(NamedTuple):
    accumulators: Array
    momenta: Array


class BoundedAdagradSlots(NamedTuple):
    accumulators: Array


class FrequencyAwareAdagradSlots(NamedTuple):
    accumulators: Array
    counters: Array


class ProximalAdagradSlots(NamedTuple):
    accumulators: Array


def adagrad(
    xp: Any, params: Array, grads: Array, slots: AdagradSlots, *, lr: Scalar,
) -> tuple[Array, AdagradSlots]:
    """TPU Adagrad: ``acc' = acc + g²``; ``p' = p − lr·g/sqrt(acc')``.

    No epsilon and the *new* accumulator (spec §4.2; TF ``ApplyAdagrad`` with
    ``update_slots=True``). Keras' Adagrad adds ε outside the root; TPU does not.
    """
    lr = scalar(xp, lr, params)
    acc = slots.accumulators + grads * grads
    return params - lr * grads / xp.sqrt(acc), AdagradSlots(acc)


def adagrad_momentum(
    xp: Any, params: Array, grads: Array, slots: AdagradMomentumSlots, *, lr: Scalar,
    momentum: Scalar, use_nesterov: bool, exponent: Scalar, beta2: Scalar, epsilon: Scalar,
) -> tuple[Array, AdagradMomentumSlots]:
    """AdagradMomentum in the hardware-tested form (spec §4.2, §7.9; TF tpu_embedding test).

    ``acc' = acc + g²`` if ``beta2 == 1`` else ``beta2·acc + (1−beta2)·g²``;
    ``s = g·(acc' + ε)^(−1/k)``; ``m' = momentum·m + s``;
    ``update = momentum·m' + s`` (Nesterov) or ``m'``; ``p' = p − lr·update``.
    The proto comment's variant (momentum without ``g``, extra ``g`` factor at the end) is
    *not* what the hardware computes.
    """
    lr, mom, k, b2, eps = (scalar(xp, v, params) for v in (lr, momentum, exponent, beta2, epsilon))
    g2 = grads * grads
    acc = select(xp, b2 == 1, slots.accumulators + g2, b2 * slots.accumulators + (1 - b2) * g2)
    s = grads * power(xp, acc + eps, -1 / k)
    m = mom * slots.momenta + s
    update = mom * m + s if use_nesterov else m
    return params - lr * update, AdagradMomentumSlots(acc, m)


def bounded_adagrad(
    xp: Any, params: Array, grads: Array, slots: BoundedAdagradSlots, *, lr: Scalar,
    update_accumulator_first: bool, max_var_update: Scalar, max_accumulator: Scalar,
) -> tuple[Array, BoundedAdagradSlots]:
    """BoundedAdagrad; the proto gives only fields, so the clamp placement is meshembed's.

    ``acc' = acc + g²``, then ``acc' = min(acc', max_accumulator)`` if ``max_accumulator > 0``;
    ``Δ = lr·g/sqrt(acc' if update_accumulator_first else acc)``, then
    ``Δ = clamp(Δ, −max_var_update, max_var_update)`` if ``max_var_update > 0``;
    ``p' = p − Δ``. The cap applies to the stored accumulator (so the denominator uses the
    capped value) and the update bound applies to the actual change of the weight.
    """
    lr, max_upd, max_acc = (scalar(xp, v, params) for v in (lr, max_var_update, max_accumulator))
    acc = slots.accumulators + grads * grads
    acc = select(xp, max_acc > 0, minimum(xp, acc, max_acc), acc)
    denom = acc if update_accumulator_first else slots.accumulators
    delta = lr * grads / xp.sqrt(denom)
    bounded = minimum(xp, maximum(xp, delta, -max_upd), max_upd)
    delta = select(xp, max_upd > 0, bounded, delta)
    return params - delta, BoundedAdagradSlots(acc)


def frequency_aware_adagrad(
    xp: Any, params: Array, grads: Array, slots: FrequencyAwareAdagradSlots, *, lr: Scalar,
    step_counter: Scalar, l1_regularization_strength: Scalar = 0.0,
    l2_regularization_strength: Scalar = 0.0, max_lr_multiplier: Scalar,
    probability_exponent: Scalar, accumulator_decay: Scalar, initial_accumulator_value: Scalar,
) -> tuple[Array, FrequencyAwareAdagradSlots]:
    """FrequencyAwareAdagrad, from the (garbled) proto comment, read as meshembed documents.

    ``counter' = counter + 1``;
    ``acc' = max(accumulator_decay·acc + g², initial_accumulator_value)``;
    ``lr_scale = min((step_counter/counter')^probability_exponent, max_lr_multiplier)``;
    ``update = g·lr_scale/sqrt(acc') + l1·sign(p) + l2·p``; ``p' = p − lr·update``.

    Two readings differ from the literal comment (docs/optimizers.md): the comment divides
    ``step_counter`` by ``acc'`` (a row's *count* is the evident intent: step/count is the
    inverse hit frequency) and ends with ``p − lr_scale·g·update`` (read as
    ``p − lr·update``; lr_scale and g are already inside ``update``). ``step_counter`` is the
    value of the dynamic input named by the proto's ``step_counter`` tag. Unverified.
    """
    lr, step, l1, l2, max_mult, expo, decay, init_acc = (
        scalar(xp, v, params) for v in (
            lr, step_counter, l1_regularization_strength, l2_regularization_strength,
            max_lr_multiplier, probability_exponent, accumulator_decay, initial_accumulator_value))
    counters = slots.counters + 1
    acc = maximum(xp, decay * slots.accumulators + grads * grads, init_acc)
    lr_scale = minimum(xp, power(xp, step / counters, expo), max_mult)
    update = grads * lr_scale / xp.sqrt(acc) + l1 * xp.sign(params) + l2 * params
    return params - lr * update, FrequencyAwareAdagradSlots(acc, counters)


def proximal_adagrad(
    xp: Any, params: Array, grads: Array, slots: ProximalAdagradSlots, *, lr: Scalar,
    l1: Scalar, l2: Scalar,
) -> tuple[Array, ProximalAdagradSlots]:
    """ProximalAdagrad (spec §4.2; TF ``ApplyProximalAdagrad``).

    ``acc' = acc + g²``; ``η = lr/sqrt(acc')``; ``v = p − η·g``;
    ``p' = sign(v)·max(|v| − η·l1, 0)/(1 + η·l2)``. With ``l1 = 0`` this is exactly
    ``v/(1 + η·l2)``, TF's other branch, so no branch on ``l1`` is needed.
    """
    lr, l1, l2 = (scalar(xp, v, params) for v in (lr, l1, l2))
    acc = slots.accumulators + grads * grads
    eta = lr / xp.sqrt(acc)
    v = params - eta * grads
    shrunk = xp.sign(v) * xp.maximum(xp.abs(v) - eta * l1, xp.zeros_like(v))
    return shrunk / (1 + eta * l2), ProximalAdagradSlots(acc)


__all__ = [
    "AdagradMomentumSlots", "AdagradSlots", "BoundedAdagradSlots", "FrequencyAwareAdagradSlots",
    "ProximalAdagradSlots", "adagrad", "adagrad_momentum", "bounded_adagrad",
    "frequency_aware_adagrad", "proximal_adagrad",
]
