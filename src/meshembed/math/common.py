"""Shared mechanics of every optimizer update (spec §4.1) and the scalar/dtype rules.

Every function here is written against an Array-API namespace ``xp`` only: no in-place
writes, no Python branching on array values. Python branching happens only on *static*
configuration (Python bools, or Python numbers that are known when tracing), so that
``jax.jit``, ``torch.compile`` and CuPy take the functions as they are.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import array_api_compat
import numpy as np

Array = Any
Scalar = Any  # a Python number or a 0-d array of any namespace

__all__ = [
    "GRADIENT_ACCUMULATOR_INITIAL_VALUE",
    "Array",
    "Scalar",
    "SymbolicScalar",
    "clamp",
    "decay_weights",
    "is_static",
    "maximum",
    "minimum",
    "namespace",
    "power",
    "quantize",
    "scalar",
    "select",
]

#: Initial value of TPU's hidden ``gradient_accumulators`` slot (spec §4.1): the float32
#: whose bits are 0x00000001 (~1.4e-45). Arithmetic treats it as 0; the hardware uses it to
#: tell "touched with a zero gradient" from "cleared". meshembed sums duplicates with a
#: segment sum before the update, so this value is only needed where an accumulator is
#: stored (checkpoints that mirror TPU state); the math never reads it.
GRADIENT_ACCUMULATOR_INITIAL_VALUE: float = struct.unpack("<f", struct.pack("<I", 1))[0]


class SymbolicScalar:
    """Base of a recorder's symbolic hyper-parameter (``meshembed_native.codegen``): a value
    known only when a generated kernel runs, with a Python float's semantics (weak, double).
    :func:`scalar` returns it unchanged and :func:`is_static` says False, so it is cast to the
    rows' dtype only where it meets an array, exactly as the float the reference gets."""

    __slots__ = ()


def namespace(*arrays: Array) -> Any:
    """The Array-API-compatible namespace of ``arrays`` (``array_api_compat`` wrapper)."""
    return array_api_compat.array_namespace(*arrays)


def is_static(value: Any) -> bool:
    """True for a Python or NumPy scalar number: known at trace time, safe to branch on."""
    return isinstance(value, (bool, int, float, np.generic))


def scalar(xp: Any, value: Scalar, like: Array) -> Scalar:
    """Turn a hyper-parameter into something that keeps ``like``'s dtype in arithmetic.

    A Python float is "weak" in NumPy 2, torch, JAX and array-api-strict: ``f32 * 0.5``
    stays float32, so static numbers are returned as Python floats (NumPy scalars are
    converted, because ``np.float64`` is *not* weak). A 0-d array (e.g. a traced learning
    rate) is cast to ``like``'s dtype and device, since ``f32 * f64[]`` upcasts in NumPy/JAX.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, SymbolicScalar):  # a recorded Python float: stays weak
        return value
    if is_static(value):
        return float(value)
    if type(value) is type(like):  # one library: no namespace lookup (nor its lru_cache in a torch.compile trace)
        return xp.astype(value, like.dtype)
    try:
        array_api_compat.array_namespace(value, like)
    except TypeError:  # another library's 0-d array (e.g. a NumPy lr for torch rows)
        return xp.asarray(value, dtype=like.dtype, device=array_api_compat.device(like))
    return xp.astype(value, like.dtype)


def select(xp: Any, cond: Any, if_true: Array, if_false: Array) -> Array:
    """``xp.where`` that also accepts a static Python bool (then no array op is emitted)."""
    if isinstance(cond, (bool, np.bool_)):
        return if_true if bool(cond) else if_false
    return xp.where(cond, if_true, if_false)


def _operand(xp: Any, value: Scalar, like: Array) -> Any:
    """``value`` as an array operand: Array API 2023.12's ``maximum``/``minimum`` take arrays
    only (Python scalars are allowed from 2024.12), so a static number becomes a 0-d array of
    ``like``'s dtype and device (the same value the scalar would have been converted to)."""
    if is_static(value):
        return xp.asarray(float(value), dtype=like.dtype, device=array_api_compat.device(like))
    return value


def maximum(xp: Any, x: Array, other: Scalar) -> Array:
    """``xp.maximum(x, other)`` for an array or a scalar ``other`` (any standard version)."""
    return xp.maximum(x, _operand(xp, other, x))


def minimum(xp: Any, x: Array, other: Scalar) -> Array:
    """``xp.minimum(x, other)`` for an array or a scalar ``other`` (any standard version)."""
    return xp.minimum(x, _operand(xp, other, x))


def power(xp: Any, x: Array, exponent: Scalar) -> Array:
    """``xp.pow(x, exponent)`` for an array or a scalar ``exponent`` (any standard version)."""
    return xp.pow(x, _operand(xp, exponent, x))


def clamp(xp: Any, x: Array, lower: Scalar | None, upper: Scalar | None) -> Array:
    """Clamp ``x`` to ``[lower, upper]``; ``None`` or an infinite static bound is open."""
    lo = None if lower is None or (is_static(lower) and math.isinf(lower) and lower < 0) else lower
    hi = None if upper is None or (is_static(upper) and math.isinf(upper) and upper > 0) else upper
    if lo is None and hi is None:
        return x
    if lo is not None:
        x = maximum(xp, x, scalar(xp, lo, x))
    if hi is not None:
        x = minimum(xp, x, scalar(xp, hi, x))
    return x


def decay_weights(xp: Any, params: Array, weight_decay: Scalar) -> Array:
    """Decoupled weight decay ``p ← p − wd·p`` (TF-Addons ``DecoupledWeightDecayExtension``)."""
    if is_static(weight_decay) and float(weight_decay) == 0.0:
        return params
    return params - scalar(xp, weight_decay, params) * params


def quantize(xp: Any, x: Array, lower: Scalar, upper: Scalar, num_buckets: int) -> Array:
    """Simulated quantization, forward pass only (spec §2.1 ``SimulatedQuantization``).

    ``c = clamp(x, lo, hi)``; ``q = (hi − lo)/(num_buckets − 1)``;
    ``out = floor((c − lo)/q + 0.5)·q + lo``. The stored table stays unquantized and the
    backward pass is the identity (a straight-through estimator), so this is applied to
    gathered rows before the combiner, never to the table.
    """
    if is_static(num_buckets) and int(num_buckets) < 2:
        raise ValueError(
            f"Invalid `num_buckets`. Expected an integer >= 2. Received: num_buckets={num_buckets}"
        )
    lo = scalar(xp, lower, x)
    hi = scalar(xp, upper, x)
    c = minimum(xp, maximum(xp, x, lo), hi)
    q = (hi - lo) / (num_buckets - 1)
    return xp.floor((c - lo) / q + 0.5) * q + lo
