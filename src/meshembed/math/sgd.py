"""Stochastic gradient descent and Assign (spec §4.2)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, scalar


class SgdSlots(NamedTuple):
    """SGD keeps no state besides ``parameters``."""


class AssignSlots(NamedTuple):
    """Assign keeps no state besides ``parameters``."""


def stochastic_gradient_descent(
    xp: Any, params: Array, grads: Array, slots: SgdSlots, *, lr: Scalar,
) -> tuple[Array, SgdSlots]:
    """``p' = p − lr·g`` (spec §4.2; TF ``ApplyGradientDescent``)."""
    return params - scalar(xp, lr, params) * grads, SgdSlots()


def assign(
    xp: Any, params: Array, grads: Array, slots: AssignSlots, *, lr: Scalar,
) -> tuple[Array, AssignSlots]:
    """``p' = g``: the (accumulated) gradient *is* the new value (spec §4.2 Assign).

    ``lr`` is accepted for the uniform signature and ignored. Duplicates must be summed
    (gradient accumulation or dedup) before this runs, or the last writer wins.
    """
    return xp.astype(grads, params.dtype), AssignSlots()
