"""``TorchShardedTable``: one contiguous local tensor holding the shards this process owns.

Kept free of a module-level ``import torch`` so that ``import meshembed_torch`` works (and
reports why the backend is unavailable) on machines without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from meshembed.backend.protocol import ShardedTable
from meshembed.errors import InputError
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

    # -- ids, and their owners under torch.distributed -------------------------------------------
    def checked_ids(self, ids: "torch.Tensor") -> tuple["torch.Tensor", tuple[int, int]]:
        """``(ids as a 1-D int64 tensor on this table's device, (min, max))``, checked against
        the vocabulary (an out-of-range id would otherwise land on another shard's row under
        MOD); the range is returned for callers that would otherwise scan the ids again."""
        import torch

        t = ids
        if t.dtype != torch.int64:
            if t.is_floating_point() or t.dtype == torch.bool:
                raise InputError(f"Invalid `ids`. Expected integer ids. Received: dtype={t.dtype}")
            t = t.to(torch.int64)
        t = t.reshape(-1).to(self.data.device)
        lo, hi = 0, -1
        if t.numel():
            lo, hi = (int(v) for v in torch.aminmax(t))
            vocab = self.placement.vocabulary_size
            if lo < 0 or hi >= vocab:
                raise InputError(
                    f"Invalid `ids`. Expected ids in [0, {vocab}) for a table of vocabulary_size "
                    f"{vocab}. Received: min={lo}, max={hi}"
                )
        return t, (lo, hi)

    def owner_rank(self, ids: "torch.Tensor") -> "torch.Tensor":
        """The rank holding each id's row (distributed tables)."""
        owner = self.rowmap.owner(ids)
        return owner if self.placement.num_shards == self.group.world else owner % self.group.world

    def refuse(self, what: str, exc: BaseException) -> None:
        """This rank's input to ``what`` was invalid (``exc``; the caller re-raises it).
        Distributed, the rank still takes part in the call's first exchange, with a failure
        status, so every rank raises at once instead of waiting for this one
        (:class:`meshembed_torch.distributed.Route`). A plain ``try`` costs nothing when
        nothing fails, so single-process calls pay nothing."""
        if self.group is None:
            return
        import torch

        from meshembed.backend.status import status_of
        from meshembed.errors import MeshembedError
        from meshembed_torch.distributed import Route

        try:
            Route(self.group, self.data.new_zeros(0, dtype=torch.int64), what, status_of(exc))
        except MeshembedError:  # the peers' view of this failure; ours is exc
            pass

    def to_owners(self, ids: "torch.Tensor", g: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(ids, rows)`` that every rank sent to this one (the rows it owns), grouped by
        source rank in each rank's order. Collective (three all-to-alls), even with no ids."""
        from meshembed_torch.distributed import Route

        route = Route(self.group, self.owner_rank(ids), "update_rows")
        g = route.send("gradients", g.reshape(ids.shape[0], self.data.shape[1]))
        return route.send("ids", ids), g

    def __repr__(self) -> str:
        where = "single process" if self.group is None else f"rank {self.group.rank}/{self.group.world}"
        return (f"TorchShardedTable(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
                f"shards={self.placement.num_shards} {self.placement.strategy}, held={self.held_shards}, {where})")


def empty_table(dim: int, dtype: Any, placement: Placement, group: "RankGroup | None", device: Any) -> TorchShardedTable:
    """An uninitialised table of ``placement``'s shards this process holds (every shard in a
    single process; shard ``s`` on rank ``s % world`` over ``group``)."""
    from meshembed_torch.kernels import RowMap, empty_rows

    world, rank = (1, 0) if group is None else (group.world, group.rank)
    held = tuple(s for s in range(placement.num_shards) if s % world == rank)
    rowmap = RowMap(placement.vocabulary_size, placement.num_shards, placement.strategy, held, device)
    return TorchShardedTable(empty_rows((rowmap.local_rows, dim), dtype, device), placement, rowmap, group)
