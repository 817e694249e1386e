"""Small shared helpers of the config package: error wording, float32 rounding, enums.

Errors read like Keras: ``Invalid `x` for table 'user'. Expected ... Received: x=...``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


def invalid(arg: str, where: str, expected: str, value: Any, error: type = ConfigError, fix: str = "") -> Exception:
    """Build the one error shape every config check uses."""
    place = f" for {where}" if where else ""
    return error(f"Invalid `{arg}`{place}. Expected {expected}. Received: {arg}={value!r}" + (f". Fix: {fix}" if fix else ""))


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
    with np.errstate(over="ignore"):
        x = np.float32(value)
    if not math.isfinite(float(x)):
        return float(x)
    return float(str(x))


FLOAT32_MAX = float(np.finfo(np.float32).max)


def as_float(arg: str, value: Any, where: str = "") -> float:
    """A float32-representable float: NaN, and finite values that overflow float32 (which
    the proto would store as inf), are refused rather than silently changed."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise invalid(arg, where, "a float", value)
    if math.isnan(float(value)):
        raise invalid(arg, where, "a float that is not NaN", value)
    x = f32(value)
    if math.isinf(x) and math.isfinite(float(value)):
        raise invalid(arg, where, f"a value within float32's range (|x| <= {FLOAT32_MAX:.8g}; the proto "
                      "stores float32, where it would become inf)", value)
    return x


def as_bool(arg: str, value: Any, where: str = "") -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise invalid(arg, where, "a bool", value)


#: Largest values of the proto's integer types: a larger Python int cannot be serialized.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def as_int(arg: str, value: Any, where: str = "", *, minimum: int | None = None,
           maximum: int | None = INT32_MAX, error: type = ConfigError, fix: str = "") -> int:
    """An integer (Python or NumPy; never a bool, float or string) in [minimum, maximum];
    ``maximum`` defaults to the proto's int32 limit (None: unbounded). ``error``/``fix``: the
    error class raised and the remedy its message ends with."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise invalid(arg, where, "an integer" + (f" >= {minimum}" if minimum is not None else ""), value, error, fix)
    if minimum is not None and value < minimum:
        expected = "an integer > 0" if minimum == 1 else f"an integer >= {minimum}"
        raise invalid(arg, where, expected, value, error, fix)
    if maximum is not None and value > maximum:
        bits = "int64" if maximum == INT64_MAX else "int32" if maximum == INT32_MAX else ""
        limit = f"2**{maximum.bit_length()} - 1, the proto's {bits} limit" if bits else str(maximum)
        raise invalid(arg, where, f"an integer <= {maximum} ({limit})", value, error, fix)
    return int(value)


@dataclass(frozen=True)
class Domain:
    """The finite interval a hyper-parameter must lie in; ``source`` says who sets the range."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    source: str = ""

    def __contains__(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def describe(self) -> str:
        """Keras-style wording: "a finite value in [0, 1)"."""
        lo, hi = math.isfinite(self.lo), math.isfinite(self.hi)
        if lo and hi:
            text = f"a finite value in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        elif lo:
            text = f"a finite value {'>' if self.lo_open else '>='} {self.lo:g}"
        elif hi:
            text = f"a finite value {'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            text = "a finite value"
        return f"{text} ({self.source})" if self.source else text

    def check(self, arg: str, value: float, where: str = "") -> None:
        if value not in self:
            raise invalid(arg, where, self.describe(), value)

    def citing(self, source: str) -> Domain:
        """The same range, with the reference that sets it."""
        return Domain(self.lo, self.hi, self.lo_open, self.hi_open, source)


FINITE = Domain()
NON_NEGATIVE = Domain(0.0)
POSITIVE = Domain(0.0, lo_open=True)
NON_POSITIVE = Domain(hi=0.0)
UNIT = Domain(0.0, 1.0)                      # [0, 1]
UNIT_OPEN_TOP = Domain(0.0, 1.0, hi_open=True)  # [0, 1)


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
