"""The torch backend's native code: the C++ it compiles on first use and calls through ctypes.

One module for both libraries, because they are the same kind of code — ctypes bindings of C++
drivers (``meshembed_native/drivers.h``) that run a row kernel generated from the core's math
(:mod:`meshembed_native.codegen`), built once by :mod:`meshembed_native.build` — and the other
backends keep their native code in one ``native.py`` too (docs/internals.md, "Layering"):

* ``native_fused.cc``: the fused sparse updates of the embedding tables (dedup, batch-order
  sums, the row kernel), the pooled sum and the gather of large outputs (first half below);
* ``native_dense.cc``: the dense optimizer's fused step and the NaN policy's one pass
  (``dense_*`` and :func:`all_finite`, second half below).

Where a library cannot be built the core functions run instead (one RuntimeWarning each);
``TorchBackend(fused=False)`` / ``MESHEMBED_TORCH_FUSED=0`` turn both off.

Fused CPU updates (``native_fused.cc``): the driver does the dedup, the per-row gradient sums
(in batch order) and, per unique row, one call of the optimizer's row kernel — generated from
the core's math by :mod:`meshembed_native.codegen`, so no formula is written here — in one
pass over each row (what fbgemm's TBE does). Every element-wise optimizer and the row-wise ones (a per-row slot is
``[rows, 1]``, stepped by 1: ``RowKernel.widths``), float32 and float64, with clipping and
weight decay; the learning rate and other dynamic values are the kernel's parameters, so a
value that changes every step compiles nothing. It is an *optimisation* of the core function:
``TorchBackend(fused=False)`` / ``MESHEMBED_TORCH_FUSED=0`` (read by the backend's constructor)
turn it off, and tests compare it with the core function and NumPy.
The sums can also check every gradient element for NaN/Inf before anything is written (the
engine's policy, ``update_rows(check_finite=True)``) without a pass of its own; and
:func:`gather_rows` is the lookup of large outputs (a per-id feature's rows) with streaming stores.
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Any, Sequence

from meshembed_native import build, codegen
from meshembed.errors import InputError, NonFiniteError
from meshembed.math.rule import UpdateRule

_FUSED_SOURCE = Path(__file__).with_name("native_fused.cc")

_fused_state: dict[str, Any] = {}

_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int, ctypes.c_int, ctypes.c_int]
_POOLED_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
_POOLED16_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
_GATHER16_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
_GATHER_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                ctypes.c_int]

#: Outputs of :func:`gather_rows` from this size on (``meshembed::kStreamMinBytes`` of
#: meshembed_native/drivers.h, whose gather both backends run) are written with streaming stores: faster
#: from this size on, slower below it, even when read right after (docs/benchmarks.md,
#: "Measurements behind design choices in the code", torch backend).
STREAM_MIN_BYTES = 16 << 20


def _fused_library() -> Any:
    """The loaded driver library, or None (with one warning) where it cannot be built."""
    signatures = {f"meshembed_fused_update_{dtype}": (ctypes.c_int64, _ARGS) for dtype in ("float32", "float64")}
    signatures["meshembed_gather_rows"] = (ctypes.c_int64, _GATHER_ARGS)
    for dtype in ("float32", "float64"):
        signatures[f"meshembed_pooled_sum_{dtype}"] = (ctypes.c_int64, _POOLED_ARGS)
    signatures["meshembed_pooled_sum_16"] = (ctypes.c_int64, _POOLED16_ARGS)
    signatures["meshembed_gather_rows_16"] = (ctypes.c_int64, _GATHER16_ARGS)
    return build.load_once(_fused_state, _FUSED_SOURCE, "torch_native_fused", signatures,
                           "the torch backend's fused CPU updates are", flags=(*build.FLAGS, "-fopenmp"),
                           hint=" Set MESHEMBED_TORCH_FUSED=0 to silence this.")


class RowOutside(InputError):
    """:func:`update` found a row outside the table (nothing was written)."""


def kernel_for(rule: Any, values: Sequence[float], datas: Sequence[Any], grads: Any, n: int, grad_index: Any,
               weights: Any) -> tuple[codegen.RowKernel, tuple[float, ...]] | None:
    """``(row kernel, parameter block)`` when a generated kernel computes ``rule`` with
    ``values`` for these CPU tables (float32 or float64, one dtype) and ``n`` ids' gradients
    of the expected shapes, else None (the core function then runs, and reports any error)."""
    import torch

    if not isinstance(rule, UpdateRule) or not 1 <= len(datas) <= codegen.MAX_ARRAYS:
        return None
    dtype = {torch.float32: "float32", torch.float64: "float64"}.get(datas[0].dtype)
    if dtype is None or any(t.dtype != datas[0].dtype or t.device.type != "cpu" or not t.is_contiguous()
                            for t in (*datas, grads)):
        return None
    dim = datas[0].shape[1] if datas[0].dim() == 2 else -1
    row_slots = set(getattr(rule.math, "row_slots", ()))
    widths = [1 if k and rule.slot_names[k - 1] in row_slots else dim
              for k in range(len(datas))] if len(datas) <= 1 + len(rule.slot_names) else []
    if grads.dim() != 2 or grads.shape[1] != dim or len(widths) != len(datas) or any(
            tuple(d.shape) != (datas[0].shape[0], w) for d, w in zip(datas, widths)):  # row-wise slots: [rows, 1]
        return None
    if (grad_index is None and grads.shape[0] != n) or (grad_index is not None and grad_index.numel() != n):
        return None
    if weights is not None and weights.numel() != n:
        return None
    if len(values) != len(rule.dynamic) or _fused_library() is None:
        return None
    kernel = codegen.row_kernel(rule if rule.dtype == dtype else dataclasses.replace(rule, dtype=dtype), len(datas))
    if kernel is None or [dim if w == 0 else 1 for w in kernel.widths] != widths:
        return None
    return kernel, kernel.params(values)


def update(kernel: tuple[codegen.RowKernel, tuple[float, ...]], rows: Any, grads: Any, grad_index: Any,
           weights: Any, datas: Sequence[Any], threads: int, check_finite: bool = False) -> None:
    """Run the kernel in place on ``datas`` (the table, then its slots): contribution ``i``
    adds ``weights[i] * grads[grad_index[i]]`` (defaults: 1 and ``i``) to row ``rows[i]``.

    ``check_finite``: raise :class:`~meshembed.errors.NonFiniteError`, with nothing written, if any element of
    ``grads`` is NaN or Inf; checked while the gradients are summed (no pass of its own)."""
    import torch

    row_kernel, hp = kernel
    rows = rows.to(torch.int64).contiguous()
    index = None if grad_index is None else grad_index.to(torch.int64).contiguous()
    w = None if weights is None else weights.to(datas[0].dtype).contiguous()
    params = (ctypes.c_double * max(1, len(hp)))(*hp)
    arrays = (ctypes.c_void_p * len(datas))(*(d.data_ptr() for d in datas))
    done = getattr(_fused_library(), f"meshembed_fused_update_{row_kernel.dtype}")(
        row_kernel.address, params, len(datas), arrays, datas[0].shape[0], rows.data_ptr(), rows.numel(),
        None if index is None else index.data_ptr(), None if w is None else w.data_ptr(), grads.data_ptr(),
        grads.shape[0], grads.shape[1], int(threads), int(bool(check_finite)),
        sum(1 << k for k, w in enumerate(row_kernel.widths) if w))
    if done == -4:
        raise NonFiniteError()
    if done == -1:
        raise RowOutside(f"Invalid `ids`: expected rows in [0, {datas[0].shape[0]}). Nothing was updated.")
    if done == -2:
        raise InputError(f"Invalid `grad_index`: expected every index in [0, {grads.shape[0]}) (a row of "
                         "`grads`). Nothing was updated.")
    if done < 0:  # the backend checked the kernel and the array count: an internal error, not a user's
        raise RuntimeError(f"meshembed fused update: internal error {done} (a bad kernel or array count)")


def gather_rows(data: Any, index: Any, out: Any) -> bool:
    """``torch.index_select(data, 0, index, out=out)`` for a CPU ``out`` of at least
    :data:`STREAM_MIN_BYTES`, with streaming stores (row_kernels.h ``StreamRow``); returns False,
    having done nothing, where it does not apply (the caller then runs ``index_select``).
    ``index``: int64 rows of ``data``, already checked against its row count."""
    import torch

    if (out.device.type != "cpu" or data.device.type != "cpu" or data.dim() != 2
            or out.dtype != data.dtype or tuple(out.shape) != (index.numel(), data.shape[1])
            or index.dtype != torch.int64 or not (data.is_contiguous() and out.is_contiguous())
            or out.numel() * out.element_size() < STREAM_MIN_BYTES or _fused_library() is None):
        return False
    index = index.contiguous()
    done = _fused_library().meshembed_gather_rows(data.data_ptr(), data.shape[0], index.data_ptr(), index.numel(),
                                            data.shape[1] * data.element_size(), out.data_ptr(),
                                            torch.get_num_threads())
    if done < 0:  # the backend checked the ids: an internal error, not a user's
        raise RuntimeError("meshembed gather_rows: internal error (a row outside the table)")
    return True


def pooled_sum(data: Any, ids: Any, slots: Any, num_segments: int, threads: int, offsets: Any = None) -> Any:
    """``out[s] = Σ data[ids[i]]`` over the positions ``i`` with ``slots[i] == s`` (the sum
    combiner's forward over sorted segments; an empty segment is zeros) in one C++ pass
    (``meshembed_pooled_sum_*``): each segment summed in registers in position order from 0 —
    the bits of ``embedding_bag(mode="sum")`` and of the NumPy reference — with the ids' range
    check and the slots' order check folded in, no int32 copy. ``offsets`` (int64
    ``[num_segments + 1]``, the same segments' first positions): read instead of scanning the
    slots. None, having done nothing the caller sees, where it does not apply: not a 2-D
    float32/float64 CPU table, not 1-D int64 CPU ids and slots of one length, an id outside
    the table, slots that are not non-decreasing in ``[0, num_segments)`` or offsets that do
    not run from 0 to ``len(ids)`` (the caller's general path then reports or sorts)."""
    import torch

    dtype = {torch.float32: "float32", torch.float64: "float64"}.get(getattr(data, "dtype", None))
    n = _pooled_checks(data, ids, slots, num_segments, (torch.float32, torch.float64))
    if n is None:
        return None
    offsets = _pooled_offsets(offsets, num_segments)  # else: scan the slots
    out = torch.empty((num_segments, data.shape[1]), dtype=data.dtype)
    done = getattr(_fused_library(), f"meshembed_pooled_sum_{dtype}")(
        data.data_ptr(), data.shape[0], data.shape[1], ids.data_ptr(), slots.data_ptr(), n, num_segments,
        None if offsets is None else offsets.data_ptr(), out.data_ptr(), int(threads))
    return out if done == 0 else None


def _pooled_checks(data: Any, ids: Any, slots: Any, num_segments: int, dtypes: tuple) -> int | None:
    """The id count where :func:`pooled_sum` / :func:`pooled_sum_16` may run on these arrays
    (a 2-D contiguous CPU table of one of ``dtypes``, 1-D int64 contiguous CPU ids and slots of
    one non-zero length, a segment), else None."""
    import torch

    n = ids.numel() if isinstance(ids, torch.Tensor) else 0
    if (getattr(data, "dtype", None) not in dtypes or n == 0 or not isinstance(slots, torch.Tensor)
            or data.dim() != 2 or data.device.type != "cpu" or not data.is_contiguous() or ids.dtype != torch.int64
            or slots.dtype != torch.int64 or ids.device.type != "cpu" or slots.device.type != "cpu"
            or ids.dim() != 1 or slots.dim() != 1 or slots.numel() != n or num_segments < 1
            or not (ids.is_contiguous() and slots.is_contiguous()) or _fused_library() is None):
        return None
    return n


def _pooled_offsets(offsets: Any, num_segments: int) -> Any:
    """``offsets`` where the kernel can read them as the segments' first positions, else None
    (the kernel then scans the slots)."""
    import torch

    if offsets is not None and not (isinstance(offsets, torch.Tensor) and offsets.dtype == torch.int64
                                    and offsets.device.type == "cpu" and offsets.is_contiguous()
                                    and tuple(offsets.shape) == (num_segments + 1,)):
        return None
    return offsets


def pooled_sum_16(data: Any, ids: Any, slots: Any, num_segments: int, dtype: str, threads: int,
                  offsets: Any = None) -> Any:
    """:func:`pooled_sum` of a low-precision table (``int16`` patterns of ``dtype``, ``"bfloat16"``
    or ``"float16"``): the float32 sums of the rows widened to float32 — exactly the bits of
    :func:`pooled_sum` (and ``embedding_bag``) over those widened rows — in one C++ pass that
    widens each element as it adds it (``meshembed_pooled_sum_16``), so neither the gathered 16-bit
    rows nor their float32 copies exist. bfloat16 widens by a shift; float16 through the float32
    value of each of the 65,536 patterns, made once by the core's widening
    (``meshembed.math.rounding.widen_bits``). None, having done nothing the caller sees, where
    :func:`pooled_sum` would return None (not ``int16`` patterns; see there)."""
    import torch

    n = _pooled_checks(data, ids, slots, num_segments, (torch.int16,))
    if n is None or dtype not in ("bfloat16", "float16"):
        return None
    lut = None if dtype == "bfloat16" else _widened_patterns(dtype)
    offsets = _pooled_offsets(offsets, num_segments)
    out = torch.empty((num_segments, data.shape[1]), dtype=torch.float32)
    done = _fused_library().meshembed_pooled_sum_16(
        data.data_ptr(), data.shape[0], data.shape[1], ids.data_ptr(), slots.data_ptr(), n, num_segments,
        None if offsets is None else offsets.data_ptr(), 0 if lut is None else 1,
        None if lut is None else lut.ctypes.data, out.data_ptr(), int(threads))
    return out if done == 0 else None


def gather_rows_16(data: Any, ids: Any, dtype: str, threads: int) -> Any:
    """``data[ids]`` widened to float32 for a low-precision table (``int16`` patterns of ``dtype``,
    ``"bfloat16"`` or ``"float16"``): the exact values of the core's widening
    (``meshembed.math.rounding.widen_bits``) in one C++ pass (``meshembed_gather_rows_16``), without
    the 16-bit rows or an integer temporary. None, having done nothing the caller sees, where it
    does not apply (not a 2-D contiguous CPU ``int16`` table, not 1-D int64 CPU ids, no library, an
    id outside the table: the caller's general path then runs and reports)."""
    import torch

    if (dtype not in ("bfloat16", "float16") or getattr(data, "dtype", None) != torch.int16 or data.dim() != 2
            or data.device.type != "cpu" or not data.is_contiguous() or not isinstance(ids, torch.Tensor)
            or ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu" or _fused_library() is None):
        return None
    ids = ids.contiguous()
    lut = None if dtype == "bfloat16" else _widened_patterns(dtype)
    out = torch.empty((ids.numel(), data.shape[1]), dtype=torch.float32)
    done = _fused_library().meshembed_gather_rows_16(
        data.data_ptr(), data.shape[0], data.shape[1], ids.data_ptr(), ids.numel(), 0 if lut is None else 1,
        None if lut is None else lut.ctypes.data, out.data_ptr(), int(threads))
    return out if done == ids.numel() else None


def _widened_patterns(dtype: str) -> Any:
    """The float32 values of the 65,536 ``dtype`` patterns, indexed by the pattern as an
    unsigned 16-bit number (the core's exact widening, made once per format)."""
    key = "lut_" + dtype
    if key not in _fused_state:
        import array_api_compat.numpy as xp
        import numpy as np

        from meshembed.math.rounding import widen_bits

        patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16)
        _fused_state[key] = np.ascontiguousarray(np.asarray(widen_bits(xp, patterns, dtype), np.int32).view(np.float32))
    return _fused_state[key]


# -- the dense optimizer's fused CPU step (native_dense.cc) ------------------------------
#
# ``me.optimizers.Adadelta`` (and ``me.torch.Adadelta``) hand the backend an ``UpdateRule``;
# where ``meshembed_native.codegen`` generates its row kernel (every element-wise rule, float32
# and float64) one C call updates all the staged tensors in place, each tensor cut into chunks
# spread over OpenMP threads: each element of the gradient, the variable and the slots is read
# once and written once (the W2 memory bound). The formula is the generated one — the core's
# math, recorded — so this module holds no formula; it only checks the tensors and passes
# pointers. ``TorchBackend(fused=False)`` / ``MESHEMBED_TORCH_FUSED=0`` turn it off (the core
# function, compiled, runs).

_DENSE_SOURCE = Path(__file__).with_name("native_dense.cc")
#: Elements per chunk (256 KiB of float32): enough to amortise a call, small enough to
#: spread one tensor over the threads.
DENSE_CHUNK = 1 << 16
_dense_state: dict[str, Any] = {}


_UPDATE_ARGS = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
_CHECK_ARGS = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


def _dense_library() -> Any:
    """The loaded driver, or None (one warning) where it cannot be built."""
    signatures = {"meshembed_dense_update": (ctypes.c_int64, _UPDATE_ARGS),
                  "meshembed_all_finite": (ctypes.c_int, _CHECK_ARGS)}
    return build.load_once(_dense_state, _DENSE_SOURCE, "torch_native_dense", signatures,
                           "the torch backend's fused dense update is", flags=(*build.FLAGS, "-fopenmp"),
                           hint=" Set MESHEMBED_TORCH_FUSED=0 to silence this.")


def dense_kernel_for(rule: UpdateRule) -> Any:
    """The generated row kernel of ``rule`` (the variable and its slots), or None: not
    element-wise or no compiler."""
    if not isinstance(rule, UpdateRule) or not rule.elementwise:
        return None
    kernel = codegen.row_kernel(rule, 1 + len(rule.slot_names))
    return kernel if kernel is not None and _dense_library() is not None else None


def _plain(torch: Any) -> tuple:
    """The tensor types checked by type alone: a plain tensor or ``nn.Parameter`` (a subclass
    such as a DTensor takes the slower checks)."""
    if "plain" not in _dense_state:
        _dense_state["plain"] = (torch.Tensor, torch.nn.Parameter)
    return _dense_state["plain"]


def dense_pointers(kernel: Any, grads: Sequence[Any], targets: Sequence[Sequence[Any]]) -> tuple | None:
    """The C call's arrays ``(numels, gradient pointers, target pointers)`` where the kernel
    may run on these tensors: CPU, the kernel's dtype, contiguous, each target shaped like its
    gradient; else None (the compiled core function then runs and reports any error). One loop
    over the tensors that checks and collects at once: W2's 64 variables are 256 tensors, and
    each attribute read costs ~0.1 µs (docs/benchmarks.md, W2 profile)."""
    import torch

    dtype = getattr(torch, kernel.dtype)
    k, count = len(targets), len(grads)
    if k != kernel.n_arrays or any(len(t) != count for t in targets):
        return None
    plain = _plain(torch)
    numels = (ctypes.c_int64 * count)()
    gptrs = (ctypes.c_void_p * count)()
    tptrs = (ctypes.c_void_p * (k * count))()
    for n, g in enumerate(grads):
        if not ((type(g) in plain or (isinstance(g, torch.Tensor) and not hasattr(g, "device_mesh")))
                and g.dtype == dtype and g.is_cpu and g.is_contiguous()):
            return None
        shape = g.shape
        numels[n] = g.numel()
        gptrs[n] = g.data_ptr()
        for j in range(k):
            x = targets[j][n]
            if not ((type(x) in plain or (isinstance(x, torch.Tensor) and not hasattr(x, "device_mesh")))
                    and x.dtype == dtype and x.is_cpu and x.is_contiguous() and x.shape == shape):
                return None
            tptrs[j * count + n] = x.data_ptr()
    return numels, gptrs, tptrs


def dense_fits(kernel: Any, grads: Sequence[Any], targets: Sequence[Sequence[Any]]) -> bool:
    """Whether the kernel may run on these tensors (see :func:`dense_pointers`)."""
    return dense_pointers(kernel, grads, targets) is not None


def dense_update(kernel: Any, grads: Sequence[Any], values: Sequence[Sequence[float]],
           targets: Sequence[Sequence[Any]], threads: int, prepared: tuple | None = None) -> None:
    """Run ``kernel`` over every tensor in one call, in place (see :func:`dense_pointers`; ``prepared``:
    its result for these tensors, computed here if not given). Tensors that share their values
    (one learning rate for all: the usual case) share one parameter block (stride 0)."""
    count = len(grads)
    numels, gptrs, tptrs = prepared or dense_pointers(kernel, grads, targets)
    first = kernel.params(values[0]) if count else ()
    if all(v is values[0] for v in values) or all(kernel.params(v) == first for v in values):
        block, stride = first, 0
    else:
        block, stride = [p for v in values for p in kernel.params(v)], kernel.n_params
    hp = (ctypes.c_double * max(1, len(block)))(*block)
    elem = grads[0].element_size() if count else 4
    _dense_library().meshembed_dense_update(kernel.address, count, len(targets), elem, numels, gptrs, tptrs, hp, stride,
                                      DENSE_CHUNK, int(threads))


def all_finite(arrays: Sequence[Any], threads: int) -> bool | None:
    """Whether every element of ``arrays`` is finite, in one C pass over all of them (the
    dense optimizer's NaN policy reads every gradient once); None where it does not apply
    (not all contiguous float32 / float64 CPU tensors of one dtype, or no library): the
    caller then uses the framework's reductions."""
    import torch

    if not arrays:
        return None
    dtype = arrays[0].dtype if isinstance(arrays[0], torch.Tensor) else None
    if dtype not in (torch.float32, torch.float64):
        return None
    lib = _dense_library()
    if lib is None:
        return None
    plain = _plain(torch)
    count = len(arrays)
    numels = (ctypes.c_int64 * count)()
    ptrs = (ctypes.c_void_p * count)()
    for n, x in enumerate(arrays):
        if not ((type(x) in plain or (isinstance(x, torch.Tensor) and not hasattr(x, "device_mesh")))
                and x.dtype == dtype and x.is_cpu and x.is_contiguous()):
            return None
        numels[n] = x.numel()
        ptrs[n] = x.data_ptr()
    return bool(lib.meshembed_all_finite(count, arrays[0].element_size(), numels, ptrs, DENSE_CHUNK, int(threads)))
