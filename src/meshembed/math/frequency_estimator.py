"""FrequencyEstimator (spec §4.2, from the proto comment)."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar, minimum, scalar


class FrequencyEstimatorSlots(NamedTuple):
    last_hit_step: Array


def frequency_estimator(
    xp: Any, params: Array, grads: Array, slots: FrequencyEstimatorSlots, *, lr: Scalar,
    tau: Scalar, max_delta: Scalar, outlier_threshold: Scalar, weight_exponent: Scalar = 1.0,
) -> tuple[Array, FrequencyEstimatorSlots]:
    """Estimate the steps between hits of each id; ``params`` is the width-1 table D.

    The "learning rate" is the dynamic input float32(global_step) and the gradient is
    ignored (the model sends zeros). ``delta = step − last_hit_step``;
    ``cd = min(delta, max_delta)``; ``outlier = delta ≥ outlier_threshold·D``;
    ``D' = cd if outlier else D·(1−tau) + cd·tau``; ``last_hit_step' = step``.
    D starts at ``max_delta`` (see ``OPTIMIZERS["frequency_estimator"]``).
    ``weight_exponent`` shapes the *forward* weight ``(delta/max_delta)^weight_exponent``
    and does not enter the update, so it is accepted and unused here.
    """
    del grads, weight_exponent
    step, tau, max_d, thr = (scalar(xp, v, params) for v in (lr, tau, max_delta, outlier_threshold))
    delta = step - slots.last_hit_step
    cd = minimum(xp, delta, max_d)
    outlier = delta >= thr * params
    new_d = xp.where(outlier, cd, params * (1 - tau) + cd * tau)
    return new_d, FrequencyEstimatorSlots(xp.zeros_like(delta) + step)
