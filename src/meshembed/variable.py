"""``me.Variable`` (a named, laid-out backend array) and ``me.IndexedSlices`` (a sparse gradient).

A Variable owns one backend array and keeps it on its layout: every ``assign`` re-places the
new value, so optimizer slots created from a variable's layout stay co-sharded with it
whatever the array library's own sharding propagation does.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from meshembed.errors import InputError
from meshembed.sharding.mesh import Layout

__all__ = ["IndexedSlices", "Variable", "dtype_name"]


_DTYPE_NAMES: dict[tuple[type, Any], str] = {}


def dtype_name(dtype: Any) -> str:
    """Backend-neutral dtype name (``"float32"``) of a NumPy, torch or JAX dtype.

    Memoised: an optimizer step asks several times per variable, and NumPy's dtype
    stringification is slow enough to show in a step of many variables (docs/benchmarks.md)."""
    key = (type(dtype), dtype)  # by type first: comparing a torch dtype with a NumPy one warns
    try:
        return _DTYPE_NAMES[key]
    except (KeyError, TypeError):
        pass
    text = str(dtype)
    if text.startswith("torch."):
        name = text[len("torch."):]
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = text
    try:
        _DTYPE_NAMES[key] = name
    except TypeError:  # unhashable dtype-like: not remembered
        pass
    return name


def _full_array(value: Any) -> Any:
    """The whole logical array of a possibly sharded value (torch DTensor -> local tensor)."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def to_backend(backend: Any, value: Any, dtype: str | None) -> Any:
    """``backend.asarray``; a NumPy array of an ml_dtypes float (bfloat16, float8) that the
    backend cannot take (torch) goes through float32, which holds its values exactly."""
    if not backend.is_native(value):
        value = np.asarray(value)
        if value.dtype.kind == "V" or type(value.dtype).__module__.startswith("ml_dtypes") or (
            value.dtype.name in ("bfloat16",) or value.dtype.name.startswith("float8")
        ):
            try:
                return backend.asarray(value, dtype=dtype)
            except TypeError:
                wide = backend.asarray(value.astype(np.float32))
                native = getattr(backend.xp, dtype or value.dtype.name, None)
                if native is None:
                    raise
                return backend.xp.astype(wide, native)
    return backend.asarray(value, dtype=dtype)


class Fresh(NamedTuple):
    """An initial value made for one variable alone (an optimizer's zeros): the variable
    adopts it instead of copying it, so making a slot never holds two copies."""

    value: Any


