"""Optimizer spec classes: one frozen dataclass per member of the proto's `parameters` oneof.

A spec is pure data; `meshembed.math.OPTIMIZERS[spec.algorithm]` holds the update rule.
Contract (docs/internals.md):

* ``algorithm`` — the proto oneof field name; ``slot_names`` — TPU slot names after
  ``parameters`` in Load/Retrieve order (spec §2.6); ``slot_initial_values()`` — same order;
  ``hyperparameters()`` — keyed by the proto field names of the algorithm's message.
* Constructor arguments use TF2 ``tf.tpu.experimental.embedding`` names where TF2 has the
  optimizer (SGD, Adagrad, AdagradMomentum, FTRL, Adam), the proto's field names otherwise.
  Defaults follow TF2, then TF's v1 TPU classes, then the proto's zero values (noted per class).
* Slot initial values are not in the proto (spec §4); they are settable here and the engine
  uses them when it creates slots.

Hyper-parameter domains. Every float hyper-parameter and slot initial value is finite, and
lies in the range its class declares in ``_domains`` (each range says where it comes from:
TF's or PyTorch's argument checks, Keras, or the formula in spec §4.2). ``_tf2_domains``
holds the stricter ranges of TF2's Python classes (Adam's ``epsilon > 0``, ...). A spec built
in Python is checked against both at construction. A spec read from a proto is not checked
when parsed (TF's runtime takes any proto value, so a config TF wrote always loads and round
trips); the engine calls ``check_domain(table=...)`` when it is built, so ``rho=7`` from a
proto is refused before any training step, with the table named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, Union

from meshembed.config.common import (
    FINITE,
    NON_NEGATIVE,
    NON_POSITIVE,
    POSITIVE,
    UNIT,
    UNIT_OPEN_TOP,
    Domain,
    as_bool,
    as_enum,
    as_float,
    as_int,
    invalid,
    located,
    tf2_checks_enabled,
)
from meshembed.errors import ConfigError
from meshembed.math.custom import CustomOptimizer

__all__ = [
    "OPTIMIZER_CLASSES", "Adadelta", "Adagrad", "AdagradMomentum", "Adam", "Assign",
    "BoundedAdagrad", "CenteredRMSProp", "DynamicLearningRate", "FTRL", "FrequencyAwareAdagrad",
    "FrequencyEstimator", "Lion", "OPTIMIZER_TYPES", "is_custom", "MAX_AUXILIARY_SLOTS", "MAX_DYNAMIC_TAG",
    "MDLAdagradLight", "Momentum",
    "OnlineYogi", "OptimizerSpec", "ProximalAdagrad", "ProximalYogi", "QuantizationConfig",
    "RMSProp", "SGD", "UserDefinedProgram",
]

#: TF's ``kMaxAuxiliaryParameterCount``: at most 7 state variables besides ``parameters``.
MAX_AUXILIARY_SLOTS = 7
#: Largest dynamic-input tag: ``learning_rates`` holds max tag + 1 values each step, so a huge
#: tag (2**31 - 1) is refused when the config is built, not when that list is allocated.
MAX_DYNAMIC_TAG = 2**16 - 1

PACKING_STATUS = {"unspecified": 0, "enabled": 1, "disabled": 2}
HOT_ID_STATUS = {"unspecified": 0, "enabled": 1, "disabled": 2, "migration_only": 3}


@dataclass(frozen=True)
class DynamicLearningRate:
    """A scalar read from ``learning_rates[tag]`` of SendTPUEmbeddingGradients each step.

    Also used for other optimizer dynamic inputs (FrequencyAwareAdagrad's ``step_counter``).
    """

    tag: int = 0

    def __post_init__(self) -> None:
        tag = as_int("tag", self.tag, "DynamicLearningRate", minimum=0)
        if tag > MAX_DYNAMIC_TAG:  # learning_rates would need tag + 1 values every step
            raise invalid("tag", "DynamicLearningRate",
                          f"an integer in [0, {MAX_DYNAMIC_TAG}] (SendTPUEmbeddingGradients takes one learning "
                          "rate per tag up to the largest, every step; TF numbers tags 0..K-1 with K at most "
                          "the number of tables). Fix: renumber the tags from 0", tag)


@dataclass(frozen=True)
class QuantizationConfig:
    """Forward-pass-only simulated quantization (spec §2.1): clamp to [lower, upper], then
    round to one of ``num_buckets`` evenly spaced levels. ``None`` bounds are unset sides."""

    num_buckets: int
    lower: float | None
    upper: float | None
    enabled: bool = True

    def __post_init__(self) -> None:
        where = "QuantizationConfig"
        if tf2_checks_enabled():
            as_int("num_buckets", self.num_buckets, where, minimum=2)
        else:
            as_int("num_buckets", self.num_buckets, where, minimum=0)
        for name in ("lower", "upper"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, as_float(name, value, where))
        object.__setattr__(self, "enabled", as_bool("enabled", self.enabled, where))
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise invalid("lower", where, f"a value <= upper ({self.upper})", self.lower)


LearningRateLike = Union[float, DynamicLearningRate, Callable[[], float], None]


def required_arguments(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` needs (0 when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(1 for p in params if p.default is p.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _check_learning_rate(value: Any, where: str = "") -> Any:
    if isinstance(value, DynamicLearningRate) or value is None:
        return value
    if callable(value):
        if required_arguments(value):  # a Keras LearningRateSchedule takes the step
            raise invalid("learning_rate", where,
                          "a float, a DynamicLearningRate or a callable taking no arguments (it is called "
                          "once per step, as in TF2's TPU embedding); this one needs arguments, like a Keras "
                          "LearningRateSchedule, which takes the step. Fix: learning_rate=lambda: "
                          "schedule(step) with your step counter, or pass the schedule to a me.tpu optimizer, "
                          "which calls it with its TPUEmbedding's step", value)
        return value
    return as_float("learning_rate", value, where)


#: A constant learning rate is finite (as_float already refuses 1e39, inf in float32; a proto
#: can still carry inf, which the engine's check refuses).
LEARNING_RATE = FINITE.citing("an infinite learning rate writes inf into the table")
#: Decoupled weight decay shrinks weights; PyTorch's optimizers also refuse weight_decay < 0.
WEIGHT_DECAY = NON_NEGATIVE.citing("decay shrinks weights, as PyTorch's weight_decay >= 0")
#: Initial value of a slot that accumulates squares (Adagrad-family accumulators, Adadelta,
#: Yogi's v): a negative one reaches sqrt() as NaN. TF1 FtrlParameters / ProximalYogiParameters
#: and PyTorch Adagrad allow zero.
SQUARES_INIT = NON_NEGATIVE.citing("it accumulates squared gradients; TF1 and PyTorch allow >= 0")
#: l1 / l2 regularization strengths (TF1 FtrlParameters, ProximalAdagradParameters, TF's
#: ApplyProximalAdagrad / ApplyFtrl: "must be greater than or equal to zero").
REGULARIZATION = NON_NEGATIVE.citing("TF's regularization strengths are >= 0")
#: Weight of a moving average ``b*x + (1-b)*y``, zero and one included (PyTorch Adadelta
#: rho and RMSprop alpha, Keras SGD momentum "must be a float between [0, 1]").
AVERAGE_WEIGHT = UNIT.citing("a moving-average weight; PyTorch and Keras check [0, 1]")
#: Adam-style betas: TF2 Adam, TF1 AdamParameters / ProximalYogiParameters, PyTorch Adam all
#: check 0 <= beta < 1.
BETA = UNIT_OPEN_TOP.citing("TF's Adam and ProximalYogi classes and PyTorch check 0 <= beta < 1")
#: An epsilon added under a root; PyTorch (Adam, Adadelta, RMSprop) allows 0, as TF's kernels.
EPSILON = NON_NEGATIVE.citing("added under a root; PyTorch allows 0")
#: TF2's Python classes require a strictly positive epsilon / initial accumulator.
TF2_POSITIVE = POSITIVE.citing("TF2's tf.tpu.experimental.embedding classes require > 0")


def _limits(lower: float | None, upper: float | None) -> tuple[float, float] | None:
    if lower is None and upper is None:
        return None
    return (-math.inf if lower is None else lower, math.inf if upper is None else upper)


@dataclass(frozen=True)
class OptimizerSpec:
    """Base of the 19 optimizer specs: the learning rate and the options every optimizer shares.

    Shared options (TF2 names; proto effect in spec §5.2):
      use_gradient_accumulation: True/False write ENABLED/DISABLED; None leaves the proto's
        UNSPECIFIED, which TF treats as enabled.
      clip_weight_min / clip_weight_max: ``clipping_limits``, applied to weights after the update.
      clipvalue: gradient clamp before the update, a scalar c = (-c, c) or a (min, max) pair
        with None for an open side. Needs gradient accumulation.
      weight_decay_factor, multiply_weight_decay_factor_by_learning_rate: decoupled decay.
      simulated_quantization: a QuantizationConfig or None.
      low_dimensional_packing_status: "unspecified" | "enabled" | "disabled" (bool accepted:
        True = enabled, False = unspecified, as TF2). Memory layout only.
      hot_id_replication: None (absent) or a HotIdReplicationConfiguration status name.
      unknown_fields: wire bytes of OptimizationParameters fields this proto version does not
        know; kept so a proto round trip loses nothing.
    """

    learning_rate: LearningRateLike = 0.001
    _: KW_ONLY
    use_gradient_accumulation: bool | None = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    clipvalue: float | tuple[float | None, float | None] | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    simulated_quantization: QuantizationConfig | None = None
    low_dimensional_packing_status: str | bool | int = "unspecified"
    hot_id_replication: str | int | None = None
    unknown_fields: bytes = field(default=b"", repr=False)

    algorithm: ClassVar[str] = ""
    slot_names: ClassVar[tuple[str, ...]] = ()
    # (proto field name, constructor attribute) of the algorithm's parameter message.
    _fields: ClassVar[tuple[tuple[str, str], ...]] = ()
    _bool_fields: ClassVar[frozenset[str]] = frozenset()
    supports_weight_decay: ClassVar[bool] = True
    requires_gradient_accumulation: ClassVar[bool] = False
    # Per slot in ``slot_names``: the attribute holding its initial value, or a constant.
    _slot_inits: ClassVar[tuple[str | float, ...]] = ()
    # attribute -> range; float hyper-parameters and slot initial values not named are FINITE.
    _domains: ClassVar[dict[str, Domain]] = {}
    # Stricter ranges of TF2's Python classes, checked only for specs built in Python.
    _tf2_domains: ClassVar[dict[str, Domain]] = {}

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        if type(self) is OptimizerSpec:
            raise TypeError("OptimizerSpec is abstract; use one of the optimizer classes (SGD, Adagrad, ...).")
        where = f"{type(self).__name__} optimizer"
        for attr in self._slot_inits:
            if isinstance(attr, str):
                self._set(attr, as_float(attr, getattr(self, attr), where))
        self._set("learning_rate", _check_learning_rate(self.learning_rate, where))
        if self.use_gradient_accumulation is not None:
            self._set("use_gradient_accumulation", as_bool("use_gradient_accumulation", self.use_gradient_accumulation, where))
        for name in ("clip_weight_min", "clip_weight_max", "weight_decay_factor"):
            value = getattr(self, name)
            if value is not None:
                self._set(name, as_float(name, value, where))
        if self.multiply_weight_decay_factor_by_learning_rate is not None:
            self._set("multiply_weight_decay_factor_by_learning_rate",
                      as_bool("multiply_weight_decay_factor_by_learning_rate",
                              self.multiply_weight_decay_factor_by_learning_rate, where))
        self._set("clipvalue", self._normalise_clipvalue(self.clipvalue, where))
        packing = self.low_dimensional_packing_status
        if isinstance(packing, bool):
            packing = "enabled" if packing else "unspecified"
        self._set("low_dimensional_packing_status",
                  as_enum("low_dimensional_packing_status", packing, PACKING_STATUS, where))
        if self.hot_id_replication is not None:
            self._set("hot_id_replication", as_enum("hot_id_replication", self.hot_id_replication, HOT_ID_STATUS, where))
        if self.simulated_quantization is not None and not isinstance(self.simulated_quantization, QuantizationConfig):
            raise invalid("simulated_quantization", where, "a QuantizationConfig or None", self.simulated_quantization)
        if not isinstance(self.unknown_fields, bytes):
            raise invalid("unknown_fields", where, "bytes", self.unknown_fields)
        for proto_name, attr in self._fields:
            value = getattr(self, attr)
            if proto_name in self._bool_fields:
                self._set(attr, as_bool(attr, value, where))
            else:
                self._set(attr, as_float(attr, value, where))
        self._check_options(where)
        if tf2_checks_enabled():
            self._check_domain(where)
            self._check_arguments(where)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @staticmethod
    def _normalise_clipvalue(value: Any, where: str) -> Any:
        if value is None:
            return None
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise invalid("clipvalue", where, "a scalar or a (min, max) pair", value)
            lo, hi = (None if v is None else as_float("clipvalue", v, where) for v in value)
            if lo is not None and hi is not None and lo > hi:
                raise invalid("clipvalue", where, "min <= max", value)
            return (lo, hi)
        c = as_float("clipvalue", value, where)
        if c < 0:
            raise invalid("clipvalue", where, "a scalar >= 0 (it clamps to (-c, c))", value)
        return c

    def _check_options(self, where: str) -> None:
        """Option combinations TF's runtime rejects (spec §4.1)."""
        accumulate = self.gradient_accumulation_enabled
        if not accumulate and self.clipvalue is not None:
            raise invalid("clipvalue", where,
                          "None when use_gradient_accumulation=False (gradient clipping needs gradient "
                          "accumulation; set use_gradient_accumulation=True)", self.clipvalue)
        if not accumulate and self.requires_gradient_accumulation:
            raise invalid("use_gradient_accumulation", where,
                          f"True for {type(self).__name__} (it needs gradient accumulation)",
                          self.use_gradient_accumulation)
        if self.weight_decay_factor and not self.supports_weight_decay:
            raise invalid("weight_decay_factor", where,
                          f"None or 0 ({type(self).__name__} does not support weight decay)",
                          self.weight_decay_factor)
        if self.clip_weight_min is not None and self.clip_weight_max is not None \
                and self.clip_weight_min > self.clip_weight_max:
            raise invalid("clip_weight_min", where, f"a value <= clip_weight_max ({self.clip_weight_max})",
                          self.clip_weight_min)
        aux = len(self.slot_names) + (1 if accumulate else 0)
        if aux > MAX_AUXILIARY_SLOTS:
            raise invalid("use_gradient_accumulation", where,
                          f"False: {len(self.slot_names)} slots plus the gradient accumulator exceed TF's "
                          f"limit of {MAX_AUXILIARY_SLOTS} auxiliary state variables",
                          self.use_gradient_accumulation)

    def _check_arguments(self, where: str) -> None:
        """TF2-Python argument checks; skipped for configs read from a proto."""
        lr = self.learning_rate
        if lr is None:
            raise invalid("learning_rate", where, "a float, a callable or DynamicLearningRate", lr)
        for attr, domain in self._tf2_domains.items():
            domain.check(attr, getattr(self, attr), where)

    def domain_fields(self) -> dict[str, Domain]:
        """Every float hyper-parameter and slot initial value (attribute names), with its range."""
        names = [attr for proto, attr in self._fields if proto not in self._bool_fields]
        names += [attr for attr in self._slot_inits if isinstance(attr, str) and attr not in names]
        return {name: self._domains.get(name, FINITE) for name in names}

    def check_domain(self, table: str | None = None) -> None:
        """Raise ConfigError if a hyper-parameter is outside its domain (see the module doc).

        Specs built in Python are checked at construction; the engine calls this for specs
        read from a proto. ``table`` names the table in the message."""
        with located(f"table '{table}'") if table else contextlib.nullcontext():
            self._check_domain(f"{type(self).__name__} optimizer")

    def _check_domain(self, where: str) -> None:
        lr = self.learning_rate
        if isinstance(lr, float):
            LEARNING_RATE.check("learning_rate", lr, where)
        if self.weight_decay_factor is not None:
            WEIGHT_DECAY.check("weight_decay_factor", self.weight_decay_factor, where)
        for attr, domain in self.domain_fields().items():
            domain.check(attr, getattr(self, attr), where)

    # ------------------------------------------------------------------ contract
    def slot_initial_values(self) -> tuple[float, ...]:
        """Initial value of each slot in ``slot_names`` (from ``_slot_inits``; zeros if unset)."""
        if not self._slot_inits:
            return tuple(0.0 for _ in self.slot_names)
        return tuple(getattr(self, v) if isinstance(v, str) else v for v in self._slot_inits)

    def hyperparameters(self) -> dict[str, float | bool | int]:
        """The algorithm's parameter-message fields, keyed by proto field name."""
        return {proto: getattr(self, attr) for proto, attr in self._fields}

    @classmethod
    def _kwargs_from_hyperparameters(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Inverse of ``hyperparameters()`` (used by proto parsing)."""
        return {attr: values[proto] for proto, attr in cls._fields if proto in values}

    @property
    def gradient_accumulation_enabled(self) -> bool:
        """UNSPECIFIED (None) counts as enabled, as in TF."""
        return self.use_gradient_accumulation is not False

    @property
    def is_dynamic(self) -> bool:
        return isinstance(self.learning_rate, DynamicLearningRate) or callable(self.learning_rate)

    def clipping_limits(self) -> tuple[float, float] | None:
        """Weight clamp after the update, ``(lower, upper)`` with ±inf for an open side."""
        return _limits(self.clip_weight_min, self.clip_weight_max)

    def gradient_clipping_limits(self) -> tuple[float, float] | None:
        """Gradient clamp before the update, ``(lower, upper)`` with ±inf for an open side."""
        c = self.clipvalue
        if c is None:
            return None
        if isinstance(c, tuple):
            return _limits(*c)
        return (-c, c)

    def dynamic_inputs(self) -> tuple[DynamicLearningRate, ...]:
        """Dynamic inputs other than the learning rate (FrequencyAwareAdagrad's step counter)."""
        return ()

    def replace(self, **changes: Any) -> OptimizerSpec:
        return dataclasses.replace(self, **changes)


# The Adagrad family (Adagrad, BoundedAdagrad, ProximalAdagrad, FrequencyAwareAdagrad):
# one accumulator slot of squared gradients starting at ``initial_accumulator_value``.
_ACCUMULATORS = ("accumulators",)
_ACCUMULATOR_INIT: tuple[str | float, ...] = ("initial_accumulator_value",)
_ACCUMULATOR_DOMAIN: dict[str, Domain] = {"initial_accumulator_value": SQUARES_INIT}


# ---------------------------------------------------------------------------- TF2 optimizers
@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """Plain SGD, ``p' = p - lr*g``. No slots. TF2 default lr 0.01."""

    learning_rate: LearningRateLike = 0.01
    algorithm: ClassVar[str] = "stochastic_gradient_descent"


@dataclass(frozen=True)
class Adagrad(OptimizerSpec):
    """Adagrad without epsilon, new accumulator in the denominator (spec §4.2). TF2 defaults."""

    learning_rate: LearningRateLike = 0.001
    initial_accumulator_value: float = 0.1
    algorithm: ClassVar[str] = "adagrad"
    slot_names: ClassVar[tuple[str, ...]] = _ACCUMULATORS
    _slot_inits: ClassVar[tuple[str | float, ...]] = _ACCUMULATOR_INIT
    _domains: ClassVar[dict[str, Domain]] = _ACCUMULATOR_DOMAIN
    _tf2_domains: ClassVar[dict[str, Domain]] = {"initial_accumulator_value": TF2_POSITIVE}


@dataclass(frozen=True)
class AdagradMomentum(OptimizerSpec):
    """Adagrad with momentum (arXiv 2002.11803), hardware-tested form of spec §4.2. TF2 defaults."""

    learning_rate: LearningRateLike = 0.001
    momentum: float = 0.0
    use_nesterov: bool = False
    exponent: float = 2.0
    beta2: float = 1.0
    epsilon: float = 1e-10
    algorithm: ClassVar[str] = "adagrad_momentum"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulators", "momenta")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("momentum", "momentum"), ("use_nesterov", "use_nesterov"), ("exponent", "exponent"),
        ("beta2", "beta2"), ("epsilon", "epsilon"))
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"use_nesterov"})
    _domains: ClassVar[dict[str, Domain]] = {
        "momentum": AVERAGE_WEIGHT, "beta2": AVERAGE_WEIGHT, "epsilon": EPSILON,
        # s = g * (acc + eps)^(-1/exponent): 0 divides by zero; TF2 requires exponent > 0.
        "exponent": POSITIVE.citing("the accumulator's root is 1/exponent; TF2 requires > 0")}
    _tf2_domains: ClassVar[dict[str, Domain]] = {"epsilon": TF2_POSITIVE}


