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


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


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


def _by_identity(fn: Callable) -> FnSpec:
    return FnSpec(("id", id(fn), fn), lambda dyn, g, *rows: fn(g, *rows), ())


def split(fn: Callable, trace_scalars: bool = True) -> FnSpec:
    """Split ``fn`` into (static key, dynamic values). ``trace_scalars=False`` keeps every
    value static (the fallback when a function branches on a hyper-parameter in Python)."""
    if isinstance(fn, functools.partial):
        names = sorted(fn.keywords)
        dyn_names = tuple(n for n in names if trace_scalars and _is_dynamic(fn.keywords[n]))
        static_kw = tuple((n, fn.keywords[n]) for n in names if n not in dyn_names)
        dyn_args = tuple(i for i, a in enumerate(fn.args) if trace_scalars and _is_dynamic(a))
        static_args = tuple(_MARK if i in dyn_args else a for i, a in enumerate(fn.args))
        key = ("partial", fn.func, static_args, static_kw, dyn_names, dyn_args)
        statics = [a for a in static_args if a is not _MARK] + [v for _, v in static_kw]
        if not (_hashable(key) and _safe_static(fn.func) and all(_safe_static(v) for v in statics)):
            return _by_identity(fn)
        func, args, kw = fn.func, fn.args, dict(static_kw)

        def call_partial(dyn: tuple[Any, ...], g: Any, *rows: Any) -> Any:
            a = list(args)
            for i, v in zip(dyn_args, dyn[: len(dyn_args)]):
                a[i] = v
            k = dict(kw)
            k.update(zip(dyn_names, dyn[len(dyn_args):]))
            return func(*a, g, *rows, **k)

        dyn = tuple(_trace_value(fn.args[i]) for i in dyn_args) + tuple(
            _trace_value(fn.keywords[n]) for n in dyn_names
        )
        return FnSpec(key, call_partial, dyn)

    if inspect.isfunction(fn):
        cells = tuple(c.cell_contents for c in (fn.__closure__ or ()))
        dyn_idx = tuple(i for i, v in enumerate(cells) if trace_scalars and _is_dynamic(v))
        static_cells = tuple(_MARK if i in dyn_idx else v for i, v in enumerate(cells))
        defaults = fn.__defaults__ or ()
        kwdefaults = tuple(sorted((fn.__kwdefaults__ or {}).items()))
        key = ("function", fn.__code__, id(fn.__globals__), static_cells, defaults, kwdefaults)
        statics = [v for v in static_cells if v is not _MARK] + list(defaults) + [v for _, v in kwdefaults]
        if not (_hashable(key) and all(_safe_static(v) for v in statics)):
            return _by_identity(fn)
        if not dyn_idx:
            return FnSpec(key, lambda dyn, g, *rows: fn(g, *rows), ())
        code, glob, name = fn.__code__, fn.__globals__, fn.__name__
        fn_defaults, fn_kwdefaults = fn.__defaults__, fn.__kwdefaults__

        def call_closure(dyn: tuple[Any, ...], g: Any, *rows: Any) -> Any:
            values = list(cells)
            for i, v in zip(dyn_idx, dyn):
                values[i] = v
            rebuilt = types.FunctionType(code, glob, name, fn_defaults, tuple(types.CellType(v) for v in values))
            rebuilt.__kwdefaults__ = fn_kwdefaults
            return rebuilt(g, *rows)

        return FnSpec(key, call_closure, tuple(_trace_value(cells[i]) for i in dyn_idx))

    return _by_identity(fn)  # bound methods, callable objects: their state may change
