"""Row kernels of the Torch backend: dedup + segment sums, id → storage-row maps, table
storage, the gather → rule → scatter functions the backend hands ``torch.compile``, and a
16-bit table's float32 rule rows with NumPy's bits (:func:`rule_rows`, at the end).

Of the ways to dedup and sum rows in ATen on CPU (``unique``, a dense id map, ``index_add_``,
``scatter_add_``, CSR matmul, ``coalesce``: figures in docs/benchmarks.md, "Measurements behind
design choices"), the fastest is a stable sort of the ids followed by ``embedding_bag`` in
``sum`` mode with the sort permutation as indices and the segment starts as offsets: the bag
kernel is the only multi-threaded row reduction in ATen on CPU, and a stable sort keeps each
segment's rows in input order, so the sums are added in the same order as NumPy's
``np.add.at`` (bit-identical results). Dedup is the sort; no separate ``unique`` pass.
"""

from __future__ import annotations

import itertools
import platform
import sys
import types
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from meshembed.backend.env import env_flag
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed.sharding.placement import Placement
from meshembed_native.pages import HUGE_PAGE_MIN_BYTES, advise_huge_pages
from meshembed_torch import native

_BAG_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Segments(NamedTuple):
    """Ids grouped by value: ``unique`` (sorted), ``perm`` (input positions grouped by id,
    input order kept inside a group) and ``starts`` (offset of each group in ``perm``)."""

    unique: torch.Tensor
    perm: torch.Tensor
    starts: torch.Tensor


def segments(ids: torch.Tensor, id_range: tuple[int, int] | None = None) -> Segments:
    """Group equal ids with one stable sort (no separate ``unique`` pass). ``id_range``:
    ``(min, max)`` of the ids when the caller already knows it (saves a scan)."""
    ids = ids.reshape(-1)
    if ids.numel() == 0:
        empty = ids.new_empty(0)
        return Segments(empty, empty, empty)
    keys = _narrow(ids, id_range)
    sorted_ids, perm = torch.sort(keys, stable=True)
    # one pass over the sorted keys (faster than ne + nonzero + index_select of the starts)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.zeros_like(counts)
    torch.cumsum(counts[:-1], 0, out=starts[1:])
    return Segments(unique.to(ids.dtype), perm, starts)


def _narrow(index: torch.Tensor, id_range: tuple[int, int] | None = None) -> torch.Tensor:
    """int64 indices as int32 when they fit: the CPU sort and the bag kernel run faster on
    int32 (docs/benchmarks.md); same results."""
    if index.dtype != torch.int64 or index.numel() == 0:
        return index
    lo, hi = torch.aminmax(index) if id_range is None else id_range
    if int(lo) >= -(2**31) and int(hi) < 2**31:
        return index.to(torch.int32)
    return index


def inverse(seg: Segments) -> torch.Tensor:
    """Group number of every input position (what ``unique(return_inverse=True)`` gives)."""
    n = seg.perm.numel()
    counts = torch.diff(seg.starts, append=seg.starts.new_tensor([n]))
    groups = torch.repeat_interleave(torch.arange(seg.starts.numel(), device=seg.perm.device), counts)
    out = torch.empty_like(seg.perm)
    out.index_copy_(0, seg.perm, groups)
    return out


