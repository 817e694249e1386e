"""``TorchShardedTable``: one contiguous local tensor holding the shards this process owns.

Kept free of a module-level ``import torch`` so that ``import meshembed_torch`` works (and
reports why the backend is unavailable) on machines without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from meshembed.backend.protocol import ShardedTable
from meshembed.sharding.placement import Placement

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from meshembed_torch.distributed import RankGroup
    from meshembed_torch.kernels import RowMap


class TorchShardedTable(ShardedTable):
    """A ``[V, D]`` table split by a MOD/DIV :class:`Placement`.

    * ``data`` — the rows of every shard held here, concatenated in shard order (each shard
      in local-row order), so a row access for any number of logical shards is one
      ``index_select``/``index_copy_`` with an index computed by ``rowmap``.
    * Single process: every shard is held (``group is None``); a DIV table is then stored
      exactly in global order.
    * Distributed: shard ``s`` lives on rank ``s % world_size`` (shard id = rank when
      ``num_shards == world_size``), and ``group`` is the ``DeviceMesh``'s process group.
    """

    def __init__(self, data: "torch.Tensor", placement: Placement, rowmap: "RowMap",
                 group: "RankGroup | None" = None):
        self.data = data
        self.placement = placement
        self.rowmap = rowmap
        self.group = group

    @property
    def shape(self) -> tuple[int, int]:
        return (self.placement.vocabulary_size, int(self.data.shape[1]))

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def device(self) -> Any:
        return self.data.device

    @property
    def mesh(self) -> Any:
        """The ``DeviceMesh`` the rows are sharded over (None in a single process)."""
        return None if self.group is None else self.group.mesh

    @property
    def held_shards(self) -> tuple[int, ...]:
        return self.rowmap.held

    @property
    def shards(self) -> dict[int, "torch.Tensor"]:
        """Views of each held shard, keyed by shard id."""
        out, start = {}, 0
        for s in self.rowmap.held:
            rows = self.placement.rows_in_shard(s)
            out[s] = self.data[start:start + rows]
            start += rows
        return out

    def write_block(self, start: int, block: np.ndarray) -> None:
        """Copy logical rows ``[start, start + len(block))`` into the shards held here."""
        import torch

        src = torch.from_numpy(np.ascontiguousarray(block))
        for s, first, rows in self.placement.block_parts(start, start + len(block)):
            if s in self.rowmap.held:
                part = src[rows]
                at = self.rowmap.local_offset(s) + first
                self.data[at : at + len(part)].copy_(part)

    def __repr__(self) -> str:
        where = "single process" if self.group is None else f"rank {self.group.rank}/{self.group.world}"
        return (f"TorchShardedTable(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
                f"shards={self.placement.num_shards} {self.placement.strategy}, held={self.held_shards}, {where})")
