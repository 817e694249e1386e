"""Low-precision tables on the step: bfloat16 / float16 storage with float32 math.

A table whose ``TableConfig(precision=me.embedding.Precision(...))`` stores its parameters or
a slot in 16 bits keeps that array as its 16-bit patterns in an ``int16`` backend table, so
NumPy (which has no bfloat16), torch, JAX and any Array API library hold the same bits. Every
step function reads it through here:

* lookups gather the 16-bit rows and widen them to float32 (exact), then combine in float32 —
  or, where the backend has them, its gather that widens as it copies (``Backend.gather_widened``)
  and its pooled sum that widens as it adds (``Backend.gather_combine_low_precision``): the same
  bits without the 16-bit rows and their float32 copies;
* an update sums the gradients per unique id, gathers and widens the rows, applies the
  table's :class:`~meshembed.math.UpdateRule` with ``meshembed.math.apply_rule`` in float32,
  rounds each 16-bit array back (``meshembed.math.rounding``) and scatters — only protocol
  methods, so every backend runs it (the fused update kernels are not used for such tables);
  eagerly, a few MiB of rows at a time (``_UPDATE_ELEMENTS``: the host memory of its temporaries);
* creation, ``load_parameters`` and a float32 restore round to nearest even on the host;
  ``retrieve_parameters`` returns the exact float32 values; checkpoints keep the patterns.

docs/low_precision.md specifies the rounding and its random bits.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import array_api_compat
import numpy as np

from meshembed.backend.protocol import Backend, check_rule
from meshembed.embedding.layout import Layout, TableSpec
from meshembed.errors import ConfigError
from meshembed.config.precision import array_dtypes
from meshembed.math.rounding import (counters, interleave, narrow, philox_words, round_bits, stream_of, widen,
                                     widen_bits)
from meshembed.math.rule import UpdateRule, apply_rule

__all__ = ["array_dtypes", "check_layout", "fresh_state", "from_storage", "is_low", "lookup_rows",
           "stream_of", "to_storage", "update_table"]

#: NumPy dtype of the stored patterns of each 16-bit format.
STORAGE = {"bfloat16": np.dtype(np.int16), "float16": np.dtype(np.int16)}
#: Rows per host block when converting whole tables (bounds the temporaries of the rounding):
#: W1's 10**6 x 64 bf16 table on torch peaked 182-185 MB above the baseline at creation in blocks
#: of 2**16 rows, 165-167 in blocks of 2**11 (the table 122, the batch and modules ~20).
_BLOCK_ROWS = 1 << 11
_xp_host = None
#: Compiled integer programs of tracing backends, per backend (see :func:`_update_padded`).
_COMPILED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _host_xp() -> Any:
    global _xp_host
    if _xp_host is None:
        import array_api_compat.numpy as xp

        _xp_host = xp
    return _xp_host


def is_low(t: TableSpec) -> bool:
    """Whether table ``t`` stores any array in 16 bits (the branch every step function takes)."""
    return t.precision is not None and any(d != "float32" for d in array_dtypes(t))


def check_layout(layout: Layout, backend: Any) -> None:
    """ConfigError, before any table is made, for a low-precision table the step cannot run."""
    from meshembed.embedding.updates import update_kind

    for t in layout.tables:
        if not is_low(t):
            continue
        dtypes = array_dtypes(t)
        if update_kind(t) == "in_order":
            raise ConfigError(
                f"Table {t.name!r}: low-precision storage ({dtypes}) needs gradient accumulation (the "
                "default): with `use_gradient_accumulation=False` an id's contributions are applied one "
                "after another, and the random bits of stochastic rounding are drawn once per (step, row). "
                "Fix: leave gradient accumulation on, or store the table in float32.")
        if backend.processes > 1:
            raise ConfigError(
                f"Table {t.name!r}: low-precision storage ({dtypes}) runs in a single process; the "
                f"{backend.name!r} backend shares the tables over {backend.processes} processes. Fix: one "
                "process, or store the table in float32.")
        if t.index >= 1 << 24 or len(dtypes) > 256:
            raise ConfigError(f"Table {t.name!r}: low-precision storage supports 2**24 tables of up to 255 slots.")


# -- host conversions ------------------------------------------------------------------------
def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the stored patterns of ``dtype``, rounded to nearest even (host)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return values
    flat = values.reshape(-1, values.shape[-1]) if values.ndim >= 2 else values.reshape(1, -1)
    out = np.empty(flat.shape, STORAGE[dtype])
    for start in range(0, flat.shape[0], _BLOCK_ROWS):
        block = flat[start:start + _BLOCK_ROWS]
        out[start:start + _BLOCK_ROWS] = round_bits(_host_xp(), block.view(np.int32), dtype, "nearest")
    return out.reshape(values.shape)


def from_storage(patterns: np.ndarray, dtype: str) -> np.ndarray:
    """Stored patterns of ``dtype`` -> their exact float32 values (host)."""
    if dtype == "float32":
        return np.asarray(patterns, dtype=np.float32)
    patterns = np.ascontiguousarray(patterns).view(STORAGE[dtype])
    return np.asarray(widen_bits(_host_xp(), patterns, dtype)).view(np.float32)


# -- device conversions --------------------------------------------------------------------------
def lookup_rows(backend: Any, table: Any, ids: Any, dtype: str) -> Any:
    """``table[ids]`` as float32 rows: the backend's gather that widens as it copies
    (``Backend.gather_widened``), else gathered and widened by one compiled program (:func:`_widener`)."""
    if dtype == "float32":
        return backend.gather(table, ids)
    rows = backend.gather_widened(table, ids, dtype)
    return rows if rows is not None else _widener(backend, dtype)(backend.gather(table, ids))


# -- tables ------------------------------------------------------------------------------------
def fresh_state(backend: Any, t: TableSpec, blocks: Iterable[np.ndarray], placement: Any,
                slot_values: Sequence[float]) -> list[Any]:
    """Table ``t``'s ``[params, *slots]`` backend tables from float32 initial ``blocks`` of rows
    and constant slot values, each array in its storage dtype (rounded to nearest even)."""
    shape = (t.vocabulary_size, t.dimension)
    dtypes = array_dtypes(t)

    def stored(dtype: str, parts: Iterable[np.ndarray]) -> Any:
        if dtype == "float32":
            return backend.create_table_from_blocks(shape, parts, placement)
        patterns = (to_storage(np.asarray(block, dtype=np.float32), dtype) for block in parts)
        return backend.create_table_from_blocks(shape, patterns, placement, STORAGE[dtype])

    from meshembed.embedding.initializers import Constant

    state = [stored(dtypes[0], blocks)]
    for dtype, value in zip(dtypes[1:], slot_values):
        state.append(stored(dtype, Constant(value).blocks(shape)))
    return state


def update_table(backend: Any, state: Sequence[Any], t: TableSpec, rule: UpdateRule, values: Sequence[Any],
                 host_ids: np.ndarray, row_grads: Any, step: int, guard: Any = None) -> list[Any]:
    """Table ``t``'s new ``[params, *slots]``: one update per unique id of ``host_ids`` (their
    per-id gradient rows ``row_grads`` summed first), in float32, each 16-bit array rounded back.
    ``step``: the number of steps applied before this one (a counter of the random bits)."""
    from meshembed.embedding.updates import is_non_lazy, with_every_row

    xp = backend.xp
    values = check_rule(rule, values, backend.name)
    dtypes = array_dtypes(t)
    host_ids = np.asarray(host_ids, dtype=np.int64).reshape(-1)
    if is_non_lazy(t):  # every row, with a zero gradient where not looked up
        host_ids, row_grads = with_every_row(t, host_ids, row_grads)
    if host_ids.size == 0 or (guard is not None and not bool(guard)):
        return list(state)
    out = backend.update_low_precision(list(state), t, rule, values, host_ids, row_grads, int(step), guard)
    if out is not None:  # the backend's own program (Backend.update_low_precision)
        return list(out)
    uids, grads = backend.segment_sum(backend.asarray(host_ids, dtype="int64"), row_grads)
    unique = np.unique(host_ids)  # = uids (sorted unique), on the host: the random bits' counters
    if type(backend).is_traced is not Backend.is_traced and backend.capabilities.devices == 1:
        # one device: compiled, padded programs; several: the eager path below (the padded
        # programs' rows and gradients would live on different device sets)
        return _update_padded(backend, state, t, rule, values, unique, grads, step)
    n = int(unique.shape[0])
    size = max(1, _UPDATE_ELEMENTS // max(1, t.dimension))
    if n <= size:
        done = [(uids, _new_rows(backend, state, t, rule, values, unique, uids, grads, step))]
    else:
        # Rows in chunks of `size` (the last one padded to that size with copies of its first
        # row, whose results are dropped): each chunk's temporaries are a few MiB, where the whole
        # update's were several of the gradient sums' size (host memory that the allocator keeps
        # once freed), and the compiled integer programs see one shape. The rows are unique, so
        # each chunk's rows are the ones they were in the whole: the same bits. Only the new rows
        # (in their stored dtypes) are kept, and nothing is written before every chunk is done.
        _UPDATE_STATS["chunked"] += 1
        done = []
        for lo in range(0, n, size):
            hi = min(n, lo + size)
            ids, g = unique[lo:hi], grads[lo:hi]
            if hi - lo < size:
                ids = np.concatenate([ids, np.full(size - (hi - lo), ids[0], np.int64)])
                g = xp.concat([g, xp.broadcast_to(g[:1], (size - (hi - lo), t.dimension))], axis=0)
            ids_dev = backend.asarray(ids, dtype="int64")
            rows = _new_rows(backend, state, t, rule, values, ids, ids_dev, g, step)
            done.append((ids_dev[: hi - lo], [r[: hi - lo] for r in rows]))
            del g, rows
    out = list(state)
    for ids_dev, rows in done:
        out = [backend.scatter(array, ids_dev, row) for array, row in zip(out, rows)]
    return out


#: Rows of a 16-bit table's eager update are processed this many elements (rows x dimension) at
#: a time (see :func:`update_table`): 2 MiB of float32 rows per array; at W1 (dimension 64) 8,192
#: rows, whose rounding programs take 1 Mi elements, which torch still compiles. W1's bf16 rows,
#: peak memory (benchmarks/w1_memory.py, 3 runs each): Adagrad 532-548 MB in one piece, 515-520
#: in chunks of 2**20 elements, 505-507 in chunks of 2**19. Time: one thread, 55-59 ms a step in
#: one piece, 58-61 in chunks (the same work, plus the padding); on all threads of the loaded 2-core
#: machine each chunk's parallel regions wait for cores (medians 180-490 ms either way, noise).
#: Fixed-size chunks also spare torch the recompilation of the rounding for a new row count.
_UPDATE_ELEMENTS = 1 << 19
#: How many updates ran in chunks (``"chunked"``): what a test reads.
_UPDATE_STATS = {"chunked": 0}


def _new_rows(backend: Any, state: Sequence[Any], t: TableSpec, rule: UpdateRule, values: Sequence[Any],
              unique: np.ndarray, uids: Any, grads: Any, step: int) -> list[Any]:
    """Each array's new rows ``unique`` (host ids, ``uids`` on the backend) from their summed
    gradients ``grads``, in the array's stored dtype (16-bit ones rounded); nothing written."""
    xp = backend.xp
    dtypes = array_dtypes(t)
    p = t.precision
    rows = [lookup_rows(backend, a, uids, d) for a, d in zip(state, dtypes)]
    new = list(backend.apply_rule_rows(rule, values, grads, rows))
    del rows, grads  # (each temporary dropped once used: the update's peak memory)
    low = [k for k, d in enumerate(dtypes) if d != "float32"]
    words: dict[int, tuple] = {k: () for k in low}
    if p.rounding == "stochastic":  # every 16-bit array's words from the same counters, one program
        ctr = counters(xp, unique, step, t.dimension, array_api_compat.device(new[0]))
        streams = tuple(stream_of(t.index, k) for k in low)
        words = dict(zip(low, _philox(backend, p.seed, streams)(*(limb for word in ctr for limb in word))))
        del ctr
    for k in low:
        new[k] = _rounder(backend, dtypes[k], p.rounding, t.dimension)(new[k], *words.pop(k))
    return new


