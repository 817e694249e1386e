"""Table initialisers, TF2-like.

The default is TF2's ``TruncatedNormal(mean=0, stddev=1/sqrt(dim))`` (values beyond two
standard deviations are redrawn), seeded per table from the engine seed and the table index,
so the same config and seed give the same tables on every backend and shard count.
A table's initialiser may be a callable ``(shape, rng) -> array`` or ``(shape) -> array``,
an array of the table's shape, or a constant. Without one, a FrequencyEstimator table (D)
starts at its ``max_delta`` (spec §4.2), see :func:`default_initializer`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshembed.errors import ConfigError


@dataclass(frozen=True)
class TruncatedNormal:
    """Normal(mean, stddev) with draws beyond 2 stddev redrawn; stddev None → 1/sqrt(dim)."""

    mean: float = 0.0
    stddev: float | None = None

    def __call__(self, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
        """float32 values; the float64 draws are made in pieces (a 10⁶ × 64 table would
        otherwise hold 1.5 GB of float64 temporaries). Same values as drawing the whole
        array at once and redrawing every out-of-range entry in order until none is left."""
        std = self.stddev if self.stddev is not None else 1.0 / math.sqrt(shape[1])
        out = np.empty(int(np.prod(shape)), dtype=np.float32)
        redraw = []
        for start in range(0, out.size, _DRAW_PIECE):
            draws = rng.standard_normal(min(_DRAW_PIECE, out.size - start))
            out[start : start + draws.size] = self.mean + std * draws
            redraw.append(np.flatnonzero(np.abs(draws) > 2.0) + start)
        bad = np.concatenate(redraw) if redraw else np.zeros(0, np.int64)
        while bad.size:
            draws = rng.standard_normal(bad.size)
            out[bad] = self.mean + std * draws
            bad = bad[np.abs(draws) > 2.0]
        return out.reshape(shape)


_DRAW_PIECE = 1 << 20  # float64 draws per piece (8 MiB)


@dataclass(frozen=True)
class Constant:
    """Every entry equal to ``value``."""

    value: float = 0.0

    def __call__(self, shape: tuple[int, int], rng: np.random.Generator | None = None) -> np.ndarray:
        return np.full(shape, self.value, dtype=np.float32)


def Zeros() -> Constant:  # noqa: N802 - reads like the TF/Keras class
    """All zeros."""
    return Constant(0.0)


@dataclass(frozen=True)
class RowIdInitializer:
    """Row ``i`` holds ``offset + i`` in every column: a misplaced row is obvious in tests.

    Unlike TF's, it numbers logical rows, so it does not restart on every host shard."""

    offset: float = 0.0

    def __call__(self, shape: tuple[int, int], rng: np.random.Generator | None = None) -> np.ndarray:
        rows = np.arange(shape[0], dtype=np.float32)[:, None] + np.float32(self.offset)
        return np.broadcast_to(rows, shape).astype(np.float32)


def default_initializer(optimizer: Any) -> Any:
    """The initialiser of a table given none: TF2's TruncatedNormal, except for a
    FrequencyEstimator, whose table holds the inter-arrival estimate D that starts at
    ``max_delta`` (spec §4.2: "D starts at max_delta")."""
    if getattr(optimizer, "algorithm", None) == "frequency_estimator":
        return Constant(float(optimizer.hyperparameters()["max_delta"]))
    return TruncatedNormal()


def table_rng(seed: int, table_index: int) -> np.random.Generator:
    """Independent stream per table, fixed by (seed, table index)."""
    return np.random.default_rng([int(seed), int(table_index)])


def initial_values(init: Any, shape: tuple[int, int], rng: np.random.Generator, table: str) -> np.ndarray:
    """Materialise ``init`` (None, callable, array or number) as a float32 ``shape`` array."""
    if init is None:
        init = TruncatedNormal()
    if isinstance(init, str):
        named = {"zeros": Zeros(), "ones": Constant(1.0), "truncated_normal": TruncatedNormal()}
        if init not in named:
            raise ConfigError(
                f"Invalid initializer for table {table!r}. Expected one of {sorted(named)}, a "
                f"callable, an array or a number. Received: {init!r}"
            )
        init = named[init]
    if callable(init):
        try:
            takes_rng = len(inspect.signature(init).parameters) >= 2
        except (TypeError, ValueError):
            takes_rng = True
        values = init(shape, rng) if takes_rng else init(shape)
    elif np.ndim(init) == 0:
        values = np.full(shape, float(init), dtype=np.float32)
    else:
        values = init
    values = np.asarray(values, dtype=np.float32)
    if values.shape != tuple(shape):
        raise ConfigError(
            f"Invalid initializer for table {table!r}: expected values of shape {tuple(shape)}. "
            f"Received: shape={values.shape}"
        )
    return values  # backends copy what they store (create_table), so no defensive copy here