@dataclass(frozen=True)
class FTRL(OptimizerSpec):
    """FTRL-proximal with ``beta`` and optional linear-times-lr storage (spec §4.2). TF2 names
    and defaults; ``initial_linear_value`` is the v1 slot initialiser of ``linears``."""

    learning_rate: LearningRateLike = 0.001
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    multiply_linear_by_learning_rate: bool = False
    allow_zero_accumulator: bool = False
    initial_linear_value: float = 0.0
    algorithm: ClassVar[str] = "ftrl"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulators", "linears")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("l1", "l1_regularization_strength"), ("l2", "l2_regularization_strength"),
        ("lr_power", "learning_rate_power"), ("beta", "beta"),
        ("multiply_linear_by_lr", "multiply_linear_by_learning_rate"),
        ("allow_zero_accumulator", "allow_zero_accumulator"))
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"multiply_linear_by_lr", "allow_zero_accumulator"})
    _slot_inits: ClassVar[tuple[str | float, ...]] = ("initial_accumulator_value", "initial_linear_value")
    _domains: ClassVar[dict[str, Domain]] = {
        "learning_rate_power": NON_POSITIVE.citing("TF's FtrlOptimizer and TF1 FtrlParameters check <= 0"),
        "l1_regularization_strength": REGULARIZATION, "l2_regularization_strength": REGULARIZATION,
        # beta joins acc^P in the denominator (spec §4.2): a negative one can zero it.
        "beta": NON_NEGATIVE.citing("it adds to acc^-lr_power in the denominator, as in the FTRL paper"),
        "initial_accumulator_value": SQUARES_INIT}
    _tf2_domains: ClassVar[dict[str, Domain]] = {"initial_accumulator_value": TF2_POSITIVE}


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """TPU Adam: lazy, no bias correction (pass it through a dynamic lr). TF2 defaults:
    epsilon 1e-7 and ``sum_inside_sqrt=True`` (the proto's own default is False)."""

    learning_rate: LearningRateLike = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-07
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True
    algorithm: ClassVar[str] = "adam"
    slot_names: ClassVar[tuple[str, ...]] = ("momenta", "velocities")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("beta1", "beta_1"), ("beta2", "beta_2"), ("epsilon", "epsilon"))
    _domains: ClassVar[dict[str, Domain]] = {"beta_1": BETA, "beta_2": BETA, "epsilon": EPSILON}
    _tf2_domains: ClassVar[dict[str, Domain]] = {"epsilon": TF2_POSITIVE}

    def __post_init__(self) -> None:
        self._set("lazy_adam", as_bool("lazy_adam", self.lazy_adam))
        self._set("sum_inside_sqrt", as_bool("sum_inside_sqrt", self.sum_inside_sqrt))
        super().__post_init__()

    def _check_options(self, where: str) -> None:
        super()._check_options(where)
        if not self.lazy_adam and not self.gradient_accumulation_enabled:
            raise invalid("lazy_adam", where,
                          "True when use_gradient_accumulation=False (non-lazy Adam needs gradient "
                          "accumulation)", self.lazy_adam)

    def hyperparameters(self) -> dict[str, float | bool | int]:
        hp = super().hyperparameters()
        hp["use_non_lazy_adam"] = not self.lazy_adam
        hp["use_sum_inside_sqrt"] = self.sum_inside_sqrt
        return hp

    @classmethod
    def _kwargs_from_hyperparameters(cls, values: dict[str, Any]) -> dict[str, Any]:
        kwargs = super()._kwargs_from_hyperparameters(values)
        kwargs["lazy_adam"] = not values.get("use_non_lazy_adam", False)
        kwargs["sum_inside_sqrt"] = values.get("use_sum_inside_sqrt", False)
        return kwargs


