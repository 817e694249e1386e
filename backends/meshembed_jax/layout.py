"""Where a table's logical shards live on JAX devices (no jax import at module level).

A table with ``S`` logical shards (MOD/DIV rows, ``meshembed.sharding.Placement``) is stored
as one padded ``[S, max_rows, D]`` ``jax.Array``, sharded along axis 0 over a one-axis
``jax.sharding.Mesh`` of ``n_dev`` devices, where ``n_dev`` is the largest divisor of ``S``
that the devices allow. Device ``p`` of the mesh therefore holds the ``k = S // n_dev``
consecutive logical shards ``[p*k, (p+1)*k)`` as a ``[k, max_rows, D]`` block; shards with
one row fewer than ``max_rows`` keep a padding row that no id ever reaches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from meshembed.backend.env import env_flag
from meshembed.sharding.placement import Placement

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
