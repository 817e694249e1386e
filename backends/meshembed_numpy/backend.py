"""The NumPy backend.

Each table is a list of per-shard arrays placed by MOD/DIV (``meshembed.sharding``).
Row access goes shard by shard, exactly as a multi-device backend routes ids to owners,
so a placement bug shows up here first.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as xp_numpy
import numpy as np

from meshembed.backend.protocol import Backend, Capabilities, walk_blocks
from meshembed.sharding.placement import Placement, shard, unshard
from meshembed_numpy.dense import NumpyDenseMixin
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

    def create_table(self, values: np.ndarray, placement: Placement) -> NumpyShardedTable:
        return NumpyShardedTable(shard(np.asarray(values), placement), placement)  # fresh arrays

    def create_table_from_blocks(self, shape: tuple[int, int], blocks: Any, placement: Placement) -> NumpyShardedTable:
        shards = [np.empty((placement.rows_in_shard(s), shape[1]), dtype=np.float32)
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
        owner = table.placement.owner(ids)
        local = table.placement.local_row(ids)
        out = np.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
        for s, part in enumerate(table.shards):
            mask = owner == s
            out[mask] = part[local[mask]]
        return out

    def scatter(self, table: NumpyShardedTable, ids: np.ndarray, rows: np.ndarray) -> NumpyShardedTable:
        ids = np.asarray(ids, dtype=np.int64)
        owner = table.placement.owner(ids)
        local = table.placement.local_row(ids)
        for s, part in enumerate(table.shards):
            mask = owner == s
            part[local[mask]] = rows[mask]
        return table

    def segment_sum(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        uids, inverse = np.unique(ids, return_inverse=True)
        sums = np.zeros((uids.shape[0],) + values.shape[1:], dtype=values.dtype)
        np.add.at(sums, inverse.reshape(-1), values)
        return uids, sums

    def segment_sum_to(self, values: np.ndarray, segment_ids: np.ndarray, num_segments: int) -> np.ndarray:
        out = np.zeros((num_segments,) + values.shape[1:], dtype=values.dtype)
        np.add.at(out, np.asarray(segment_ids, dtype=np.int64), values)
        return out