def sum_segments(seg: Segments, values: torch.Tensor, weights: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out[k] = Σ_{i in group k} w_i · values[rows_i]`` (``rows`` defaults to ``i``).

    ``rows`` lets a caller sum rows of a *smaller* source without expanding it first, e.g.
    per-sample gradients reused by every id of the sample (the combiner backward): this
    skips materialising the ``[num_ids, D]`` gradient entirely.
    """
    tail = values.shape[1:]
    n = seg.unique.shape[0]
    if n == 0:
        return values.new_zeros((0,) + tuple(tail))
    flat = values.reshape(values.shape[0], -1)
    if bag_sums(flat):
        index, starts, psw = bag_inputs(seg, flat.shape[0], weights, rows, flat.dtype)
        out = F.embedding_bag(index, flat, starts, mode="sum", per_sample_weights=psw)
    else:  # integer / bool / empty rows: the bag kernel takes floats only
        if weights is not None and all_ones(weights):
            weights = None
        src = flat.index_select(0, rows.reshape(-1)) if rows is not None else flat
        if weights is not None:
            src = src * weights.reshape(-1, 1).to(src.dtype)
        out = torch.zeros((n, flat.shape[1]), dtype=src.dtype, device=src.device)
        out.index_add_(0, inverse(seg), src)
    return out.reshape((n,) + tuple(tail))


def bag_sums(flat: torch.Tensor) -> bool:
    """Whether the rows of 2-D ``flat`` can be summed by ``embedding_bag`` (floats, D > 0)."""
    return flat.dtype in _BAG_DTYPES and flat.shape[1] > 0


def bag_inputs(seg: Segments, source_rows: int, weights: torch.Tensor | None = None,
               rows: torch.Tensor | None = None, dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(indices, offsets, per_sample_weights)`` of the ``embedding_bag(mode="sum")`` over a
    ``source_rows``-row source that gives :func:`sum_segments`; weights of all ones are
    dropped (the sum combiner's scale: two passes saved)."""
    index = seg.perm if rows is None else rows.reshape(-1).index_select(0, seg.perm)
    if weights is not None and all_ones(weights):
        weights = None
    psw = None if weights is None else weights.reshape(-1).index_select(0, seg.perm).to(dtype)
    starts = seg.starts
    if source_rows < 2**31 and index.numel() < 2**31:  # int32 bag: see _narrow
        index, starts = index.to(torch.int32), starts.to(torch.int32)
    return index, starts, psw


def bag_offsets(sorted_ids: torch.Tensor, num_segments: int, int32: bool = False) -> torch.Tensor:
    """Start of each segment in non-decreasing ``sorted_ids`` (all in ``[0, num_segments)``):
    the ``offsets`` of ``embedding_bag``. An exclusive cumsum of ``bincount`` — one linear
    pass, faster than ``searchsorted`` of every segment (docs/benchmarks.md)
    (131,072 ids, 16,384 segments)."""
    dtype = torch.int32 if int32 else torch.int64
    offsets = torch.zeros(num_segments, dtype=dtype, device=sorted_ids.device)
    if num_segments > 1 and sorted_ids.numel():
        counts = torch.bincount(sorted_ids, minlength=num_segments)
        torch.cumsum(counts[:-1], 0, dtype=dtype, out=offsets[1:])
    return offsets


def sorted_offsets(segment_ids: torch.Tensor, num_segments: int, int32: bool = False) -> torch.Tensor | None:
    """:func:`bag_offsets` of non-empty ``segment_ids`` that are already non-decreasing (the
    sample-major combiner input), found in one pass over them; ``None`` when they are not
    sorted (sort them first). ``IndexError`` when one is outside ``[0, num_segments)``.

    One ``unique_consecutive`` replaces the sortedness test and the ``bincount`` (faster at
    W1: docs/benchmarks.md); its runs are strictly increasing exactly when the ids are
    sorted, and with one run per segment the offsets are the runs' exclusive cumsum."""
    runs, counts = torch.unique_consecutive(segment_ids, return_counts=True)
    if runs.numel() > 1 and not bool((runs[1:] > runs[:-1]).all()):
        return None
    lo, hi = int(runs[0]), int(runs[-1])
    if lo < 0 or hi >= num_segments:
        raise IndexError(
            f"Invalid `segment_ids`. Expected values in [0, {num_segments}). Received: min={lo}, max={hi}"
        )
    if runs.numel() != num_segments:  # empty segments: counts of every segment first
        counts = torch.zeros(num_segments, dtype=counts.dtype, device=counts.device).index_copy_(0, runs, counts)
    dtype = torch.int32 if int32 else torch.int64
    offsets = torch.zeros(num_segments, dtype=dtype, device=segment_ids.device)
    if num_segments > 1:
        torch.cumsum(counts[:-1], 0, dtype=dtype, out=offsets[1:])
    return offsets


def all_ones(weights: torch.Tensor) -> bool:
    """True when every weight is 1 (one cheap pass; lets the bag kernels skip weighting)."""
    return bool(torch.all(weights == 1))


def segment_sum(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique ids, per-id sums of ``values`` rows)."""
    seg = segments(ids)
    return seg.unique, sum_segments(seg, values)


def segment_sum_to(values: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Dense segment sum into ``num_segments`` rows (empty segments are zero).

    Segment ids that are already non-decreasing (sample-major combiner input, the usual
    case) need no sort: the bag kernel runs on offsets from :func:`bag_offsets`.
    """
    segment_ids = segment_ids.reshape(-1)
    tail = tuple(values.shape[1:])
    n = segment_ids.numel()
    if n == 0:
        return values.new_zeros((num_segments,) + tail)
    flat = values.reshape(n, -1)
    if flat.dtype not in _BAG_DTYPES or flat.shape[1] == 0:
        out = torch.zeros((num_segments, flat.shape[1]), dtype=flat.dtype, device=flat.device)
        return out.index_add_(0, segment_ids, flat).reshape((num_segments,) + tail)
    small = n < 2**31
    offsets = sorted_offsets(segment_ids, num_segments, int32=small)
    if offsets is None:
        sorted_ids, perm = torch.sort(segment_ids, stable=True)
        offsets = sorted_offsets(sorted_ids, num_segments, int32=small)
    else:
        perm = torch.arange(n, device=flat.device)
    perm = perm.to(torch.int32) if small else perm
    return F.embedding_bag(perm, flat, offsets, mode="sum").reshape((num_segments,) + tail)


class RowMap:
    """Maps global ids to rows of a contiguous local storage holding some shards.

    The storage is the held shards' rows concatenated in shard order; shard ``s`` holds
    its rows in local-row order (``Placement.global_ids``). The MOD/DIV arithmetic is
    :class:`~meshembed.sharding.placement.Placement`'s own, run on tensors. For one process
    holding every DIV shard that is the identity, so no arithmetic is done at all.
    """

    def __init__(self, vocabulary_size: int, num_shards: int, strategy: str,
                 held: tuple[int, ...], device: torch.device):
        self.placement = Placement(vocabulary_size, num_shards, strategy)
        self.held = held
        offsets = [0] * num_shards
        acc = 0
        for s in held:
            offsets[s] = acc
            acc += self.placement.rows_in_shard(s)
        self.local_rows = acc
        self._offset_list = offsets
        self.identity = (num_shards == 1) or (strategy == "div" and held == tuple(range(num_shards)))
        self._offsets = torch.tensor(offsets, dtype=torch.int64, device=device)

    def local_offset(self, shard: int) -> int:
        """First row of a held shard in the local storage."""
        return self._offset_list[shard]

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Shard of each global id (``Placement.owner`` on tensors)."""
        if self.placement.num_shards == 1:
            return torch.zeros_like(ids)
        return self.placement.owner(ids, xp=torch)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Storage row of each id; every id must belong to a held shard."""
        if self.identity:
            return ids
        owner = self.owner(ids)
        local = self.placement.local_row(ids, xp=torch, owner=owner)
        return local + self._offsets.index_select(0, owner)


MALLOC_ENV = "MESHEMBED_TORCH_MALLOC_TUNING"
#: glibc's own ceiling for its dynamic mmap threshold, and twice it for the trim threshold:
#: the state glibc reaches by itself once a 32 MiB block has been freed.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_malloc_state: list[bool] = []


def tune_malloc() -> bool:
    """Keep glibc from handing a training step's temporaries back to the kernel (once per
    process). Opt-in, as it changes the whole process's allocator: only with
    ``$MESHEMBED_TORCH_MALLOC_TUNING=1``. Returns whether it applied.

    glibc's dynamic thresholds start low (128 KiB mmap, 2× that trim) and only rise as blocks
    are freed, so with the W1 step's few 4–8 MiB temporaries (the forward activations, the
    per-row gradient sums, inductor's row buffer) the heap top is trimmed and grown again
    every few steps: thousands of page faults on a third of the steps (docs/benchmarks.md).
    Fixing the mmap threshold at its ceiling (32 MiB) and the trim threshold at 64 MiB — what
    glibc would pick itself after freeing one 32 MiB block — removes nearly all of them. Process-wide, but bounded: at
    most 64 MiB of freed heap stays mapped per arena; allocators other than glibc's
    (jemalloc, tcmalloc via ``LD_PRELOAD``) are left alone."""
    if _malloc_state:
        return _malloc_state[0]
    applied = False
    if env_flag(MALLOC_ENV, False) \
            and sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            loaded = ctypes.cast(libc.malloc, ctypes.c_void_p).value
            ours = ctypes.cast(ctypes.CDLL("libc.so.6").malloc, ctypes.c_void_p).value
            if loaded == ours:  # glibc's malloc is the one in use (no LD_PRELOADed allocator)
                m_trim_threshold, m_mmap_threshold = -1, -3
                applied = bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and \
                    bool(libc.mallopt(m_trim_threshold, TRIM_THRESHOLD))
        except (OSError, AttributeError):
            applied = False
    _malloc_state.append(applied)
    return applied


def empty_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised table; on Linux CPU, large ones are backed by 2 MiB pages (and make
    :func:`tune_malloc` run: a table that large means training steps with MiB temporaries).

    Row access of an embedding table is random, so with 4 KiB pages nearly every touched row
    costs a TLB miss; ``MADV_HUGEPAGE`` before the first write halves the time of random row
    gathers and scatters (docs/benchmarks.md, "Huge pages"). Only a hint.
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if device.type == "cpu" and sys.platform.startswith("linux") and nbytes >= HUGE_PAGE_MIN_BYTES:
        advise_huge_pages(out.data_ptr(), nbytes)
        tune_malloc()
    return out


class RecycledRows:
    """Output buffers of >= 32 MiB (a per-id lookup's rows at W1: 131,072 × 64 float32) kept
    and handed out again once nobody holds them, as a caching allocator would.

    glibc maps such blocks fresh on every allocation (its mmap-threshold ceiling is 32 MiB),
    so each costs a first touch of every page, about half of a W1 per-id lookup
    (docs/benchmarks.md, "The per-id step"). A buffer is reused only when this cache holds
    the one reference to it, to its TensorImpl and to its storage (no view, no NumPy array,
    no autograd record, no DLPack export) and it does not require grad; ``keep`` buffers per
    shape cover ``acts = emb.dequeue()`` loops, where the previous step's are still bound."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._bufs: dict[tuple, list[torch.Tensor]] = {}
        # the references this cache's own lookup holds (list, loop variable, arguments),
        # counted on a probe by the same code path, so no interpreter detail is assumed
        self._own_refs = 0
        for probe in [torch.empty(0)]:
            self._own_refs = sys.getrefcount(probe)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        bufs = self._bufs.setdefault((tuple(shape), dtype, device), [])
        for buf in bufs:
            if sys.getrefcount(buf) <= self._own_refs and self._free(buf):
                return buf
        out = empty_rows(tuple(shape), dtype, device)
        bufs.append(out)
        del bufs[:-self.keep]
        return out

    @staticmethod
    def _free(buf: torch.Tensor) -> bool:
        return (buf._use_count() == 1 and not buf.requires_grad
                and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2)  # + the wrapper


# -- compiled updates: what the backend hands torch.compile ------------------------------------

def gather_update_scatter(fn: Callable, values: Any, g: Any, index: Any, *datas: Any) -> None:
    """Rows at ``index`` of every table → ``fn(values, g, *rows)`` → written back in place.

    Compiled by inductor this is one fused pass (gather, the optimizer's element-wise math and
    the scatter) with no full-table copy; eager it is the plain three-step version."""
    rows = [d.index_select(0, index) for d in datas]
    new_rows = fn(values, g, *rows)
    for d, r in zip(datas, new_rows):
        r = torch.as_tensor(r).to(dtype=d.dtype)
        if tuple(r.shape) != (index.shape[0], d.shape[1]):  # a broadcast result
            r = r.expand(index.shape[0], d.shape[1])
        d.index_copy_(0, index, r)


def bag_update_scatter(fn: Callable, values: Any, source: Any, perm: Any, starts: Any, rows_of: Any,
                        weights: Any, small: bool, rows: Any, *datas: Any) -> None:
    """Per-row gradient sums, then :func:`gather_update_scatter` at storage ``rows``.

    The sums are one ``embedding_bag`` over ``source`` with the sort permutation ``perm``
    (through ``rows_of`` when the gradients are per sample) as indices, the group ``starts``
    as offsets and ``weights[perm]`` as per-sample weights (``small``: int32 indices), the
    arguments of :func:`meshembed_torch.kernels.bag_inputs`. Compiled as one function,
    inductor builds those indices in one fused gather + cast and computes the new rows in
    place of the sums' buffer (no second ``[U, D]`` temporary)."""
    index = perm if rows_of is None else rows_of.index_select(0, perm)
    psw = None if weights is None else weights.index_select(0, perm).to(source.dtype)
    if small:
        index, starts = index.to(torch.int32), starts.to(torch.int32)
    g = torch.nn.functional.embedding_bag(index, source, starts, mode="sum", per_sample_weights=psw)
    gather_update_scatter(fn, values, g, rows, *datas)


COMPILE_IDS = itertools.count()

#: Distinct hyper-parameter values one compiled update may be specialised for before that
#: update runs eager for good (a learning-rate schedule would otherwise recompile each step).
MAX_FLOAT_VARIANTS = 3


class Compiled:
    """A ``torch.compile``d function that is specialised on Python floats.

    dynamo's default traces Python floats as symbolic inputs (no recompilation when a
    learning rate changes), but with the core's FTRL that gave *silently wrong* numbers once
    the learning rate changed (docs/benchmarks.md, "Measurements behind design choices in
    the code", torch backend). So floats are specialised (``specialize_float=True``: a guard per value,
    exact results), and after ``MAX_FLOAT_VARIANTS`` distinct value sets — a schedule, not a
    constant — the function is left eager instead of recompiling every step."""

    def __init__(self, torch: Any, func: Callable, rows_dynamic: bool = False):
        """``rows_dynamic``: only the first dimension of tensor arguments is dynamic (marked
        on every call), the others are specialised; otherwise dynamo's automatic dynamic
        shapes (specialised on the first call, dynamic once a shape changes). Not
        ``dynamic=True``: it also makes the integers a function closes over symbolic, and
        inductor 2.13 then emitted float vector shifts for the integer program of the Philox
        words (``embedding.precision``): a C++ compile error."""
        self._torch = torch
        self._compiled = torch.compile(func, dynamic=False if rows_dynamic else None)
        self._rows_dynamic = rows_dynamic
        self._seen: set = set()
        self.eager = func

    def for_values(self, floats: tuple) -> Callable | None:
        if floats not in self._seen:
            if len(self._seen) >= MAX_FLOAT_VARIANTS:
                return None
            self._seen.add(floats)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._rows_dynamic:
            mark = self._torch._dynamo.maybe_mark_dynamic
            for a in args:
                if isinstance(a, self._torch.Tensor) and a.dim():
                    mark(a, 0)
        with SpecializeFloats(self._torch):
            return self._compiled(*args, **kwargs)


class SpecializeFloats:
    """``torch._dynamo.config.patch(specialize_float=True)`` for one call, without building a
    patch object per call (a noticeable part of a small compiled call: docs/benchmarks.md)."""

    __slots__ = ("_config", "_old")

    def __init__(self, torch: Any):
        self._config = torch._dynamo.config

    def __enter__(self) -> None:
        self._old = self._config.specialize_float
        self._config.specialize_float = True

    def __exit__(self, *exc: Any) -> None:
        self._config.specialize_float = self._old


def python_floats(value: Any, out: list, depth: int = 0) -> None:
    """Append the Python floats in ``value`` (nested call arguments) to ``out``: the values a
    :class:`Compiled` function is specialised on."""
    if isinstance(value, bool) or depth > 3:
        return
    if isinstance(value, float):
        out.append(value)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            python_floats(value[k], out, depth + 1)
    elif isinstance(value, (tuple, list)):
        for v in value:
            python_floats(v, out, depth + 1)


def distinct_code(func: Callable, n: int) -> Callable:
    """A copy of ``func`` with its own code object, so dynamo keeps a separate cache for it
    (dynamo's caches and recompilation limits are per code object)."""
    code = func.__code__.replace(co_name=f"{func.__name__}_{n}")
    copy = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


#: Elements an update must touch before ``torch.compile`` is used on CPU (the measured rule:
#: README, "Compilation").
COMPILE_MIN_ELEMENTS = 1 << 20


class UpdateCompiler:
    """When and how the torch backend compiles: the backend's ``compile`` mode, the
    ``torch.compile``d gather → rule → scatter entries of ``update_rows`` and the warn-once
    fallback to eager when the compiler fails. A part of :class:`~meshembed_torch.TorchBackend`
    (``backend._compiler``), holding what it compiled."""

    def __init__(self, mode: str, xp: Any):
        self.mode = mode  # "auto" | "always" | "never"
        self.broken = False  # the compiler failed once: eager from then on
        #: calls of ``Backend.compile`` functions that ran compiled (``stats()["compiled_calls"]``)
        self.compiled_calls = 0
        #: compiled entries by (rule, row layout, function name)
        self.entries: dict[Any, Compiled] = {}
        self._xp = xp
        self._rule_updates: dict[Any, Callable] = {}

    def wants(self, elements: int, device: Any) -> bool:
        """The measured rule (README, "Compilation"): inductor wins on CPU once an update
        touches about a million elements; below that eager is as fast and compiling (seconds
        per new function) would only slow tests and small models down."""
        if self.mode == "never" or self.broken:
            return False
        if self.mode == "always":
            return True
        return device.type == "cpu" and elements >= COMPILE_MIN_ELEMENTS

    def entry(self, rule: Any, elements: int, device: Any, layout: tuple = (),
              func: Callable | None = None) -> Callable | None:
        """A ``torch.compile``d gather → rule → scatter for ``rule``, or None for eager.

        One compiled entry per rule (its static part) and row layout (``layout``: each table's
        row width and dtype); the rule's values are tensor inputs, so a learning rate that
        changes every step reuses the entry. Only the row counts are dynamic: a static row
        width lets inductor unroll and vectorise the row loop without a tail (docs/benchmarks.md),
        and one entry per width keeps each entry's dynamo cache small. ``func`` is what gets
        compiled (default :func:`gather_update_scatter`; :func:`bag_update_scatter` also sums)."""
        if not self.wants(elements, device):
            return None
        func = func or gather_update_scatter
        key = (rule, layout, func.__name__)
        found = self.entries.get(key)
        if found is None:
            found = self.entries[key] = Compiled(torch, distinct_code(func, len(self.entries)), rows_dynamic=True)
        return found

    def run(self, compiled: Callable, eager: Callable, *args: Any) -> Any:
        """Run ``compiled``; if it fails but ``eager`` succeeds, the compiler is at fault: warn
        once and stay eager from then on. An error eager raises too is the caller's, as is."""
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - decided below
            out = eager(*args)
            import warnings

            self.broken = True
            warnings.warn(f"torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); the torch "
                          "backend runs eager from now on.", RuntimeWarning, stacklevel=3)
            return out

    def update_fn(self, rule: Any) -> Callable:
        """``update(values, g, *rows) -> new rows``: the rule through ``apply_rule`` (one
        function object per rule, so a compiled caller sees the same one every step)."""
        update = self._rule_updates.get(rule)
        if update is None:
            xp = self._xp

            def update(values: Any, g: Any, *rows: Any) -> tuple:
                return apply_rule(xp, rule, values, g, *rows)

            self._rule_updates[rule] = update
        return update

    @staticmethod
    def hyper(values: Any, device: Any) -> tuple:
        """A rule's values as 0-d float64 tensors: inputs of a compiled update, not constants,
        so a new learning rate compiles nothing (float64: the precision of a Python float)."""
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device).unbind()

    def update_rows(self, datas: list, index: Any, g: Any, rule: Any, values: Any) -> None:
        """``rule`` on the storage rows ``index`` (unique) of ``datas`` (a table and its slots):
        gather → rule → scatter in place, compiled where :meth:`wants` says so."""
        first = datas[0]
        compiled = self.entry(rule, index.shape[0] * first.shape[1], first.device,
                              tuple((d.shape[1], d.dtype) for d in datas) + ((g.dtype,) if g.dim() > 1 else ()))
        update = self.update_fn(rule)
        if compiled is None:  # eager: the values as Python floats, exactly the NumPy reference's
            gather_update_scatter(update, tuple(values), g, index, *datas)
        else:
            self.run(compiled, gather_update_scatter, update, self.hyper(values, first.device), g, index, *datas)

    def function(self, fn: Callable, options: dict) -> Callable:
        """``Backend.compile``: ``torch.compile`` where it pays. ``force=True`` always compiles;
        otherwise the function runs eager on small inputs and compiled once its tensor arguments
        (also inside lists and tuples) hold ``COMPILE_MIN_ELEMENTS`` elements together on CPU —
        what one call reads and writes (see :meth:`wants`)."""
        import inspect

        if options.pop("force", False):
            forced = torch.compile(fn, dynamic=options.pop("dynamic", True), **options)

            def run_forced(*args: Any, **kwargs: Any) -> Any:
                with SpecializeFloats(torch):  # see Compiled
                    return forced(*args, **kwargs)

            run_forced.__wrapped__ = fn  # type: ignore[attr-defined]
            return run_forced
        if self.mode == "never":
            return fn
        compiled: list[Compiled] = []
        # Its own code object, so each compile() call has its own dynamo cache and recompile
        # budget (dynamo keys both on code, so two compile() of one function would share).
        traced = distinct_code(fn, next(COMPILE_IDS)) if inspect.isfunction(fn) else fn

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            elements = sum(t.numel() for t in tensors)
            device = tensors[0].device if tensors else torch.device("cpu")
            if self.wants(elements, device):
                if not compiled:
                    compiled.append(Compiled(torch, traced))
                floats: list = []
                python_floats([args, kwargs], floats)
                runner = compiled[0].for_values(tuple(floats))  # fn's own constants are fixed
                if runner is not None:
                    out = self.run(lambda *a: runner(*a, **kwargs), lambda *a: fn(*a, **kwargs), *args)
                    self.compiled_calls += not self.broken
                    return out
            return fn(*args, **kwargs)

        dispatch.__wrapped__ = fn  # type: ignore[attr-defined]
        return dispatch


