"""Keras configs and variable stores: ``get_config`` / ``from_config`` (Keras 3 and tf_keras
formats), ``save_own_variables`` / ``load_own_variables``, weights, pickling and copies; and the
checks of the optimizer's scalar arguments.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from meshembed.errors import CheckpointError, ConfigError, StateError
from meshembed.optimizers import schedules
from meshembed.optimizers.options import EMAOption, GradientsClipOption
from meshembed.sharding.mesh import Mesh
from meshembed.variable import Variable

__all__ = ["ConfigMixin"]


class ConfigMixin:
    """Keras configs, variable stores, weights, pickling and copies.

    One part of :class:`~meshembed.optimizers.Optimizer`."""

    # -- config -----------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Keras' config keys: Keras 3's (``loss_scale_factor``, ``gradient_accumulation_steps``,
        which Keras 3 itself reads back) when built from Keras 3's arguments, else tf_keras'
        (``jit_compile``, ``is_legacy_optimizer``; clip and EMA options flattened)."""
        lr = self._learning_rate
        config = {
            "name": self.name,
            "learning_rate": lr if isinstance(lr, float) else schedules.serialize(lr),
            "weight_decay": self.weight_decay,
            **self.gradients_clip_option.get_config(),
            **self.ema_option.get_config(),
        }
        if self.keras3:
            config.update(loss_scale_factor=self.loss_scale_factor,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        else:
            config.update(jit_compile=self.jit_compile, is_legacy_optimizer=False)
        if self.allow_nonfinite:  # meshembed's own key, written only when not the default
            config["allow_nonfinite"] = True
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None,
                    mesh: Mesh | None = None) -> "Optimizer":
        """Inverse of ``get_config``; reads the configs Keras 3 and tf_keras write.

        A config with ``loss_scale_factor`` / ``gradient_accumulation_steps`` is Keras 3's and
        gives Keras 3's semantics; otherwise (tf_keras) the clip/EMA keys become the DTensor
        options. The mesh is not part of a config; pass it here."""
        if not isinstance(config, dict):
            raise ConfigError(f"Invalid `config`. Expected a dict. Received: config={config!r}")
        config = {k: (v.item() if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0 else v)
                  for k, v in config.items()}
        if config.pop("is_legacy_optimizer", False):
            raise ConfigError(
                "Invalid `config`. Expected a config of a new-style (non-legacy) Keras optimizer. "
                "Received: is_legacy_optimizer=True"
            )
        config.pop("decay", None)  # Keras 3 ignores it too (with a warning)
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            config["learning_rate"] = schedules.deserialize(lr, custom_objects)
        keras3 = "loss_scale_factor" in config or "gradient_accumulation_steps" in config
        if not keras3:
            clip = config.pop("gradients_clip_option", None)
            flat_clip = {k: config.pop(k) for k in _CLIP_KEYS if k in config}
            ema = config.pop("ema_option", None)
            flat_ema = {k: config.pop(k) for k in _EMA_KEYS if k in config}
            if isinstance(clip, dict):
                clip = GradientsClipOption.from_config(clip)
            if isinstance(ema, dict):
                ema = EMAOption.from_config(ema)
            if clip is None and any(v is not None for v in flat_clip.values()):
                with warnings.catch_warnings():  # tf_keras wrote it; its warning is for new code
                    warnings.simplefilter("ignore")
                    clip = GradientsClipOption(**{k: (None if v is None else float(v)) for k, v in flat_clip.items()})
            if ema is None and flat_ema:
                ema = EMAOption(**{k: (float(v) if k == "ema_momentum" else v) for k, v in flat_ema.items()})
            config.update(gradients_clip_option=clip, ema_option=ema)
        else:
            config.pop("jit_compile", None)
        try:
            return cls(**config, mesh=mesh)
        except TypeError as exc:
            raise ConfigError(f"Invalid `config` for {cls.__name__}: {exc}. Received keys: {sorted(config)}") from None

    # -- state: Keras 3's variable store and stateless step ------------------------------------
    def save_own_variables(self, store: Any) -> None:
        """Keras 3's layout, what ``keras.optimizers.Adadelta.load_own_variables`` expects:
        ``store["0"]`` the iteration, ``store["1"]`` the learning rate when it is a float (Keras 3
        keeps it in a variable; a schedule is not one), then ``variables[1:]`` in Keras 3's order.
        Keras skips a store of another length with only a warning, leaving its slots zero, so
        the learning-rate entry is not optional. A dict or an h5 group; loads on any backend."""
        values = [v.numpy() for v in self.variables]
        if not callable(self._learning_rate):  # float64: the float itself (Keras casts it on assign)
            values.insert(1, np.asarray(self._learning_rate, np.float64))
        for i, value in enumerate(values):
            store[str(i)] = value

    def load_own_variables(self, store: Any) -> None:
        """Assign ``variables`` from a store in Keras 3's layout (``save_own_variables``, or
        Keras 3's own: its learning rate at "1" sets a float learning rate) or without the
        learning-rate entry (a schedule's, tf_keras', ``get_weights``), from any backend or mesh.
        Everything is checked before anything is assigned; a store that does not fit is a
        ``CheckpointError`` naming the entry."""
        if not self.built:
            raise StateError(
                f"Invalid call: load_own_variables() before optimizer {self.name!r} was built. "
                "Call build(var_list) (or one apply_gradients) first, then load."
            )
        variables = self.variables
        try:
            keys = list(store.keys())
            values = {k: np.asarray(store[k]) for k in keys}
        except Exception as exc:  # noqa: BLE001 - any store failure is the store's
            raise CheckpointError(f"Invalid `store`. Expected a mapping of '0', '1', ... to arrays ({exc}).") from None
        with_lr = len(keys) == len(variables) + 1 and "1" in values and values["1"].shape == ()
        order = ["0", *[str(i) for i in range(2, len(keys))]] if with_lr else [str(i) for i in range(len(keys))]
        if len(order) != len(variables) or set(order) - set(values):
            raise CheckpointError(
                f"Invalid `store` for optimizer {self.name!r}. Expected {len(variables)} variables "
                f"({[v.name for v in variables]}) under keys '0'..'{len(variables) - 1}' (or Keras 3's layout with "
                f"its learning rate at '1'). Received keys: {sorted(keys)}"
            )
        for v, k in zip(variables, order):
            x = values[k]
            # a complex variable's slots take complex entries only, a real one's real ones (never
            # the imaginary parts dropped)
            kind = "integer" if v is variables[0] else "complex" if "complex" in v.dtype else "float"
            kind_ok = {"integer": x.dtype.kind in ("i", "u"), "complex": x.dtype.kind == "c",
                       "float": x.dtype.kind == "f" or "float" in str(x.dtype)}[kind]
            if tuple(x.shape) != v.shape or not kind_ok:
                raise CheckpointError(
                    f"Invalid `store` entry '{k}' for {v.name!r}. Expected shape {v.shape} and a "
                    f"{kind} dtype. Received: shape={tuple(x.shape)}, dtype={x.dtype}"
                )
        if int(values["0"]) < 0:
            raise CheckpointError(
                f"Invalid `store` entry '0' (the iteration). Expected a count >= 0. Received: {values['0']!r}"
            )
        lr_value = None
        if with_lr:
            x = values["1"]
            try:
                lr_value = check_learning_rate(float(x) if x.dtype.kind in "iuf" else x.item())
            except (ConfigError, TypeError, ValueError):
                raise CheckpointError(
                    "Invalid `store` entry '1' (Keras 3's learning rate). Expected a non-negative finite "
                    f"number. Received: {x!r}"
                ) from None
        for v, k in zip(variables, order):
            v.assign(values[k])
        if lr_value is not None and not callable(self._learning_rate):
            self._learning_rate = lr_value

    def get_weights(self) -> list[np.ndarray]:
        """NumPy copies of ``variables`` (tf_keras / Keras 3)."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``variables`` from arrays in their order (checked first, as ``load_own_variables``)."""
        if not self.built:
            raise StateError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. Call "
                "`optimizer.build(trainable_variables)` first."
            )
        self.load_own_variables({str(i): w for i, w in enumerate(weights)})

    def __getstate__(self) -> dict:
        """Pickle by backend name (a backend holds modules); compiled kernels are rebuilt."""
        state = dict(self.__dict__)
        state["_backend"] = getattr(self._backend, "name", self._backend)
        state["_compile_cache"] = {}
        state["_in_place_backends"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_in_place_backends", {})  # pickled before it existed
        if isinstance(self._backend, str):
            from meshembed.backend import get_backend

            self._backend = get_backend(self._backend)
        self._index = {id(v): i for i, v in enumerate(self._trainable)}

    def __deepcopy__(self, memo: dict) -> "Optimizer":
        """A copy with its own variables; the backend, mesh and compiled kernels are shared
        (they are process-wide objects, not state)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in ("_backend", "mesh"):
                new.__dict__[key] = value
            elif key in ("_compile_cache", "_in_place_backends"):
                new.__dict__[key] = {}
            else:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._index = {id(v): i for i, v in enumerate(new._trainable)}
        return new


_CLIP_KEYS = ("clipnorm", "global_clipnorm", "clipvalue")


_EMA_KEYS = ("use_ema", "ema_momentum", "ema_overwrite_frequency")


#: Keras 3 arguments with no DTensor-option form; any of them (or a flat clip/EMA argument)
#: selects Keras 3's semantics, and they cannot be mixed with the two option objects.
_KERAS3_KEYS = (*_CLIP_KEYS, *_EMA_KEYS, "loss_scale_factor", "gradient_accumulation_steps")


def _optional_number(name: str, value: Any, positive: bool) -> float | None:
    if value is None:
        return None
    bad = isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value)
    if bad or value < 0 or (positive and value == 0):
        raise ConfigError(
            f"Invalid `{name}`. Expected a {'positive' if positive else 'non-negative'} finite number or None. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def check_learning_rate(value: Any) -> Any:
    """A learning rate as every dense front end takes it: a schedule or callable (checked per
    value when called), or a non-negative finite number (returned as a float); else ConfigError."""
    if isinstance(value, schedules.LearningRateSchedule) or (callable(value) and not isinstance(value, numbers.Real)):
        return value
    if isinstance(value, Variable) and value.shape == ():  # Keras: a learning-rate variable
        value = value.numpy().item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not np.isfinite(value) or value < 0:
        raise ConfigError(
            "Invalid `learning_rate`. Expected a non-negative float, a LearningRateSchedule or a "
            f"callable of the step. Received: learning_rate={value!r}"
        )
    return float(value)


def _check_schedule_value(value: Any, schedule: Any) -> float:
    try:
        ok = not isinstance(value, (str, bytes, bool)) and np.ndim(value) == 0
        out = float(value) if ok else math.nan
    except (TypeError, ValueError):
        out = math.nan
    if not (math.isfinite(out) and out >= 0):
        raise ConfigError(
            f"Invalid learning rate from {schedule!r}. Expected a non-negative finite number. Received: {value!r}"
        )
    return out


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return 1
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is inspect.Parameter.empty)