# ---------------------------------------------------------------------------- proto-named optimizers
@dataclass(frozen=True)
class BoundedAdagrad(OptimizerSpec):
    """Adagrad with update and accumulator bounds (internal algorithm; proto zero defaults,
    accumulators start at 0.1 like Adagrad)."""

    learning_rate: LearningRateLike = 0.001
    update_accumulator_first: bool = False
    max_var_update: float = 0.0
    max_accumulator: float = 0.0
    initial_accumulator_value: float = 0.1
    algorithm: ClassVar[str] = "bounded_adagrad"
    slot_names: ClassVar[tuple[str, ...]] = _ACCUMULATORS
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("update_accumulator_first", "update_accumulator_first"), ("max_var_update", "max_var_update"),
        ("max_accumulator", "max_accumulator"))
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"update_accumulator_first"})
    _slot_inits: ClassVar[tuple[str | float, ...]] = _ACCUMULATOR_INIT
    # Bounds on |update| and on the accumulator; 0 means unbounded (spec §4.2).
    _domains: ClassVar[dict[str, Domain]] = {
        **_ACCUMULATOR_DOMAIN,
        "max_var_update": NON_NEGATIVE.citing("a bound on |update|; 0 means none"),
        "max_accumulator": NON_NEGATIVE.citing("a cap on the accumulator; 0 means none")}


