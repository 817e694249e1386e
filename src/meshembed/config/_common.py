"""Small shared helpers of the config package: error wording, float32 rounding, enums.

Errors read like Keras: ``Invalid `x` for table 'user'. Expected ... Received: x=...``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from meshembed.errors import ConfigError

# True while a config is being built from a proto: TF2-Python-only argument checks (for
# example Adam's epsilon > 0) are skipped there, because TensorFlow's runtime accepts any
# proto value and a proto written elsewhere must still load.
_FROM_PROTO: contextvars.ContextVar[bool] = contextvars.ContextVar("meshembed_from_proto", default=False)


@contextlib.contextmanager
def parsing_proto() -> Iterator[None]:
    """Relax TF2-Python-only argument checks while converting a proto."""
    token = _FROM_PROTO.set(True)
    try:
        yield
    finally:
        _FROM_PROTO.reset(token)


def tf2_checks_enabled() -> bool:
    return not _FROM_PROTO.get()


def invalid(arg: str, where: str, expected: str, value: Any) -> ConfigError:
    """Build the one error shape every config check uses."""
    place = f" for {where}" if where else ""
    return ConfigError(f"Invalid `{arg}`{place}. Expected {expected}. Received: {arg}={value!r}")


@contextlib.contextmanager
def located(where: str) -> Iterator[None]:
    """Re-raise a ConfigError from a nested object with `where` (e.g. "table 'user'") added."""
    try:
        yield
    except ConfigError as err:
        msg = str(err)
        if where in msg:
            raise
        head, sep, tail = msg.partition(". Expected ")
        if msg.startswith("Invalid `") and sep:
            joiner = " of " if " for " in head else " for "
            raise ConfigError(f"{head}{joiner}{where}{sep}{tail}") from err
        raise ConfigError(f"{where}: {msg}") from err


def one_of(names: Any) -> str:
    """Render choices in a stable order, Keras style: {'a', 'b'}."""
    return "{" + ", ".join(repr(n) for n in names) + "}"


def f32(value: Any) -> float:
    """Round to the float32 the proto stores, spelled as the shortest decimal.

    So ``0.01`` written and read back is ``0.01`` again, and a parsed config compares equal
    to the Python-built one.
    """
    x = np.float32(value)
    if not math.isfinite(float(x)):
        return float(x)
    return float(str(x))


def as_float(arg: str, value: Any, where: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise invalid(arg, where, "a float", value)
    if math.isnan(float(value)):
        raise invalid(arg, where, "a float that is not NaN", value)
    return f32(value)


def as_bool(arg: str, value: Any, where: str = "") -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise invalid(arg, where, "a bool", value)


def as_int(arg: str, value: Any, where: str = "", *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise invalid(arg, where, "an integer" + (f" >= {minimum}" if minimum is not None else ""), value)
    if minimum is not None and value < minimum:
        expected = "an integer > 0" if minimum == 1 else f"an integer >= {minimum}"
        raise invalid(arg, where, expected, value)
    return int(value)


def as_enum(arg: str, value: Any, names: Mapping[str, int], where: str = "",
            aliases: Mapping[str, str] | None = None) -> str:
    """Normalise an enum given as a name (any case), an alias or the proto number."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        for name, number in names.items():
            if number == value:
                return name
    elif isinstance(value, str):
        key = value.strip().lower()
        if aliases and key in aliases:
            key = aliases[key]
        if key in names:
            return key
    raise invalid(arg, where, f"one of {one_of(names)}", value)
