"""The JAX backend: sharded ``jax.Array`` tables, jit + donation, shard_map routing.

Importing this module never imports jax (``unavailable_reason`` must work without it);
jax is imported when the backend is instantiated.

Design (see ``layout.py`` and ``kernels.py``):

* a table is one padded ``[num_shards, max_rows, D]`` array with a ``NamedSharding`` over a
  one-axis mesh; slots are created with the same placement and so share the sharding;
* lookup/scatter/update are ``jax.jit``-compiled ``shard_map`` kernels, cached by static
  shape, with table and slot buffers donated;
* batch sizes are rounded up to buckets (at most 8 per octave) so varying batches reuse a
  few compiled shapes; unique ids per device are bounded by a *capacity*, explicit
  (``JaxBackend(capacity=...)`` / ``MESHEMBED_JAX_CAPACITY``: overflow raises
  ``CapacityError``) or automatic (grows and retries, tables unchanged meanwhile);
* with several JAX processes (``jax.distributed.initialize``) every call is collective:
  each process passes its own part of the batch and gets its own rows back.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Sequence

import numpy as np

from meshembed.backend.env import env_choice, env_int
from meshembed.backend.protocol import Backend, Capabilities, walk_blocks
from meshembed.errors import CapacityError, ConfigError, InputError
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed.sharding.placement import Placement
from meshembed_jax.dense import JaxDenseMixin
from meshembed_jax.layout import (
    JaxShardedTable,
    ShardLayout,
    choose_devices,
    collapse_to_huge_pages,
    pad_shards,
    unpad_shards,
)

_KERNEL_CACHE_SIZE = 128
#: Tables from this size on are filled on their devices block by block
#: (``create_table_from_blocks``); smaller ones are joined on the host first.
BLOCKWISE_MIN_BYTES = 32 << 20
#: Host bytes of one window of that fill (all shards together).
WINDOW_BYTES = 8 << 20


#: Registered fused updates run in this process (tests check the path was taken).
fused_calls = [0]


def bucket(n: int) -> int:
    """Round ``n`` up to one of at most 8 sizes per power of two (min 8): shapes repeat
    across steps with varying batch sizes while padding wastes at most 12.5%."""
    if n <= 8:
        return 8
    step = 1 << max((n - 1).bit_length() - 3, 0)
    return -(-n // step) * step


class JaxBackend(JaxDenseMixin, Backend):
    """Tables on a ``jax.sharding.Mesh``; compiled, donated, shard_map-routed row kernels.

    Args:
        capacity: max unique ids one device may own per step (static shape of the update).
            ``None``: ``MESHEMBED_JAX_CAPACITY`` or automatic (start at a quarter of the
            batch bucket, grow on overflow).
        dedup: ``"dense"`` (row -> slot map, no sort), ``"sort"`` or ``None`` = pick per
            table (dense while a device holds at most max(64 x batch, 2^24) rows);
            ``MESHEMBED_JAX_DEDUP`` overrides ``None``.
        enable_x64: ``True`` requires the process's own ``jax_enable_x64`` (checked, never
            set: the backend changes no global JAX flag). ``None``/``False``: follow it. With
            x64 off ids are int32 (int64 input range-checked and narrowed), tables, slots
            and counters 32-bit, and float64 tables are refused.
        devices: the devices tables are placed on (default ``jax.devices()``).
    """

    name = "jax"

    def __init__(self, capacity: int | None = None, dedup: str | None = None, enable_x64: bool | None = None,
                 devices: Sequence[Any] | None = None):
        import jax

        if enable_x64 and not jax.config.jax_enable_x64:
            raise ConfigError(
                "Invalid `enable_x64=True`: jax_enable_x64 is off, and meshembed never changes a "
                "process-wide JAX flag. Fix: call jax.config.update('jax_enable_x64', True) (or set "
                "JAX_ENABLE_X64=1) at the start of your program, or use 32-bit tables."
            )
        self._jax = jax
        # the devices tables are placed on (me.jax: those of the user's Mesh, in its order)
        self._devices = None if devices is None else list(devices)
        self.capacity = capacity if capacity is not None else env_int("MESHEMBED_JAX_CAPACITY")
        self.dedup = dedup or env_choice("MESHEMBED_JAX_DEDUP", ("dense", "sort"))
        if self.dedup is not None and self.dedup not in ("dense", "sort"):
            raise ValueError(f"Invalid `dedup`. Expected one of ('dense', 'sort'). Received: dedup={self.dedup!r}")
        self._layouts: dict[tuple[Placement, tuple[int, ...]], ShardLayout] = {}
        self._meshes: dict[tuple[int, ...], Any] = {}
        self._kernels: collections.OrderedDict[Any, Callable] = collections.OrderedDict()
        self._auto_capacity: dict[tuple[Any, int], int] = {}
        self._prepared: collections.OrderedDict[Any, tuple[Any, Any]] = collections.OrderedDict()
        self._no_weight_arrays: dict[tuple, Any] = {}
        self._hp_arrays: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    # -- discovery ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import jax
        except ImportError as exc:
            return f"jax is not installed ({exc})"
        try:
            jax.devices()
        except Exception as exc:  # a broken install or no usable platform
            return f"jax cannot start ({type(exc).__name__}: {exc})"
        return None

    @property
    def capabilities(self) -> Capabilities:
        x64 = bool(self._jax.config.jax_enable_x64)  # devices and processes are fixed by now
        cached = self.__dict__.get("_caps")
        if cached is None or cached.float64 != x64:
            cached = self._caps = self._capabilities()
        return cached

    def _capabilities(self) -> Capabilities:
        jax = self._jax
        platform = jax.devices()[0].platform
        return Capabilities(
            devices=len(self._devices or jax.devices()),
            float64=bool(jax.config.jax_enable_x64),
            in_place=True,  # donated buffers; the table object is updated and returned
            deterministic_scatter=platform in ("cpu", "tpu"),
            autodiff=True,
            compiles=True,
            distributed=jax.process_count() > 1,
            runs_hlo=True,
            update_rules=True,
            # with several processes each one holds its own gradients: check before updating
            guarded_updates=jax.process_count() == 1,
        )

    def hlo_program(self, table_name: str, program: bytes, num_slots: int) -> dict[str, Any]:
        """UserDefinedProgram's ``hlo_runner`` / ``takes_learning_rate`` (``runs_hlo``): the
        program runs on XLA's CPU client, also inside the compiled step (:mod:`.hlo`)."""
        from meshembed_jax import hlo

        return dict(hlo.program_hyperparameters(table_name, bytes(program), int(num_slots)))

    @property
    def xp(self) -> Any:
        xp = self.__dict__.get("_xp")
        if xp is None:  # array_namespace needs an array: make it once, not per call
            import array_api_compat
            import jax.numpy as jnp

            xp = self._xp = array_api_compat.array_namespace(jnp.zeros(()))
        return xp

    def all_finite(self, x: Any) -> bool:
        """The protocol's sum-first test as two compiled reductions instead of eager ops."""
        if not self.is_native(x):
            return super().all_finite(x)
        jnp = self._jax.numpy
        finite_sum = self._kernel("finite_sum", lambda: self._jax.jit(lambda v: jnp.isfinite(jnp.sum(v))))
        if bool(finite_sum(x)):
            return True
        every = self._kernel("all_finite", lambda: self._jax.jit(lambda v: jnp.all(jnp.isfinite(v))))
        return bool(every(x))

    def finite_guard(self, arrays: Sequence[Any]) -> Any:
        """One compiled check over every array; dispatched, not waited for.

        On one CPU device (float32/float64) an FFI kernel tests the exponent bits on XLA's
        thread pool (faster than XLA: docs/benchmarks.md); elsewhere
        ``sum(x * 0)``, 0 when every element is finite and NaN otherwise (it cannot
        overflow): exact, and faster than XLA's ``all(isfinite(x))``."""
        from meshembed_jax import cpu_kernels

        jnp = self._jax.numpy
        arrays = [self.asarray(a) for a in arrays]
        if (arrays and all(len(a.sharding.device_set) == 1 for a in arrays)
                and cpu_kernels.usable(next(iter(arrays[0].devices())).platform, *(a.dtype for a in arrays))):
            check = self._kernel(("finite_guard_ffi", len(arrays)), lambda: self._jax.jit(
                lambda *xs: cpu_kernels.all_finite(list(xs))))
        else:
            check = self._kernel(("finite_guard", len(arrays)), lambda: self._jax.jit(
                lambda *xs: jnp.isfinite(sum(jnp.sum(x * 0) for x in xs))))
        return check(*arrays)

    # -- dense arrays ------------------------------------------------------------------
    def asarray(self, x: Any, dtype: Any = None) -> Any:
        import jax.numpy as jnp

        dtype = None if dtype is None else np.dtype(dtype)
        if dtype is not None and dtype.itemsize == 8 and not self._jax.config.jax_enable_x64:
            if dtype.kind not in "iu":
                raise InputError(
                    f"Invalid `dtype` {dtype} for the jax backend without jax_enable_x64. Fix: "
                    "enable x64 yourself at startup (jax.config.update('jax_enable_x64', True)) "
                    "or use 32-bit dtypes."
                )
            return self._narrow_ids(x, dtype)
        if self.is_native(x):
            return x if dtype is None or x.dtype == dtype else x.astype(dtype)
        if isinstance(x, np.ndarray) or not isinstance(x, (np.generic, int, float, bool, list, tuple)):
            # torch CPU tensors, cupy via __array__, ...; device_put is faster than jnp.asarray
            host = np.asarray(x, dtype=dtype)
            if host.dtype.itemsize == 8 and not self._jax.config.jax_enable_x64:
                host = host.astype(host.dtype.kind + "4") if host.dtype.kind in "fiu" else host
            return self._jax.device_put(host)
        return jnp.asarray(x, dtype=dtype)

    def _narrow_ids(self, x: Any, dtype: np.dtype) -> Any:
        """64-bit integers without x64: int32 after a range check (ids, counters)."""
        narrow = np.dtype(dtype.kind + "4")
        if self.is_native(x):
            return x if x.dtype == narrow else x.astype(narrow)  # already at most 32 bits
        host = np.asarray(x)
        info = np.iinfo(narrow)
        if host.size and (host.min() < info.min or host.max() > info.max):
            raise InputError(
                f"Invalid integer values for the jax backend without jax_enable_x64: they must fit "
                f"{narrow} (range {info.min}..{info.max}). Received: min={host.min()}, max={host.max()}. "
                "Fix: enable x64 yourself at startup (jax.config.update('jax_enable_x64', True))."
            )
        return self._jax.device_put(host.astype(narrow))

    def to_numpy(self, x: Any) -> np.ndarray:
        if isinstance(x, JaxShardedTable):
            return self.unshard(x)
        if self.is_native(x) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    def is_native(self, x: Any) -> bool:
        return isinstance(x, self._jax.Array)

    def is_traced(self, x: Any) -> bool:
        return isinstance(x, self._jax.core.Tracer)

    def compile(self, fn: Callable, **options: Any) -> Callable:
        """``jax.jit``; options such as ``donate_argnums``/``static_argnames`` pass through."""
        return self._jax.jit(fn, **options)

    # -- processes -----------------------------------------------------------------------
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

    # -- layout --------------------------------------------------------------------------
    def layout(self, placement: Placement) -> ShardLayout:
        """The (cached) device layout of a placement; equal placements share one sharding."""
        jax = self._jax
        if placement.vocabulary_size >= 2**31 - 1 and not jax.config.jax_enable_x64:
            raise ConfigError(
                f"Invalid `vocabulary_size`={placement.vocabulary_size} for the jax backend without "
                "jax_enable_x64: its ids need more than int32. Fix: call "
                "jax.config.update('jax_enable_x64', True) at startup, or use a smaller vocabulary."
            )
        devices = choose_devices(placement.num_shards, list(self._devices or jax.devices()), jax.process_count())
        key = (placement, tuple(d.id for d in devices))
        found = self._layouts.get(key)
        if found is None:
            mesh = self._meshes.get(key[1])
            if mesh is None:
                from jax.sharding import Mesh

                from meshembed_jax.layout import AXIS

                mesh = self._meshes[key[1]] = Mesh(np.array(devices, dtype=object), (AXIS,))
            found = self._layouts[key] = ShardLayout(placement, len(devices), mesh)
        return found

    def _put(self, host: np.ndarray, sharding: Any) -> Any:
        """Host array (the same on every process) -> global array with ``sharding``.

        On CPU the runtime may keep using ``host``'s memory instead of copying it, so
        ``host`` must be an array nobody else writes to."""
        jax = self._jax
        if jax.process_count() == 1:
            return jax.device_put(host, sharding)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    # -- sharded row tables ------------------------------------------------------------
    def create_table(self, values: Any, placement: Placement) -> JaxShardedTable:
        values = np.asarray(values.shape and self.to_numpy(values) if self.is_native(values) else values)
        if values.ndim != 2 or values.shape[0] != placement.vocabulary_size:
            raise InputError(
                f"Invalid table values. Expected shape ({placement.vocabulary_size}, dim). "
                f"Received: shape={values.shape}"
            )
        if values.dtype.itemsize == 8 and not self._jax.config.jax_enable_x64:
            raise InputError(
                f"Invalid table dtype {values.dtype}: 64-bit tables on the jax backend need "
                "jax_enable_x64, which meshembed never turns on for you. Fix: call "
                "jax.config.update('jax_enable_x64', True) at startup, or use float32 values."
            )
        layout = self.layout(placement)
        data = self._put(pad_shards(values, placement), layout.sharding)  # a fresh host array
        collapse_to_huge_pages(data)
        return JaxShardedTable(data, layout, values.shape[1])

    def create_table_from_blocks(self, shape: tuple[int, int], blocks: Any, placement: Placement) -> JaxShardedTable:
        """A large table is made as zeros on its devices and filled window by window, in
        place, so the host never holds the whole table next to the devices' copy; a small
        one is joined on the host and put at once (fewer compiled kernels)."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from meshembed_jax import kernels
        from meshembed_jax.layout import AXIS

        rows, dim = shape
        if rows * dim * 4 < BLOCKWISE_MIN_BYTES:
            return super().create_table_from_blocks(shape, blocks, placement)
        layout = self.layout(placement)
        s_all, r_max = placement.num_shards, placement.max_rows
        c = max(1, min(r_max, WINDOW_BYTES // (4 * dim * s_all)))  # rows per shard and window
        zeros = self._kernel(("zeros", layout, dim), lambda: self._jax.jit(
            lambda: jnp.zeros((s_all, r_max, dim), jnp.float32), out_shardings=layout.sharding))
        write = self._kernel(("window_write", layout, c, dim), lambda: kernels.make_window_write(layout))
        by_shard = NamedSharding(layout.mesh, PartitionSpec(AXIS))
        table = JaxShardedTable(zeros(), layout, dim)

        def place(start: int, block: np.ndarray) -> None:
            parts = placement.block_parts(start, start + len(block))
            longest = max(len(range(*sl.indices(len(block)))) for _, _, sl in parts)
            for w in range(0, longest, c):
                window = np.zeros((s_all, c, dim), np.float32)
                at, lo, hi = (np.zeros(s_all, np.int32) for _ in range(3))
                for s, first, sl in parts:
                    part = block[sl][w : w + c]
                    if len(part):  # shard s gets local rows first + w ...: a window ending in the table
                        at[s] = min(first + w, r_max - c)
                        lo[s], hi[s] = first + w - at[s], first + w - at[s] + len(part)
                        window[s, lo[s] : hi[s]] = part
                table.data = write(table.data, self._put(window, layout.sharding),
                                   *(self._put(x, by_shard) for x in (at, lo, hi)))
                table.data.block_until_ready()  # one window in flight: dispatch is asynchronous

        walk_blocks(shape, blocks, place)
        collapse_to_huge_pages(table.data)
        return table

    def unshard(self, table: JaxShardedTable) -> np.ndarray:
        return unpad_shards(self.to_numpy(table.data), table.placement)

    def _kernel(self, key: Any, build: Callable[[], Callable]) -> Callable:
        """LRU cache of compiled kernels, keyed by everything static about them."""
        fn = self._kernels.get(key)
        if fn is None:
            fn = self._kernels[key] = build()
            while len(self._kernels) > _KERNEL_CACHE_SIZE:
                self._kernels.popitem(last=False)
        else:
            self._kernels.move_to_end(key)
        return fn

    def _global_batch(self, layout: ShardLayout, ids: Any, *rows: Any) -> tuple[Any, ...]:
        """Pad ``ids`` (with -1) and row arrays (with 0) to a bucket, replicated on the mesh.

        Returns ``(ids, *rows, n_local, offset)``: with several processes each one passes its
        own part and the parts are concatenated in process order; ``offset`` is where this
        process's part starts.
        """
        import jax.numpy as jnp

        from meshembed_jax.kernels import index_dtype

        jax = self._jax
        idt = np.dtype(index_dtype(layout))
        if jax.process_count() > 1:
            return self._global_batch_multiprocess(layout, idt, ids, *rows)
        n = int(np.prod(ids.shape))
        nb = bucket(n)
        if self.is_native(ids):
            ids = ids.reshape(-1).astype(idt)
            if nb > n:
                ids = jnp.concatenate([ids, jnp.full((nb - n,), -1, idt)])
        else:
            host = np.full((nb,), -1, idt)
            host[:n] = np.asarray(ids).reshape(-1)
            ids = host
        out = [jax.device_put(ids, layout.replicated)]
        for r in rows:
            if self.is_native(r):
                r = r.reshape(n, -1)
                if nb > n:
                    r = jnp.concatenate([r, jnp.zeros((nb - n, r.shape[1]), r.dtype)])
            else:
                r = np.asarray(r).reshape(n, -1)
                if nb > n:
                    r = np.concatenate([r, np.zeros((nb - n, r.shape[1]), r.dtype)])
            out.append(jax.device_put(r, layout.replicated))
        return (*out, n, 0)

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

    def gather(self, table: JaxShardedTable, ids: Any) -> Any:
        from meshembed_jax import kernels

        layout, dim = table.layout, table.shape[1]
        shape = tuple(ids.shape)
        gids, n, offset = self._global_batch(layout, ids)
        lookup = self._kernel(("lookup", layout, dim), lambda: kernels.make_lookup(layout, dim))
        rows = self._local_result(lookup(table.data, gids), n, offset)
        return rows.reshape(shape + (dim,)) if len(shape) != 1 else rows

    def scatter(self, table: JaxShardedTable, ids: Any, rows: Any) -> JaxShardedTable:
        from meshembed_jax import kernels

        layout, dim = table.layout, table.shape[1]
        gids, grows, _, _ = self._global_batch(layout, ids, rows)
        write = self._kernel(("scatter", layout, dim), lambda: kernels.make_scatter(layout, dim))
        table.data = write(table.data, gids, grows)
        return table

    def segment_sum(self, ids: Any, values: Any) -> tuple[Any, Any]:
        import jax.numpy as jnp

        from meshembed_jax import kernels

        ids = self.asarray(ids)
        values = self.asarray(values)
        n = ids.shape[0]
        nb = bucket(n)
        if nb > n:
            ids = jnp.concatenate([ids, jnp.full((nb - n,), -1, ids.dtype)])
            values = jnp.concatenate([values, jnp.zeros((nb - n,) + values.shape[1:], values.dtype)])
        fn = self._kernel(("segment_sum", nb), lambda: kernels.make_segment_sum(nb))
        uniq, sums, count = fn(ids, values)
        c = int(count)
        return uniq[:c], sums[:c]

    def segment_sum_to(self, values: Any, segment_ids: Any, num_segments: int) -> Any:
        jax = self._jax
        def build() -> Callable:
            def seg_sum(v: Any, s: Any, k: int) -> Any:
                # the engine's slots are usually sorted (sample-major); XLA's sorted scatter
                # is about twice as fast on CPU, so check on device and pick the variant
                return jax.lax.cond(
                    jax.numpy.all(s[1:] >= s[:-1]),
                    lambda: jax.ops.segment_sum(v, s, num_segments=k, indices_are_sorted=True),
                    lambda: jax.ops.segment_sum(v, s, num_segments=k),
                )

            return jax.jit(seg_sum, static_argnums=2)

        fn = self._kernel("segment_sum_to", build)
        return fn(self.asarray(values), self.asarray(segment_ids), int(num_segments))

    def _replicated_1d(self, layout: ShardLayout, x: Any, nb: int, fill: Any, dtype: Any) -> Any:
        """A flat array padded with ``fill`` to ``nb`` entries, replicated on the mesh.

        Padding runs on the host (no compilation per batch size); a native array on a CPU
        device is read in place. A native (immutable) array's result is remembered: the
        engine passes the same ids and slots to the lookup and then to the update."""
        dtype = np.dtype(dtype)
        native = self.is_native(x)
        if native:
            key = (id(x), layout, nb, fill, dtype.str)
            hit = self._prepared.get(key)
            if hit is not None and hit[0] is x:
                return hit[1]
            if any(d.platform != "cpu" for d in x.devices()):  # keep it on the accelerator
                import jax.numpy as jnp

                flat = x.reshape(-1).astype(dtype)
                if nb > flat.shape[0]:
                    flat = jnp.concatenate([flat, jnp.full((nb - flat.shape[0],), fill, dtype)])
                out = self._jax.device_put(flat, layout.replicated)
                return self._remember(key, x, out)
        host = np.full((nb,), fill, dtype)
        flat = np.asarray(x).reshape(-1)
        host[: flat.shape[0]] = flat
        out = self._jax.device_put(host, layout.replicated)
        return self._remember(key, x, out) if native else out

    def _no_weights(self, layout: ShardLayout, dtype: Any) -> Any:
        """The placeholder weights of an unweighted kernel call (made once per layout/dtype)."""
        key = (layout, np.dtype(dtype).str)
        if key not in self._no_weight_arrays:
            self._no_weight_arrays[key] = self._jax.device_put(np.zeros(1, dtype), layout.replicated)
        return self._no_weight_arrays[key]

    def _remember(self, key: Any, x: Any, out: Any) -> Any:
        self._prepared[key] = (x, out)
        while len(self._prepared) > 8:
            self._prepared.popitem(last=False)
        return out

    def gather_combine(
        self, table: JaxShardedTable, ids: Any, segment_ids: Any, num_segments: int, weights: Any = None
    ) -> Any:
        """One compiled kernel: each device gathers the rows it owns in pieces, weights them
        and sums them into its slots; a ``psum`` of ``[num_segments, D]`` combines devices."""
        from meshembed_jax import kernels

        if self._jax.process_count() > 1:  # each process passes its own part: route as before
            return super().gather_combine(table, ids, segment_ids, num_segments, weights)
        layout, dim = table.layout, table.shape[1]
        n = int(np.prod(ids.shape))
        nb, sb = bucket(n), bucket(int(num_segments))
        idt = kernels.index_dtype(layout)
        gids = self._replicated_1d(layout, ids, nb, -1, idt)
        segs = self._replicated_1d(layout, segment_ids, nb, sb, np.int32)  # padding: dropped
        weighted = weights is not None
        w = self._replicated_1d(layout, weights, nb, 0, table.dtype) if weighted else self._no_weights(layout, table.dtype)
        fn = self._kernel(
            ("gather_combine", layout, dim, nb, sb, weighted),
            lambda: kernels.make_gather_combine(layout, dim, nb, sb, weighted),
        )
        out = fn(table.data, gids, segs, w)
        return out[: int(num_segments)] if sb != num_segments else out

    # -- the fused update --------------------------------------------------------------
    def _dedup_for(self, layout: ShardLayout, nb: int) -> str:
        if self.dedup:
            return self.dedup
        return "dense" if layout.rows_per_device <= max(64 * nb, 1 << 24) else "sort"

    def _capacity_for(self, layout: ShardLayout, nb: int) -> int:
        if self.capacity is not None:
            return int(self.capacity)
        learned = self._auto_capacity.get((layout, nb))
        if learned is not None:
            return learned
        return min(nb, bucket(layout.rows_per_device), max(min(nb, 1024), bucket(nb // 4)))

    def check_update(self, tables: Sequence[JaxShardedTable], ids: np.ndarray) -> None:
        """With a fixed capacity, count the unique ids each device would own (on the host)
        and raise ``CapacityError`` before the engine writes any table; automatic capacity
        grows instead. With several processes the ids of all of them are counted (an
        all-gather: every process checks the same tables in the same order)."""
        if self.capacity is None:
            return
        ids = np.asarray(ids).reshape(-1)
        if self._jax.process_count() > 1:
            ids = self._join_processes([ids])[0][0]
        if len(ids) <= self.capacity:
            return
        layout = tables[0].layout
        placement = layout.placement
        ids = ids[(ids >= 0) & (ids < placement.vocabulary_size)]
        device = placement.owner(ids) // layout.shards_per_device
        worst = max((np.unique(ids[device == k]).size for k in np.unique(device)), default=0)
        if worst > self.capacity:
            raise self._capacity_error(tables[0], worst, self.capacity)

    def update_rows(
        self,
        tables: Sequence[JaxShardedTable],
        ids: Any,
        grads: Any,
        fn: UpdateRule,
        *,
        values: Sequence[Any] = (),
        grad_index: Any = None,
        grad_weights: Any = None,
        guard: Any = None,
    ) -> list[JaxShardedTable]:
        """One compiled step: route, dedup + segment-sum, gather rows, the rule ``fn`` with
        ``values`` (traced arguments: a new learning rate compiles nothing), scatter back.

        With ``grad_index`` the gradient of ``ids[i]`` is ``grad_weights[i] *
        grads[grad_index[i]]`` (the combiner's backward pass), formed in pieces inside the
        per-row sum of the same compiled step, never as a ``[len(ids), D]`` array.

        Where the rule has a generated row kernel (``cpu_kernels.row_kernel``: every
        elementwise rule, float32/float64 CPU tables, automatic capacity) the step is one C++
        pass per device instead of the XLA program; ``MESHEMBED_JAX_FUSED=0`` turns it off.

        Table and slot buffers are donated. On overflow of an explicit capacity it raises
        ``CapacityError`` with every table unchanged; with ``guard`` (a device boolean) false
        the step writes nothing. With automatic capacity (one process) it returns without
        waiting for the step; an overflow is found and the step redone with a larger
        capacity before the tables are next read.
        """
        tables = list(tables)
        layout, dim = self._check_tables(tables)
        values = self._check_rule(fn, values)
        guard = self._guard(layout, guard)
        if grad_index is not None and self._jax.process_count() > 1:
            # each process passes its own part: expand its rows and route them as before
            xp = self.xp
            grads = xp.take(self.asarray(grads), self.asarray(grad_index), axis=0)
            if grad_weights is not None:
                grads = grads * xp.reshape(self.asarray(grad_weights), (-1, 1))
            grad_index = None
        if grad_index is None:
            gids, ggrads, _, _ = self._global_batch(layout, ids, grads)
            nb = int(gids.shape[0])
            return self._update(tables, layout, dim, fn, nb, (gids, ggrads, guard), values=values)
        from meshembed_jax.kernels import index_dtype

        n = int(np.prod(ids.shape))
        nb = bucket(n)
        gids = self._replicated_1d(layout, ids, nb, -1, index_dtype(layout))
        # padded like the lookup's segment ids (the same array is then converted once);
        # padding ids own no row, so their segment is never read
        source = self.asarray(grads).reshape(-1, dim)
        segs = self._replicated_1d(layout, grad_index, nb, bucket(int(source.shape[0])), np.int32)
        weighted = grad_weights is not None
        w = (self._replicated_1d(layout, grad_weights, nb, 0, tables[0].dtype) if weighted
             else self._no_weights(layout, tables[0].dtype))
        g = self._jax.device_put(source, layout.replicated)
        return self._update(tables, layout, dim, fn, nb, (gids, g, segs, w, guard), weighted, values=values)

    def _guard(self, layout: ShardLayout, guard: Any) -> Any:
        """``guard`` replicated on the layout's mesh (a constant true one when None)."""
        if guard is None:
            key = (layout, "guard")
            if key not in self._no_weight_arrays:
                self._no_weight_arrays[key] = self._jax.device_put(np.asarray(True), layout.replicated)
            return self._no_weight_arrays[key]
        guard = self.asarray(guard)
        if layout.n_dev == 1 and guard.devices() == set(layout.mesh.devices.flat):
            return guard  # already where the kernel runs
        return self._jax.device_put(guard, layout.replicated)

    def _capacity_error(self, table: JaxShardedTable, worst: int, capacity: int) -> CapacityError:
        return CapacityError(
            f"Batch too large for table {table!r}: one device owns {worst} unique ids this step "
            f"but the jax backend's capacity is {capacity}. Nothing was updated. Fix: raise the "
            f"capacity (JaxBackend(capacity=...), MESHEMBED_JAX_CAPACITY or backend.capacity) to "
            f"at least {worst}, or leave it unset for automatic sizing, or split the batch."
        )

    def _check_tables(self, tables: list[JaxShardedTable]) -> tuple[ShardLayout, int]:
        layout, dim = tables[0].layout, tables[0].shape[1]
        for t in tables[1:]:
            if t.layout != layout or t.shape[1] != dim:
                raise InputError(
                    "Invalid `tables`: a table and its slots must share placement and dimension. "
                    f"Received: {tables[0]!r} and {t!r}"
                )
        return layout, dim

    def _check_rule(self, rule: Any, values: Sequence[Any]) -> tuple[float, ...]:
        """The call's values as floats, after checking ``rule`` is an UpdateRule with as many."""
        if not isinstance(rule, UpdateRule):
            raise InputError(
                "Invalid `fn` for the jax backend's update_rows. Expected a meshembed.math.UpdateRule "
                f"(meshembed.embedding.updates.make_rule(table)) with its `values=`. Received: {type(rule).__name__}"
            )
        if len(values) != len(rule.dynamic):
            raise InputError(
                f"Invalid `values` for the {rule.algorithm!r} rule. Expected {len(rule.dynamic)} values, "
                f"one per {rule.dynamic}. Received: {len(values)}"
            )
        return tuple(float(v) for v in values)

    def rule_call(self, rule: UpdateRule) -> Callable[..., tuple]:
        """``call(dyn, g, *rows)``: ``apply_rule`` with the call's values ``dyn`` (traced by the
        compiled step), the static hyper-parameters Python constants as in the NumPy reference
        (so derived constants such as ``1 - beta_2`` round once, in double). Cached per rule, so
        the engine and me.jax share one compiled program."""
        return self._kernel(("rule_call", rule), lambda: functools.partial(apply_rule, self.xp, rule))

    def update_program(self, layout: ShardLayout, dim: int, n_tables: int, capacity: int, dedup: str,
                       rule: UpdateRule, combined: bool = False, weighted: bool = False) -> Callable:
        """The compiled XLA step of ``rule`` (``kernels.make_update``), cached on its static part."""
        from meshembed_jax import kernels

        call = self.rule_call(rule)
        return self._kernel(("update", layout, dim, n_tables, capacity, dedup, combined, weighted, rule),
                            lambda: kernels.make_update(layout, dim, n_tables, capacity, dedup, call, combined, weighted))

    def fused_program(self, layout: ShardLayout, dim: int, rule: UpdateRule, dtypes: Sequence[Any], combined: bool,
                      weighted: bool) -> tuple[Callable, Any] | None:
        """``(step, kernel)``: the compiled fused step (``kernels.make_fused_update``) over the
        rule's generated row kernel, for tables of ``dtypes`` (the table, then its slots), or
        None where the XLA step must run: a fixed capacity (a promise the capacity-bounded
        step keeps), mixed or non-float dtypes, no CPU FFI kernels, no generated kernel."""
        from meshembed_jax import cpu_kernels, kernels

        dtypes = [np.dtype(d) for d in dtypes]
        if self.capacity is not None or not cpu_kernels.fused_enabled() or len(set(dtypes)) != 1:
            return None
        if not kernels.use_cpu_kernels(layout, dtypes[0]):
            return None
        kernel = cpu_kernels.row_kernel(rule, len(dtypes), dtypes[0])
        if kernel is None:
            return None
        step = self._kernel(("fused_update", layout, dim, len(dtypes), kernel.symbol, combined, weighted),
                            lambda: kernels.make_fused_update(layout, dim, len(dtypes), kernel.address, combined,
                                                              weighted))
        return step, kernel

    def _fused_update(self, tables: list[JaxShardedTable], layout: ShardLayout, dim: int, rule: UpdateRule,
                      args: tuple, weighted: bool | None, values: tuple[float, ...]) -> bool:
        """Run the rule's generated row kernel (:meth:`fused_program`); False where the XLA
        step must run. One in-place pass per device with buffers sized by the batch: no
        capacity to check, nothing for the host to wait for."""
        from meshembed_jax import cpu_kernels

        grads = args[1]
        if grads.ndim != 2 or grads.dtype != tables[0].dtype:
            return False
        if grads.shape[1] != dim or (weighted is None and grads.shape[0] != args[0].shape[0]):
            return False  # the XLA path reports the shape error before anything is written
        combined = weighted is not None
        found = self.fused_program(layout, dim, rule, [t.dtype for t in tables], combined, bool(weighted))
        if found is None:
            return False
        step, kernel = found
        if combined:
            ids, grads, segs, w, guard = args
        else:
            (ids, grads, guard), segs, w = args, self._no_weights(layout, np.int32), self._no_weights(layout, grads.dtype)
        params = tuple(kernel.params(values))
        key = (layout, params)
        hp = self._hp_arrays.get(key)
        if hp is None:
            hp = self._hp_arrays[key] = self._jax.device_put(cpu_kernels.hp_block(params), layout.replicated)
            while len(self._hp_arrays) > 8:
                self._hp_arrays.popitem(last=False)
        for t, d in zip(tables, step(tuple(t.data for t in tables), ids, grads, segs, w, guard, hp)):
            t.data = d
        fused_calls[0] += 1
        return True

    def _update(self, tables, layout, dim, rule, nb, args, weighted=None, defer=True, values=()) -> list[JaxShardedTable]:
        """Run the fused or the XLA update step; ``args`` are its batch arguments (with
        ``weighted`` not None: the combiner's backward form)."""
        if self._fused_update(tables, layout, dim, rule, args, weighted, values):
            return tables
        jax = self._jax
        capacity = self._capacity_for(layout, nb)
        dedup = self._dedup_for(layout, nb)
        step = self.update_program(layout, dim, len(tables), capacity, dedup, rule, weighted is not None,
                                   bool(weighted))
        try:
            new, count = step(tuple(t.data for t in tables), *args, values)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError) as exc:
            raise ConfigError(
                f"Invalid update rule {rule.algorithm!r}: its math branches in Python on one of its dynamic "
                f"values {rule.dynamic}, which the jax backend passes as traced inputs (nothing was updated). "
                "Fix: give that hyper-parameter a constant value, or write the math with xp.where."
            ) from exc
        for t, d in zip(tables, new):
            t.data = d

        fixed = self.capacity is not None

        def check() -> None:
            for t in tables:
                t.pending = None
            worst = int(count.addressable_data(0))  # replicated scalar: waits for the step
            if worst > capacity:  # the kernel wrote nothing: grow the capacity and redo it
                if fixed:
                    raise self._capacity_error(tables[0], worst, capacity)
                self._auto_capacity[(layout, nb)] = bucket(worst + worst // 4)
                self._update(tables, layout, dim, rule, nb, args, weighted, defer=False, values=values)

        if defer and not fixed and jax.process_count() == 1:
            # Automatic capacity (growing is the only outcome of an overflow): check when
            # a table is next read, so the host prepares the next step while this one runs.
            for t in tables:
                t.pending = check
        else:
            check()
        return tables