@dataclass(frozen=True)
class FrequencyAwareAdagrad(OptimizerSpec):
    """Adagrad scaled by estimated id frequency. ``step_counter`` is a dynamic input
    (a ``DynamicLearningRate`` tag into ``learning_rates``). Accumulators start at
    ``initial_accumulator_value`` (a proto field here), counters at 0."""

    learning_rate: LearningRateLike = 0.001
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    max_lr_multiplier: float = 1.0
    probability_exponent: float = 0.0
    accumulator_decay: float = 1.0
    initial_accumulator_value: float = 0.1
    step_counter: DynamicLearningRate | Callable[[], float] | None = None
    algorithm: ClassVar[str] = "frequency_aware_adagrad"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulators", "counters")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("l1_regularization_strength", "l1_regularization_strength"),
        ("l2_regularization_strength", "l2_regularization_strength"),
        ("max_lr_multiplier", "max_lr_multiplier"), ("probability_exponent", "probability_exponent"),
        ("accumulator_decay", "accumulator_decay"), ("initial_accumulator_value", "initial_accumulator_value"))
    _slot_inits: ClassVar[tuple[str | float, ...]] = (*_ACCUMULATOR_INIT, 0.0)
    # The proto comment's formula (spec §4.2): acc' = max(decay*acc + g², initial),
    # lr_scale = min((step/acc')^probability_exponent, max_lr_multiplier).
    _domains: ClassVar[dict[str, Domain]] = {
        **_ACCUMULATOR_DOMAIN,
        "l1_regularization_strength": REGULARIZATION, "l2_regularization_strength": REGULARIZATION,
        "max_lr_multiplier": NON_NEGATIVE.citing("it caps a learning-rate scale"),
        "accumulator_decay": UNIT.citing("it decays the accumulator each step")}

    def __post_init__(self) -> None:
        sc = self.step_counter
        if sc is not None and not isinstance(sc, DynamicLearningRate) and not callable(sc):
            raise invalid("step_counter", f"{type(self).__name__} optimizer",
                          "a DynamicLearningRate, a callable or None", sc)
        super().__post_init__()

    def dynamic_inputs(self) -> tuple[DynamicLearningRate, ...]:
        return (self.step_counter,) if isinstance(self.step_counter, DynamicLearningRate) else ()

    def check_domain(self, table: str | None = None) -> None:
        """Also refuse a missing ``step_counter`` (the engine's check, before any step): the
        update divides the step by each row's count, so without it no step can run. A spec
        without one may still be built and round-trip through the proto as data."""
        super().check_domain(table)
        if self.step_counter is None:
            with located(f"table '{table}'") if table else contextlib.nullcontext():
                raise invalid("step_counter", f"{type(self).__name__} optimizer",
                              "a DynamicLearningRate tag or a callable returning the global step (the update "
                              "scales the learning rate by step / count per row, so it cannot run without one). "
                              "Fix: FrequencyAwareAdagrad(..., step_counter=DynamicLearningRate(k)) and pass the "
                              "step as learning_rates[k], or step_counter=lambda: step", None)