def _bucket(n: int) -> int:
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def _update_padded(backend: Any, state: Sequence[Any], t: TableSpec, rule: UpdateRule, values: Sequence[Any],
                   unique: np.ndarray, grads: Any, step: int) -> list[Any]:
    """:func:`update_table` on a backend that traces (JAX), the same bits: eagerly, every one
    of the ~1000 element-wise integer operations of the rounding would compile again for each
    new number of rows. Here the rows are padded to a power of two with rows the step does not
    touch (their old values are written back, bit for bit), the integer work (widening, the
    random words, rounding, the choice between new and old rows) runs as compiled programs,
    one per row bucket, and the optimizer runs eagerly on bucket-shaped arrays (compiled, float
    arithmetic could be fused differently from the other backends)."""
    xp = backend.xp
    dtypes = array_dtypes(t)
    p = t.precision
    n, dim = int(unique.shape[0]), t.dimension
    nb = min(_bucket(n), t.vocabulary_size)
    ids = unique
    if nb > n:  # spare rows: the first ids this step does not update (there are enough: nb <= V)
        spare = np.setdiff1d(np.arange(min(t.vocabulary_size, n + nb), dtype=np.int64), unique)[: nb - n]
        ids = np.concatenate([unique, spare])
        # zeros placed as the gradients are (a replicated array on several devices stays one)
        grads = xp.concat([grads, xp.broadcast_to(xp.zeros_like(grads[:1]), (nb - n, dim))], axis=0)
    ids_dev = backend.asarray(ids, dtype="int64")
    mask = backend.asarray(np.arange(nb) < n)
    stored = [backend.gather(a, ids_dev) for a in state]
    rows = [s if d == "float32" else _widener(backend, d)(s) for s, d in zip(stored, dtypes)]
    new = apply_rule(xp, rule, values, grads, *rows)
    ctr = None
    out = []
    for k, (array, old, row, dtype) in enumerate(zip(state, stored, new, dtypes)):
        if dtype == "float32":
            row = _program(backend, ("select",), lambda: lambda m, a, b: xp.where(xp.reshape(m, (-1, 1)), a, b))(
                mask, row, old)
        else:
            words = ()
            if p.rounding == "stochastic":
                ctr = counters(xp, ids, step, dim) if ctr is None else ctr  # uncommitted: any device set
                words = _philox(backend, p.seed, (stream_of(t.index, k),))(*(limb for word in ctr for limb in word))[0]

            def rounding(dtype: str = dtype) -> Any:
                def rounded(x: Any, m: Any, before: Any, *w: Any) -> Any:
                    h = narrow(backend, x, dtype, p.rounding, interleave(xp, w, dim) if w else None)
                    return xp.where(xp.reshape(m, (-1, 1)), h, before)
                return rounded

            row = _program(backend, ("round", dtype, p.rounding, dim), rounding)(row, mask, old, *words)
        out.append(backend.scatter(array, ids_dev, row))
    return out