# -- low-precision tables (docs/low_precision.md): the rule's float32 rows with NumPy's bits --
#
# The rule's float32 math of a 16-bit table's update (``Backend.apply_rule_rows``, between the core's widening and rounding in
# ``meshembed.embedding.precision.update_table``) with NumPy's bits.
#
# Run op by op with torch, the rule's float math is not NumPy's in every rule (measured:
# ``torch.pow`` is not libm's ``powf``; 8 optimizers left float32 slot values a last bit off).
# So the rows run through the generated C++ row kernel (:mod:`.native`, NumPy's bits for
# ``+ − × ÷ sqrt``) over ``[n, D]`` float32 rows ``0..n-1`` (each row once: the driver's sum is the
# summed gradient itself). A kernel that calls pow/exp/log is not NumPy's there (its float32
# versions are its own, within 1 ulp; measured: AdagradMomentum's ``pow(x, -1/2)`` left 7-15
# ``momenta`` values a bit off), so for such a rule — and with the fused kernels off, or for a
# rule without a generated kernel — NumPy's own ``apply_rule`` runs on zero-copy NumPy views of
# the rows (the NumPy backend's computation). ``None`` (torch operations) elsewhere: rows or
# gradients not float32 on the CPU, a value that is not a Python number (the kernel takes
# doubles; NumPy treats a Python float as a weak scalar), a rule not computed in float32.

