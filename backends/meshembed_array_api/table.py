"""A sharded row table of any Array API library: one array per logical MOD/DIV shard."""

from __future__ import annotations

from typing import Any

from meshembed.backend.protocol import ShardedTable
from meshembed.sharding.placement import Placement


class ArrayAPIShardedTable(ShardedTable):
    """Per-shard ``[rows_in_shard, D]`` arrays placed by ``placement``. Immutable in use:
    a write returns a new table (the standard has no in-place indexed assignment)."""

    def __init__(self, shards: list[Any], placement: Placement):
        self.shards = shards
        self.placement = placement

    @property
    def shape(self) -> tuple[int, int]:
        return (self.placement.vocabulary_size, int(self.shards[0].shape[1]))

    @property
    def dtype(self) -> Any:
        return self.shards[0].dtype
