"""Turning the engine's optimizer callable into a cache key plus traced scalars.

The engine hands ``update_rows`` a fresh callable every step (a ``functools.partial`` of
the core's math function, or a closure) whose learning rate may change every step. Keyed
by identity, each step would retrace and recompile. Instead the callable is split into its
*static* part (function, namespace, flags: hashed into the kernel key) and its *dynamic*
part (Python/NumPy floats and arrays: passed to the compiled step as traced arguments), so
one compiled kernel serves every step with the same shapes.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


def _is_dynamic(value: Any) -> bool:
    """Values that vary per step and are safe to trace: floats and arrays (not bools/ints)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (float, np.floating)):
        return True
    if isinstance(value, np.ndarray):
        return True
    return type(value).__module__.startswith(("jax", "jaxlib")) and hasattr(value, "shape")


def _trace_value(value: Any) -> Any:
    """Python/NumPy float scalars become weakly-typed Python floats so float32 rows stay float32."""
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


@dataclass(frozen=True)
class FnSpec:
    """``call(dyn, g, *rows)`` reproduces ``fn(g, *rows)`` with ``dyn`` as traced values."""

    key: Any
    call: Callable[..., Any]
    dyn: tuple[Any, ...]


_MARK = object()  # placeholder of a dynamic value inside a key


def _safe_static(value: Any) -> bool:
    """Values that cannot change behind the key's back: a closure over a mutable object
    (an engine reading ``self.lr`` at trace time) must not reuse an old trace."""
    if value is None or isinstance(value, (bool, int, str, bytes, type, types.ModuleType, np.dtype)):
        return True
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, np.ufunc)):
        return True  # keyed by identity: a fresh closure is a fresh key
    if isinstance(value, tuple):
        return all(_safe_static(v) for v in value)
    params = getattr(type(value), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


class _Unsafe(Exception):
    """A value that cannot be part of a static key (mutable, unhashable or stateful)."""


def _split_value(value: Any, trace: bool) -> tuple[Any, list[Any], Callable[[Any], Any]]:
    """(static description, dynamic leaves, rebuild(leaf_iterator)) of one captured value.

    Recurses through dicts with string keys, tuples, lists and NamedTuples (the engine binds
    hyper-parameters as a dict); other values must be safe statics.
    """
    if trace and _is_dynamic(value):
        return _MARK, [_trace_value(value)], lambda it: next(it)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        keys = sorted(value)
        parts = [_split_value(value[k], trace) for k in keys]
        static = ("dict", tuple((k, p[0]) for k, p in zip(keys, parts)))
        return static, [leaf for p in parts for leaf in p[1]], lambda it: {k: p[2](it) for k, p in zip(keys, parts)}
    if isinstance(value, (tuple, list)):
        parts = [_split_value(v, trace) for v in value]
        kind = type(value)
        static = (kind, tuple(p[0] for p in parts))
        leaves = [leaf for p in parts for leaf in p[1]]
        if hasattr(value, "_fields"):  # NamedTuple
            return static, leaves, lambda it: kind(*[p[2](it) for p in parts])
        return static, leaves, lambda it: kind([p[2](it) for p in parts])
    if isinstance(value, (float, np.floating)) or _safe_static(value):
        _check_hashable(value)
        return (type(value), value), [], lambda it: value
    raise _Unsafe(type(value).__name__)


def _check_hashable(value: Any) -> None:
    try:
        hash(value)
    except TypeError as exc:
        raise _Unsafe(str(exc)) from None


def _by_identity(fn: Callable) -> FnSpec:
    """Fallback key: the object itself (kept alive by the cache, so its id is not reused)."""
    return FnSpec(("id", id(fn), fn), lambda dyn, g, *rows: fn(g, *rows), ())


def split(fn: Callable, trace_scalars: bool = True) -> FnSpec:
    """Split ``fn`` into (static key, dynamic values). ``trace_scalars=False`` keeps every
    value static (the fallback when a function branches on a hyper-parameter in Python)."""
    try:
        if isinstance(fn, functools.partial):
            if not _safe_static(fn.func):
                return _by_identity(fn)
            static, leaves, rebuild = _split_value((fn.args, dict(fn.keywords)), trace_scalars)
            key = ("partial", fn.func, static)
            _check_hashable(key)
            func = fn.func

            def call_partial(dyn: tuple[Any, ...], g: Any, *rows: Any) -> Any:
                args, kw = rebuild(iter(dyn))
                return func(*args, g, *rows, **kw)

            return FnSpec(key, call_partial, tuple(leaves))

        if inspect.isfunction(fn):
            cells = tuple(c.cell_contents for c in (fn.__closure__ or ()))
            captured = (cells, fn.__defaults__ or (), dict(fn.__kwdefaults__ or {}))
            static, leaves, rebuild = _split_value(captured, trace_scalars)
            key = ("function", fn.__code__, id(fn.__globals__), static)
            _check_hashable(key)
            if not leaves:
                return FnSpec(key, lambda dyn, g, *rows: fn(g, *rows), ())
            code, glob, name = fn.__code__, fn.__globals__, fn.__name__

            def call_closure(dyn: tuple[Any, ...], g: Any, *rows: Any) -> Any:
                new_cells, defaults, kwdefaults = rebuild(iter(dyn))
                rebuilt = types.FunctionType(
                    code, glob, name, tuple(defaults) or None, tuple(types.CellType(v) for v in new_cells)
                )
                rebuilt.__kwdefaults__ = kwdefaults or None
                return rebuilt(g, *rows)

            return FnSpec(key, call_closure, tuple(leaves))
    except _Unsafe:
        pass
    return _by_identity(fn)  # bound methods, callable objects, mutable captures
