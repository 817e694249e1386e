"""Gradients in: validation and conversion to the variable's backend, dtype and layout,
sparse ``IndexedSlices`` (duplicates summed first), and the (gradient, variable) pairs.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from meshembed.errors import InputError
from meshembed.variable import IndexedSlices, Variable, to_backend, dtype_name

__all__ = ["GradientsMixin"]


class GradientsMixin:
    """Gradient validation, conversion and densifying.

    One part of :class:`~meshembed.optimizers.Optimizer`."""

    # -- gradients ------------------------------------------------------------------------
    def _convert_gradient(self, grad: Any, variable: Variable) -> Any:
        """A backend array (placed on the variable's layout) or IndexedSlices of backend
        arrays, validated against ``variable``; raises before anything changes."""
        backend = variable.backend
        if isinstance(grad, Variable):
            grad = grad.value
        if isinstance(grad, IndexedSlices):
            if grad.dense_shape != variable.shape:
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected IndexedSlices with dense_shape "
                    f"{variable.shape}. Received: dense_shape={grad.dense_shape}"
                )
            idx = np.asarray(backend.to_numpy(grad.indices) if backend.is_native(grad.indices) else grad.indices)
            if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected 1-D integer indices. "
                    f"Received: indices of dtype {idx.dtype} and shape {idx.shape}"
                )
            if idx.size and (idx.min() < 0 or idx.max() >= variable.shape[0]):
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected indices in [0, {variable.shape[0]}). "
                    f"Received: indices from {idx.min()} to {idx.max()}"
                )
            values = self._as_native(grad.values, variable)
            expected = (idx.shape[0], *variable.shape[1:])
            if tuple(values.shape) != expected:
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected IndexedSlices values of shape "
                    f"{expected}. Received: shape={tuple(values.shape)}"
                )
            return IndexedSlices(values, backend.asarray(idx.astype(np.int64), dtype="int64"), grad.dense_shape)
        value = self._as_native(grad, variable)
        if tuple(value.shape) != variable.shape:
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected shape {variable.shape}. "
                f"Received: shape={tuple(value.shape)}"
            )
        return value if variable.layout is None else backend.place(value, variable.layout)

    @staticmethod
    def _as_native(value: Any, variable: Variable) -> Any:
        """A backend array of the variable's dtype from an integer or real floating gradient
        (or a complex one, for a complex variable); string, object and bool gradients, and
        complex ones for a real variable, are refused (never parsed, truncated or cast silently)."""
        backend = variable.backend
        native = backend.is_native(value)
        if native:
            name = dtype_name(value.dtype)
            if name == variable.dtype:
                return value
            kind = "f" if "float" in name else ("i" if "int" in name else "c" if "complex" in name else name)
        else:
            try:
                arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            except (TypeError, ValueError) as exc:
                arr, kind = None, f"{type(value).__name__} ({exc})"
            else:
                kind = arr.dtype.kind if arr.dtype.kind in "fiuc" else str(arr.dtype)
                kind = "f" if "float" in str(arr.dtype) else ("i" if kind == "u" else kind)
        if kind not in ("f", "i", "c") or (kind == "c" and "complex" not in variable.dtype):
            what = {"c": "complex"}.get(kind, kind)
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected an integer or real floating array "
                f"(cast to {variable.dtype}; complex for a complex variable). Received: {what} values. Fix: pass "
                "the gradient as a float array"
                + (" (the real part, or a real view of both parts), or make the variable complex." if kind == "c"
                   else ".")
            )
        try:
            if native:
                return backend.xp.astype(value, variable.value.dtype)
            host = to_backend(backend, np.asarray(arr, dtype=np.float64) if arr.dtype.kind in "iu" else arr, None)
            return backend.xp.astype(host, variable.value.dtype)
        except (TypeError, ValueError) as exc:
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected a numeric array convertible to "
                f"{variable.dtype}. Received: {type(value).__name__} ({exc})"
            ) from None

    def _densify(self, grad: Any, variable: Variable) -> tuple[Any, Any]:
        """``(dense gradient, touched-row mask or None)``. Duplicate indices are summed first
        (one update per touched row); with the DTensor options untouched rows of the variable
        and slots keep their values, as the TPU embedding and tf_keras' legacy optimizer do;
        with Keras 3's arguments the update is dense, as Keras 3 does."""
        if not isinstance(grad, IndexedSlices):
            return grad, None
        backend = variable.backend
        if self.keras3:  # Keras 3 (and tf_keras' new optimizers) update every row: slots decay
            return self._densify_rows(grad, variable), None
        xp = backend.xp
        n = variable.shape[0]
        dense = backend.segment_sum_to(grad.values, grad.indices, n)
        ones = xp.ones_like(xp.real(grad.values) if xp.isdtype(grad.values.dtype, "complex floating") else grad.values)
        touched = backend.segment_sum_to(ones, grad.indices, n) > 0  # (a complex sum has no order)
        if variable.layout is not None:
            dense, touched = backend.place(dense, variable.layout), backend.place(touched, variable.layout)
        return dense, touched

    @staticmethod
    def _densify_rows(grad: IndexedSlices, variable: Variable) -> Any:
        backend = variable.backend
        dense = backend.segment_sum_to(grad.values, grad.indices, variable.shape[0])
        return dense if variable.layout is None else backend.place(dense, variable.layout)

    def _prepare_pairs(self, grads_and_vars: Any) -> list[tuple[Any, Variable]]:
        try:
            pairs = [tuple(p) for p in grads_and_vars]
        except TypeError:
            raise InputError(
                "Invalid `grads_and_vars`. Expected a list of (gradient, variable) pairs. "
                f"Received: grads_and_vars={grads_and_vars!r}"
            ) from None
        if any(len(p) != 2 for p in pairs):
            raise InputError("Invalid `grads_and_vars`. Expected a list of (gradient, variable) pairs.")
        self._check_var_list([v for _, v in pairs], "grads_and_vars")
        return [(g, v) for g, v in pairs]


def _map_values(grad: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` of a dense gradient, or of an ``IndexedSlices``' values."""
    if isinstance(grad, IndexedSlices):
        return IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def _divide(backend: Any, x: Any, d: float) -> Any:
    """``x / d``; a complex ``x`` part by part, as its real view (complex arithmetic divides by
    ``d + 0j``, which rounds differently: ``(re·d + im·0)/(d² + 0)``)."""
    if not backend.xp.isdtype(x.dtype, "complex floating"):
        return x / d
    return backend.from_real_view(backend.real_view(x) / d)


def _all_finite(xp: Any, x: Any) -> bool:
    """Every element finite; one sum first (NaN/Inf propagate), the element test only when
    that sum is not finite. Works on a torch DTensor (the reductions are all-reduced). A
    complex array: each part (a torch DTensor cannot test a complex 0-d sum)."""
    if xp.isdtype(x.dtype, "complex floating"):
        return _all_finite(xp, xp.real(x)) and _all_finite(xp, xp.imag(x))

    def host(v: Any) -> bool:
        full = getattr(v, "full_tensor", None)
        return bool(full() if callable(full) else v)

    return host(xp.isfinite(xp.sum(x))) or host(xp.all(xp.isfinite(x)))
