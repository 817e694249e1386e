"""Sums per key in input order, vectorised: the NumPy backend's segment sums.

The order of a sum is the reference's contract: the rows that share a key are added one
after another in input order, starting from +0.0 (``np.add.at`` on a zero array; every
fast path — generated kernels, torch, JAX — gives the same bits). NumPy's reductions
(``sum``, ``add.reduceat``) add pairwise, so they are not used, and ``np.add.at`` on
``[n, D]`` rows pays about a microsecond per row. Here the rows are sorted by key (stably:
input order holds within a key) and summed in *rounds*: round ``r`` adds the ``r``-th row of
every key that has one, as one gather and one add over all those keys. Keys are kept in
decreasing count order, so the keys of round ``r`` are a prefix of the accumulator. After
``ROUNDS`` rounds, the rows left (Zipf's few frequent ids) go through ``np.add.at`` on a
flattened accumulator with one index per element — NumPy 2's one-dimensional fast path,
sequential in index order — a chunk at a time (:func:`add_rows_at`).

Rows are fetched by position (``fetch(positions)``), so a caller sums gathered table rows
or ``grads[slot] * weight`` without first building one ``[n, D]`` array of all of them
(time and peak memory: docs/benchmarks.md, "The NumPy backend").
"""

from __future__ import annotations

from typing import Callable

import numpy as np

#: Rounds of the vectorised loop (a pooled bag has fewer ids: its sum is all rounds).
ROUNDS = 16
#: Rows per chunk of :func:`add_rows_at` (4,096 × 64 floats: 1 MiB of rows, 2 MiB of index).
CHUNK_ROWS = 4096


class Segments:
    """The keys of one sum: ``unique`` (sorted) and where each one's rows are."""

    def __init__(self, keys: np.ndarray):
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if keys.size < 2 or bool(np.all(keys[1:] >= keys[:-1])):
            order = np.arange(keys.size)  # already sorted (the combiner's bags): no sort
        else:
            order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        first = np.ones(keys.size, dtype=bool)
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, keys.size))
        self.unique = ordered[starts]
        self._order = order
        self._by_count = np.argsort(-counts, kind="stable")  # round r's keys: a prefix
        self._starts, self._counts = starts[self._by_count], counts[self._by_count]

    @property
    def by_count(self) -> np.ndarray:
        """The unique keys in the order of ``sum(..., sorted_keys=False)``'s rows."""
        return self.unique[self._by_count]

    def sum(self, fetch: Callable[[np.ndarray], np.ndarray], width: int, dtype: np.dtype,
            sorted_keys: bool = True) -> np.ndarray:
        """``[len(unique), width]``: per key, its rows (``fetch(positions)``: the rows at those
        input positions, a new array) added in input order to +0.0, as ``accumulator + row``
        (a NaN's sign and payload are the hardware's, as on every backend).
        Rows in the order of ``unique``, or with ``sorted_keys=False`` of :attr:`by_count`
        (no reordering copy: a caller that scatters by key needs none)."""
        acc = np.zeros((self.unique.size, width), dtype=dtype)
        starts, counts, order = self._starts, self._counts, self._order
        rounds = min(ROUNDS, int(counts[0]) if counts.size else 0)
        # active[r]: how many keys have more than r rows (counts decrease)
        active = np.searchsorted(-counts, -np.arange(rounds + 1), side="left")
        for r in range(rounds):
            acc[: active[r]] += fetch(order[starts[: active[r]] + r])
        long = int(active[rounds]) if counts.size else 0  # keys with rows left after the rounds
        if long:
            left = counts[:long] - rounds
            keys = np.repeat(np.arange(long), left)
            within = np.arange(keys.size) - np.repeat(np.cumsum(left) - left, left)
            positions = order[np.repeat(starts[:long] + rounds, left) + within]
            add_rows_at(acc, keys, lambda part: fetch(positions[part]))
        if not sorted_keys:
            return acc
        out = np.empty_like(acc)
        out[self._by_count] = acc
        return out


def add_rows_at(out: np.ndarray, targets: np.ndarray, fetch: Callable[[slice], np.ndarray]) -> np.ndarray:
    """``out[targets[i]] += fetch(i)`` for ``i`` in input order, exactly as ``np.add.at(out,
    targets, rows)`` (``out``: ``[m, D]``, C-contiguous; ``fetch(s)``: the rows of the input
    positions in slice ``s``), with one index per element: the same additions in the same
    order, on NumPy 2's fast path. Returns ``out``."""
    width = out.shape[1]
    flat, columns = out.reshape(-1), np.arange(width, dtype=np.intp)
    for start in range(0, targets.shape[0], CHUNK_ROWS):
        part = slice(start, start + CHUNK_ROWS)
        index = (targets[part].astype(np.intp)[:, None] * width + columns).reshape(-1)
        np.add.at(flat, index, np.ascontiguousarray(fetch(part)).reshape(-1))
    return out
