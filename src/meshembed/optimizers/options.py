"""Gradient-clipping and EMA options of the dense optimizer (Keras DTensor optimizer names),
and the one implementation of their math: :func:`clip` and :func:`ema`.

Keras' DTensor ``Adadelta`` accepted these two objects and ignored them; meshembed honours
them with tf_keras' semantics, and their configs flatten into the optimizer config under
Keras' own keys (``clipnorm``, ``use_ema``, ...) so a config moves between the two.

``clip`` and ``ema`` are pure functions over an Array API namespace ``xp``: the host optimizer
(``me.optimizers.Adadelta``, and ``me.torch.Adadelta`` through it) calls them eagerly with
Python-float norms, ``me.jax.adadelta`` traced under ``jax.jit`` with 0-d arrays. Written once,
so the front ends cannot drift apart (they once did on a NaN/Inf global norm).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Sequence

from meshembed.errors import ConfigError
from meshembed.math.common import is_static, maximum, minimum, scalar, select

__all__ = ["EMAOption", "GradientsClipOption", "clip", "ema", "sum_squares"]


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

    def clip(self, xp: Any, grads: Sequence[Any], sums: Sequence[Any] | None = None) -> list[Any]:
        """``clip(xp, grads, self, sums)``: see :func:`clip`."""
        return clip(xp, grads, self, sums)

    def get_config(self) -> dict[str, Any]:
        return {"clipnorm": self.clipnorm, "global_clipnorm": self.global_clipnorm, "clipvalue": self.clipvalue}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GradientsClipOption":
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GradientsClipOption) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        return "GradientsClipOption(" + ", ".join(f"{k}={v}" for k, v in self.get_config().items()) + ")"


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


# -- the math of the two options, once for every front end ------------------------------------
def clip(xp: Any, grads: Sequence[Any], option: GradientsClipOption, sums: Sequence[Any] | None = None) -> list[Any]:
    """Clipped copies of ``grads`` (arrays of ``xp``) as ``option`` asks, exactly as TensorFlow's
    ``tf.clip_by_norm`` / ``tf.clip_by_global_norm`` / ``tf.clip_by_value`` (which tf_keras and
    Keras 3 call), NaN and Inf included:

    * ``clipnorm=c``: ``g·c / max(‖g‖, c)`` per gradient: an Inf element becomes NaN and the
      rest of that gradient 0, a NaN makes it all NaN; other gradients are untouched;
    * ``global_clipnorm=c``: every gradient times ``c·min(1/n, 1/c) + (n − n)``, ``n`` the joint
      norm: a NaN or Inf in any gradient makes *every* gradient NaN; ``n = 0`` leaves them;
    * ``clipvalue=v``: each element clamped to ``[−v, v]`` (±Inf → ±v, NaN stays NaN).

    ``sums``: each gradient's ``Σg²`` when the caller has them, as Python floats (the host: one
    sync, and a float scale multiplies sharded arrays without mixing array kinds) or 0-d arrays
    (under ``jax.jit``); computed here otherwise. No in-place writes, no branch on a value."""
    grads = list(grads)
    if not option.uses_norm:
        if option.clipvalue is None:
            return grads
        v = option.clipvalue
        return [maximum(xp, minimum(xp, g, v), -v) for g in grads]  # tf.clip_by_value's order
    if sums is None:
        sums = [xp.sum(g * g) for g in grads]
    if option.clipnorm is not None:
        c = option.clipnorm
        return [g * c / _max_propagating_nan(xp, _sqrt(xp, s), c, g) for g, s in zip(grads, sums)]
    c = option.global_clipnorm
    if all(is_static(s) for s in sums):
        n = math.sqrt(math.fsum(float(s) for s in sums))
        scale: Any = c * min(1.0 / n if n else math.inf, 1.0 / c) + (n - n)
    else:
        n = xp.sqrt(sum(sums[1:], sums[0]))
        scale = c * minimum(xp, 1.0 / n, 1.0 / c) + (n - n)
    return [g * scalar(xp, scale, g) for g in grads]


def _sqrt(xp: Any, s: Any) -> Any:
    return math.sqrt(float(s)) if is_static(s) else xp.sqrt(s)


def _max_propagating_nan(xp: Any, norm: Any, c: float, like: Any) -> Any:
    """``max(norm, c)`` that keeps a NaN norm (as ``tf.maximum``), in ``like``'s dtype."""
    if is_static(norm):
        return norm if math.isnan(norm) else max(norm, c)
    return scalar(xp, maximum(xp, norm, c), like)


def ema(xp: Any, averages: Sequence[Any], values: Sequence[Any], momentum: float, step: Any, *,
        keras3: bool = False, overwrite_frequency: int | None = None) -> tuple[list[Any], list[Any]]:
    """One EMA update after a step: ``(new averages, new variable values)``.

    ``avg ← m·avg + (1−m)·var`` for each variable's new value ``var``. Keras 3 (``keras3``)
    uses ``m = 0`` on its first update (``step == 0``), so the average starts at the variable;
    tf_keras' average started at the variable when built. With ``overwrite_frequency=k`` the
    variables take their averages after updates ``k, 2k, ...`` (``(step + 1) % k == 0``), as
    both Kerases do. ``step``: updates before this one, a Python int (the host) or a 0-d
    integer array (traced: the momentum and the overwrite are then selected, not branched)."""
    now: Any = False
    if overwrite_frequency:
        now = (step + 1) % overwrite_frequency == 0
        now = bool(now) if is_static(step) else now
    new_avgs, new_vals = [], []
    for avg, v in zip(averages, values):
        if not keras3:
            m: Any = momentum
        elif is_static(step):
            m = momentum if int(step) != 0 else 0.0
        else:  # Keras 3's own form: cast(iterations != 0, dtype) * momentum
            m = xp.astype(step != 0, v.dtype) * momentum
        new = m * avg + (1 - m) * v
        new_avgs.append(new)
        new_vals.append(select(xp, now, new, v))
    return new_avgs, new_vals
