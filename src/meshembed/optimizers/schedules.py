"""Learning-rate schedules: callables of the step that serialise in Keras' config format.

A config written here (``{"module": "keras.optimizers.schedules", "class_name":
"ExponentialDecay", "config": {...}, "registered_name": None}``) is what tf_keras writes,
so an optimizer config with a schedule moves between Keras and meshembed. The step is the
optimizer's ``iterations`` before the update (0 on the first step), as in Keras.
"""

from __future__ import annotations

import math
from typing import Any

from meshembed.errors import ConfigError

__all__ = [
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "deserialize",
    "serialize",
]

_MODULE = "keras.optimizers.schedules"


class LearningRateSchedule:
    """Base class: ``schedule(step) -> float`` plus ``get_config``/``from_config``."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LearningRateSchedule":
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"Invalid `{name}`. Expected a positive number. Received: {name}={value!r}")


class ExponentialDecay(LearningRateSchedule):
    """``lr0 · rate^(step/decay_steps)`` (the exponent floored when ``staircase``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False, name: str | None = None) -> None:
        _positive("decay_steps", decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return float(self.initial_learning_rate) * float(self.decay_rate) ** p

    def get_config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase, "name": self.name}


class InverseTimeDecay(LearningRateSchedule):
    """``lr0 / (1 + rate · step/decay_steps)`` (the ratio floored when ``staircase``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False, name: str | None = None) -> None:
        _positive("decay_steps", decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return float(self.initial_learning_rate) / (1.0 + float(self.decay_rate) * p)

    def get_config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase, "name": self.name}


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` while ``step <= boundaries[0]``, ``values[i]`` while
    ``boundaries[i-1] < step <= boundaries[i]``, ``values[-1]`` after the last boundary."""

    def __init__(self, boundaries: list[int], values: list[float], name: str | None = None) -> None:
        if len(values) != len(boundaries) + 1:
            raise ConfigError(
                "Invalid `values`. Expected one more value than boundaries. "
                f"Received: boundaries={boundaries!r}, values={values!r}"
            )
        if list(boundaries) != sorted(boundaries):
            raise ConfigError(f"Invalid `boundaries`. Expected increasing numbers. Received: boundaries={boundaries!r}")
        self.boundaries = list(boundaries)
        self.values = list(values)
        self.name = name

    def __call__(self, step: int) -> float:
        for b, v in zip(self.boundaries, self.values):
            if step <= b:
                return float(v)
        return float(self.values[-1])

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """``(lr0 − end)·(1 − t/T)^power + end`` with ``t = min(step, T)``; with ``cycle`` the
    horizon ``T`` grows to the next multiple of ``decay_steps`` instead of clamping."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, end_learning_rate: float = 0.0001,
                 power: float = 1.0, cycle: bool = False, name: str | None = None) -> None:
        _positive("decay_steps", decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name

    def __call__(self, step: int) -> float:
        horizon = float(self.decay_steps)
        if self.cycle:
            horizon *= max(1.0, math.ceil(step / self.decay_steps))
            t = float(step)
        else:
            t = float(min(step, self.decay_steps))
        lr0, end = float(self.initial_learning_rate), float(self.end_learning_rate)
        return (lr0 - end) * (1.0 - t / horizon) ** float(self.power) + end

    def get_config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "end_learning_rate": self.end_learning_rate, "power": self.power, "cycle": self.cycle,
                "name": self.name}


_BUILTIN: dict[str, type[LearningRateSchedule]] = {
    "ExponentialDecay": ExponentialDecay,
    "InverseTimeDecay": InverseTimeDecay,
    "PiecewiseConstantDecay": PiecewiseConstantDecay,
    "PiecewiseConstant": PiecewiseConstantDecay,
    "PolynomialDecay": PolynomialDecay,
}


def serialize(schedule: Any) -> dict[str, Any]:
    """Keras' serialised form of a schedule; a clear error for anything not serialisable."""
    if not isinstance(schedule, LearningRateSchedule):
        raise ConfigError(
            "Invalid `learning_rate` for get_config(). Expected a float or a "
            "meshembed.optimizers.schedules.LearningRateSchedule (e.g. ExponentialDecay, "
            "PiecewiseConstantDecay), which can be written to a config; a plain callable cannot. "
            f"Received: learning_rate={schedule!r}"
        )
    name = type(schedule).__name__
    if _BUILTIN.get(name) is type(schedule):
        return {"module": _MODULE, "class_name": name, "config": dict(schedule.get_config()), "registered_name": None}
    # a user's schedule: tf_keras' form (no module; found by name in custom_objects on load)
    return {"module": None, "class_name": name, "config": dict(schedule.get_config()), "registered_name": name}


def deserialize(config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> LearningRateSchedule:
    """Inverse of :func:`serialize`; also reads configs written by tf_keras / Keras 3."""
    if not isinstance(config, dict) or "class_name" not in config:
        raise ConfigError(
            "Invalid `learning_rate` config. Expected a dict with 'class_name' and 'config'. "
            f"Received: {config!r}"
        )
    name = config["class_name"]
    known = {**_BUILTIN, **(custom_objects or {})}
    cls = known.get(name) or known.get(config.get("registered_name") or "")
    if cls is None:
        raise ConfigError(
            f"Invalid `learning_rate` schedule. Expected one of {sorted(_BUILTIN)} (or pass it in "
            f"custom_objects). Received: class_name={name!r}"
        )
    return cls.from_config(dict(config.get("config", {})))
