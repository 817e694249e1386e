"""``Precision``: the storage dtypes of one table's parameters and slots, and how updates round.

An extension of TPUEmbeddingConfiguration (whose tables are float32 only): it is not written
into the proto — ``EmbeddingConfig.to_proto()`` stays what TensorFlow parses — but travels
beside it, in ``TableConfig(precision=...)`` and in a checkpoint's manifest. See
docs/low_precision.md.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshembed.errors import ConfigError
from meshembed.math.rounding import ROUNDINGS, STORAGE_DTYPES

__all__ = ["Precision", "dtype_name"]


def invalid(arg: str, where: str, expected: str, value: Any) -> ConfigError:
    place = f" for {where}" if where else ""
    return ConfigError(f"Invalid `{arg}`{place}. Expected {expected}. Received: {arg}={value!r}")


def one_of(names: Any) -> str:
    return "{" + ", ".join(repr(n) for n in names) + "}"


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def dtype_name(value: Any, arg: str = "dtype", where: str = "Precision") -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` from a string, a NumPy / ml_dtypes dtype,
    or a torch / JAX dtype object; anything else is a ConfigError."""
    name = None
    if isinstance(value, str):
        name = value.strip().lower()
    else:
        try:
            import numpy as np

            name = np.dtype(value).name
        except TypeError:
            text = str(value)  # torch.bfloat16, jnp.float16, ...
            name = text.rsplit(".", 1)[-1].strip("'>")
    name = _ALIASES.get(name, name)
    if name not in STORAGE_DTYPES:
        raise invalid(arg, where, f"one of {one_of(STORAGE_DTYPES)}", value)
    return name


@dataclass(frozen=True)
class Precision:
    """Storage dtypes of a table (``parameters``) and of its optimizer slots, and the rounding
    of every update that writes a 16-bit array.

    Args:
        parameters: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        slots: one dtype for every slot, or ``{slot_name: dtype}`` (slots not named stay
            float32), e.g. ``{"accumulators": "float32"}``.
        rounding: ``"stochastic"`` (default): an update rounds up with probability equal to
            its distance from the value below, with random bits from Philox-4x32-10 keyed by
            ``(seed, table, array)`` and counted by ``(column, row id, step)``, so the bits do
            not depend on backend, shard count, thread or batch order; ``"nearest"``: to
            nearest, ties to even. Initial values and ``load_parameters`` always round to
            nearest.
        seed: the generator's seed, an integer in ``[0, 2**32)``.

    Lookups read the 16-bit rows and return float32 activations; an update widens the rows
    (exactly), runs the optimizer in float32 and rounds the result back.
    """

    parameters: str = "float32"
    slots: Any = "float32"
    rounding: str = "stochastic"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", dtype_name(self.parameters, "parameters"))
        slots = self.slots
        if isinstance(slots, Mapping) or (isinstance(slots, tuple) and all(
                isinstance(p, tuple) and len(p) == 2 for p in slots)):
            pairs = slots.items() if isinstance(slots, Mapping) else slots
            checked = []
            for name, dt in pairs:
                if not isinstance(name, str) or not name:
                    raise invalid("slots", "Precision", "a dtype or a {slot_name: dtype} mapping with string keys",
                                  self.slots)
                checked.append((name, dtype_name(dt, f"slots[{name!r}]")))
            slots = tuple(sorted(checked))
        else:
            slots = dtype_name(slots, "slots")
        object.__setattr__(self, "slots", slots)
        if not isinstance(self.rounding, str) or self.rounding.lower() not in ROUNDINGS:
            raise invalid("rounding", "Precision", f"one of {one_of(ROUNDINGS)}", self.rounding)
        object.__setattr__(self, "rounding", self.rounding.lower())
        try:
            if isinstance(self.seed, bool):
                raise TypeError
            seed = operator.index(self.seed)
        except TypeError:
            raise invalid("seed", "Precision", "an integer in [0, 2**32)", self.seed) from None
        if not 0 <= seed < 2**32:
            raise invalid("seed", "Precision", "an integer in [0, 2**32)", self.seed)
        object.__setattr__(self, "seed", int(seed))

    def slot_dtype(self, name: str) -> str:
        """The storage dtype of slot ``name``."""
        if isinstance(self.slots, str):
            return self.slots
        return dict(self.slots).get(name, "float32")

    def dtypes(self, slot_names: tuple[str, ...]) -> tuple[str, ...]:
        """``(parameters, *slots)`` storage dtypes for a table with these slots."""
        return (self.parameters, *(self.slot_dtype(n) for n in slot_names))

    @property
    def named_slots(self) -> tuple[str, ...]:
        """The slot names ``slots`` names (empty for one dtype for all)."""
        return () if isinstance(self.slots, str) else tuple(n for n, _ in self.slots)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the checkpoint manifest's form)."""
        slots = self.slots if isinstance(self.slots, str) else {n: d for n, d in self.slots}
        return {"parameters": self.parameters, "slots": slots, "rounding": self.rounding, "seed": self.seed}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Precision":
        if not isinstance(data, Mapping) or set(data) != {"parameters", "slots", "rounding", "seed"}:
            raise invalid("precision", "", "a mapping with keys parameters, slots, rounding, seed", data)
        return cls(parameters=data["parameters"], slots=data["slots"], rounding=data["rounding"], seed=data["seed"])


def array_dtypes(t: Any) -> tuple[str, ...]:
    """``(parameters, *slots)`` storage dtypes of a table spec ``t`` (its ``optimizer``'s
    ``slot_names`` and its ``precision``; all float32 without a precision)."""
    names = tuple(getattr(t.optimizer, "slot_names", ()) or ())
    p = t.precision
    if p is None:
        return ("float32",) * (1 + len(names))
    unknown = sorted(set(p.named_slots) - set(names))
    if unknown:
        raise ConfigError(
            f"Invalid `precision` for table {t.name!r}: slots {unknown} are not slots of "
            f"{type(t.optimizer).__name__}. Expected some of {list(names)}. Received: precision={p!r}")
    return p.dtypes(names)
