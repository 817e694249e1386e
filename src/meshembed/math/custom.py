"""``CustomOptimizer``: a Python-level update rule that runs on every backend.

TF2 has ``tf.tpu.experimental.embedding.CustomOptimizer`` only for SparseCore (v3); here
it is a frozen spec with the same interface as the proto optimizer specs
(``algorithm``, ``slot_names``, ``slot_initial_values()``, ``hyperparameters()`` and the
shared options), whose ``update_fn`` follows the math signature
``update_fn(xp, params, grads, slots, *, lr, **hyperparameters) -> (params, slots)``.
It has no proto form, hence no Load/Retrieve op.
"""

from __future__ import annotations

import collections
import functools
import keyword
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

__all__ = ["CustomOptimizer", "slots_type_for"]

UpdateFn = Callable[..., tuple[Any, Any]]


@functools.lru_cache(maxsize=None)
def slots_type_for(slot_names: tuple[str, ...], typename: str = "CustomSlots") -> type:
    """A NamedTuple type with the given slot names (validated as identifiers)."""
    for name in slot_names:
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
            raise ValueError(
                "Invalid `slot_names`. Expected Python identifiers not starting with '_'. "
                f"Received: slot_names={slot_names!r}"
            )
    if len(set(slot_names)) != len(slot_names):
        raise ValueError(f"Invalid `slot_names`. Expected unique names. Received: {slot_names!r}")
    return collections.namedtuple(typename, slot_names)  # type: ignore[misc]


@dataclass(frozen=True, init=False)
class CustomOptimizer:
    """A user-defined per-row update, run through ``meshembed.math.apply_update``.

    ``slot_initializers`` gives one float per slot (the value every slot element starts
    at). ``hyperparameters`` are passed to ``update_fn`` as keywords. Clipping, weight
    decay and the other shared options mean what they mean for the proto optimizers.
    """

    algorithm: ClassVar[str] = "custom"

    update_fn: UpdateFn
    slot_names: tuple[str, ...]
    slot_initializers: tuple[float, ...]
    learning_rate: Any
    use_gradient_accumulation: bool
    clip_weight_min: float | None
    clip_weight_max: float | None
    clipvalue: float | tuple[float | None, float | None] | None
    weight_decay_factor: float
    multiply_weight_decay_factor_by_learning_rate: bool
    simulated_quantization: Any
    name: str
    _hyperparameters: Mapping[str, Any] = field(repr=False)

    def __init__(
        self, update_fn: UpdateFn, slot_names: tuple[str, ...] = (),
        slot_initializers: tuple[float, ...] = (), *, learning_rate: Any = 0.01,
        hyperparameters: Mapping[str, Any] | None = None, use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None, clip_weight_max: float | None = None,
        clipvalue: float | tuple[float | None, float | None] | None = None,
        weight_decay_factor: float = 0.0,
        multiply_weight_decay_factor_by_learning_rate: bool = False,
        simulated_quantization: Any = None, name: str = "custom",
    ) -> None:
        if not callable(update_fn):
            raise TypeError(
                f"Invalid `update_fn`. Expected a callable. Received: update_fn={update_fn!r}"
            )
        slot_names = tuple(slot_names)
        slot_initializers = tuple(float(v) for v in slot_initializers)
        slots_type_for(slot_names)
        if len(slot_initializers) != len(slot_names):
            raise ValueError(
                "Invalid `slot_initializers`. Expected one value per slot name "
                f"{slot_names!r}. Received: slot_initializers={slot_initializers!r}"
            )
        if clipvalue is not None and not use_gradient_accumulation:
            raise ValueError(
                "Invalid `clipvalue`. Gradient clipping needs use_gradient_accumulation=True. "
                f"Received: clipvalue={clipvalue!r}, use_gradient_accumulation=False"
            )
        values = dict(
            update_fn=update_fn, slot_names=slot_names, slot_initializers=slot_initializers,
            learning_rate=learning_rate, use_gradient_accumulation=bool(use_gradient_accumulation),
            clip_weight_min=clip_weight_min, clip_weight_max=clip_weight_max, clipvalue=clipvalue,
            weight_decay_factor=float(weight_decay_factor or 0.0),
            multiply_weight_decay_factor_by_learning_rate=bool(
                multiply_weight_decay_factor_by_learning_rate),
            simulated_quantization=simulated_quantization, name=name,
            _hyperparameters=dict(hyperparameters or {}),
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def slots_type(self) -> type:
        """The NamedTuple type of this optimizer's slots."""
        return slots_type_for(self.slot_names)

    def __hash__(self) -> int:
        return hash((self.update_fn, self.slot_names, self.slot_initializers, self.name,
                     tuple(sorted(self._hyperparameters.items()))))

    def slot_initial_values(self) -> tuple[float, ...]:
        return self.slot_initializers

    def hyperparameters(self) -> dict[str, Any]:
        return dict(self._hyperparameters)

    def dynamic_inputs(self) -> tuple[Any, ...]:
        """Hyper-parameters given as ``DynamicLearningRate(tag)``: read from Send's
        ``learning_rates[tag]`` each step, like FrequencyAwareAdagrad's ``step_counter``."""
        return tuple(v for v in self._hyperparameters.values()
                     if hasattr(v, "tag") and not isinstance(v, (bool, int, float)))

    @property
    def gradient_accumulation_enabled(self) -> bool:
        return self.use_gradient_accumulation is not False

    @property
    def is_dynamic(self) -> bool:
        lr = self.learning_rate
        return hasattr(lr, "tag") or callable(lr)

    def replace(self, **changes: Any) -> "CustomOptimizer":
        """A copy with ``changes`` (constructor argument names; ``hyperparameters`` replaces
        the whole mapping). ``dataclasses.replace`` cannot rebuild this class."""
        kwargs: dict[str, Any] = dict(
            update_fn=self.update_fn, slot_names=self.slot_names,
            slot_initializers=self.slot_initializers, learning_rate=self.learning_rate,
            hyperparameters=self._hyperparameters,
            use_gradient_accumulation=self.use_gradient_accumulation,
            clip_weight_min=self.clip_weight_min, clip_weight_max=self.clip_weight_max,
            clipvalue=self.clipvalue, weight_decay_factor=self.weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate=(
                self.multiply_weight_decay_factor_by_learning_rate),
            simulated_quantization=self.simulated_quantization, name=self.name,
        )
        unknown = sorted(set(changes) - set(kwargs))
        if unknown:
            raise TypeError(f"CustomOptimizer.replace() got unknown argument(s) {unknown}")
        kwargs.update(changes)
        return type(self)(**kwargs)

    __replace__ = replace  # copy.replace (Python 3.13+)

    def gradient_clipping_limits(self) -> tuple[float, float] | None:
        """``(lower, upper)`` from ``clipvalue`` (``c`` means ``(−c, c)``), ±inf when open."""
        if self.clipvalue is None:
            return None
        if isinstance(self.clipvalue, tuple):
            lo, hi = self.clipvalue
        else:
            lo, hi = -float(self.clipvalue), float(self.clipvalue)
        return (-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi))

    def clipping_limits(self) -> tuple[float, float] | None:
        """Weight clamp ``(lower, upper)`` after the update, ±inf when open."""
        if self.clip_weight_min is None and self.clip_weight_max is None:
            return None
        lo = -math.inf if self.clip_weight_min is None else float(self.clip_weight_min)
        hi = math.inf if self.clip_weight_max is None else float(self.clip_weight_max)
        return (lo, hi)
