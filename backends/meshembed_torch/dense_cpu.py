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


def fits(kernel: Any, grads: Sequence[Any], targets: Sequence[Sequence[Any]]) -> bool:
    """Whether the kernel may run on these tensors: CPU, the kernel's dtype, contiguous,
    each target shaped like its gradient (else the compiled core function runs and reports
    any error)."""
    import torch

    dtype = getattr(torch, kernel.dtype)
    if len(targets) != kernel.n_arrays:
        return False
    for n, g in enumerate(grads):
        own = [t[n] for t in targets]
        if any(not isinstance(x, torch.Tensor) or hasattr(x, "device_mesh") or x.device.type != "cpu"
               or x.dtype != dtype or not x.is_contiguous() for x in (g, *own)):
            return False
        if any(x.shape != g.shape for x in own):
            return False
    return True


def update(kernel: Any, grads: Sequence[Any], values: Sequence[Sequence[float]],
           targets: Sequence[Sequence[Any]], threads: int) -> None:
    """Run ``kernel`` over every tensor in one call, in place (see :func:`fits`)."""
    count, k = len(grads), len(targets)
    numels = (ctypes.c_int64 * count)(*(g.numel() for g in grads))
    gptrs = (ctypes.c_void_p * count)(*(g.data_ptr() for g in grads))
    tptrs = (ctypes.c_void_p * (k * count))(*(t[n].data_ptr() for t in targets for n in range(count)))
    block = [p for v in values for p in kernel.params(v)]
    hp = (ctypes.c_double * max(1, len(block)))(*block)
    elem = grads[0].element_size() if count else 4
    _library().meshembed_dense_update(kernel.address, count, k, elem, numels, gptrs, tptrs, hp, kernel.n_params,
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
    if dtype not in (torch.float32, torch.float64) or any(
            not isinstance(x, torch.Tensor) or hasattr(x, "device_mesh") or x.dtype != dtype
            or x.device.type != "cpu" or not x.is_contiguous()
            for x in arrays):
        return None
    lib = _library()
    if lib is None:
        return None
    count = len(arrays)
    numels = (ctypes.c_int64 * count)(*(x.numel() for x in arrays))
    ptrs = (ctypes.c_void_p * count)(*(x.data_ptr() for x in arrays))
    return bool(lib.meshembed_all_finite(count, arrays[0].element_size(), numels, ptrs, CHUNK, int(threads)))
