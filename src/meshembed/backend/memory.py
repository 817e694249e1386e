"""Allocations whose size the user controls fail as one meshembed error stating the bytes.

A table of ``vocabulary_size x dimension``, a batch's activations, an optimizer slot or a host
copy of a table can be larger than the machine. NumPy then raises a bare ``MemoryError`` (or a
``ValueError`` "array is too big"), torch a ``RuntimeError`` from its allocator and XLA
``RESOURCE_EXHAUSTED``; none says which table or how much. :func:`allocating` wraps such an
allocation and turns each of those into :class:`~meshembed.errors.ResourceError` (still a
``MemoryError``) naming what was allocated, its bytes, shape and dtype, and the fix; sizes no
array of this process can have are refused before anything is allocated.
"""

from __future__ import annotations

import math
import sys
from typing import Sequence

from meshembed.errors import ResourceError

__all__ = ["allocating", "allocation_failed", "check_size", "nbytes", "FIX"]

#: The usual ways out, for a caller that has no more specific advice.
FIX = ("use a smaller batch (or smaller `input_shape` / `vocabulary_size` / `dimension`), shard the tables "
       "over more ranks or devices (`num_shards`, a larger mesh), or store them in lower precision "
       "(`TableConfig(precision=...)`).")

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
             "int32": 4, "int64": 8, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16}
#: Text of the allocation failures that are not MemoryError: NumPy's size checks, torch's CPU
#: and CUDA allocators, XLA.
_MARKERS = ("array is too big", "maximum allowed size exceeded", "maximum allowed dimension exceeded",
            "can't allocate memory", "out of memory", "resource_exhausted", "failed to allocate",
            "cannot allocate memory", "bad_alloc")


def nbytes(shape: Sequence[int], dtype: str = "float32", arrays: int = 1) -> int:
    """Bytes of ``arrays`` arrays of ``shape`` and ``dtype``, as a Python int (no overflow)."""
    size = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if size is None:  # a NumPy / torch dtype object
        size = _ITEMSIZE.get(str(getattr(dtype, "name", dtype)).replace("torch.", ""), 4)
    return arrays * math.prod(map(int, shape)) * size  # NumPy ints would wrap


def _limit() -> tuple[int, str]:
    """The most bytes one array of this process can have, and why."""
    limit, why = sys.maxsize, f"the largest array size this process can address ({sys.maxsize:,} bytes)"
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY and soft < limit:
            limit, why = soft, f"this process's address-space limit (RLIMIT_AS = {soft:,} bytes)"
    except (ImportError, OSError, ValueError):  # not a Unix: only the address-size limit
        pass
    return limit, why


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,} bytes ({n / size:.3g} {unit})"
    return f"{n:,} bytes"


def _message(what: str, n: int, shape: Sequence[int], dtype: str, arrays: int, reason: str, nothing: str,
             fix: str) -> str:
    each = f"{arrays} {dtype} arrays of shape {tuple(shape)}" if arrays > 1 else f"a {dtype} array of shape {tuple(shape)}"
    return f"Cannot allocate {what}: it needs {_human(n)} ({each}), and {reason}. {nothing} Fix: {fix}"


#: Below this many bytes the address-space limit is not asked (a syscall) before allocating:
#: no process runs under a smaller one, and a failure is still mapped by ``allocating``.
_ASK_LIMIT_FROM = 1 << 26


def check_size(what: str, shape: Sequence[int], dtype: str = "float32", *, arrays: int = 1, fix: str = FIX,
               nothing: str = "Nothing was changed.") -> int:
    """The bytes of the allocation; ``ResourceError`` before allocating when no array of this
    process can be that large (NumPy's limit, the address-space limit)."""
    n = nbytes(shape, dtype, arrays)
    each = n // arrays if arrays > 1 else n
    if each < _ASK_LIMIT_FROM:
        return n
    limit, why = _limit()
    if each > limit:
        raise ResourceError(_message(what, n, shape, dtype, arrays, f"that exceeds {why}", nothing, fix))
    return n


def allocation_failed(exc: BaseException) -> bool:
    """``exc`` is a failed allocation: MemoryError, NumPy's "array is too big", torch's
    allocator errors, XLA's RESOURCE_EXHAUSTED."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, ValueError)) and any(m in text for m in _MARKERS)


class allocating:  # noqa: N801 - used as a function: ``with allocating(...):``
    """Run the block that allocates ``what`` (``arrays`` arrays of ``shape`` and ``dtype``);
    a failed allocation inside it leaves as :class:`ResourceError`. Refuses impossible sizes
    first (:func:`check_size`). ``nothing`` is the caller's promise about state after a
    failure, said in the message. A class, not a generator: it wraps every lookup."""

    __slots__ = ("what", "shape", "dtype", "arrays", "fix", "nothing", "nbytes")

    def __init__(self, what: str, shape: Sequence[int], dtype: str = "float32", *, arrays: int = 1,
                 fix: str = FIX, nothing: str = "Nothing was changed.") -> None:
        self.what, self.shape, self.dtype, self.arrays, self.fix, self.nothing = what, shape, dtype, arrays, fix, nothing
        self.nbytes = check_size(what, shape, dtype, arrays=arrays, fix=fix, nothing=nothing)

    def __enter__(self) -> int:
        return self.nbytes

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, ResourceError) or not allocation_failed(exc):
            return None
        detail = f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else type(exc).__name__
        raise ResourceError(_message(self.what, self.nbytes, self.shape, self.dtype, self.arrays,
                                     f"that allocation failed ({detail})", self.nothing, self.fix)) from exc
