"""Low-precision tables on the step: bfloat16 / float16 storage with float32 math.

A table whose ``TableConfig(precision=me.embedding.Precision(...))`` stores its parameters or
a slot in 16 bits keeps that array as its 16-bit patterns in an ``int16`` backend table, so
NumPy (which has no bfloat16), torch, JAX and any Array API library hold the same bits. Every
step function reads it through here:

* lookups gather the 16-bit rows and widen them to float32 (exact), then combine in float32;
* an update sums the gradients per unique id, gathers and widens the rows, applies the
  table's :class:`~meshembed.math.UpdateRule` with ``meshembed.math.apply_rule`` in float32,
  rounds each 16-bit array back (``meshembed.math.rounding``) and scatters — only protocol
  methods, so every backend runs it (the fused update kernels are not used for such tables);
* creation, ``load_parameters`` and a float32 restore round to nearest even on the host;
  ``retrieve_parameters`` returns the exact float32 values; checkpoints keep the patterns.

docs/low_precision.md specifies the rounding and its random bits.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import array_api_compat
import numpy as np

from meshembed.backend.protocol import check_rule
from meshembed.embedding.layout import Layout, TableSpec
from meshembed.errors import ConfigError
from meshembed.math.rounding import random_words, round_bits, widen_bits
from meshembed.math.rule import UpdateRule, apply_rule

__all__ = ["array_dtypes", "check_layout", "fresh_state", "from_storage", "is_low", "lookup_rows",
           "stream_of", "to_storage", "update_table"]

#: NumPy dtype of the stored patterns of each 16-bit format.
STORAGE = {"bfloat16": np.dtype(np.int16), "float16": np.dtype(np.int16)}
#: Rows per host block when converting whole tables (bounds the temporaries of the rounding).
_BLOCK_ROWS = 1 << 16
_xp_host = None


def _host_xp() -> Any:
    global _xp_host
    if _xp_host is None:
        import array_api_compat.numpy as xp

        _xp_host = xp
    return _xp_host


def _slot_names(t: TableSpec) -> tuple[str, ...]:
    opt = t.optimizer
    return tuple(getattr(opt, "slot_names", ()) or ())


def array_dtypes(t: TableSpec) -> tuple[str, ...]:
    """``(parameters, *slots)`` storage dtypes of table ``t`` (all float32 without a precision)."""
    names = _slot_names(t)
    p = t.precision
    if p is None:
        return ("float32",) * (1 + len(names))
    unknown = sorted(set(p.named_slots) - set(names))
    if unknown:
        raise ConfigError(
            f"Invalid `precision` for table {t.name!r}: slots {unknown} are not slots of "
            f"{type(t.optimizer).__name__}. Expected some of {list(names)}. Received: precision={p!r}")
    return p.dtypes(names)


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


def stream_of(table_index: int, array_index: int) -> int:
    """The second key word of an array's random bits: ``table_index * 256 + array_index``
    (array 0 = parameters, k = the k-th slot)."""
    return int(table_index) * 256 + int(array_index)


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
def widen(backend: Any, rows: Any, dtype: str) -> Any:
    """Stored rows (a backend int16 array) -> float32 rows (exact)."""
    if dtype == "float32":
        return rows
    return backend.bitcast(widen_bits(backend.xp, rows, dtype), "float32")


def narrow(backend: Any, values: Any, dtype: str, rounding: str, random: Any = None) -> Any:
    """float32 rows -> stored rows of ``dtype`` (int16), rounded as ``rounding`` says."""
    bits = backend.bitcast(backend.xp.astype(values, backend.xp.float32), "int32")
    return round_bits(backend.xp, bits, dtype, rounding, random)


def lookup_rows(backend: Any, table: Any, ids: Any, dtype: str) -> Any:
    """``table[ids]`` as float32 rows."""
    return widen(backend, backend.gather(table, ids), dtype)


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
        out = np.empty(shape, STORAGE[dtype])
        start = 0
        for block in parts:
            block = np.asarray(block, dtype=np.float32)
            out[start:start + len(block)] = to_storage(block, dtype)
            start += len(block)
        if start != shape[0]:
            raise ValueError(f"Invalid table blocks: they cover {start} rows, expected {shape[0]}.")
        return backend.create_table(out, placement)

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
    from meshembed.embedding.updates import is_non_lazy

    xp = backend.xp
    values = check_rule(rule, values, backend.name)
    dtypes = array_dtypes(t)
    host_ids = np.asarray(host_ids, dtype=np.int64).reshape(-1)
    if is_non_lazy(t):  # every row, with a zero gradient where not looked up
        every = np.arange(t.vocabulary_size, dtype=np.int64)
        zeros = xp.zeros((t.vocabulary_size, t.dimension), dtype=row_grads.dtype,
                         device=array_api_compat.device(row_grads))
        host_ids = np.concatenate([host_ids, every])
        row_grads = xp.concat([row_grads, zeros], axis=0)
    if host_ids.size == 0 or (guard is not None and not bool(guard)):
        return list(state)
    uids, grads = backend.segment_sum(backend.asarray(host_ids, dtype="int64"), row_grads)
    rows = [widen(backend, backend.gather(a, uids), d) for a, d in zip(state, dtypes)]
    new = apply_rule(xp, rule, values, grads, *rows)
    p = t.precision
    out = []
    unique = None
    for k, (array, row, dtype) in enumerate(zip(state, new, dtypes)):
        if dtype != "float32":
            random = None
            if p.rounding == "stochastic":
                if unique is None:
                    unique = np.unique(host_ids)  # = uids (sorted unique), on the host
                random = random_words(xp, p.seed, stream_of(t.index, k), step, unique, t.dimension,
                                      device=array_api_compat.device(row))
            row = narrow(backend, row, dtype, p.rounding, random)
        out.append(backend.scatter(array, uids, row))
    return out
