"""Where a table's logical shards live on JAX devices (no jax import at module level).

A table with ``S`` logical shards (MOD/DIV rows, ``meshembed.sharding.Placement``) is stored
as one padded ``[S, max_rows, D]`` ``jax.Array``, sharded along axis 0 over a one-axis
``jax.sharding.Mesh`` of ``n_dev`` devices, where ``n_dev`` is the largest divisor of ``S``
that the devices allow. Device ``p`` of the mesh therefore holds the ``k = S // n_dev``
consecutive logical shards ``[p*k, (p+1)*k)`` as a ``[k, max_rows, D]`` block; shards with
one row fewer than ``max_rows`` keep a padding row that no id ever reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import numpy as np

from meshembed.backend.protocol import ShardedTable
from meshembed.sharding.placement import Placement
from meshembed_native.pages import HUGE_PAGE_MIN_BYTES, advise_huge_pages

AXIS = "shard"


@dataclass(frozen=True)
class ShardLayout:
    """Static facts a kernel is compiled for: placement, device count and the mesh.

    Frozen and hashable so it can key kernel caches; every table and slot with the same
    placement gets the same layout, hence the same ``NamedSharding`` (slots co-sharded).
    """

    placement: Placement
    n_dev: int
    mesh: Any  # jax.sharding.Mesh over n_dev devices, axis AXIS

    @property
    def num_shards(self) -> int:
        return self.placement.num_shards

    @property
    def max_rows(self) -> int:
        return self.placement.max_rows

    @property
    def shards_per_device(self) -> int:
        return self.num_shards // self.n_dev

    @property
    def rows_per_device(self) -> int:
        """Rows of one device's block, padding included (the dense id map's size)."""
        return self.shards_per_device * self.max_rows

    # one sharding object per layout: JAX caches facts such as the device assignment on it
    # (a new NamedSharding per call is a measurable cost in every device_put: docs/benchmarks.md)
    @cached_property
    def sharding(self) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(AXIS, None, None))

    @cached_property
    def replicated(self) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec())


def choose_devices(num_shards: int, devices: list[Any], process_count: int) -> list[Any]:
    """Devices for ``num_shards`` logical shards: the largest count that divides ``num_shards``.

    With several processes every process must own part of the table (each runs the same
    SPMD program), so the count must also be a multiple of the process count and the
    devices are taken evenly from every process.
    """
    by_process: dict[int, list[Any]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    local = min(len(v) for v in by_process.values())
    for n in range(min(num_shards, len(devices)), 0, -1):
        if num_shards % n or n % process_count or n // process_count > local:
            continue
        per = n // process_count
        chosen: list[Any] = []
        for p in sorted(by_process):
            chosen.extend(by_process[p][:per])
        return chosen
    raise ValueError(
        f"Invalid `num_shards` for {process_count} JAX processes: every process must hold at "
        f"least one logical shard, so num_shards must be a multiple of the process count. "
        f"Received: num_shards={num_shards}"
    )


class JaxShardedTable(ShardedTable):
    """A logical ``[V, D]`` table held as a sharded padded ``[S, max_rows, D]`` jax.Array.

    Kernels donate ``data`` and replace it with their output, so the wrapper object stays
    the same across steps while no step copies the table.
    """

    def __init__(self, data: Any, layout: ShardLayout, dim: int):
        self._data = data
        self.layout = layout
        self.placement = layout.placement
        self._dim = dim
        # a check of the last update that runs before anything reads ``data`` again
        # (``JaxBackend`` defers its capacity check so the host can prepare the next step)
        self.pending: Callable[[], None] | None = None

    @property
    def data(self) -> Any:
        if self.pending is not None:
            check, self.pending = self.pending, None
            check()
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        self._data = value

    @property
    def shape(self) -> tuple[int, int]:
        return (self.placement.vocabulary_size, self._dim)

    # dtype and sharding never change with an update: no need to wait for a pending check
    @property
    def dtype(self) -> Any:
        return np.dtype(self._data.dtype)

    @property
    def sharding(self) -> Any:
        return self._data.sharding

    def __repr__(self) -> str:
        p = self.placement
        return (
            f"JaxShardedTable(shape={self.shape}, dtype={self.dtype}, shards={p.num_shards} "
            f"({p.strategy}), devices={self.layout.n_dev})"
        )


def pad_shards(values: np.ndarray, placement: Placement) -> np.ndarray:
    """``[V, D]`` -> a new ``[S, max_rows, D]`` array with zero padding rows (host side).

    Always a fresh array: the CPU runtime may keep the memory it is given, and a table must
    never alias its caller's values. Each shard's rows are a strided (MOD) or contiguous
    (DIV) slice, copied once (no fancy-indexing temporary)."""
    s_all = placement.num_shards
    out = np.zeros((s_all, placement.max_rows) + values.shape[1:], dtype=values.dtype)
    for s in range(s_all):
        rows = placement.rows_in_shard(s)
        start = s if placement.strategy == "mod" else int(placement.shard_start(s))
        out[s, :rows] = values[start::s_all][:rows] if placement.strategy == "mod" else values[start : start + rows]
    return out


def unpad_shards(padded: np.ndarray, placement: Placement) -> np.ndarray:
    """Inverse of :func:`pad_shards`."""
    out = np.empty((placement.vocabulary_size,) + padded.shape[2:], dtype=padded.dtype)
    for s in range(placement.num_shards):
        out[placement.global_ids(s)] = padded[s, : placement.rows_in_shard(s)]
    return out


def collapse_to_huge_pages(array: Any) -> None:
    """Back a CPU table's buffers with 2 MiB pages: XLA has already allocated and written
    them, so collapse them now (``MADV_COLLAPSE``, Linux ≥ 6.1; docs/benchmarks.md, "Huge
    pages"). The buffers stay the same across steps (donated, written in place), so they keep
    their pages. A hint only: anything unsupported is left as it is.
    """
    try:
        shards = [s.data for s in array.addressable_shards]
        if any(d.platform != "cpu" for s in shards for d in s.devices()):  # (a cached set: never pop it)
            return
        for s in shards:
            nbytes = s.size * s.dtype.itemsize
            if nbytes >= HUGE_PAGE_MIN_BYTES:
                advise_huge_pages(s.unsafe_buffer_pointer(), nbytes, collapse=True)
    except Exception:  # noqa: BLE001 - a performance hint must never break table creation
        return

