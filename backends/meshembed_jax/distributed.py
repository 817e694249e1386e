"""Several JAX processes (``jax.distributed.initialize``) sharing the tables.

Every call is then collective: each process passes its own part of the batch, the parts are
joined in process order (all-gathers of host arrays) and each process gets its own rows back.
With one process nothing here communicates. Importing this module never imports jax.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshembed_jax.layout import ShardLayout
from meshembed_jax.table import bucket


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
