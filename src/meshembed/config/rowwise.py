"""Row-wise optimizer specs: fbgemm's TBE optimizers as documented meshembed extensions.

``RowWiseAdagrad`` (fbgemm ``EXACT_ROWWISE_ADAGRAD``) and ``RowWiseAdam`` (fbgemm
``PARTIAL_ROWWISE_ADAM``, no bias correction) keep one second-moment value per row (a
``(vocabulary_size, 1)`` slot, ``row_slots``). TPUEmbeddingConfiguration has no field for
them, so ``proto_form`` is False: a config holding one stays meshembed-side (``to_proto``
refuses it, naming the table; checkpoints carry the spec in their manifest). The math is
``meshembed.math.rowwise``; docs/optimizers.md "Row-wise extensions".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from meshembed.config.common import Domain, invalid
from meshembed.errors import ConfigError
from meshembed.config.optimizers import (
    BETA,
    EPSILON,
    SQUARES_INIT,
    LearningRateLike,
    OptimizerSpec,
)

__all__ = ["ROW_WISE_CLASSES", "RowWiseAdagrad", "RowWiseAdam", "has_proto_form", "row_wise_from_json",
           "row_wise_to_json", "slot_width"]


@dataclass(frozen=True)
class RowWiseAdagrad(OptimizerSpec):
    """fbgemm's exact row-wise Adagrad: ``acc += mean(g²)`` per row, ``p −= g·lr/(sqrt(acc) + ε)``.
    fbgemm's defaults (lr 0.01, ε 1e-8, accumulators from 0); needs gradient accumulation."""

    learning_rate: LearningRateLike = 0.01
    initial_accumulator_value: float = 0.0
    epsilon: float = 1e-8
    algorithm: ClassVar[str] = "row_wise_adagrad"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulators",)
    row_slots: ClassVar[tuple[str, ...]] = ("accumulators",)
    proto_form: ClassVar[bool] = False
    requires_gradient_accumulation: ClassVar[bool] = True
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("epsilon", "epsilon"),)
    _slot_inits: ClassVar[tuple[str | float, ...]] = ("initial_accumulator_value",)
    _domains: ClassVar[dict[str, Domain]] = {"initial_accumulator_value": SQUARES_INIT, "epsilon": EPSILON}

    def _check_options(self, where: str) -> None:
        super()._check_options(where)
        if self.epsilon == 0 and self.initial_accumulator_value == 0:
            raise invalid("epsilon", where, "> 0 when initial_accumulator_value is 0 (a looked-up row whose "
                          "gradients sum to zero would divide 0 by 0). Fix: keep the default 1e-8 or start the "
                          "accumulators above 0", self.epsilon)


@dataclass(frozen=True)
class RowWiseAdam(OptimizerSpec):
    """fbgemm's partial row-wise Adam: ``m`` per element, ``v += (1−β2)·(mean(g²) − v)`` per row,
    ``p −= lr·m/(sqrt(v) + ε)``; no bias correction (as TPU Adam: pass it through a dynamic
    lr). fbgemm's defaults (ε 1e-8); lazy; needs gradient accumulation."""

    learning_rate: LearningRateLike = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-8
    algorithm: ClassVar[str] = "row_wise_adam"
    slot_names: ClassVar[tuple[str, ...]] = ("momenta", "velocities")
    row_slots: ClassVar[tuple[str, ...]] = ("velocities",)
    proto_form: ClassVar[bool] = False
    requires_gradient_accumulation: ClassVar[bool] = True
    _fields: ClassVar[tuple[tuple[str, str], ...]] = (("beta1", "beta_1"), ("beta2", "beta_2"), ("epsilon", "epsilon"))
    _domains: ClassVar[dict[str, Domain]] = {"beta_1": BETA, "beta_2": BETA, "epsilon": EPSILON}

    def _check_options(self, where: str) -> None:
        super()._check_options(where)
        if self.epsilon == 0:
            raise invalid("epsilon", where, "> 0 (velocities start at 0: a row's first zero gradient would "
                          "divide 0 by 0). Fix: keep the default 1e-8", self.epsilon)


#: meshembed algorithm name -> row-wise spec class (not proto fields: see the module doc).
ROW_WISE_CLASSES: dict[str, type[OptimizerSpec]] = {c.algorithm: c for c in (RowWiseAdagrad, RowWiseAdam)}


def has_proto_form(opt: Any) -> bool:
    """False for an optimizer TPUEmbeddingConfiguration cannot carry (row-wise, custom)."""
    return isinstance(opt, OptimizerSpec) and getattr(opt, "proto_form", True)


def slot_width(opt: Any, slot: str, dimension: int) -> int:
    """Columns of ``slot``: 1 for a row-wise slot, else the table's ``dimension``."""
    return 1 if slot in getattr(opt, "row_slots", ()) else int(dimension)


_SHARED = ("use_gradient_accumulation", "clip_weight_min", "clip_weight_max", "clipvalue", "weight_decay_factor",
           "multiply_weight_decay_factor_by_learning_rate")


def row_wise_to_json(opt: OptimizerSpec) -> dict[str, Any]:
    """The spec as JSON (a checkpoint's manifest): its class and its fields, except the learning
    rate, which travels in config.pb (a constant or a dynamic tag, callables as for any table)."""
    if opt.simulated_quantization is not None or opt.hot_id_replication is not None or opt.unknown_fields:
        raise ConfigError(f"{type(opt).__name__}: simulated_quantization, hot_id_replication and unknown_fields "
                          "have no checkpoint form for a row-wise optimizer. Fix: leave them unset")
    names = set(_SHARED) | {a for _, a in opt._fields} | {a for a in opt._slot_inits if isinstance(a, str)}
    fields = {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt) if f.name in names}
    if isinstance(fields.get("clipvalue"), tuple):
        fields["clipvalue"] = list(fields["clipvalue"])
    return {"class": type(opt).__name__, "fields": fields}


def row_wise_from_json(entry: Any, learning_rate: Any) -> OptimizerSpec:
    """Inverse of :func:`row_wise_to_json` with ``learning_rate`` (ValueError, TypeError or
    ConfigError when ``entry`` is not one)."""
    classes = {c.__name__: c for c in ROW_WISE_CLASSES.values()}
    if not isinstance(entry, dict) or set(entry) != {"class", "fields"} or entry["class"] not in classes:
        raise ValueError(f"expected {{'class': one of {sorted(classes)}, 'fields': {{...}}}}, got {entry!r}")
    cls, fields = classes[entry["class"]], entry["fields"]
    allowed = set(_SHARED) | {a for _, a in cls._fields} | {a for a in cls._slot_inits if isinstance(a, str)}
    if not isinstance(fields, dict) or not set(fields) <= allowed:
        raise ValueError(f"expected fields among {sorted(allowed)}, got {fields!r}")
    fields = dict(fields)
    if isinstance(fields.get("clipvalue"), list):
        fields["clipvalue"] = tuple(fields["clipvalue"])
    return cls(learning_rate, **fields)
