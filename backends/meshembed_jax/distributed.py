"""Where a JAX table lives: its shards on the devices (:class:`ShardLayout`), and the several
JAX processes (``jax.distributed.initialize``) sharing the tables (:class:`JaxProcesses`).
Importing this module never imports jax.

A table with ``S`` logical shards (MOD/DIV rows, ``meshembed.sharding.Placement``) is stored
as one padded ``[S, max_rows, D]`` ``jax.Array``, sharded along axis 0 over a one-axis
``jax.sharding.Mesh`` of ``n_dev`` devices, where ``n_dev`` is the largest divisor of ``S``
that the devices allow. Device ``p`` of the mesh therefore holds the ``k = S // n_dev``
consecutive logical shards ``[p*k, (p+1)*k)`` as a ``[k, max_rows, D]`` block; shards with
one row fewer than ``max_rows`` keep a padding row that no id ever reaches.

With several JAX processes every call is collective: each process passes its own part of the
batch, the parts are joined in process order (all-gathers of host arrays) and each process
gets its own rows back. With one process nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from meshembed.backend.env import env_flag
from meshembed.sharding.placement import Placement

AXIS = "shard"


def bucket(n: int) -> int:
    """Round ``n`` up to one of at most 8 sizes per power of two (min 8): shapes repeat
    across steps with varying batch sizes while padding wastes at most 12.5%."""
    if n <= 8:
        return 8
    step = 1 << max((n - 1).bit_length() - 3, 0)
    return -(-n // step) * step


@dataclass(frozen=True)
class ShardLayout:
    """Static facts a kernel is compiled for: placement, device count and the mesh.

    Frozen and hashable so it can key kernel caches; every table and slot with the same
    placement gets the same layout, hence the same ``NamedSharding`` (slots co-sharded).
    """

    placement: Placement
    n_dev: int
    mesh: Any  # jax.sharding.Mesh over n_dev devices, axis AXIS
    #: Whether the CPU FFI row kernels may serve this layout (``kernels.use_cpu_kernels``): the
    #: backend's switch (``JaxBackend(cpu_kernels=)``); a layout made elsewhere reads
    #: ``$MESHEMBED_JAX_CPU_KERNELS`` (default on) once, when it is made.
    cpu_kernels: bool = field(default_factory=lambda: env_flag("MESHEMBED_JAX_CPU_KERNELS", True))

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

    @cached_property
    def device_set(self) -> set:
        """The mesh's devices (compared with an array's ``devices()``)."""
        return set(self.mesh.devices.flat)


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


class JaxProcesses:
    """``processes`` / ``agree`` and the multi-process batch plumbing of ``JaxBackend`` (a mixin)."""

    @property
    def processes(self) -> int:
        """``jax.process_count()``: the processes of ``jax.distributed`` sharing the tables."""
        return int(self._jax.process_count())

    def agree(self, status: int = 0) -> tuple[int, ...]:
        """Every process's status, in process order: one all-gather of an int32 scalar
        (collective when ``jax.process_count() > 1``; else ``(status,)``, no communication)."""
        if self._jax.process_count() == 1:
            return (int(status),)
        from jax.experimental import multihost_utils

        every = multihost_utils.process_allgather(np.asarray(int(status), np.int32))
        return tuple(int(s) for s in np.asarray(every).reshape(-1))

    def _put(self, host: np.ndarray, sharding: Any) -> Any:
        """Host array (the same on every process) -> global array with ``sharding``.

        On CPU the runtime may keep using ``host``'s memory instead of copying it, so
        ``host`` must be an array nobody else writes to."""
        jax = self._jax
        if jax.process_count() == 1:
            return jax.device_put(host, sharding)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _global_batch_multiprocess(self, layout: ShardLayout, idt: np.dtype, ids: Any, *rows: Any) -> tuple:
        local = [np.asarray(self.to_numpy(ids)).reshape(-1).astype(idt)]
        n = local[0].shape[0]
        local += [np.asarray(self.to_numpy(r)).reshape(n, -1) for r in rows]
        joined, offset = self._join_processes(local)
        nb = bucket(joined[0].shape[0])
        out = []
        for i, part in enumerate(joined):
            full = np.full((nb,) + part.shape[1:], -1 if i == 0 else 0, part.dtype)
            full[: part.shape[0]] = part
            out.append(self._put(full, layout.replicated))
        return (*out, n, offset)

    def _join_processes(self, parts: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """Every process's ``parts`` (host arrays of one leading length per process) joined
        in process order, and where this process's rows start. A collective: every process
        must call it with the same number of parts."""
        from jax.experimental import multihost_utils

        n = parts[0].shape[0]
        sizes = np.asarray(multihost_utils.process_allgather(np.array([n], np.int64))).reshape(-1)
        top = int(sizes.max())
        joined = []
        for part in parts:
            padded = np.zeros((top,) + part.shape[1:], part.dtype)
            padded[:n] = part
            every = np.asarray(multihost_utils.process_allgather(padded))  # [P, top, ...]
            joined.append(np.concatenate([every[p, : sizes[p]] for p in range(len(sizes))]))
        return joined, int(sizes[: self._jax.process_index()].sum())

    def _local_result(self, x: Any, n: int, offset: int) -> Any:
        """This process's rows of a replicated kernel result."""
        if self._jax.process_count() > 1:
            x = x.addressable_data(0)
        return x[offset : offset + n] if (offset or x.shape[0] != n) else x
