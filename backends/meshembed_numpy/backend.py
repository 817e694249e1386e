"""The NumPy backend.

Each table is a list of per-shard arrays placed by MOD/DIV (``meshembed.sharding``).
Row access goes shard by shard, exactly as a multi-device backend routes ids to owners,
so a placement bug shows up here first.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import array_api_compat.numpy as xp_numpy
import numpy as np

from meshembed.backend.protocol import Backend, Capabilities, walk_blocks
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed.sharding.placement import Placement, shard, unshard
from meshembed_numpy.table import NumpyShardedTable


#: Elements per piece of an elementwise dense step (256 KiB of float32; see compile_update).
PIECE_ELEMENTS = 1 << 16


class NumpyBackend(Backend):
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

    def compile_update(self, rule: UpdateRule, count: int) -> Callable[..., Any]:
        """An element-wise rule (Adadelta's) runs on pieces of ``PIECE_ELEMENTS`` of each
        variable and writes them in place: NumPy evaluates a formula one full-size temporary
        per operation, which at W2 (16.7M float32) held ~5 extra arrays (peak 2.7x the
        parameters and slots; 1.02x in pieces, at the same speed). Same numbers: every
        element depends only on the same element of each input."""
        if not rule.elementwise:
            return super().compile_update(rule, count)

        def step(grad: Any, values: tuple, *own: Any) -> tuple:
            return apply_rule(xp_numpy, rule, values, grad, *own)

        def step_in_pieces(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> None:
            for n in range(count):
                own = [t[n] for t in targets]
                grad = np.asarray(grads[n])
                hp = tuple(values[n])  # Python floats: the reference's arithmetic
                if grad.shape != own[0].shape or not all(t.shape == grad.shape and t.flags.c_contiguous for t in own):
                    for target, new in zip(own, step(grad, hp, *own)):
                        target[...] = new
                    continue
                flat_grad, flat = grad.reshape(-1), [t.reshape(-1) for t in own]  # views of the targets
                for start in range(0, flat_grad.size, PIECE_ELEMENTS):
                    piece = slice(start, start + PIECE_ELEMENTS)
                    for target, new in zip(flat, step(flat_grad[piece], hp, *(t[piece] for t in flat))):
                        target[piece] = new

        return step_in_pieces

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