@dataclass(frozen=True)
class Momentum(OptimizerSpec):
    """Heavy-ball momentum, optional Nesterov (spec §4.2). v1 TPU class names; momenta start at 0."""

    learning_rate: LearningRateLike = 0.001
    momentum: float = 0.9
    use_nesterov: bool = False
    algorithm: ClassVar[str] = "momentum"
    slot_names: ClassVar[tuple[str, ...]] = ("momenta",)
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("momentum", "momentum"), ("use_nesterov", "use_nesterov"))
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"use_nesterov"})
    _domains: ClassVar[dict[str, Domain]] = {"momentum": AVERAGE_WEIGHT}


@dataclass(frozen=True)
class Lion(OptimizerSpec):
    """Lion (arXiv 2302.06675); lazy unless ``use_non_lazy_lion``. Keras Lion's betas (0.9, 0.99)."""

    learning_rate: LearningRateLike = 0.001
    beta1: float = 0.9
    beta2: float = 0.99
    use_non_lazy_lion: bool = False
    algorithm: ClassVar[str] = "lion"
    slot_names: ClassVar[tuple[str, ...]] = ("momenta",)
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("beta1", "beta1"), ("beta2", "beta2"), ("use_non_lazy_lion", "use_non_lazy_lion"))
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"use_non_lazy_lion"})
    # c = beta1*m + (1-beta1)*g, m' = beta2*m + (1-beta2)*g (arXiv 2302.06675; Keras Lion).
    _domains: ClassVar[dict[str, Domain]] = {"beta1": AVERAGE_WEIGHT, "beta2": AVERAGE_WEIGHT}


