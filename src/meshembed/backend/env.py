"""The one reader of meshembed's environment switches (``MESHEMBED_*``), for the core and backends.

Every reader goes through here so that one spelling means the same everywhere: before, five
readers disagreed (``off`` was *on* for one, ``yes`` was *off* for another). A value that is
not a known spelling is an error naming the variable, not a silent default.
"""

from __future__ import annotations

import os

from meshembed.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """``$name`` as a bool: 1/0, true/false, yes/no, on/off (any case); unset or empty -> ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"Invalid environment variable {name}={os.environ[name]!r}. Expected one of "
        f"{', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off), any case. "
        f"Fix: set {name}=1 or {name}=0, or unset it for the default ({int(default)})."
    )


def env_int(name: str, default: int | None = None) -> int | None:
    """``$name`` as an int; unset or empty -> ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"Invalid environment variable {name}={os.environ[name]!r}. Expected an integer. "
            f"Fix: set {name} to a whole number, or unset it for the default ({default})."
        ) from None


def env_choice(name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
    """``$name`` as one of ``choices`` (compared in lower case); unset or empty -> ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in choices:
        return value
    raise ConfigError(
        f"Invalid environment variable {name}={os.environ[name]!r}. Expected one of {', '.join(choices)}. "
        f"Fix: set {name} to one of them, or unset it for the default ({default})."
    )
