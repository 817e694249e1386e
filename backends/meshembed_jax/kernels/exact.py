"""Float math inside a JAX trace with the bits of running it op by op (eagerly, or in NumPy).

Inside one compiled program XLA:CPU fuses element-wise operations and contracts a multiply
feeding an add into one fused multiply-add (``multiply_add_fusion``: one rounding instead of
two), and its algebraic simplifier may rewrite a division by a constant. The results then
differ in the last bit from the same operations run one at a time — what the engine does for
a low-precision table (``embedding/precision.py``: the optimizer's float math stays eager),
and what the NumPy reference computes. ``jax.lax.optimization_barrier`` does not stop it:
XLA:CPU removes the barrier before fusion (measured: ``0.9·m + 0.1·g`` over 28,672 values,
7,966 last-bit differences with and without a barrier around the two products).

:func:`call` runs a function written against an Array API namespace (here
``meshembed.math.apply_rule``: the formula lives once) on :class:`Sealed` arrays: every float
result of an operation — and every Python constant that meets an array — is *sealed*, its
bits XORed with a runtime zero and read back as float32, an integer round trip XLA cannot
see through. A sealed value is a rounded float32 that no later operation can fuse into (no
FMA contraction, no reassociation, no rewrite across operations), so each operation rounds
once, as it does op by op. The cost: two integer operations per element per float
operation, in the same fused loops.

Two operations are done as NumPy does them rather than as XLA would: a division by a
broadcast divisor (XLA's simplifier makes it a multiplication by the float32 reciprocal, 1
ulp off in ~23% of values) divides element by element by the divisor widened behind a seal
(:meth:`_Namespace.divide`), and ``pow`` (XLA's is not libm's ``powf``) runs NumPy's
``power`` through ``jax.pure_callback`` (:meth:`_Namespace.pow`).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import array_api_compat
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ScalarArithmetic", "Sealed", "call"]


class _Namespace:
    """An Array API namespace over :class:`Sealed` arrays: each function unwraps its
    arguments, calls ``xp``'s, and seals its float results."""

    def __init__(self, xp: Any, zero: Any) -> None:
        self._xp, self._zero = xp, zero

    def seal(self, x: Any) -> Any:
        """``x`` as a :class:`Sealed` array (a float one through the integer round trip)."""
        if isinstance(x, Sealed):
            return x
        if isinstance(x, (tuple, list)):
            return type(x)(self.seal(v) for v in x)
        if not isinstance(x, jax.Array):
            return x
        if x.dtype in (jnp.float32, jnp.float64):
            it = jnp.int32 if x.dtype == jnp.float32 else jnp.int64
            zero = self._zero.astype(it)
            x = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, it) ^ zero, x.dtype)
        return Sealed(x, self)

    def constant(self, value: Any, like: Any) -> Any:
        """A Python number meeting ``like`` (a jax array): as JAX's weak typing converts it
        (to ``like``'s float dtype), sealed, so it is no literal XLA could fold into the math."""
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.generic)):
            return value
        if not jnp.issubdtype(like.dtype, jnp.floating):
            return value
        return self.seal(jnp.asarray(value, like.dtype)).a

    def divide(self, x: Any, y: Any) -> Any:
        """``x / y`` correctly rounded, as NumPy divides: XLA's simplifier turns a division by a
        broadcast (a scalar, a row) into a multiplication by its float32 reciprocal (measured:
        ``x / 0.15`` over 100,000 values, 23,484 one bit off), so such a divisor is widened to
        the result's shape behind a seal XLA cannot see through (its bits XORed with the
        numerator's bits ANDed with the runtime zero), and the division is element by element."""
        a, b = _unwrap(x), _unwrap(y)
        a = a if isinstance(a, jax.Array) else self.constant(a, b)
        b = b if isinstance(b, jax.Array) else self.constant(b, a)
        if not isinstance(a, jax.Array) or not isinstance(b, jax.Array):
            return self.seal(a / b)
        shape = jnp.broadcast_shapes(a.shape, b.shape)
        if b.shape != shape and jnp.issubdtype(b.dtype, jnp.floating) and b.dtype in (jnp.float32, jnp.float64):
            it = jnp.int32 if b.dtype == jnp.float32 else jnp.int64
            wide = jnp.broadcast_to(b, shape)
            if a.shape == shape and a.dtype == b.dtype:
                mask = jax.lax.bitcast_convert_type(a, it) & self._zero.astype(it)
                b = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(wide, it) ^ mask, b.dtype)
            else:
                b = jax.lax.optimization_barrier(wide)  # measured: keeps the division element-wise
        return self.seal(a / b)

    def pow(self, x: Any, y: Any) -> Any:
        """``x ** y`` as NumPy computes it (its float32 ``power``, libm's ``powf``): XLA's
        float32 pow differs from it in ~20% of values (measured over 100,000, three exponents),
        so it runs on the host through ``jax.pure_callback``."""
        a, b = _unwrap(x), _unwrap(y)
        a = a if isinstance(a, jax.Array) else self.constant(a, b)
        b = b if isinstance(b, jax.Array) else self.constant(b, a)
        if not isinstance(a, jax.Array) or not isinstance(b, jax.Array) \
                or not jnp.issubdtype(jnp.result_type(a, b), jnp.floating):
            return self.seal(self._xp.pow(a, b))
        shape = jnp.broadcast_shapes(a.shape, b.shape)
        dtype = jnp.result_type(a, b)
        out = jax.ShapeDtypeStruct(shape, dtype)
        r = jax.pure_callback(lambda u, v: np.asarray(np.power(u, v), dtype), out, a.astype(dtype), b.astype(dtype),
                              vmap_method="broadcast_all")
        return self.seal(r)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._xp, name)
        if not callable(attr) or isinstance(attr, type) or name.startswith("__"):
            return attr

        def fn(*args: Any, **kwargs: Any) -> Any:
            return self.seal(attr(*_unwrap(args), **_unwrap(kwargs)))

        fn.__name__ = name
        return fn


