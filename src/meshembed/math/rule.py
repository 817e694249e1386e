"""Update rules as data: what the core hands a backend instead of a closure.

An :class:`UpdateRule` is built once per table. It holds everything that changes the
compiled code (algorithm, slots, the static hyper-parameters, which clipping / weight-decay
terms exist, laziness, dtype) and is frozen and hashable, so a backend caches its compiled or
fused kernels on the rule alone. What may change between steps — every learning rate and any
hyper-parameter fed from Send's ``learning_rates`` — is *not* in the rule: it is a tuple of
floats (``values``, in the order of ``rule.dynamic``) passed at every call, so a compiler that
takes them as inputs never recompiles when a learning rate changes.

:func:`apply_rule` is the one definition of what a rule computes (it calls
:func:`meshembed.math.apply_update`); a backend's fused kernel is an optimisation of it that
conformance compares with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from meshembed.math.registry import OptimizerMath, apply_update

__all__ = ["UpdateRule", "apply_rule", "build_rule"]

@dataclass(frozen=True)
class UpdateRule:
    """One table's optimizer update, as data (see the module docstring).

    ``math``: the algorithm's :class:`OptimizerMath` (``algorithm`` is its name, ``"custom"``
    for a CustomOptimizer); ``slot_names``: the slots after the parameters, in Load/Retrieve
    order; ``static``: ``(name, value)`` hyper-parameters fixed for the table, sorted;
    ``dynamic``: names of the values passed per call, ``"lr"`` first; ``gradient_clip`` /
    ``weight_clip``: ``(lower, upper)`` or None; ``weight_decay`` (0: none) and whether it is
    multiplied by lr; ``lazy``: only looked-up rows change; ``dtype``: the table's dtype name.
    """

    math: OptimizerMath
    slot_names: tuple[str, ...]
    static: tuple[tuple[str, Any], ...] = ()
    dynamic: tuple[str, ...] = ("lr",)
    gradient_clip: tuple[float, float] | None = None
    weight_clip: tuple[float, float] | None = None
    weight_decay: float = 0.0
    multiply_weight_decay_by_lr: bool = False
    lazy: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.dynamic or self.dynamic[0] != "lr":
            raise ValueError(f"Invalid `dynamic`. Expected names starting with 'lr'. Received: dynamic={self.dynamic!r}")

    @property
    def algorithm(self) -> str:
        return self.math.algorithm

    @property
    def elementwise(self) -> bool:
        """Each output element depends only on the same element of each input: true of every
        built-in TPU algorithm (pure element-wise Array-API code), not of a row-wise extension
        (a mean over the row), a CustomOptimizer or an HLO program, which may do anything."""
        return self.algorithm not in ("custom", "user_defined_program") and not self.math.row_slots

    @property
    def plain(self) -> bool:
        """No gradient clipping, weight clipping or weight decay around the formula."""
        return self.weight_decay == 0 and self.gradient_clip is None and self.weight_clip is None

    def hyperparameters(self, values: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
        """``(lr, every other hyper-parameter by name)`` for the call-time ``values``."""
        if len(values) != len(self.dynamic):
            raise ValueError(
                f"Invalid `values`. Expected {len(self.dynamic)} values for {self.dynamic}. "
                f"Received: {len(values)}"
            )
        hp = dict(self.static)
        hp.update((name, values[i]) for i, name in enumerate(self.dynamic) if i)
        return values[0], hp


def build_rule(
    algorithm: Any,
    hyperparameters: Mapping[str, Any],
    dynamic: Iterable[str] = (),
    **options: Any,
) -> UpdateRule:
    """The one way an optimizer spec becomes an :class:`UpdateRule` (the embedding tables'
    specs in ``embedding/updates.py`` and the dense optimizer both call it): ``algorithm`` a
    ``meshembed.math`` name (or a CustomOptimizer), ``hyperparameters`` every value besides the
    learning rate, ``dynamic`` the names among them passed per call (after ``"lr"``); the rest
    are static. ``options``: the clipping / weight-decay / laziness / dtype fields, and
    ``slot_names`` (default: the algorithm's)."""
    from meshembed.math.registry import get_math

    math_ = get_math(algorithm)
    dynamic = sorted(set(dynamic))
    options.setdefault("slot_names", math_.slot_names)
    static = tuple(sorted((k, v) for k, v in hyperparameters.items() if k not in dynamic))
    return UpdateRule(math=math_, static=static, dynamic=("lr", *dynamic), **options)


def apply_rule(xp: Any, rule: UpdateRule, hyper_values: Sequence[Any], grads: Any, params: Any,
               *slots: Any) -> tuple:
    """``(params', *slots')``: ``rule`` applied to summed row gradients. ``hyper_values`` are
    Python floats or 0-d arrays (a compiler's inputs), in the order of ``rule.dynamic``."""
    lr, hp = rule.hyperparameters(hyper_values)
    new_params, new_slots = apply_update(
        xp, rule.math, params, grads, tuple(slots), lr=lr, hyperparameters=hp,
        gradient_clip=rule.gradient_clip, weight_clip=rule.weight_clip,
        weight_decay=rule.weight_decay, multiply_weight_decay_by_lr=rule.multiply_weight_decay_by_lr,
    )
    return (new_params, *tuple(new_slots))
