"""The NumPy backend.

Each table is a list of per-shard arrays placed by MOD/DIV (``meshembed.sharding``).
Row access goes shard by shard, exactly as a multi-device backend routes ids to owners,
so a placement bug shows up here first. Segment sums add each key's rows in input order
(``kernels.py``: the bits every other backend reproduces), fetching rows as they go, so a
step builds no ``[ids, D]`` array of gathered rows or per-id gradients.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.numpy as xp_numpy
import numpy as np

from meshembed.backend.protocol import Backend, Capabilities, RowUpdate, check_rule, walk_blocks
from meshembed.errors import NonFiniteError
from meshembed.math.rule import apply_rule
from meshembed.sharding.placement import Placement, shard, unshard
from meshembed_numpy.dense import NumpyDenseMixin
from meshembed_numpy.kernels import Segments
from meshembed_numpy.table import NumpyShardedTable


class NumpyBackend(NumpyDenseMixin, Backend):
    name = "numpy"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(devices=1, float64=True, in_place=True, deterministic_scatter=True)

    @property
    def xp(self) -> Any:
        return xp_numpy

    def asarray(self, x: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(x, dtype=None if dtype is None else np.dtype(dtype))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def bitcast(self, x: Any, dtype: Any) -> np.ndarray:
        return np.ascontiguousarray(x).view(np.dtype(dtype))

    def real_view_aliases(self, x: Any) -> bool:
        return isinstance(x, np.ndarray) and x.flags.c_contiguous

    def real_view(self, x: Any) -> np.ndarray:
        """A view of ``x``'s storage (``x`` C-contiguous; otherwise of a contiguous copy)."""
        x = np.ascontiguousarray(x)
        return x[..., None].view(np.float32 if x.dtype == np.complex64 else np.float64)

    def from_real_view(self, x: Any) -> np.ndarray:
        x = np.ascontiguousarray(x)
        return x.view(np.complex64 if x.dtype == np.float32 else np.complex128)[..., 0]

    def create_table(self, values: np.ndarray, placement: Placement) -> NumpyShardedTable:
        return NumpyShardedTable(shard(np.asarray(values), placement), placement)  # fresh arrays

    def create_table_from_blocks(self, shape: tuple[int, int], blocks: Any, placement: Placement,
                                 dtype: Any = "float32") -> NumpyShardedTable:
        shards = [np.empty((placement.rows_in_shard(s), shape[1]), dtype=np.dtype(dtype))
                  for s in range(placement.num_shards)]

        def place(start: int, block: np.ndarray) -> None:
            for s, first, rows in placement.block_parts(start, start + len(block)):
                part = block[rows]
                shards[s][first : first + len(part)] = part

        walk_blocks(shape, blocks, place)
        return NumpyShardedTable(shards, placement)

    def unshard(self, table: NumpyShardedTable) -> np.ndarray:
        return unshard(table.shards, table.placement)

    def gather(self, table: NumpyShardedTable, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if len(table.shards) == 1:  # one shard: local row == global id under MOD and DIV
            return np.take(table.shards[0], ids, axis=0)  # np.take: ~5× fancy indexing's speed
        owner = table.placement.owner(ids)
        local = table.placement.local_row(ids, owner=owner)
        out = np.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
        for s, part in enumerate(table.shards):
            mask = owner == s
            out[mask] = np.take(part, local[mask], axis=0)
        return out

    def scatter(self, table: NumpyShardedTable, ids: np.ndarray, rows: np.ndarray) -> NumpyShardedTable:
        ids = np.asarray(ids, dtype=np.int64)
        if len(table.shards) == 1:
            table.shards[0][ids] = rows
            return table
        owner = table.placement.owner(ids)
        local = table.placement.local_row(ids, owner=owner)
        for s, part in enumerate(table.shards):
            mask = owner == s
            part[local[mask]] = rows[mask]
        return table

    def segment_sum(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values = np.asarray(values)
        flat = values.reshape(values.shape[0], math.prod(values.shape[1:]))  # any trailing shape, as segment_sum_to
        segs = Segments(ids)
        sums = segs.sum(lambda pos: np.take(flat, pos, axis=0), flat.shape[1], values.dtype)
        return segs.unique, sums.reshape((segs.unique.shape[0],) + values.shape[1:])

    def segment_sum_to(self, values: np.ndarray, segment_ids: np.ndarray, num_segments: int) -> np.ndarray:
        values = np.asarray(values)
        flat = values.reshape(values.shape[0], math.prod(values.shape[1:]))  # any trailing shape (1-D: a dense optimizer's sparse rows)
        segs = Segments(segment_ids)
        out = np.zeros((num_segments, flat.shape[1]), dtype=values.dtype)
        out[segs.unique] = segs.sum(lambda pos: np.take(flat, pos, axis=0), flat.shape[1], values.dtype)
        return out.reshape((num_segments,) + values.shape[1:])

    def gather_combine(self, table: NumpyShardedTable, ids: np.ndarray, segment_ids: np.ndarray, num_segments: int,
                       weights: np.ndarray | None = None, *, offsets: np.ndarray | None = None) -> np.ndarray:
        """The protocol's gather → weight → segment sum, with the rows gathered as summed."""
        ids = np.asarray(ids, dtype=np.int64)
        dtype = table.dtype if weights is None else np.result_type(table.dtype, weights.dtype)

        def rows(pos: np.ndarray) -> np.ndarray:
            r = self.gather(table, ids[pos])
            return r if weights is None else r * np.reshape(weights[pos], (-1, 1))

        segs = Segments(segment_ids)
        out = np.zeros((num_segments, table.shape[1]), dtype=dtype)
        out[segs.unique] = segs.sum(rows, table.shape[1], dtype)
        return out

    def apply_update(self, u: RowUpdate) -> list[NumpyShardedTable]:
        """The protocol's default (segment sum, gather, rule, scatter), with the per-id gradient
        rows ``grads[grad_index] * grad_weights`` made as they are summed."""
        values = check_rule(u.rule, u.values, self.name)
        grads = np.asarray(u.grads)
        if u.check_finite and not self.all_finite(grads):
            raise NonFiniteError()
        if u.guard is not None and not bool(u.guard):
            return list(u.tables)
        index, weights = u.grad_index, u.grad_weights
        dtype = grads.dtype if index is None or weights is None else np.result_type(grads.dtype, weights.dtype)

        def rows(pos: np.ndarray) -> np.ndarray:
            if index is None:
                return np.take(grads, pos, axis=0)
            r = np.take(grads, index[pos], axis=0)
            return r if weights is None else r * np.reshape(weights[pos], (-1, 1))

        segs = Segments(u.ids)
        g = segs.sum(rows, grads.shape[-1], dtype, sorted_keys=False)  # rows of segs.by_count
        uids = segs.by_count
        old = [self.gather(t, uids) for t in u.tables]
        new = apply_rule(self.xp, u.rule, values, g, *old)
        return [self.scatter(t, uids, r) for t, r in zip(u.tables, new)]
