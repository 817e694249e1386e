"""Compiled row kernels of the JAX backend: lookup, scatter and the fused update step.

Every kernel is ``jax.jit(shard_map(per_device, ...))`` over the table's one-axis mesh:

* ids (and gradients/rows) come in replicated, padded to a size bucket with id ``-1``;
* each device maps the ids it owns to rows of its ``[k, max_rows, D]`` block and masks
  the rest (sentinel row ``M = k*max_rows``, out of bounds, dropped by scatters and read
  as zeros by gathers), so ids and gradients reach the owning device and no table leaves it;
* lookups combine the per-device partial rows with one ``psum`` (exactly one device
  contributes a non-zero row per id, so the sum is exact);
* updates deduplicate the owned ids into at most ``capacity`` slots (static shapes),
  segment-sum their gradients, gather those rows from the table and its slots, run the
  core's optimizer function once per unique row and scatter the rows back, in one
  compiled step whose table and slot buffers are donated (no copy of a table per step).

If any device owns more unique ids than ``capacity``, no device writes anything (every row
index is set to the sentinel; the decision uses the ``pmax`` of the per-device counts) and
that count comes back so the caller can raise ``CapacityError`` or retry with a larger
capacity, with the tables unchanged — never a silent truncation.

On CPU devices the row movement inside these kernels (gather + combine, dedup + gradient
sums, row gather and in-place scatter) is done by the FFI kernels of
:mod:`meshembed_jax.native`; the pure-XLA code below is what runs elsewhere (TPU, GPU) and
where they cannot be built.

The submodules hold the kernels that both the engine (``JaxBackend``) and me.jax trace:
:mod:`.exact` (float math with the op-by-op bits), :mod:`.low_precision` (a 16-bit table's
update as one program) and :mod:`.hlo` (UserDefinedProgram's HLO runner).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshembed.errors import ConfigError, InputError
from meshembed.math.rule import UpdateRule
from meshembed_jax import native
from meshembed_jax.distributed import AXIS, ShardLayout

try:  # jax >= 0.6 exports shard_map at the top level
    from jax import shard_map as _shard_map

    def shard_map(f: Callable, mesh: Any, in_specs: Any, out_specs: Any, check: bool = True) -> Callable:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)

except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map_exp

    def shard_map(f: Callable, mesh: Any, in_specs: Any, out_specs: Any, check: bool = True) -> Callable:
        return _shard_map_exp(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@contextlib.contextmanager
def traced_rule_errors(rule: UpdateRule, who: str, alternative: str) -> Iterator[None]:
    """Turn JAX's error for a rule whose math branches in Python on a traced dynamic value
    into a ConfigError naming the rule and the fix (raised before anything is written)."""
    try:
        yield
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError) as exc:
        raise ConfigError(
            f"Invalid update rule {rule.algorithm!r}: its math branches in Python on one of its dynamic "
            f"values {rule.dynamic}, which {who} passes as traced inputs (nothing was updated). "
            f"Fix: give that hyper-parameter a constant value, or {alternative}."
        ) from exc


def device_map(layout: ShardLayout, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
    """``shard_map`` of ``f`` over the layout's mesh. On a one-device mesh a per-device
    result is already the whole result: :func:`across_devices` adds no collective there, so
    the replication check is off (XLA keeps a one-device all-reduce: a copy of the output)."""
    return shard_map(f, layout.mesh, in_specs, out_specs, check=layout.n_dev > 1)


def across_devices(layout: ShardLayout, x: jax.Array, op: Callable = lax.psum) -> jax.Array:
    """``op`` (psum, pmax) of the per-device values over the mesh axis; ``x`` on one device."""
    return x if layout.n_dev == 1 else op(x, AXIS)


DEDUP_STRATEGIES = ("dense", "sort")


def use_cpu_kernels(layout: ShardLayout, *dtypes: Any) -> bool:
    """Whether the FFI row kernels (:mod:`meshembed_jax.native`) serve this layout: switched on for it
    (``layout.cpu_kernels``), CPU devices, float32/float64 rows, the library built. Otherwise
    the pure-XLA kernels below run."""
    return layout.cpu_kernels and native.usable(layout.mesh.devices.flat[0].platform, *dtypes)


def on_platform(layout: ShardLayout, ffi: Callable[[], Any], xla: Callable[[], Any], *dtypes: Any) -> Any:
    """``ffi()`` where the program runs on CPU and the FFI kernels serve the layout, else
    ``xla()``, chosen when lowering (``lax.platform_dependent``): the CPU kernels are a CPU-only
    specialisation, so the same traced step also lowers (``jax.export``) for TPU and GPU."""
    if not use_cpu_kernels(layout, *dtypes):
        return xla()
    return lax.platform_dependent(cpu=ffi, default=xla)


def index_dtype(layout: ShardLayout) -> Any:
    """int32 ids unless the vocabulary needs 64 bits (int32 gathers are faster on CPU/TPU)."""
    return jnp.int32 if layout.placement.vocabulary_size < 2**31 - 1 else jnp.int64


def local_rows(layout: ShardLayout, ids: jax.Array) -> jax.Array:
    """Row of each global id inside this device's flattened block; ``M`` when not owned.

    Runs inside ``shard_map``: the device's position on the mesh axis says which logical
    shards it holds. The MOD/DIV arithmetic is ``meshembed.sharding.Placement.owner`` /
    ``local_row`` itself, run on jnp arrays.
    """
    p = layout.placement
    v = p.vocabulary_size
    k, r_max = layout.shards_per_device, layout.max_rows
    m = k * r_max
    valid = (ids >= 0) & (ids < v)
    safe = jnp.where(valid, ids, 0)
    shard = p.owner(safe, xp=jnp)
    row = p.local_row(safe, xp=jnp, owner=shard)
    if layout.n_dev > 1:
        local_shard = shard - lax.axis_index(AXIS).astype(ids.dtype) * k
        owned = valid & (local_shard >= 0) & (local_shard < k)
    else:
        local_shard, owned = shard, valid
    return jnp.where(owned, local_shard * r_max + row, m)


def ffi_rows(layout: ShardLayout, ids: jax.Array) -> jax.Array:
    """:func:`local_rows` as the CPU row kernels take them: the ids themselves where the
    device's block is the whole table in id order (one device, one shard), since the kernels
    treat rows outside ``[0, M)`` as not owned, which ``local_rows`` maps to ``M``: the
    same rows, without an XLA pass over the ids before the kernel (0.1-0.15 ms at W1)."""
    if layout.n_dev == 1 and layout.shards_per_device == 1 and layout.max_rows == layout.placement.vocabulary_size:
        return ids
    return local_rows(layout, ids)


def dedup_dense(flat: jax.Array, m: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unique rows through a dense row -> first-occurrence map over the device's ``m`` rows.

    No sort and no prefix sum over ``m`` (XLA's CPU cumsum over a shard's rows is slow:
    docs/benchmarks.md, "Measurements behind design choices in the code", JAX backend):
    a scatter-min writes, per row, the first batch position that names it; an id is the
    representative of its row when that position is its own; a prefix sum over the *batch*
    numbers the representatives. O(m) memory (4 MB for 10^6 rows), O(N + m) work.
    Returns (row per slot [capacity] with ``m`` for unused, slot per id [N] with
    ``capacity`` for not owned/overflow, unique count). Slots follow first occurrence.
    """
    n = flat.shape[0]
    iota = lax.iota(jnp.int32, n)
    first = jnp.full((m + 1,), n, jnp.int32).at[flat].min(iota, mode="promise_in_bounds")
    rep = first.at[flat].get(mode="promise_in_bounds")
    owned = flat < m
    is_rep = owned & (rep == iota)
    rank = jnp.cumsum(is_rep.astype(jnp.int32)) - 1
    count = rank[n - 1] + 1
    slot = jnp.where(owned, rank.at[rep].get(mode="promise_in_bounds"), capacity)
    slot = jnp.where(slot < capacity, slot, capacity)
    uniq = jnp.full((capacity + 1,), m, flat.dtype).at[slot].set(flat, mode="promise_in_bounds")[:capacity]
    return uniq, slot, count