def _program(backend: Any, key: tuple, build: Any) -> Any:
    """``backend.compile(build())``, made once per backend and key. The Philox words and their
    use are separate programs: fed to one consumer, XLA fused the words' 10 rounds into every
    element of the result and recomputed them (seconds for 4096 rows)."""
    programs = _COMPILED.setdefault(backend, {})
    fn = programs.get(key)
    if fn is None:
        fn = programs[key] = backend.compile(build())
    return fn


# Every library runs these integer programs through ``Backend.compile`` (JAX: jitted, so they
# do not compile again per operation and shape; torch: compiled by inductor where the arrays are
# large, one fused loop instead of ~1000 passes over memory; NumPy: as they are). Integer
# arithmetic is exact, so compiled or not they give the same bits. On a backend that does not
# trace, the float32 <-> int32 bitcasts stay outside the programs: inside them, a user's
# torch.compile'd module forward broke its graph there (dynamo 2.13 cannot compare the NumPy
# dtype the bitcast is given; conformance's torch-module-compiled entry).
def _traces(backend: Any) -> bool:
    return type(backend).is_traced is not Backend.is_traced


def _widener(backend: Any, dtype: str) -> Any:
    """``widen`` of ``dtype`` rows (int16 patterns -> float32) through one program."""
    if _traces(backend):  # the bitcast inside: eagerly it would compile again for every shape
        return _program(backend, ("widen", dtype), lambda: lambda h: widen(backend, h, dtype))
    bits = _program(backend, ("widen_bits", dtype), lambda: lambda h: widen_bits(backend.xp, h, dtype))
    return lambda h: backend.bitcast(bits(h), "float32")


def _philox(backend: Any, seed: int, streams: tuple[int, ...]) -> Any:
    """For each of ``streams``, the four Philox words of the :func:`counters` limbs
    (``philox_words``), as one program (one compilation per table, not per array)."""
    xp = backend.xp

    def words(*limbs: Any) -> tuple:
        ctr = [(limbs[2 * i], limbs[2 * i + 1]) for i in range(4)]
        return tuple(tuple(philox_words(xp, seed, stream, ctr)) for stream in streams)

    return _program(backend, ("words", seed, streams), lambda: words)


def _rounder(backend: Any, dtype: str, rounding: str, dim: int) -> Any:
    """``narrow``: float32 rows (and, stochastic, the Philox words) -> ``dtype`` patterns, the
    rounding of the bits one program."""
    xp = backend.xp
    bits_to = _program(backend, ("round_bits", dtype, rounding, dim), lambda: lambda b, *w: round_bits(
        xp, b, dtype, rounding, interleave(xp, w, dim) if w else None))
    return lambda x, *w: bits_to(backend.bitcast(xp.astype(x, xp.float32), "int32"), *w)