def _unwrap(x: Any) -> Any:
    if isinstance(x, Sealed):
        return x.a
    if isinstance(x, tuple):
        return tuple(_unwrap(v) for v in x)
    if isinstance(x, list):
        return [_unwrap(v) for v in x]
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


class ScalarArithmetic(Exception):
    """A traced 0-d value (a dynamic learning rate) met another scalar before any array: the
    engine, which holds that value as a Python float, computes such a product in double on
    the host and rounds it once; here it would be float32 arithmetic (a last-bit difference)."""


def _binary(op: Callable, reflected: bool = False) -> Callable:
    def method(self: "Sealed", other: Any) -> Any:
        if self.a.ndim == 0 and (not isinstance(other, Sealed) or other.a.ndim == 0):
            raise ScalarArithmetic(f"{op.__name__} of a traced scalar and {type(other).__name__}")
        b = other.a if isinstance(other, Sealed) else self.ns.constant(other, self.a)
        if op is operator.truediv:
            return self.ns.divide(b, self.a) if reflected else self.ns.divide(self.a, b)
        if op is operator.pow:
            return self.ns.pow(b, self.a) if reflected else self.ns.pow(self.a, b)
        return self.ns.seal(op(b, self.a) if reflected else op(self.a, b))

    return method


def _unary(op: Callable) -> Callable:
    def method(self: "Sealed") -> Any:
        return self.ns.seal(op(self.a))

    return method


class Sealed:
    """A jax array whose float operations each round once (see the module docstring)."""

    __slots__ = ("a", "ns")
    __array_priority__ = 1000

    def __init__(self, a: Any, ns: _Namespace) -> None:
        self.a, self.ns = a, ns

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    device = property(lambda self: array_api_compat.device(self.a))  # a tracer's too
    T = property(lambda self: self.ns.seal(self.a.T))

    def __array_namespace__(self, api_version: Any = None) -> Any:
        return self.ns

    def __getitem__(self, key: Any) -> Any:
        return self.ns.seal(self.a[_unwrap(key)])

    def astype(self, dtype: Any, **kwargs: Any) -> Any:
        return self.ns.seal(self.a.astype(dtype, **kwargs))

    def reshape(self, *shape: Any, **kwargs: Any) -> Any:
        return self.ns.seal(self.a.reshape(*shape, **kwargs))

    def __bool__(self) -> bool:
        return bool(self.a)

    def __len__(self) -> int:
        return len(self.a)

    def __repr__(self) -> str:
        return f"Sealed({self.a!r})"

    __add__, __radd__ = _binary(operator.add), _binary(operator.add, True)
    __sub__, __rsub__ = _binary(operator.sub), _binary(operator.sub, True)
    __mul__, __rmul__ = _binary(operator.mul), _binary(operator.mul, True)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _binary(operator.truediv, True)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv), _binary(operator.floordiv, True)
    __mod__, __rmod__ = _binary(operator.mod), _binary(operator.mod, True)
    __pow__, __rpow__ = _binary(operator.pow), _binary(operator.pow, True)
    __and__, __rand__ = _binary(operator.and_), _binary(operator.and_, True)
    __or__, __ror__ = _binary(operator.or_), _binary(operator.or_, True)
    __xor__, __rxor__ = _binary(operator.xor), _binary(operator.xor, True)
    __lt__, __le__ = _binary(operator.lt), _binary(operator.le)
    __gt__, __ge__ = _binary(operator.gt), _binary(operator.ge)
    __eq__, __ne__ = _binary(operator.eq), _binary(operator.ne)  # type: ignore[assignment]
    __neg__, __pos__ = _unary(operator.neg), _unary(operator.pos)
    __abs__, __invert__ = _unary(operator.abs), _unary(operator.invert)
    __hash__ = None  # type: ignore[assignment]


def call(fn: Callable, xp: Any, zero: Any, *args: Any) -> Any:
    """``fn(sealed_xp, *args)`` with every array of ``args`` (nested in tuples and lists)
    sealed, its results unwrapped to jax arrays. ``zero``: a runtime int32 zero XLA cannot
    prove to be zero (e.g. ``min(step, 0)`` of a step counter that is a program input).
    Raises :class:`ScalarArithmetic` where a 0-d array of ``args`` meets another scalar (the
    op-by-op reference would hold it as a Python float and compute in double)."""
    ns = _Namespace(xp, jnp.asarray(zero, jnp.int32))
    return _unwrap(fn(ns, *ns.seal(list(args))))