@dataclass(frozen=True)
class RMSProp(OptimizerSpec):
    """RMSProp with momentum (TF ApplyRMSProp). Defaults of tf.compat.v1 RMSProp (rho 0.9,
    momentum 0, epsilon 1e-10); ``ms`` and ``mom`` start at 0 as in the v1 TPU API."""

    learning_rate: LearningRateLike = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-10
    algorithm: ClassVar[str] = "rms_prop"
    slot_names: ClassVar[tuple[str, ...]] = ("ms", "mom")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("rho", "rho"), ("momentum", "momentum"), ("epsilon", "epsilon"))
    _domains: ClassVar[dict[str, Domain]] = {"rho": AVERAGE_WEIGHT, "momentum": AVERAGE_WEIGHT, "epsilon": EPSILON}


@dataclass(frozen=True)
class CenteredRMSProp(RMSProp):
    """Centered RMSProp (TF ApplyCenteredRMSProp); ``ms``, ``mom``, ``mg`` start at 0."""

    algorithm: ClassVar[str] = "centered_rms_prop"
    slot_names: ClassVar[tuple[str, ...]] = ("ms", "mom", "mg")


@dataclass(frozen=True)
class MDLAdagradLight(OptimizerSpec):
    """MDL Adagrad Light. No public formula; kept so configs round-trip. Proto zero defaults;
    slots start at the reserved ``initial_*`` values (0). No weight decay."""

    learning_rate: LearningRateLike = 0.001
    l2: float = 0.0
    lr_power: float = 0.0
    min_servable_mdl_benefit: float = 0.0
    mdl_mix_in_margin: float = 0.0
    mdl_benefit_rampup_coeff: float = 0.0
    mdl_min_weight: float = 0.0
    benefit_revisit_scale: float = 0.0
    max_event_benefit: float = 0.0
    max_total_benefit: float = 0.0
    mdl_hard_limit: float = 0.0
    hard_limit_min_benefit: bool = False
    mdl_regularize: bool = False
    initial_accumulator: float = 0.0
    initial_weight: float = 0.0
    initial_benefit: float = 0.0
    algorithm: ClassVar[str] = "mdl_adagrad_light"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulators", "weights", "benefits")
    supports_weight_decay: ClassVar[bool] = False
    _fields: ClassVar[tuple[tuple[str, str], ...]] = tuple((n, n) for n in (
        "l2", "lr_power", "min_servable_mdl_benefit", "mdl_mix_in_margin", "mdl_benefit_rampup_coeff",
        "mdl_min_weight", "benefit_revisit_scale", "max_event_benefit", "max_total_benefit",
        "mdl_hard_limit", "hard_limit_min_benefit", "mdl_regularize"))
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"hard_limit_min_benefit", "mdl_regularize"})
    _slot_inits: ClassVar[tuple[str | float, ...]] = ("initial_accumulator", "initial_weight", "initial_benefit")
    # No public formula: only what the names say (an l2 strength, an accumulator of squares).
    _domains: ClassVar[dict[str, Domain]] = {"l2": REGULARIZATION, "initial_accumulator": SQUARES_INIT}


