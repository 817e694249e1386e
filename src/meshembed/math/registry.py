"""The optimizer registry and the shared mechanics around every update (spec §4.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import importlib

# Modules by path: the package re-exports functions under the same names (``adagrad``...).
_adadelta, _adagrad, _adam, _fe, _ftrl, _mdl, _momentum, _rowwise, _sgd, _udp, _yogi = (
    importlib.import_module(f"meshembed.math.{name}") for name in (
        "adadelta", "adagrad", "adam", "frequency_estimator", "ftrl", "mdl", "momentum", "rowwise", "sgd",
        "user_defined", "yogi"))
from meshembed.math.common import Array, Scalar, clamp, decay_weights, is_static, scalar
from meshembed.math.custom import CustomOptimizer

__all__ = ["OPTIMIZERS", "ROW_WISE", "OptimizerMath", "apply_update", "get_math", "initial_slots"]


@dataclass(frozen=True)
class OptimizerMath:
    """One algorithm: its pure update and its slot layout.

    ``update(xp, params, grads, slots, *, lr, **hyperparameters) -> (params, slots)``;
    ``slots_type`` is the NamedTuple of TPU slot names in Load/Retrieve order (``None``
    for UserDefinedProgram, whose slot count comes from the program);
    ``default_initial_values`` follows TF's Python defaults (spec §5.2, v1 classes);
    ``hyperparameter_names`` are the proto field names ``update`` takes as keywords, and
    ``dynamic_inputs`` the extra per-step values (e.g. FrequencyAwareAdagrad's
    ``step_counter``) that come from Send's ``learning_rates`` list rather than the config.
    ``row_slots``: the slots holding one value per row, shape ``(rows, 1)`` (the row-wise
    extensions); every other slot is shaped like the parameters.
    """

    algorithm: str
    update: Callable[..., tuple[Array, Any]]
    slots_type: type | None
    default_initial_values: tuple[float, ...]
    hyperparameter_names: tuple[str, ...] = ()
    dynamic_inputs: tuple[str, ...] = ()
    supported: bool = True
    row_slots: tuple[str, ...] = ()

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.slots_type, "_fields", ()))


def _entry(algorithm: str, update: Callable[..., Any], slots_type: type | None,
           initial: tuple[float, ...], names: str = "", dynamic: str = "",
           supported: bool = True, row_slots: str = "") -> OptimizerMath:
    return OptimizerMath(algorithm, update, slots_type, initial, tuple(names.split()),
                         tuple(dynamic.split()), supported, tuple(row_slots.split()))


#: Keyed by the proto ``parameters`` oneof field name (spec §2.3).
OPTIMIZERS: dict[str, OptimizerMath] = {
    e.algorithm: e for e in (
        _entry("adagrad", _adagrad.adagrad, _adagrad.AdagradSlots, (0.1,)),
        _entry("adagrad_momentum", _adagrad.adagrad_momentum, _adagrad.AdagradMomentumSlots,
               (0.0, 0.0), "momentum use_nesterov exponent beta2 epsilon"),
        _entry("bounded_adagrad", _adagrad.bounded_adagrad, _adagrad.BoundedAdagradSlots, (0.1,),
               "update_accumulator_first max_var_update max_accumulator"),
        _entry("frequency_aware_adagrad", _adagrad.frequency_aware_adagrad,
               _adagrad.FrequencyAwareAdagradSlots, (0.0, 0.0),
               "l1_regularization_strength l2_regularization_strength max_lr_multiplier "
               "probability_exponent accumulator_decay initial_accumulator_value",
               "step_counter"),
        _entry("stochastic_gradient_descent", _sgd.stochastic_gradient_descent, _sgd.SgdSlots, ()),
        _entry("ftrl", _ftrl.ftrl, _ftrl.FtrlSlots, (0.1, 0.0),
               "l1 l2 lr_power multiply_linear_by_lr beta allow_zero_accumulator"),
        _entry("adam", _adam.adam, _adam.AdamSlots, (0.0, 0.0),
               "beta1 beta2 epsilon use_non_lazy_adam use_sum_inside_sqrt"),
        _entry("momentum", _momentum.momentum, _momentum.MomentumSlots, (0.0,),
               "momentum use_nesterov"),
        _entry("lion", _adam.lion, _adam.LionSlots, (0.0,), "beta1 beta2 use_non_lazy_lion"),
        _entry("rms_prop", _momentum.rms_prop, _momentum.RmsPropSlots, (0.0, 0.0),
               "rho momentum epsilon"),
        _entry("centered_rms_prop", _momentum.centered_rms_prop, _momentum.CenteredRmsPropSlots,
               (0.0, 0.0, 0.0), "rho momentum epsilon"),
        _entry("mdl_adagrad_light", _mdl.mdl_adagrad_light, _mdl.MdlAdagradLightSlots,
               (0.0, 0.0, 0.0),
               "l2 lr_power min_servable_mdl_benefit mdl_mix_in_margin mdl_benefit_rampup_coeff "
               "mdl_min_weight benefit_revisit_scale max_event_benefit max_total_benefit "
               "mdl_hard_limit hard_limit_min_benefit mdl_regularize", supported=False),
        _entry("adadelta", _adadelta.adadelta, _adadelta.AdadeltaSlots, (0.0, 0.0), "rho epsilon"),
        _entry("proximal_adagrad", _adagrad.proximal_adagrad, _adagrad.ProximalAdagradSlots,
               (0.1,), "l1 l2"),
        _entry("online_yogi", _yogi.online_yogi, _yogi.OnlineYogiSlots, (1e-6, 0.0),
               "l1 l2 beta2"),
        _entry("proximal_yogi", _yogi.proximal_yogi, _yogi.ProximalYogiSlots, (1e-6, 0.0),
               "l1 l2 beta1 beta2 epsilon"),
        _entry("frequency_estimator", _fe.frequency_estimator, _fe.FrequencyEstimatorSlots,
               (0.0,), "tau max_delta outlier_threshold weight_exponent"),
        _entry("user_defined_program", _udp.user_defined_program, None, (), "program"),
        _entry("assign", _sgd.assign, _sgd.AssignSlots, ()),
    )
}

#: The row-wise extensions (fbgemm's TBE optimizers; no proto form), by meshembed name.
ROW_WISE: dict[str, OptimizerMath] = {
    e.algorithm: e for e in (
        _entry("row_wise_adagrad", _rowwise.row_wise_adagrad, _rowwise.RowWiseAdagradSlots, (0.0,),
               "epsilon", row_slots="accumulators"),
        _entry("row_wise_adam", _rowwise.row_wise_adam, _rowwise.RowWiseAdamSlots, (0.0, 0.0),
               "beta1 beta2 epsilon", row_slots="velocities"),
    )
}


def get_math(algorithm: str | OptimizerMath | CustomOptimizer) -> OptimizerMath:
    """The ``OptimizerMath`` for a proto algorithm name, a CustomOptimizer, or itself."""
    if isinstance(algorithm, OptimizerMath):
        return algorithm
    if isinstance(algorithm, CustomOptimizer):
        return OptimizerMath("custom", algorithm.update_fn, algorithm.slots_type,
                             algorithm.slot_initial_values(),
                             tuple(algorithm.hyperparameters()))
    try:
        return OPTIMIZERS[algorithm] if algorithm in OPTIMIZERS else ROW_WISE[algorithm]
    except (KeyError, TypeError):
        raise ValueError(
            f"Invalid `algorithm`. Expected one of {sorted(OPTIMIZERS) + sorted(ROW_WISE)} or a CustomOptimizer. "
            f"Received: algorithm={algorithm!r}"
        ) from None


def initial_slots(xp: Any, algorithm: str | OptimizerMath | CustomOptimizer, params: Array,
                  values: tuple[float, ...] | None = None) -> Any:
    """Fresh slots shaped like ``params`` (a row slot: ``(rows, 1)``), filled with ``values``
    (default: the registry's)."""
    math_ = get_math(algorithm)
    if math_.slots_type is None:
        raise ValueError(
            f"Invalid `algorithm`. {math_.algorithm!r} takes its slot count from the HLO "
            "program; build its slots explicitly."
        )
    values = math_.default_initial_values if values is None else tuple(values)
    rows = xp.full_like(params[..., :1], 0.0)
    return math_.slots_type(*(xp.full_like(rows if name in math_.row_slots else params, v)
                              for name, v in zip(math_.slot_names, values)))


def apply_update(
    xp: Any, algorithm: str | OptimizerMath | CustomOptimizer, params: Array, grads: Array,
    slots: Any, *, lr: Scalar, hyperparameters: Mapping[str, Any] | None = None,
    gradient_clip: tuple[Scalar | None, Scalar | None] | None = None,
    weight_clip: tuple[Scalar | None, Scalar | None] | None = None,
    weight_decay: Scalar = 0.0, multiply_weight_decay_by_lr: bool = False,
) -> tuple[Array, Any]:
    """One update of already accumulated (duplicate-summed) rows, in spec §4.1 order.

    1. clamp the gradient to ``gradient_clip`` (``(lower, upper)``; ``None``/±inf = open);
    2. decoupled weight decay ``p ← p − wd·p`` with
       ``wd = weight_decay·(lr if multiply_weight_decay_by_lr else 1)``, **then** the
       optimizer on the decayed weights (TF-Addons ``DecoupledWeightDecayExtension`` order;
       for SGD, Adagrad and Adam identical to ``opt(p) − wd·p``; pinned by a test);
    3. clamp the new weights to ``weight_clip``.
    ``slots`` may be any sequence in Load/Retrieve order; it is wrapped in the slot type.
    """
    math_ = get_math(algorithm)
    if math_.slots_type is not None and not isinstance(slots, math_.slots_type):
        slots = math_.slots_type(*slots)
    if gradient_clip is not None:
        grads = clamp(xp, grads, *gradient_clip)
    if multiply_weight_decay_by_lr and not (is_static(weight_decay) and weight_decay == 0):
        weight_decay = scalar(xp, weight_decay, params) * scalar(xp, lr, params)
    params = decay_weights(xp, params, weight_decay)
    new_params, new_slots = math_.update(xp, params, grads, slots, lr=lr,
                                         **dict(hyperparameters or {}))
    if weight_clip is not None:
        new_params = clamp(xp, new_params, *weight_clip)
    return new_params, new_slots
