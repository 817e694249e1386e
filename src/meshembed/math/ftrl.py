"""FTRL-proximal with TPU's ``beta`` and ``multiply_linear_by_lr`` (spec §4.2)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, is_static, maximum, minimum, power, scalar


class FtrlSlots(NamedTuple):
    accumulators: Array
    linears: Array


def _power(xp: Any, x: Array, p: Scalar) -> Array:
    """``x^p``; ``sqrt`` for the usual static ``p = 0.5``, as TF's kernel special-cases it."""
    if is_static(p) and float(p) == 0.5:
        return xp.sqrt(x)
    return power(xp, x, p)


def ftrl(
    xp: Any, params: Array, grads: Array, slots: FtrlSlots, *, lr: Scalar,
    l1: Scalar = 0.0, l2: Scalar = 0.0, lr_power: Scalar = -0.5, beta: Scalar = 0.0,
    multiply_linear_by_lr: bool = False, allow_zero_accumulator: bool = False,
) -> tuple[Array, FtrlSlots]:
    """TPU FTRL (spec §4.2; TF ``ApplyFtrl``/``ApplyFtrlMultiplyLinearByLr`` plus ``beta``).

    With ``P = −lr_power``: ``acc' = acc + g²``; ``Δ = acc'^P − acc^P``;
    plain: ``lin' = lin + g − (Δ/lr)·p``,
    ``p' = (clamp(lin', −l1, l1) − lin')/((acc'^P + beta)/lr + 2·l2)``;
    ``multiply_linear_by_lr`` (the slot stores ``lin·lr``): ``lin' = lin + lr·g − Δ·p``,
    ``p' = (clamp(lin', −lr·l1, lr·l1) − lin')/(acc'^P + 2·lr·l2 + beta)``.
    ``beta`` acts as an extra ``l2`` of ``beta/(2·lr)``; ``allow_zero_accumulator`` is
    deprecated and ignored (zero accumulators are always supported: ``0^P = 0``).
    """
    del allow_zero_accumulator
    lr, l1, l2, beta = (scalar(xp, v, params) for v in (lr, l1, l2, beta))
    power = -scalar(xp, lr_power, params)
    acc = slots.accumulators + grads * grads
    acc_p = _power(xp, acc, power)
    delta = acc_p - _power(xp, slots.accumulators, power)
    if multiply_linear_by_lr:
        lin = slots.linears + lr * grads - delta * params
        bound = lr * l1
        denom = acc_p + 2 * lr * l2 + beta
    else:
        lin = slots.linears + grads - delta / lr * params
        bound = l1
        denom = (acc_p + beta) / lr + 2 * l2
    numer = minimum(xp, maximum(xp, lin, -bound), bound) - lin
    return numer / denom, FtrlSlots(acc, lin)
