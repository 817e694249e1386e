"""Row placement of a table over shards: MOD and DIV, as TensorFlow's embedding_lookup.

Pure functions over NumPy index arrays (or, with ``xp=``, any Array-API namespace's: torch's
``RowMap`` and the JAX backend call the same methods), so every backend and the Load/Retrieve
ops agree: this is the one definition of MOD/DIV row arithmetic.
For vocabulary V over n shards with q, r = divmod(V, n) (spec §6):

* MOD: id i lives on shard ``i % n`` at local row ``i // n``.
* DIV: shard s holds ``q + (s < r)`` contiguous rows starting at ``s*q + min(s, r)``.

In both, the first ``V % n`` shards hold one extra row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STRATEGIES = ("mod", "div")


@dataclass(frozen=True)
class Placement:
    """Where each of ``vocabulary_size`` rows lives among ``num_shards`` shards."""

    vocabulary_size: int
    num_shards: int = 1
    strategy: str = "div"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"Invalid `strategy`. Expected one of {STRATEGIES}. Received: strategy={self.strategy!r}"
            )
        if self.num_shards < 1:
            raise ValueError(f"Invalid `num_shards`. Expected >= 1. Received: num_shards={self.num_shards}")
        if self.vocabulary_size < self.num_shards:
            raise ValueError(
                "Invalid `num_shards`: all embedding shards must be non-empty, so num_shards must be "
                f"<= vocabulary_size. Received: num_shards={self.num_shards}, "
                f"vocabulary_size={self.vocabulary_size}"
            )

    def rows_in_shard(self, shard_id: int) -> int:
        q, r = divmod(self.vocabulary_size, self.num_shards)
        return q + (1 if shard_id < r else 0)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(self.rows_in_shard(s) for s in range(self.num_shards))

    @property
    def max_rows(self) -> int:
        return self.rows_in_shard(0)

    def owner(self, ids: np.ndarray, xp=None) -> np.ndarray:
        """Shard that holds each global id.

        With ``xp`` (an Array API namespace), ``ids`` are that namespace's integer arrays and
        stay on their device: only standard operators are used (the generic backend)."""
        ids = np.asarray(ids, dtype=np.int64) if xp is None else ids
        n = self.num_shards
        if self.strategy == "mod":
            return ids % n
        q, r = divmod(self.vocabulary_size, n)
        if q == 0:  # unreachable: every shard is non-empty
            return ids
        return (np if xp is None else xp).maximum(ids // (q + 1), (ids - r) // q)

    def local_row(self, ids: np.ndarray, xp=None, owner=None) -> np.ndarray:
        """Row index of each global id inside its shard (``xp``: as in :meth:`owner`;
        ``owner``: :meth:`owner` of ``ids`` when the caller has it already)."""
        ids = np.asarray(ids, dtype=np.int64) if xp is None else ids
        n = self.num_shards
        if self.strategy == "mod":
            return ids // n
        return ids - self.shard_start(self.owner(ids, xp) if owner is None else owner, xp)

    def shard_start(self, shard_id, xp=None):
        """DIV only: first global id of a shard (works on arrays; ``xp``: as in :meth:`owner`)."""
        q, r = divmod(self.vocabulary_size, self.num_shards)
        if xp is None:
            return shard_id * q + np.minimum(shard_id, r)
        return shard_id * q + xp.minimum(shard_id, xp.full_like(shard_id, r))

    def block_parts(self, start: int, stop: int) -> list[tuple[int, int, slice]]:
        """Where the logical rows ``[start, stop)`` go, shard by shard: ``(shard, first local
        row, slice of the block's rows)`` for each shard that gets any. A part's local rows are
        consecutive, so a backend can fill a table block by block (see
        ``Backend.create_table_from_blocks``)."""
        n, parts = self.num_shards, []
        for s in range(n):
            if self.strategy == "mod":
                first = start + (s - start) % n
                if first < stop:
                    parts.append((s, first // n, slice(first - start, stop - start, n)))
            else:
                lo = max(start, int(self.shard_start(s)))
                hi = min(stop, int(self.shard_start(s)) + self.rows_in_shard(s))
                if lo < hi:
                    parts.append((s, lo - int(self.shard_start(s)), slice(lo - start, hi - start)))
        return parts

    def global_ids(self, shard_id: int) -> np.ndarray:
        """Global ids held by a shard, in local-row order."""
        rows = np.arange(self.rows_in_shard(shard_id), dtype=np.int64)
        if self.strategy == "mod":
            return rows * self.num_shards + shard_id
        return rows + int(self.shard_start(shard_id))


def shard(table: np.ndarray, placement: Placement) -> list[np.ndarray]:
    """Split a logical ``[V, ...]`` table into per-shard arrays (inverse of :func:`unshard`)."""
    if table.shape[0] != placement.vocabulary_size:
        raise ValueError(
            f"Invalid table: expected {placement.vocabulary_size} rows. Received: shape={table.shape}"
        )
    return [table[placement.global_ids(s)] for s in range(placement.num_shards)]


def unshard(shards: list[np.ndarray], placement: Placement) -> np.ndarray:
    """Reassemble the logical ``[V, ...]`` table from per-shard arrays."""
    if len(shards) != placement.num_shards:
        raise ValueError(f"Expected {placement.num_shards} shards. Received: {len(shards)}")
    first = np.asarray(shards[0])
    out = np.empty((placement.vocabulary_size,) + first.shape[1:], dtype=first.dtype)
    for s, part in enumerate(shards):
        expected = placement.rows_in_shard(s)
        if part.shape[0] != expected:
            raise ValueError(f"Shard {s} must have {expected} rows. Received: shape={part.shape}")
        out[placement.global_ids(s)] = part
    return out
