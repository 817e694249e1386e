"""``NumpyShardedTable``: a table as one NumPy array per logical shard (MOD/DIV rows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from meshembed.backend.protocol import ShardedTable
from meshembed.sharding.placement import Placement


class NumpyShardedTable(ShardedTable):
    """``shards[s]``: shard ``s``'s rows in local-row order (``Placement.global_ids``)."""

    def __init__(self, shards: list[np.ndarray], placement: Placement):
        self.shards = shards
        self.placement = placement

    @property
    def shape(self) -> tuple[int, int]:
        return (self.placement.vocabulary_size, self.shards[0].shape[1])

    @property
    def dtype(self) -> Any:
        return self.shards[0].dtype