@dataclass(frozen=True)
class Adadelta(OptimizerSpec):
    """Adadelta (TF ApplyAdadelta), epsilon inside both roots. tf.compat.v1 defaults
    (lr 0.001, rho 0.95, epsilon 1e-8); both slots start at 0 (Keras/TF zeros)."""

    learning_rate: LearningRateLike = 0.001
    rho: float = 0.95
    epsilon: float = 1e-08
    initial_accumulator: float = 0.0
    initial_update: float = 0.0
    algorithm: ClassVar[str] = "adadelta"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulators", "updates")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("rho", "rho"), ("epsilon", "epsilon"))
    _slot_inits: ClassVar[tuple[str | float, ...]] = ("initial_accumulator", "initial_update")
    # PyTorch Adadelta checks 0 <= rho <= 1 and eps >= 0; both slots average squares.
    _domains: ClassVar[dict[str, Domain]] = {
        "rho": AVERAGE_WEIGHT, "epsilon": EPSILON,
        "initial_accumulator": SQUARES_INIT, "initial_update": SQUARES_INIT}


@dataclass(frozen=True)
class ProximalAdagrad(OptimizerSpec):
    """Proximal Adagrad (TF ApplyProximalAdagrad). v1 TPU defaults: accumulators start at 0.1."""

    learning_rate: LearningRateLike = 0.001
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.1
    algorithm: ClassVar[str] = "proximal_adagrad"
    slot_names: ClassVar[tuple[str, ...]] = _ACCUMULATORS
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("l1", "l1"), ("l2", "l2"))
    _slot_inits: ClassVar[tuple[str | float, ...]] = _ACCUMULATOR_INIT
    _domains: ClassVar[dict[str, Domain]] = {**_ACCUMULATOR_DOMAIN, "l1": REGULARIZATION, "l2": REGULARIZATION}
    # TF1 ProximalAdagradParameters: "initial_accumulator must be positive".
    _tf2_domains: ClassVar[dict[str, Domain]] = {"initial_accumulator_value": TF2_POSITIVE}


@dataclass(frozen=True)
class OnlineYogi(OptimizerSpec):
    """Online Yogi with l1/l2 (no public TF formula). ``vs`` start at
    ``initial_accumulator_value`` (1e-6, as v1 ProximalYogi), ``linears`` at 0."""

    learning_rate: LearningRateLike = 0.001
    l1: float = 0.0
    l2: float = 0.0
    beta2: float = 0.999
    initial_accumulator_value: float = 1e-06
    algorithm: ClassVar[str] = "online_yogi"
    slot_names: ClassVar[tuple[str, ...]] = ("vs", "linears")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("l1", "l1"), ("l2", "l2"), ("beta2", "beta2"))
    _slot_inits: ClassVar[tuple[str | float, ...]] = (*_ACCUMULATOR_INIT, 0.0)
    _domains: ClassVar[dict[str, Domain]] = {
        **_ACCUMULATOR_DOMAIN, "l1": REGULARIZATION, "l2": REGULARIZATION, "beta2": BETA}


