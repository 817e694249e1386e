"""Gradient-clipping and EMA options of the dense optimizer (Keras DTensor optimizer names).

Keras' DTensor ``Adadelta`` accepted these two objects and ignored them; meshembed honours
them with tf_keras' semantics, and their configs flatten into the optimizer config under
Keras' own keys (``clipnorm``, ``use_ema``, ...) so a config moves between the two.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Sequence

from meshembed.errors import ConfigError
from meshembed.math.common import maximum, minimum

__all__ = ["EMAOption", "GradientsClipOption", "sum_squares"]


def _positive_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"Invalid `{name}`. Expected a positive number or None. Received: {name}={value!r}")
    return float(value)


def sum_squares(xp: Any, g: Any) -> float:
    """``Σ g²`` of a (possibly sharded) array as a Python float, summed in g's dtype."""
    total = xp.sum(g * g)
    full = getattr(total, "full_tensor", None)  # torch DTensor: all-reduce the partial sums
    return float(full() if callable(full) else total)


class GradientsClipOption:
    """Gradient clipping as tf_keras does it, applied before the update.

    * ``clipnorm=c``: each gradient ``g·c/max(‖g‖, c)`` (its own L2 norm);
    * ``global_clipnorm=c``: all gradients times ``c·min(1/n, 1/c)``, ``n`` their joint norm;
    * ``clipvalue=v``: each element clipped to ``[-v, v]``.

    At most one of the two norms may be set. As in tf_keras, a norm takes precedence over
    ``clipvalue`` (which is then not applied; a warning says so). For ``IndexedSlices`` the
    norms and values are those of the slices' rows, before duplicates are summed (as TF).
    """

    def __init__(
        self,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
    ) -> None:
        self.clipnorm = _positive_or_none("clipnorm", clipnorm)
        self.clipvalue = _positive_or_none("clipvalue", clipvalue)
        self.global_clipnorm = _positive_or_none("global_clipnorm", global_clipnorm)
        if self.clipnorm is not None and self.global_clipnorm is not None:
            raise ConfigError(
                "Invalid `gradients_clip_option`. Expected at most one of `clipnorm` and "
                f"`global_clipnorm`. Received: clipnorm={clipnorm}, global_clipnorm={global_clipnorm}"
            )
        if self.clipvalue is not None and (self.clipnorm or self.global_clipnorm):
            warnings.warn(
                "`clipvalue` is ignored when `clipnorm` or `global_clipnorm` is set (tf_keras "
                "semantics: only the norm clipping is applied).",
                stacklevel=2,
            )

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.clipnorm, self.clipvalue, self.global_clipnorm))

    @property
    def uses_norm(self) -> bool:
        return self.clipnorm is not None or self.global_clipnorm is not None

    def clip(self, xp: Any, grads: Sequence[Any], sums: Sequence[float] | None = None) -> list[Any]:
        """Clipped copies of ``grads`` (arrays of namespace ``xp``); no in-place writes.

        Norms are reduced to Python floats (``sums``: each gradient's ``Σ g²`` when the caller
        has them): one host sync per step, and the scale then multiplies sharded arrays
        (DTensor, NamedSharding) without mixing array kinds. A NaN or Inf norm gives NaN
        gradients, as ``tf.clip_by_global_norm`` / ``tf.clip_by_norm`` and Keras do."""
        grads = list(grads)
        if self.uses_norm and sums is None:
            sums = [sum_squares(xp, g) for g in grads]
        if self.clipnorm is not None:
            c = self.clipnorm
            return [g * (c / _max_nan(math.sqrt(s), c)) for g, s in zip(grads, sums)]
        if self.global_clipnorm is not None:
            c = self.global_clipnorm
            norm = math.sqrt(math.fsum(sums)) if all(math.isfinite(s) for s in sums) else math.nan
            # tf.clip_by_global_norm: scale = c·min(1/n, 1/c) + (n − n): n = 0 leaves g
            # unchanged, a NaN or Inf norm makes every gradient NaN.
            scale = c * min(1.0 / norm, 1.0 / c) if norm > 0 else (1.0 if norm == 0 else math.nan)
            return [g * scale for g in grads]
        if self.clipvalue is not None:
            v = self.clipvalue
            return [minimum(xp, maximum(xp, g, -v), v) for g in grads]
        return grads

    def get_config(self) -> dict[str, Any]:
        return {"clipnorm": self.clipnorm, "global_clipnorm": self.global_clipnorm, "clipvalue": self.clipvalue}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GradientsClipOption":
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GradientsClipOption) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        return "GradientsClipOption(" + ", ".join(f"{k}={v}" for k, v in self.get_config().items()) + ")"


def _max_nan(a: float, b: float) -> float:
    """``max`` that keeps a NaN (Python's ``max(nan, b)`` depends on the argument order)."""
    return a if math.isnan(a) else max(a, b)


class EMAOption:
    """Exponential moving average of the model variables, tf_keras semantics.

    The average of each variable starts at the variable's value when the optimizer is built
    and after every step becomes ``m·avg + (1−m)·var``. With ``ema_overwrite_frequency=k``
    the variables are overwritten by their averages after steps k, 2k, ...;
    ``finalize_variable_values`` copies the averages into the variables.
    """

    def __init__(
        self,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
    ) -> None:
        if not isinstance(use_ema, bool):
            raise ConfigError(f"Invalid `use_ema`. Expected a bool. Received: use_ema={use_ema!r}")
        if (
            isinstance(ema_momentum, bool)
            or not isinstance(ema_momentum, numbers.Real)
            or not 0.0 <= float(ema_momentum) <= 1.0
        ):
            raise ConfigError(
                f"Invalid `ema_momentum`. Expected a number in [0, 1]. Received: ema_momentum={ema_momentum!r}"
            )
        if ema_overwrite_frequency is not None and (
            isinstance(ema_overwrite_frequency, bool)
            or not isinstance(ema_overwrite_frequency, numbers.Integral)
            or ema_overwrite_frequency < 1
        ):
            raise ConfigError(
                "Invalid `ema_overwrite_frequency`. Expected an integer >= 1 or None. "
                f"Received: ema_overwrite_frequency={ema_overwrite_frequency!r}"
            )
        self.use_ema = use_ema
        self.ema_momentum = float(ema_momentum)
        self.ema_overwrite_frequency = None if ema_overwrite_frequency is None else int(ema_overwrite_frequency)

    def get_config(self) -> dict[str, Any]:
        return {
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EMAOption":
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EMAOption) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        return "EMAOption(" + ", ".join(f"{k}={v}" for k, v in self.get_config().items()) + ")"
