"""The dense optimizer's fused CPU step on torch (``dense_cpu.cc``): a generated row kernel.

``me.optimizers.Adadelta`` (and ``me.torch.Adadelta``) hand the backend an ``UpdateRule``;
where ``meshembed_native.codegen`` generates its row kernel (every element-wise rule, float32
and float64) one C call updates all the staged tensors in place, each tensor cut into chunks
spread over OpenMP threads: each element of the gradient, the variable and the slots is read
once and written once (the W2 memory bound). The formula is the generated one — the core's
math, recorded — so this module holds no formula; it only checks the tensors and passes
pointers. ``TorchBackend(fused=False)`` / ``MESHEMBED_TORCH_FUSED=0`` turn it off (the core
function, compiled, runs).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Sequence

from meshembed.math.rule import UpdateRule

_SOURCE = Path(__file__).with_name("dense_cpu.cc")
#: Elements per chunk (256 KiB of float32): enough to amortise a call, small enough to
#: spread one tensor over the threads.
CHUNK = 1 << 16
_state: dict[str, Any] = {}


_UPDATE_ARGS = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
_CHECK_ARGS = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


def _library() -> Any:
    """The loaded driver, or None (one warning) where it cannot be built."""
    from meshembed_native import build as native

    signatures = {"meshembed_dense_update": (ctypes.c_int64, _UPDATE_ARGS),
                  "meshembed_all_finite": (ctypes.c_int, _CHECK_ARGS)}
    return native.load_once(_state, _SOURCE, "torch_dense_cpu", signatures,
                            "the torch backend's fused dense update is", flags=(*native.FLAGS, "-fopenmp"),
                            hint=" Set MESHEMBED_TORCH_FUSED=0 to silence this.")


def kernel_for(rule: UpdateRule) -> Any:
    """The generated row kernel of ``rule`` (the variable and its slots), or None: not
    element-wise or no compiler."""
    if not isinstance(rule, UpdateRule) or not rule.elementwise:
        return None
    from meshembed_native import codegen

    kernel = codegen.row_kernel(rule, 1 + len(rule.slot_names))
    return kernel if kernel is not None and _library() is not None else None


def _plain(torch: Any) -> tuple:
    """The tensor types checked by type alone: a plain tensor or ``nn.Parameter`` (a subclass
    such as a DTensor takes the slower checks)."""
    if "plain" not in _state:
        _state["plain"] = (torch.Tensor, torch.nn.Parameter)
    return _state["plain"]


def pointers(kernel: Any, grads: Sequence[Any], targets: Sequence[Sequence[Any]]) -> tuple | None:
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


def fits(kernel: Any, grads: Sequence[Any], targets: Sequence[Sequence[Any]]) -> bool:
    """Whether the kernel may run on these tensors (see :func:`pointers`)."""
    return pointers(kernel, grads, targets) is not None


def update(kernel: Any, grads: Sequence[Any], values: Sequence[Sequence[float]],
           targets: Sequence[Sequence[Any]], threads: int, prepared: tuple | None = None) -> None:
    """Run ``kernel`` over every tensor in one call, in place (see :func:`pointers`; ``prepared``:
    its result for these tensors, computed here if not given). Tensors that share their values
    (one learning rate for all: the usual case) share one parameter block (stride 0)."""
    count = len(grads)
    numels, gptrs, tptrs = prepared or pointers(kernel, grads, targets)
    first = kernel.params(values[0]) if count else ()
    if all(v is values[0] for v in values) or all(kernel.params(v) == first for v in values):
        block, stride = first, 0
    else:
        block, stride = [p for v in values for p in kernel.params(v)], kernel.n_params
    hp = (ctypes.c_double * max(1, len(block)))(*block)
    elem = grads[0].element_size() if count else 4
    _library().meshembed_dense_update(kernel.address, count, len(targets), elem, numels, gptrs, tptrs, hp, stride,
                                      CHUNK, int(threads))


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
    lib = _library()
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
    return bool(lib.meshembed_all_finite(count, arrays[0].element_size(), numels, ptrs, CHUNK, int(threads)))