@dataclass(frozen=True)
class ProximalYogi(OptimizerSpec):
    """Proximal Yogi. v1 TPU defaults: lr 0.01, beta1 0.9, beta2 0.999, epsilon 1e-3,
    ``v`` starts at 1e-6 and ``m`` at 0."""

    learning_rate: LearningRateLike = 0.01
    l1: float = 0.0
    l2: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-03
    initial_accumulator_value: float = 1e-06
    algorithm: ClassVar[str] = "proximal_yogi"
    slot_names: ClassVar[tuple[str, ...]] = ("v", "m")
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("l1", "l1"), ("l2", "l2"), ("beta1", "beta1"), ("beta2", "beta2"), ("epsilon", "epsilon"))
    _slot_inits: ClassVar[tuple[str | float, ...]] = (*_ACCUMULATOR_INIT, 0.0)
    # TF1 ProximalYogiParameters: 0 <= beta < 1, epsilon > 0, l1/l2 >= 0, accumulator >= 0.
    _domains: ClassVar[dict[str, Domain]] = {
        **_ACCUMULATOR_DOMAIN, "l1": REGULARIZATION, "l2": REGULARIZATION, "beta1": BETA, "beta2": BETA,
        "epsilon": EPSILON}
    _tf2_domains: ClassVar[dict[str, Domain]] = {"epsilon": TF2_POSITIVE}


@dataclass(frozen=True)
class FrequencyEstimator(OptimizerSpec):
    """Per-id inter-arrival estimator: the table (width 1) holds D, ``last_hit_step`` the last
    step seen. The "learning rate" must be a dynamic input equal to the global step. Proto
    zero defaults; ``last_hit_step`` starts at 0 (D itself starts at ``max_delta``)."""

    learning_rate: LearningRateLike = None
    tau: float = 0.0
    max_delta: float = 0.0
    outlier_threshold: float = 0.0
    weight_exponent: float = 0.0
    algorithm: ClassVar[str] = "frequency_estimator"
    slot_names: ClassVar[tuple[str, ...]] = ("last_hit_step",)
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (
        ("tau", "tau"), ("max_delta", "max_delta"), ("outlier_threshold", "outlier_threshold"),
        ("weight_exponent", "weight_exponent"))
    # D' = D*(1-tau) + min(delta, max_delta)*tau; TF1 FrequencyEstimatorParameters documents
    # tau "between (0, 1)" (closed here: the proto's zero default must load).
    _domains: ClassVar[dict[str, Domain]] = {
        "tau": UNIT.citing("an interpolation weight; TF1 documents tau in (0, 1)"),
        "max_delta": NON_NEGATIVE.citing("a cap on a step difference"),
        "outlier_threshold": NON_NEGATIVE.citing("a multiple of the estimate D")}


@dataclass(frozen=True)
class UserDefinedProgram(OptimizerSpec):
    """An HLO update program (serialized ``xla.HloModuleProto`` bytes, kept verbatim).

    The slot count is a property of the HLO (k = num_outputs - 1); meshembed does not parse
    HLO, so give ``num_slots`` to name the slots ``Slot_0 .. Slot_{k-1}`` (0 after from_proto).
    """

    learning_rate: LearningRateLike = 0.001
    program: bytes = b""
    num_slots: int = 0
    algorithm: ClassVar[str] = "user_defined_program"

    def __post_init__(self) -> None:
        where = "UserDefinedProgram optimizer"
        if not isinstance(self.program, (bytes, bytearray)):
            raise invalid("program", where, "bytes (a serialized xla.HloModuleProto)", self.program)
        self._set("program", bytes(self.program))
        as_int("num_slots", self.num_slots, where, minimum=0)
        super().__post_init__()

    def hyperparameters(self) -> dict[str, Any]:
        """``{"program": <serialized HLO bytes>}`` — the message's one field."""
        return {"program": self.program}

    @property  # type: ignore[override]
    def slot_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"Slot_{i}" for i in range(self.num_slots))


@dataclass(frozen=True)
class Assign(OptimizerSpec):
    """``p' = g`` (the accumulated gradient). Needs gradient accumulation. No slots."""

    learning_rate: LearningRateLike = None
    algorithm: ClassVar[str] = "assign"
    requires_gradient_accumulation: ClassVar[bool] = True

    def _check_arguments(self, where: str) -> None:
        """Assign ignores the learning rate, so a missing one is fine."""


#: What a TableConfig or EmbeddingConfig takes as ``optimizer``: a proto spec, or a
#: CustomOptimizer (same interface, Python-level only: no proto form, no Load/Retrieve op).
OPTIMIZER_TYPES: tuple[type, ...] = (OptimizerSpec, CustomOptimizer)


def is_custom(opt: Any) -> bool:
    """True for a CustomOptimizer: an optimizer with no TPUEmbeddingConfiguration form."""
    return isinstance(opt, CustomOptimizer)


#: proto oneof field name -> spec class, in proto field-number order.
OPTIMIZER_CLASSES: dict[str, type[OptimizerSpec]] = {
    cls.algorithm: cls for cls in (
        Adagrad, SGD, FTRL, Adam, Momentum, RMSProp, CenteredRMSProp, MDLAdagradLight, Adadelta,
        ProximalAdagrad, BoundedAdagrad, OnlineYogi, ProximalYogi, FrequencyEstimator,
        UserDefinedProgram, Assign, AdagradMomentum, Lion, FrequencyAwareAdagrad)
}


def _check_registry() -> None:
    if len(OPTIMIZER_CLASSES) != 19:  # pragma: no cover - guards edits
        raise ConfigError("optimizer registry out of sync with the proto oneof")


_check_registry()
