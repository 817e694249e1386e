"""TF2's ``tf.tpu.experimental.embedding`` config classes over meshembed's specs.

The optimizer classes *are* meshembed's spec classes (subclasses with TF's positional
argument order, names and defaults), so the engine runs them unchanged. ``TableConfig`` and
``FeatureConfig`` are plain, mutable, identity-hashed objects like TF's (a TableConfig keys
``embedding_tables``); ``TPUEmbedding`` converts them to the engine's frozen configs.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import numpy as np

from meshembed import config as _cfg
from meshembed.config.common import invalid
from meshembed.config.optimizers import OptimizerSpec, required_arguments
from meshembed.embedding.initializers import Constant, RowIdInitializer, TruncatedNormal
from meshembed.errors import ConfigError
from meshembed.math.custom import CustomOptimizer

__all__ = ["FeatureConfig", "QuantizationConfig", "RowIdInitializer", "StepSchedule", "TableConfig", "OPTIMIZERS"]

QuantizationConfig = _cfg.QuantizationConfig  # (num_buckets, lower, upper[, enabled]) as TF2's

_SHARED = ("use_gradient_accumulation", "clip_weight_min", "clip_weight_max", "weight_decay_factor",
           "multiply_weight_decay_factor_by_learning_rate")


class StepSchedule:
    """A learning rate that takes the step, such as a Keras ``LearningRateSchedule``.

    TF2's TPU embedding calls a learning rate with no arguments; a schedule passed to a
    ``me.tpu`` optimizer is wrapped in this and called by its ``me.tpu.TPUEmbedding`` with the
    number of steps applied so far (Keras' ``iterations``), so it also resumes after ``restore``.
    """

    def __init__(self, schedule: Callable[[Any], Any]) -> None:
        self.schedule = schedule

    def at(self, step: Callable[[], int]) -> Callable[[], float]:
        """A zero-argument learning rate reading ``step()`` each time it is called."""
        return lambda: float(self.schedule(step()))

    def __call__(self) -> float:
        raise ConfigError(
            f"Invalid `learning_rate`. Expected a callable taking no arguments outside me.tpu.TPUEmbedding. "
            f"Received: learning_rate={self.schedule!r} (a schedule, which needs the step). Fix: use this "
            "optimizer in a me.tpu.TPUEmbedding, or pass learning_rate=lambda: schedule(step).")

    def __repr__(self) -> str:
        return f"StepSchedule({self.schedule!r})"


def _tf_optimizer(base: type, own: tuple[str, ...] | None = None, *, slot_fn: bool = True,
                  tail: tuple[str, ...] = ()) -> type:
    """A subclass of spec ``base`` whose constructor takes TF2's positional order:
    ``learning_rate, <own>, <shared options>, [slot_variable_creation_fn], clipvalue, <tail>,
    low_dimensional_packing_status``; the spec's other fields stay keyword-only."""
    init_fields = [f for f in dataclasses.fields(base) if f.init]
    base_names = {f.name for f in dataclasses.fields(OptimizerSpec) if f.init}
    if own is None:
        own = tuple(f.name for f in init_fields if f.name not in base_names)
    order = ("learning_rate", *own, *_SHARED, *(("slot_variable_creation_fn",) if slot_fn else ()),
             "clipvalue", *tail, "low_dimensional_packing_status")
    extra = tuple(f.name for f in init_fields if f.name not in order)
    defaults = {f.name: f.default for f in init_fields}
    defaults.update(slot_variable_creation_fn=None, low_dimensional_packing_status=False)
    name = base.__name__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(order):
            raise _cfg_error("arguments", name, f"at most {len(order)} positional arguments {list(order)}",
                             len(args))
        for key, value in zip(order, args):
            if key in kwargs:
                raise _cfg_error(key, name, "one value (given positionally and by keyword)", value)
            kwargs[key] = value
        unknown = sorted(set(kwargs) - set(order) - set(extra))
        if unknown:
            raise _cfg_error(unknown[0], name, f"one of the arguments {list(order) + list(extra)}",
                             kwargs[unknown[0]])
        lr = kwargs.get("learning_rate")
        if callable(lr) and not isinstance(lr, StepSchedule) and required_arguments(lr) == 1:
            kwargs["learning_rate"] = StepSchedule(lr)  # called with the step by TPUEmbedding
        fn = kwargs.pop("slot_variable_creation_fn", None)
        if fn is not None:
            raise _cfg_error("slot_variable_creation_fn", name,
                             "None (meshembed creates the slots co-sharded with the table from the "
                             "optimizer's initial values, e.g. initial_accumulator_value)", fn)
        base.__init__(self, **kwargs)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults[n]) for n in order]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults[n]) for n in extra]
    cls = type(name, (base,), {
        "__init__": __init__, "__module__": "meshembed.tpu", "__qualname__": name,
        "__doc__": f"``tf.tpu.experimental.embedding``-style {name}: {base.__doc__}",
        "__signature__": inspect.Signature(params)})
    return cls


