"""Registered fused CPU updates of the torch backend (``fused_cpu.cc``).

The default update is the core's optimizer function on gathered rows (compiled by
inductor). For SGD, Adagrad and Adadelta on float32 CPU tables a fused C++ kernel does the
dedup, the per-row gradient sums (in batch order) and the same formula in one pass over each
unique row — what fbgemm's TBE does, and what the W1 target asks of this backend. It is an
*optimisation*, not the definition: ``REGISTERED`` names the algorithms it covers,
``MESHEMBED_TORCH_FUSED=0`` turns it off, and the conformance tests run every registered
kernel against the core function and the NumPy reference.

Built on first use with the system compiler (see :mod:`meshembed_native.build`); where it cannot
be built the core function runs (one RuntimeWarning).
"""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path
from typing import Any, Sequence

from meshembed_native import build as native
from meshembed.backend.env import env_flag
from meshembed.errors import InputError
from meshembed.math.rule import REGISTERED_FUSED, UpdateRule

_SOURCE = Path(__file__).with_name("fused_cpu.cc")

REGISTERED = REGISTERED_FUSED  # the algorithms the kernel covers (shared with the JAX backend)
_state: dict[str, Any] = {}
calls = [0]  # fused updates run in this process (tests check the path was taken)


def enabled() -> bool:
    return env_flag("MESHEMBED_TORCH_FUSED", True)


def _library() -> Any:
    """The loaded kernel library, or None (with one warning) where it cannot be built."""
    if "lib" not in _state:
        try:
            lib = ctypes.CDLL(str(native.build_library(_SOURCE, "torch_fused_cpu", flags=(*native.FLAGS, "-fopenmp"))))
            fn = lib.meshembed_fused_update
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            _state["lib"] = lib
        except Exception as exc:  # no compiler, ...
            _state["lib"] = None
            warnings.warn(
                f"meshembed: the torch backend's fused CPU updates are unavailable ({type(exc).__name__}: "
                f"{str(exc)[:500]}); the core functions run instead (same numbers). Set "
                "MESHEMBED_TORCH_FUSED=0 to silence this.", RuntimeWarning, stacklevel=3)
    return _state["lib"]


def kernel_for(rule: Any, values: Sequence[float], datas: Sequence[Any], grads: Any, n: int, grad_index: Any,
               weights: Any) -> tuple[int, tuple[float, float, float]] | None:
    """``(kernel code, (lr, rho, epsilon))`` when a registered kernel computes ``rule`` with
    ``values`` for these float32 CPU tables (a plain update: no clipping or weight decay) and
    ``n`` ids' gradients of the expected shapes, else None (the core function then runs, and
    reports any shape error)."""
    import torch

    code = rule.fused_code(len(datas)) if enabled() and isinstance(rule, UpdateRule) else None
    if code is None:
        return None
    kernel = code, rule.fused_params(values)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in (*datas, grads)):
        return None
    dim = datas[0].shape[1]
    if grads.dim() != 2 or grads.shape[1] != dim or any(d.shape != datas[0].shape for d in datas):
        return None
    if (grad_index is None and grads.shape[0] != n) or (grad_index is not None and grad_index.numel() != n):
        return None
    if weights is not None and weights.numel() != n:
        return None
    if _library() is None:
        return None
    return kernel


def update(kernel: tuple[int, tuple[float, float, float]], rows: Any, grads: Any, grad_index: Any,
           weights: Any, datas: Sequence[Any], threads: int) -> None:
    """Run the kernel in place on ``datas`` (the table, then its slots): contribution ``i``
    adds ``weights[i] * grads[grad_index[i]]`` (defaults: 1 and ``i``) to row ``rows[i]``."""
    import torch

    code, hp = kernel
    rows = rows.to(torch.int64).contiguous()
    index = None if grad_index is None else grad_index.to(torch.int64).contiguous()
    w = None if weights is None else weights.to(torch.float32).contiguous()
    params = (ctypes.c_double * 3)(*hp)
    slots = [d.data_ptr() for d in datas[1:]] + [None, None]
    done = _library().meshembed_fused_update(
        code, rows.data_ptr(), rows.numel(), None if index is None else index.data_ptr(),
        None if w is None else w.data_ptr(), grads.data_ptr(), grads.shape[0], grads.shape[1],
        datas[0].data_ptr(), datas[0].shape[0], slots[0], slots[1], params, int(threads))
    if done == -2:
        raise InputError(f"Invalid `grad_index`: expected every index in [0, {grads.shape[0]}) (a row of "
                         "`grads`). Nothing was updated.")
    if done < 0:  # the backend checked the ids: an internal error, not a user's
        raise RuntimeError("meshembed fused update: a row outside the table reached the kernel")
    calls[0] += 1
