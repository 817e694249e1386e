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
from typing import Any, Iterator

import numpy as np

from meshembed.backend.protocol import join_blocks
from meshembed.errors import ConfigError


@dataclass(frozen=True)
class TruncatedNormal:
    """Normal(mean, stddev) with draws beyond 2 stddev redrawn; stddev None → 1/sqrt(dim)."""

    mean: float = 0.0
    stddev: float | None = None

    def __call__(self, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
        return join_blocks(shape, self.blocks(shape, rng), np.float32)

    def blocks(self, shape: tuple[int, int], rng: np.random.Generator) -> Iterator[np.ndarray]:
        """float32 rows, block by block (about 8 MiB of float64 draws each, whole rows): a
        block's out-of-range draws are redrawn before the next block is drawn, so a
        10⁶ × 64 table never needs its float64 draws, or the whole table, at once."""
        std = self.stddev if self.stddev is not None else 1.0 / math.sqrt(shape[1])
        rows_per_block = max(1, _DRAW_PIECE // max(1, shape[1]))
        for start in range(0, shape[0], rows_per_block):
            draws = rng.standard_normal((min(rows_per_block, shape[0] - start), shape[1]))
            bad = np.flatnonzero(np.abs(draws) > 2.0)
            while bad.size:
                redrawn = rng.standard_normal(bad.size)
                draws.flat[bad] = redrawn
                bad = bad[np.abs(redrawn) > 2.0]
            yield (self.mean + std * draws).astype(np.float32)


_DRAW_PIECE = 1 << 20  # float64 draws per block (8 MiB)


@dataclass(frozen=True)
class Constant:
    """Every entry equal to ``value``."""

    value: float = 0.0

    def __call__(self, shape: tuple[int, int], rng: np.random.Generator | None = None) -> np.ndarray:
        return np.full(shape, self.value, dtype=np.float32)

    def blocks(self, shape: tuple[int, int], rng: np.random.Generator | None = None) -> Iterator[np.ndarray]:
        """The same block over and over (backends copy what they store)."""
        rows_per_block = max(1, _DRAW_PIECE // max(1, shape[1]))
        block = np.full((min(rows_per_block, shape[0]), shape[1]), self.value, dtype=np.float32)
        for start in range(0, shape[0], rows_per_block):
            yield block[: shape[0] - start]


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


def _resolve(init: Any, table: str) -> Any:
    if init is None:
        return TruncatedNormal()
    if isinstance(init, str):
        named = {"zeros": Zeros(), "ones": Constant(1.0), "truncated_normal": TruncatedNormal()}
        if init not in named:
            raise ConfigError(
                f"Invalid initializer for table {table!r}. Expected one of {sorted(named)}, a "
                f"callable, an array or a number. Received: {init!r}"
            )
        return named[init]
    if not callable(init) and np.ndim(init) == 0:
        return Constant(float(init))
    return init


def initial_blocks(init: Any, shape: tuple[int, int], rng: np.random.Generator, table: str) -> Iterator[np.ndarray]:
    """``init`` as float32 blocks of rows (see ``Backend.create_table_from_blocks``): our
    initialisers make them one at a time; any other callable or array is one block."""
    init = _resolve(init, table)
    if isinstance(init, (TruncatedNormal, Constant)):
        return init.blocks(shape, rng)
    return iter([initial_values(init, shape, rng, table)])


def initial_values(init: Any, shape: tuple[int, int], rng: np.random.Generator, table: str) -> np.ndarray:
    """Materialise ``init`` (None, callable, array or number) as a float32 ``shape`` array."""
    init = _resolve(init, table)
    if callable(init):
        try:
            takes_rng = len(inspect.signature(init).parameters) >= 2
        except (TypeError, ValueError):
            takes_rng = True
        values = init(shape, rng) if takes_rng else init(shape)
    else:
        values = init
    values = np.asarray(values, dtype=np.float32)
    if values.shape != tuple(shape):
        raise ConfigError(
            f"Invalid initializer for table {table!r}: expected values of shape {tuple(shape)}. "
            f"Received: shape={values.shape}"
        )
    return values  # backends copy what they store (create_table), so no defensive copy here