def dedup_sort(flat: jax.Array, m: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unique rows by sorting the ids (O(N log N), independent of the vocabulary size)."""
    n = flat.shape[0]
    srt, order = lax.sort_key_val(flat, lax.iota(jnp.int32, n))
    is_row = srt < m
    first = is_row & jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
    rank = jnp.cumsum(first.astype(jnp.int32)) - 1
    count = jnp.sum(first.astype(jnp.int32))
    slot_sorted = jnp.where(is_row & (rank < capacity), rank, capacity)
    slot = jnp.zeros((n,), jnp.int32).at[order].set(slot_sorted, unique_indices=True)
    uniq = (
        jnp.full((capacity + 1,), m, flat.dtype)
        .at[slot_sorted]
        .set(srt, indices_are_sorted=True, mode="promise_in_bounds")[:capacity]
    )
    return uniq, slot, count


_DEDUP = {"dense": dedup_dense, "sort": dedup_sort}


def make_lookup(layout: ShardLayout, dim: int, shape: tuple[int, ...] | None = None) -> Callable:
    """``lookup(data, ids) -> rows``: masked local gather on every device (the CPU row
    kernel where it serves the layout: XLA's gather moves rows element by element), then
    psum. With ``shape`` the first ``prod(shape)`` rows come back as ``shape + (D,)`` from
    inside the program: an eager slice or reshape after it would copy every row."""
    m = layout.rows_per_device

    def per_device(block: jax.Array, ids: jax.Array) -> jax.Array:
        flat = local_rows(layout, ids)
        table = block.reshape(m, dim)
        # unpadded: the rows are made in their final shape (XLA copies a reshape of an FFI
        # result: a [n, 1, D] bitcast got a layout of its own)
        out = shape + (dim,) if shape is not None and math.prod(shape) == ids.shape[0] else None

        def xla() -> jax.Array:
            rows = table.at[flat].get(mode="fill", fill_value=0)
            return rows if out is None else rows.reshape(out)

        def ffi() -> jax.Array:  # zeros for the sentinel row m, as mode="fill"
            return native.gather_rows(table, flat, out)

        return across_devices(layout, on_platform(layout, ffi, xla, table.dtype))

    fn = device_map(layout, per_device, in_specs=(P(AXIS), P()), out_specs=P())
    if shape is None:
        return jax.jit(fn)
    n = math.prod(shape)

    def lookup(data: jax.Array, ids: jax.Array) -> jax.Array:
        rows = fn(data, ids)
        return rows if rows.ndim != 2 else rows[:n].reshape(shape + (dim,))

    return jax.jit(lookup)


def make_lookup_into(layout: ShardLayout, dim: int, shape: tuple[int, ...]) -> Callable:
    """``lookup(data, ids, dst) -> rows``: :func:`make_lookup` with ``shape`` for a one-device
    layout, written over ``dst`` (donated: an earlier result of the same shape nobody holds)."""
    m = layout.rows_per_device
    out = shape + (dim,)

    def per_device(block: jax.Array, ids: jax.Array, dst: jax.Array) -> jax.Array:
        flat, table = local_rows(layout, ids), block.reshape(m, dim)
        return on_platform(layout, lambda: native.gather_rows_into(table, flat, dst),
                           lambda: table.at[flat].get(mode="fill", fill_value=0).reshape(out), table.dtype)

    fn = device_map(layout, per_device, in_specs=(P(AXIS), P(), P()), out_specs=P())
    return jax.jit(fn, donate_argnums=(2,))


def make_scatter(layout: ShardLayout, dim: int) -> Callable:
    """``scatter(data, ids, rows) -> data``: each device writes the unique ids it owns."""
    m = layout.rows_per_device
    k, r_max = layout.shards_per_device, layout.max_rows

    def per_device(block: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
        flat = local_rows(layout, ids)
        out = block.reshape(m, dim).at[flat].set(rows.astype(block.dtype), mode="drop")
        return out.reshape(k, r_max, dim)

    fn = shard_map(per_device, layout.mesh, in_specs=(P(AXIS), P(), P()), out_specs=P(AXIS))
    return jax.jit(fn, donate_argnums=(0,))


def make_window_write(layout: ShardLayout) -> Callable:
    """``write(data, window, at, lo, hi) -> data``: every logical shard ``s`` replaces rows
    ``at[s] + lo[s] .. at[s] + hi[s]`` of its table with rows ``lo[s]:hi[s]`` of its
    ``[c, D]`` slice of ``window`` and keeps the others (``lo == hi``: nothing written), in
    place in the donated table. Fills a table block by block (``create_table_from_blocks``)."""
    k = layout.shards_per_device

    def per_device(block: jax.Array, window: jax.Array, at: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
        c, dim = window.shape[1], window.shape[2]
        pos = jnp.arange(c)[:, None]
        for j in range(k):  # the k logical shards this device holds
            start = (jnp.int32(j), at[j], jnp.int32(0))
            old = lax.dynamic_slice(block, start, (1, c, dim))
            keep = (pos < lo[j]) | (pos >= hi[j])
            new = jnp.where(keep[None], old, window[j][None].astype(block.dtype))
            block = lax.dynamic_update_slice(block, new, start)
        return block

    fn = shard_map(per_device, layout.mesh, in_specs=(P(AXIS),) * 5, out_specs=P(AXIS))
    return jax.jit(fn, donate_argnums=(0,))


# XLA's CPU runtime allocates every output and one temporary block per execution; glibc
# serves a request of 32 MiB or more with a fresh mmap, so a kernel whose temporaries reach
# that size pays a page fault per 4 KiB touched on every call (docs/benchmarks.md,
# "Measurements behind design choices in the code", JAX backend: blocked intermediates).
# The kernels below therefore loop over fixed-size pieces of the batch and of the unique
# rows, so temporaries stay a few MiB whatever the batch size.
CHUNK_BYTES = 1 << 21


def chunk_rows(n: int, row_bytes: int) -> int:
    """Rows per loop piece: a power of two near ``CHUNK_BYTES`` that divides ``n``."""
    if n <= 0:
        return 1
    target = max(256, CHUNK_BYTES // max(int(row_bytes), 1))
    target = 1 << (target.bit_length() - 1)
    return min(target, n & -n)


def _varying(x: Any) -> Any:
    """Mark a loop's initial carry as device-varying: shard_map types loop carries, and
    the carry becomes varying once it mixes with a device's own block or ids."""
    if not hasattr(lax, "pcast"):  # pragma: no cover - older jax: no variance typing here
        return x

    def one(a: Any) -> Any:
        try:
            return lax.pcast(a, (AXIS,), to="varying")
        except (ValueError, NameError):  # already varying, or not under shard_map
            return a

    return jax.tree.map(one, x)


def _pieces(n: int, c: int, body: Callable[[jax.Array, Any], Any], init: Any) -> Any:
    """``body(start, carry)`` for ``start`` in ``0, c, 2c, ... < n`` (one piece inline)."""
    if n == c:
        return body(jnp.int32(0), init)
    return lax.fori_loop(0, n // c, lambda j, carry: body(j * c, carry), _varying(init))


def _slice(x: jax.Array, start: jax.Array, c: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, c, axis=0)


def make_gather_combine(layout: ShardLayout, dim: int, n: int, num_segments: int, weighted: bool) -> Callable:
    """``gather_combine(data, ids, segs, weights) -> [num_segments, D]``: the combiner's
    forward pass. Each device gathers the rows it owns piece by piece, weights them and
    adds them into its partial output (no ``[n, D]`` rows); one ``psum`` combines them."""
    m = layout.rows_per_device

    def per_device(block: jax.Array, ids: jax.Array, segs: jax.Array, w: jax.Array) -> jax.Array:
        table = block.reshape(m, dim)
        c = chunk_rows(n, dim * table.dtype.itemsize)

        def xla() -> jax.Array:
            flat = local_rows(layout, ids)

            def body(start: jax.Array, acc: jax.Array) -> jax.Array:
                rows = table.at[_slice(flat, start, c)].get(mode="fill", fill_value=0)
                if weighted:
                    rows = rows * _slice(w, start, c).astype(rows.dtype)[:, None]
                return acc.at[_slice(segs, start, c)].add(rows, mode="drop")

            return _pieces(n, c, body, jnp.zeros((num_segments, dim), table.dtype))

        def ffi() -> jax.Array:
            return native.gather_combine(table, ffi_rows(layout, ids), segs, w, num_segments, weighted)

        return across_devices(layout, on_platform(layout, ffi, xla, table.dtype))

    fn = device_map(layout, per_device, in_specs=(P(AXIS), P(), P(), P()), out_specs=P())
    return jax.jit(fn)


def _pieces_of(capacity: int, dim: int, itemsize: int) -> tuple[int, int]:
    """(rows per piece, rows of all pieces) for the update's loop over the unique rows:
    pieces of about ``CHUNK_BYTES`` per array, even (the total exceeds ``capacity`` by less
    than one row per piece)."""
    target = max(256, CHUNK_BYTES // (dim * itemsize))
    pieces = -(-capacity // target)
    c = -(-capacity // pieces)
    return c, pieces * c


def _apply_unique(flats: list, uniq: jax.Array, g: jax.Array, c: int,
                  call: Callable[..., Any], dyn: tuple, ffi: bool, used: jax.Array) -> list:
    """Gather the unique rows of every table piece by piece (``c`` rows each; ``uniq`` and
    ``g`` hold whole pieces), run the optimizer, scatter back in place (the loop carries the
    donated tables; ``ffi``: the CPU row kernels move rows). Only the pieces holding the
    first ``used`` slots run (the unique rows are packed at the front; the capacity's
    headroom costs nothing)."""
    n_tables = len(flats)

    def body(start: jax.Array, tabs: tuple) -> tuple:
        idx = _slice(uniq, start, c)
        gc = _slice(g, start, c)
        if ffi:
            rows = [native.gather_rows(f, idx) for f in tabs]
        else:
            rows = [f.at[idx].get(mode="fill", fill_value=0) for f in tabs]
        new = _as_rows(call(dyn, gc.astype(tabs[0].dtype), *rows), n_tables)
        if ffi:
            return tuple(native.scatter_rows(f, idx, jnp.asarray(r).astype(f.dtype)) for f, r in zip(tabs, new))
        return tuple(
            f.at[idx].set(jnp.asarray(r).astype(f.dtype), mode="drop", unique_indices=True)
            for f, r in zip(tabs, new)
        )

    # always a loop, even for one piece: inline, XLA copies the whole donated table twice
    # around the in-place scatter (docs/benchmarks.md, "Measurements behind design choices in
    # the code", JAX backend: in-place scatter guard)
    trips = (used + (c - 1)) // c
    return list(lax.fori_loop(0, trips, lambda j, tabs: body(j * c, tabs), _varying(tuple(flats))))


def _update_body(layout: ShardLayout, dim: int, capacity: int, dedup: str, call: Callable[..., Any],
                 blocks: tuple, ids: jax.Array, guard: jax.Array, dyn: tuple,
                 add_grads: Callable[[jax.Array, jax.Array], jax.Array],
                 grad_dtype: Any, ffi_sum: Callable[..., tuple] | None = None) -> tuple:
    """Dedup + per-row gradient sum + the optimizer, per device; nothing is written on
    overflow or when ``guard`` (a replicated boolean) is false.

    The sum is ``add_grads(g, slot)`` after an XLA dedup, or, when the CPU row kernels serve
    the layout, ``ffi_sum(flat, m, rows)`` doing both in one call."""
    m = layout.rows_per_device
    k, r_max = layout.shards_per_device, layout.max_rows
    flat = local_rows(layout, ids)
    c, padded = _pieces_of(capacity, dim, blocks[0].dtype.itemsize)

    def run(ffi: bool) -> tuple:
        if ffi:  # made with whole pieces (no copy to pad them); rows past the capacity are masked
            uniq, g, count = ffi_sum(flat, m, padded)
        else:
            uniq, slot, count = _DEDUP[dedup](flat, m, capacity)
            uniq = jnp.concatenate([uniq, jnp.full((padded - capacity,), m, uniq.dtype)]) if padded > capacity else uniq
            g = add_grads(jnp.zeros((padded + 1, dim), grad_dtype), slot)[:padded]  # slot capacity: not owned
        # one decision for all devices: if any device overflows, no device writes (the caller
        # redoes or refuses the whole step; a device that wrote would be stepped twice)
        worst = across_devices(layout, count, lax.pmax)
        ok = guard & (worst <= capacity)
        uniq = jnp.where(ok, uniq, m)  # row m: nothing written
        flats = [b.reshape(m, b.shape[-1]) for b in blocks]  # a row-wise slot: one column
        new = _apply_unique(flats, uniq, g, c, call, dyn, ffi, jnp.where(ok, count, 0))
        return tuple(f.reshape(k, r_max, f.shape[-1]) for f in new), worst

    if ffi_sum is None or grad_dtype != blocks[0].dtype:
        return run(False)
    return on_platform(layout, lambda: run(True), lambda: run(False), grad_dtype, *(b.dtype for b in blocks))


def make_update(layout: ShardLayout, dim: int, n_tables: int, capacity: int, dedup: str,
                call: Callable[..., Any], combined: bool = False, weighted: bool = False) -> Callable:
    """The sparse step: ``update(datas, ids, grads, guard, dyn) -> (datas, count)``, or with
    ``combined`` ``update(datas, ids, grads, segs, w, guard, dyn)``, the combiner's backward
    pass fused in: row ``i``'s gradient is ``w[i] * grads[segs[i]]`` (``w`` read when
    ``weighted``), formed piece by piece inside the per-row sum, so the ``[len(ids), D]`` row
    gradients never exist.

    ``call(dyn, g, *rows)`` is the rule's function (``apply_rule`` with the call's values
    ``dyn`` traced), applied to pieces of the unique rows (it is row-wise). ``count`` is the
    largest number of unique ids one device owns; ``> capacity`` means nothing was written.
    """

    def per_device(blocks: tuple, ids: jax.Array, grads: jax.Array, *rest: Any) -> tuple:
        (segs, w, guard, dyn) = rest if combined else (None, None, *rest)
        if not combined:  # one row per id, [..., D]: flattened here, a bitcast (eagerly: a copy)
            grads = grads.reshape(-1, grads.shape[-1])
        n = ids.shape[0]
        c = chunk_rows(n, dim * grads.dtype.itemsize)

        def add_grads(g: jax.Array, slot: jax.Array) -> jax.Array:
            def body(start: jax.Array, acc: jax.Array) -> jax.Array:
                if not combined:
                    return acc.at[_slice(slot, start, c)].add(_slice(grads, start, c), mode="promise_in_bounds")
                rows = grads.at[_slice(segs, start, c)].get(mode="fill", fill_value=0)
                if weighted:
                    rows = rows * _slice(w, start, c).astype(rows.dtype)[:, None]
                return acc.at[_slice(slot, start, c)].add(rows, mode="promise_in_bounds")

            return _pieces(n, c, body, g)

        def ffi_sum(flat: jax.Array, m: int, cap: int) -> tuple:
            none = jnp.zeros((1,), jnp.int32)
            wt = w if weighted else jnp.zeros((1,), grads.dtype)
            return native.dedup_sum(flat, grads, segs if combined else none, wt if combined else none, m, cap,
                                         combined=combined, weighted=combined and weighted)

        return _update_body(layout, dim, capacity, dedup, call, blocks, ids, guard, dyn, add_grads, grads.dtype,
                            ffi_sum)

    specs = (tuple(P(AXIS) for _ in range(n_tables)),) + (P(),) * (6 if combined else 4)
    fn = device_map(layout, per_device, in_specs=specs, out_specs=(tuple(P(AXIS) for _ in range(n_tables)), P()))
    return jax.jit(fn, donate_argnums=(0,))


#: XLA's CPU client runs a program on the calling thread, before the call returns, when its
#: cost analysis counts fewer than 1,000 flops (a "cheap" program, PjRt's CPU client), and
#: an FFI call counts as none: a program of FFI calls alone is always run so. The engine's
#: fused update (1.5 ms at W1) then held the Python thread, which could have prepared the
#: next step meanwhile. A program given :func:`dispatch_marker` counts this many and is
#: dispatched like any other (run when its inputs are ready, on the client's threads).
DISPATCH_FLOPS = 2048


def dispatch_marker(ids: jax.Array) -> jax.Array:
    """A scalar output (the largest of the first ``DISPATCH_FLOPS`` ids) whose reduction XLA's
    cost analysis counts as ``DISPATCH_FLOPS`` flops (~1 us of work): the program holding it
    is not "cheap", so the call returns while it runs (:data:`DISPATCH_FLOPS`). Fewer ids:
    a program that small is cheap either way."""
    return jnp.max(ids[: min(int(ids.shape[0]), DISPATCH_FLOPS)], initial=jnp.iinfo(ids.dtype).min)


def make_fused_update(layout: ShardLayout, dim: int, n_tables: int, address: int, combined: bool,
                      weighted: bool, dispatched: bool = False) -> Callable:
    """``update(datas, ids, grads, segs, w, guard, hp) -> datas``: the rule's generated row
    kernel (``address``, see ``native.row_kernel``) run by ``native.fused_update``
    on CPU devices: dedup, per-row sums and the kernel in one in-place pass per device. Its
    buffers are sized by the batch, so no capacity can overflow; the call is skipped when
    ``guard`` is false. ``combined``: row ``i``'s gradient is ``w[i] * grads[segs[i]]``.
    ``dispatched`` (the engine's eager step): ``-> (datas, marker)`` with
    :func:`dispatch_marker`, so the call returns before the update has run."""
    m = layout.rows_per_device
    k, r_max = layout.shards_per_device, layout.max_rows

    def per_device(blocks: tuple, ids: jax.Array, grads: jax.Array, segs: jax.Array, w: jax.Array,
                   guard: jax.Array, hp: jax.Array) -> tuple:
        flat = ffi_rows(layout, ids)
        if not combined:  # one row per id, [..., D]: flattened here (eagerly: a copy)
            grads = grads.reshape(-1, grads.shape[-1])

        def body(_: jax.Array, datas: tuple) -> tuple:
            return tuple(native.fused_update(list(datas), flat, grads, segs, w, hp, address, combined, weighted))

        # a loop of one trip (none when the guard is false): inline, XLA copies the donated
        # tables around the in-place call, as with the scatter in _apply_unique
        flats = tuple(b.reshape(m, b.shape[-1]) for b in blocks)  # a row-wise slot: one column
        new = lax.fori_loop(0, guard.astype(jnp.int32), body, _varying(flats))
        return tuple(f.reshape(k, r_max, f.shape[-1]) for f in new)

    specs = (tuple(P(AXIS) for _ in range(n_tables)), P(), P(), P(), P(), P(), P())
    fn = device_map(layout, per_device, in_specs=specs, out_specs=tuple(P(AXIS) for _ in range(n_tables)))
    if not dispatched:
        return jax.jit(fn, donate_argnums=(0,))

    def update(datas: tuple, ids: jax.Array, *rest: jax.Array) -> tuple:
        return fn(datas, ids, *rest), dispatch_marker(ids)

    return jax.jit(update, donate_argnums=(0,))


def _as_rows(new: Any, n_tables: int) -> list[Any]:
    """The optimizer function returns one array per table (tuple/list/NamedTuple, or a
    bare array for a single table)."""
    if n_tables == 1 and not isinstance(new, (tuple, list)):
        new = (new,)
    new = list(new)
    if len(new) != n_tables:
        raise InputError(
            f"Invalid update rule result. Expected {n_tables} arrays (the table and each slot, in the "
            f"order given). Received: {len(new)}. Fix: return (params, slots) with one slot per slot name."
        )
    return new


def make_segment_sum(n: int) -> Callable:
    """``(ids[n], values[n, ...]) -> (sorted unique ids padded with -1, sums, count)``."""

    def fn(ids: jax.Array, values: jax.Array) -> tuple:
        big = jnp.iinfo(ids.dtype).max
        keyed = jnp.where(ids >= 0, ids, big)  # padding (-1) sorts last
        srt, order = lax.sort_key_val(keyed, lax.iota(jnp.int32, n))
        first = (srt != big) & jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
        rank = jnp.cumsum(first.astype(jnp.int32)) - 1
        count = jnp.sum(first.astype(jnp.int32))
        slot_sorted = jnp.where(srt != big, rank, n)
        sums = jnp.zeros((n + 1,) + values.shape[1:], values.dtype).at[slot_sorted].add(values[order])[:n]
        uniq = jnp.full((n + 1,), -1, ids.dtype).at[slot_sorted].set(srt)[:n]
        return uniq, sums, count

    return jax.jit(fn)