def _cfg_error(arg: str, where: str, expected: str, value: Any) -> Exception:
    return invalid(arg, f"{where} optimizer", expected, value)


OPTIMIZERS: dict[str, type] = {
    "SGD": _tf_optimizer(_cfg.SGD, slot_fn=False),
    "Adagrad": _tf_optimizer(_cfg.Adagrad),
    "AdagradMomentum": _tf_optimizer(_cfg.AdagradMomentum),
    "FTRL": _tf_optimizer(_cfg.FTRL, ("learning_rate_power", "l1_regularization_strength",
                                      "l2_regularization_strength", "beta", "initial_accumulator_value"),
                          tail=("multiply_linear_by_learning_rate", "allow_zero_accumulator")),
    "Adam": _tf_optimizer(_cfg.Adam),
}
for _name in ("Adadelta", "BoundedAdagrad", "CenteredRMSProp", "FrequencyAwareAdagrad", "FrequencyEstimator",
              "Lion", "MDLAdagradLight", "Momentum", "OnlineYogi", "ProximalAdagrad", "ProximalYogi",
              "RMSProp", "Assign"):
    OPTIMIZERS[_name] = _tf_optimizer(getattr(_cfg, _name))

_OWN_INITIALIZERS = (TruncatedNormal, Constant, RowIdInitializer)


