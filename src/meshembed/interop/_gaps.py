"""Gap reports: what a translation between meshembed and another framework could not keep.

A translation never downgrades silently: every field it could not represent exactly is a
``Gap`` (what differs and what was done), and ``strict=True`` turns any gap into a
``ConfigError`` before anything is returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from meshembed.errors import ConfigError

__all__ = ["Gap", "GapReport", "Translation"]


@dataclass(frozen=True)
class Gap:
    """One field that could not be carried over exactly."""

    field: str  #: the source field, e.g. ``"optimizer.eps"``
    differs: str  #: how the two frameworks differ there
    done: str  #: what the translation did about it
    table: str | None = None  #: the table (or feature) it concerns, None for all

    def __str__(self) -> str:
        where = f"table '{self.table}': " if self.table else ""
        return f"{where}{self.field}: {self.differs}; {self.done}"


class GapReport(tuple):
    """A tuple of ``Gap``; ``str()`` gives one line per gap, ``for_table`` filters."""

    def for_table(self, table: str | None) -> GapReport:
        return GapReport(g for g in self if g.table in (None, table))

    def fields(self, table: str | None = None) -> tuple[str, ...]:
        return tuple(g.field for g in (self if table is None else self.for_table(table)))

    def __str__(self) -> str:
        return "\n".join(str(g) for g in self) if self else "no gaps: the translation is exact"


class Translation(NamedTuple):
    """``(result, gaps)`` of one translation: ``cfg, gaps = me.interop.from_torchrec(...)``."""

    result: Any
    gaps: GapReport


class _Gaps:
    """Collects gaps while translating; ``finish`` applies ``strict``."""

    def __init__(self, source: str, strict: bool) -> None:
        if not isinstance(strict, bool):
            raise ConfigError(f"Invalid `strict`. Expected True or False. Received: strict={strict!r}")
        self.source, self.strict, self.items = source, strict, []

    def add(self, field: str, differs: str, done: str, table: str | None = None) -> None:
        self.items.append(Gap(field, differs, done, table))

    def finish(self, result: Any) -> Translation:
        report = GapReport(self.items)
        if self.strict and report:
            lines = "\n  ".join(str(g) for g in report)
            raise ConfigError(
                f"The {self.source} translation is not exact (strict=True) and has {len(report)} "
                f"gap(s):\n  {lines}\nChange these fields, or pass strict=False to accept the report.")
        return Translation(result, report)
