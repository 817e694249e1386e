"""Optimizer math, written once over an Array-API namespace ``xp``.

One pure function per algorithm of ``OptimizationParameters.parameters``
(``fn(xp, params, grads, slots, *, lr, **hyperparameters) -> (params, slots)``, keywords =
proto field names), the shared mechanics of spec §4.1 (:func:`apply_update`) and forward
simulated quantization (:func:`quantize`). Beside them, fbgemm's row-wise Adagrad and Adam
(:mod:`meshembed.math.rowwise`, registry :data:`ROW_WISE`: one slot value per row, no proto
form). See ``docs/optimizers.md``.
"""

from __future__ import annotations

from meshembed.math.adadelta import AdadeltaSlots, adadelta
from meshembed.math.adagrad import (
    AdagradMomentumSlots,
    AdagradSlots,
    BoundedAdagradSlots,
    FrequencyAwareAdagradSlots,
    ProximalAdagradSlots,
    adagrad,
    adagrad_momentum,
    bounded_adagrad,
    frequency_aware_adagrad,
    proximal_adagrad,
)
from meshembed.math.adam import AdamSlots, LionSlots, adam, lion
from meshembed.math.common import GRADIENT_ACCUMULATOR_INITIAL_VALUE, quantize
from meshembed.math.custom import CustomOptimizer
from meshembed.math.frequency_estimator import FrequencyEstimatorSlots, frequency_estimator
from meshembed.math.ftrl import FtrlSlots, ftrl
from meshembed.math.mdl import MdlAdagradLightSlots, mdl_adagrad_light
from meshembed.math.momentum import (
    CenteredRmsPropSlots,
    MomentumSlots,
    RmsPropSlots,
    centered_rms_prop,
    momentum,
    rms_prop,
)
from meshembed.math.registry import OPTIMIZERS, ROW_WISE, OptimizerMath, apply_update, get_math, initial_slots
from meshembed.math.rowwise import RowWiseAdagradSlots, RowWiseAdamSlots, row_wise_adagrad, row_wise_adam
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed.math.sgd import AssignSlots, SgdSlots, assign, stochastic_gradient_descent
from meshembed.math.user_defined import user_defined_program, user_defined_slot_names
from meshembed.math.yogi import OnlineYogiSlots, ProximalYogiSlots, online_yogi, proximal_yogi

__all__ = [
    "GRADIENT_ACCUMULATOR_INITIAL_VALUE", "OPTIMIZERS", "ROW_WISE", "RowWiseAdagradSlots",
    "RowWiseAdamSlots", "AdadeltaSlots", "AdagradMomentumSlots",
    "AdagradSlots", "AdamSlots", "AssignSlots", "BoundedAdagradSlots", "CenteredRmsPropSlots",
    "CustomOptimizer", "FrequencyAwareAdagradSlots", "FrequencyEstimatorSlots", "FtrlSlots",
    "LionSlots", "MdlAdagradLightSlots", "MomentumSlots", "OnlineYogiSlots", "OptimizerMath",
    "ProximalAdagradSlots", "ProximalYogiSlots", "RmsPropSlots", "SgdSlots", "UpdateRule", "adadelta",
    "adagrad", "adagrad_momentum", "adam", "apply_rule", "apply_update", "assign", "bounded_adagrad",
    "centered_rms_prop", "frequency_aware_adagrad", "frequency_estimator", "ftrl", "get_math",
    "initial_slots", "lion", "mdl_adagrad_light", "momentum", "online_yogi", "proximal_adagrad",
    "proximal_yogi", "quantize", "rms_prop", "row_wise_adagrad", "row_wise_adam",
    "stochastic_gradient_descent", "user_defined_program",
    "user_defined_slot_names",
]