def _positive_int(arg: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(arg, where, "an int >= 1", value)
    return value


class TableConfig:
    """One embedding table, TF2's signature. Several FeatureConfigs may share one object
    (a shared table). ``initializer`` takes the shape (TF's contract) or is one of
    meshembed's initialisers; None is TF2's TruncatedNormal(0, 1/sqrt(dim)), seeded by the
    TPUEmbedding's ``seed``. ``layout`` (SparseCore) is not supported and must be None."""

    def __init__(self, vocabulary_size: int, dim: int, initializer: Callable[..., Any] | None = None,
                 optimizer: OptimizerSpec | CustomOptimizer | None = None, combiner: str = "mean",
                 name: str | None = None, quantization_config: QuantizationConfig | None = None,
                 layout: Any = None, dtype: Any = "float32", *, precision: Any = None, dynamic: Any = None) -> None:
        where = "TableConfig" + (f" '{name}'" if name else "")
        _positive_int("vocabulary_size", vocabulary_size, where)
        _positive_int("dim", dim, where)
        if initializer is not None and not callable(initializer):
            raise invalid("initializer", where, "a callable (shape) -> values, or None", initializer)
        if optimizer is not None and not isinstance(optimizer, (OptimizerSpec, CustomOptimizer)):
            raise invalid("optimizer", where, "an instance of a meshembed.tpu optimizer class (SGD, Adagrad, "
                          "Adam, FTRL, ...) or None", optimizer)
        if not isinstance(combiner, str) or combiner not in ("mean", "sum", "sqrtn"):
            raise invalid("combiner", where, "one of ('mean', 'sum', 'sqrtn') (custom combiners are not "
                          "supported)", combiner)
        if name is not None and (not isinstance(name, str) or not name):
            raise invalid("name", where, "a non-empty string or None", name)
        if quantization_config is not None and not isinstance(quantization_config, QuantizationConfig):
            raise invalid("quantization_config", where, "a meshembed.tpu.QuantizationConfig or None",
                          quantization_config)
        if layout is not None:
            raise invalid("layout", where, "None (SparseCore table layouts are not supported)", layout)
        dtype_name = getattr(dtype, "name", dtype)
        if dtype_name != "float32":  # the engine's tables are float32; an int32 one trained as float32
            raise invalid("dtype", where, "float32 (tf.float32, np.float32 or 'float32'; meshembed keeps every "
                          "table in float32, integer tables are not supported). Fix: omit `dtype`", dtype)
        self.vocabulary_size = vocabulary_size
        self.dim = dim
        self.initializer = initializer
        self.optimizer = optimizer
        self.combiner = combiner
        self.name = name
        self.quantization_config = quantization_config
        self.layout = layout
        self.dtype = dtype_name
        #: meshembed's extension: 16-bit storage of the table and its slots (me.embedding.Precision)
        self.precision = precision
        self.dynamic = dynamic  # a me.embedding.DynamicVocabulary (ids are then raw int64 keys)

    def _engine(self, name: str, optimizer: Any) -> _cfg.TableConfig:
        """The engine's frozen TableConfig under ``name`` with ``optimizer`` (this object is not changed)."""
        init = self.initializer
        if init is not None and not isinstance(init, _OWN_INITIALIZERS):
            user = init
            init = lambda shape: user(shape)  # noqa: E731 - TF's contract: one argument, the shape
        return _cfg.TableConfig(name, self.vocabulary_size, self.dim, optimizer=optimizer,
                                combiner=self.combiner, initializer=init,
                                quantization=self.quantization_config, dtype=self.dtype, precision=self.precision,
                                dynamic=self.dynamic)

    def __repr__(self) -> str:
        return (f"TableConfig(vocabulary_size={self.vocabulary_size!r}, dim={self.dim!r}, "
                f"initializer={self.initializer!r}, optimizer={self.optimizer!r}, combiner={self.combiner!r}, "
                f"name={self.name!r}, quantization_config={self.quantization_config!r})")


class FeatureConfig:
    """One feature, TF2's signature. ``max_sequence_length`` M > 0 makes a sparse/ragged
    input a sequence (output ``[B, M, dim]``, longer rows cut); ``output_shape`` fixes the
    activation shape without ``dim`` (else it comes from ``build`` or the first enqueue).
    ``name`` is informational: the feature is known by its path in the nest."""

    def __init__(self, table: TableConfig, max_sequence_length: int = 0, validate_weights_and_indices: bool = True,
                 output_shape: Any = None, name: str | None = None) -> None:
        where = "FeatureConfig" + (f" '{name}'" if name else "")
        if not isinstance(table, TableConfig):
            raise invalid("table", where, "a meshembed.tpu.TableConfig", table)
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) \
                or max_sequence_length < 0:
            raise invalid("max_sequence_length", where, "an int >= 0", max_sequence_length)
        if not isinstance(validate_weights_and_indices, bool):
            raise invalid("validate_weights_and_indices", where, "a bool", validate_weights_and_indices)
        if name is not None and not isinstance(name, str):
            raise invalid("name", where, "a string or None", name)
        self.table = table
        self.max_sequence_length = max_sequence_length
        self.validate_weights_and_indices = validate_weights_and_indices
        self.output_shape = _shape(output_shape, "output_shape", where)
        self.name = name

    def __repr__(self) -> str:
        return (f"FeatureConfig(table={self.table!r}, max_sequence_length={self.max_sequence_length!r}, "
                f"validate_weights_and_indices={self.validate_weights_and_indices!r}, "
                f"output_shape={self.output_shape!r}, name={self.name!r})")


def _shape(value: Any, arg: str, where: str) -> tuple[int, ...] | None:
    """None (unknown) or a tuple of ints >= 1; accepts lists and TensorShape-likes."""
    if value is None:
        return None
    if hasattr(value, "as_list"):
        if getattr(value, "rank", 0) is None:
            return None
        value = value.as_list()
    try:
        dims = tuple(value)
    except TypeError:
        raise invalid(arg, where, "a list of ints >= 1 or None", value) from None
    if not dims:
        return None
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise invalid(arg, where, "a fully defined list of ints >= 1 (or None)", value)
    return tuple(int(d) for d in dims)