class Variable:
    """A mutable, named array on a backend, optionally laid out over a mesh.

    ``initial_value`` may be an array-like or a zero-argument callable returning one.
    ``backend`` defaults to the layout's mesh backend, then to the current default backend.
    """

    def __init__(
        self,
        initial_value: Any,
        name: str | None = None,
        layout: Layout | None = None,
        trainable: bool = True,
        backend: Any = None,
        dtype: Any = None,
    ) -> None:
        from meshembed.backend import get_backend

        if layout is not None and not isinstance(layout, Layout):
            raise InputError(f"Invalid `layout`. Expected a meshembed.Layout or None. Received: layout={layout!r}")
        if name is not None and not isinstance(name, str):
            raise InputError(f"Invalid `name`. Expected a string or None. Received: name={name!r}")
        if backend is None and layout is not None:
            backend = layout.mesh.backend
        self._backend = get_backend(backend)
        if layout is not None and layout.mesh.backend is not self._backend:
            raise InputError(
                f"Invalid `layout`. Expected a mesh on backend {self._backend.name!r}. "
                f"Received: layout={layout!r}"
            )
        copy = not isinstance(initial_value, Fresh)
        if not copy:
            initial_value = initial_value.value
        elif callable(initial_value) and not self._backend.is_native(initial_value):
            initial_value = initial_value()
        self.name: str = name if name is not None else "Variable"
        self.layout: Layout | None = layout
        self.trainable: bool = bool(trainable)
        self._value: Any = None
        self._value = self.prepare_value(initial_value, dtype=dtype, copy=copy, check_shape=False)

    # -- conversion -------------------------------------------------------------------
    def prepare_value(self, value: Any, *, dtype: Any = None, copy: bool, check_shape: bool = True) -> Any:
        """Convert ``value`` to this backend's array of the right dtype/shape on the layout."""
        backend = self._backend
        if isinstance(value, Variable):
            value = value.value
        if dtype is None and self._value is not None:
            dtype = self.dtype
        if isinstance(value, np.ndarray) and copy:
            value = np.array(value, copy=True)  # never alias a caller's NumPy buffer
        if not backend.is_native(value) or (dtype is not None and dtype_name(value.dtype) != dtype_name(dtype)):
            if backend.sharding_of(value) is not None:
                value = _full_array(value)
            value = to_backend(backend, value, None if dtype is None else dtype_name(dtype))
        elif copy and backend.sharding_of(value) is None:
            # asarray first: torch detaches from autograd, so a Parameter never drags a graph along
            value = backend.xp.asarray(backend.asarray(value), copy=True)
        shape = tuple(int(d) for d in value.shape)
        if check_shape and shape != self.shape:
            raise InputError(
                f"Invalid value for variable {self.name!r}. Expected shape {self.shape}. Received: shape={shape}"
            )
        if self.layout is not None:
            try:
                self.layout.check_shape(shape)
            except Exception as exc:
                raise InputError(f"{exc} (variable {self.name!r})") from None
            value = backend.place(value, self.layout)
        return value

    # -- public surface ---------------------------------------------------------------
    @property
    def value(self) -> Any:
        """The backend array (``np.ndarray``, ``torch.Tensor``/``DTensor``, ``jax.Array``).

        An optimizer step may update it in place (torch, dense steps without EMA: the tensor
        object stays, its values change, as with Keras variables and torch.optim) or replace
        it with a new array (other backends and cases); take ``numpy()`` for a snapshot."""
        return self._value

    @property
    def backend(self) -> Any:
        return self._backend

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self._value.shape
        return shape if type(shape) is tuple else tuple(map(int, shape))  # NumPy's, JAX's: ints already

    @property
    def dtype(self) -> str:
        """Dtype name, e.g. ``"float32"`` (the same string on every backend)."""
        return dtype_name(self._value.dtype)

    @property
    def sharding(self) -> Any:
        """The backend's own sharding object of the value (None when not tracked)."""
        return self._backend.sharding_of(self._value)

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the whole (global) value."""
        return np.array(self._backend.to_numpy(_full_array(self._value)), copy=True)

    def assign(self, value: Any) -> "Variable":
        """Replace the value (same shape; cast to this dtype; placed on the layout)."""
        self._value = self.prepare_value(value, copy=True)
        return self

    def assign_fresh(self, value: Any) -> None:
        """Assign an array the optimizer just computed (no defensive copy needed)."""
        self._value = self.prepare_value(value, copy=False)

    def adopt(self, value: Any) -> None:
        """Hold ``value`` as it is: an array already made for this variable (by
        :meth:`prepare_value`, or an optimizer step's output of its shape, dtype and placement)."""
        self._value = value

    def __deepcopy__(self, memo: dict) -> "Variable":
        """A new variable with a copy of the value; backend and layout are shared (they
        describe where the value lives, and hold modules and device handles)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        backend = self._backend
        value = self._value
        new._value = backend.xp.asarray(value, copy=True) if backend.sharding_of(value) is None else value * 1
        return new

    def __getstate__(self) -> dict:
        """Pickle the value as NumPy and the backend by name (a backend holds modules)."""
        state = dict(self.__dict__)
        state["_value"] = self.numpy()
        state["_backend"] = self._backend.name
        return state

    def __setstate__(self, state: dict) -> None:
        from meshembed.backend import get_backend

        value = state.pop("_value")
        self.__dict__.update(state)
        self._backend = get_backend(state["_backend"])
        self._value = None
        self._value = self.prepare_value(value, dtype=dtype_name(value.dtype), copy=False, check_shape=False)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        layout = "" if self.layout is None else f", layout={list(self.layout.sharding_specs)}"
        return f"<meshembed.Variable {self.name!r} shape={self.shape} dtype={self.dtype}{layout} backend={self._backend.name!r}>"


class IndexedSlices:
    """A sparse gradient: rows ``values[k]`` belong at row ``indices[k]`` of a ``dense_shape``
    array. Indices may repeat; optimizers sum duplicates and update only the touched rows."""

    def __init__(self, values: Any, indices: Any, dense_shape: Sequence[int]) -> None:
        try:
            dense_shape = tuple(int(d) for d in dense_shape)
        except TypeError:
            raise InputError(
                f"Invalid `dense_shape`. Expected a sequence of ints. Received: dense_shape={dense_shape!r}"
            ) from None
        if not dense_shape:
            raise InputError("Invalid `dense_shape`. Expected rank >= 1. Received: dense_shape=()")
        self.values = values
        self.indices = indices
        self.dense_shape: tuple[int, ...] = dense_shape

    def __repr__(self) -> str:
        return f"IndexedSlices(indices shape={tuple(np.shape(self.indices))}, dense_shape={self.dense_shape})"