def _numpy_xp() -> Any:
    import array_api_compat.numpy as xp

    return xp


def rule_rows(be: Any, rule: Any, values: Sequence[Any], grads: Any, rows: Sequence[Any]) -> list | None:
    """The rule's new rows with NumPy's bits (see the comment above), or None."""
    torch = be._torch
    if not isinstance(rule, UpdateRule) or rule.dtype != "float32" or any(type(v) not in (int, float) for v in values):
        return None
    if any(a.dtype != torch.float32 or a.device.type != "cpu" for a in (grads, *rows)) or grads.dim() != 2:
        return None
    grads = grads.contiguous()
    rows = [r.contiguous() for r in rows]
    n = int(grads.shape[0])
    kernel = native.kernel_for(rule, values, rows, grads, n, None, None) if be.fused else None
    if kernel is None or kernel[0].calls_libm:
        new = apply_rule(_numpy_xp(), rule, values, grads.numpy(), *(r.numpy() for r in rows))
        be._stats["numpy_low_precision_updates"] += 1
        return [torch.from_numpy(np.ascontiguousarray(r, dtype=np.float32)) for r in new]
    # rows 0..n-1, each once: the kernel's sum (from zero) is grads itself; written in place
    native.update(kernel, torch.arange(n, dtype=torch.int64), grads, None, None, rows, torch.get_num_threads())
    be._stats["fused_low_precision_updates"] += 1
    return rows
