"""``ArrayAPIBackend``: the Backend protocol over any Array API namespace (2023.12+).

Only the standard, reached through ``array-api-compat``: no import of a particular array
library here. Tables are logical MOD/DIV shards (one array each, ``meshembed.sharding``); the
row kernels are in ``kernels`` (why they are deterministic is said there); updates run the
core's update rule through the protocol's default ``update_rows``; dense variables use the protocol's in-place step (``x[...] = v``).
NumPy is used only for the host side of the protocol (``to_numpy``, ``create_table``).
"""

from __future__ import annotations

import importlib
from typing import Any

import array_api_compat
import numpy as np

from meshembed.backend.protocol import Backend, Capabilities
from meshembed.errors import ConfigError
from meshembed.sharding.placement import Placement, shard, unshard
from meshembed_array_api import kernels, native
from meshembed_array_api.table import ArrayAPIShardedTable


#: The oldest Array API standard the core runs on (the math passes static numbers to
#: maximum/minimum as 0-d arrays, as 2023.12 requires).
MIN_STANDARD = "2023.12"


def _numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of ``dtype``, also of a variable's dtype name with its namespace
    (``"array_api_strict.int64"``, what ``me.Variable.dtype`` says on this backend)."""
    if isinstance(dtype, str) and "." in dtype:
        dtype = dtype.rsplit(".", 1)[1]
    return np.dtype(dtype)


class ArrayAPIBackend(Backend):
    """A backend for the Array API namespace ``xp`` (a module such as ``array_api_strict``, or
    a library that ``array_api_compat`` wraps), its arrays made on ``device`` (default: the
    library's)."""

    def __init__(self, xp: Any, *, name: str | None = None, device: Any = None):
        try:
            self._xp = array_api_compat.array_namespace(xp.asarray(0, device=device))
        except (AttributeError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"Invalid `xp`: expected an Array API namespace (a module with `asarray`, e.g. "
                f"array_api_strict, or one array_api_compat wraps). Received: xp={xp!r} ({exc})"
            ) from exc
        self.name = name or f"array_api:{getattr(xp, '__name__', type(xp).__name__)}"
        self.device = device
        version = str(getattr(self._xp, "__array_api_version__", MIN_STANDARD))
        if version < MIN_STANDARD:  # "YYYY.MM" strings order as dates
            raise ConfigError(
                f"Invalid `xp` for backend {self.name!r}: it implements Array API {version}, and "
                f"meshembed's math needs {MIN_STANDARD} or newer (Python scalars in element-wise "
                "functions such as maximum(x, 0.5)). Fix: a newer release of the library or of "
                "array-api-compat (array-api-strict: leave ARRAY_API_STRICT_API_VERSION unset)."
            )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(devices=1, float64=self._has_float64(), in_place=False, deterministic_scatter=True)

    def _has_float64(self) -> bool:
        """From the standard's inspection API (JAX without x64 has no float64)."""
        info = getattr(self._xp, "__array_namespace_info__", None)
        return info is None or "float64" in info().dtypes(device=self.device, kind="real floating")

    @property
    def xp(self) -> Any:
        return self._xp

    # -- dense arrays ---------------------------------------------------------------------
    def _dtype(self, dtype: Any) -> Any:
        if dtype is None:
            return None
        found = getattr(self._xp, _numpy_dtype(dtype).name, None)
        if found is None:
            raise ConfigError(
                f"Invalid `dtype`: backend {self.name!r} (an Array API namespace) has no "
                f"{np.dtype(dtype).name}. Received: dtype={dtype!r}. Fix: use float32, float64 or an integer dtype."
            )
        return found

    def is_native(self, x: Any) -> bool:
        return array_api_compat.is_array_api_obj(x) and array_api_compat.array_namespace(x) is self._xp

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        dt = self._dtype(dtype)
        if self.is_native(x):
            return x if dt is None or x.dtype == dt else self._xp.astype(x, dt)
        host = np.asarray(x if not array_api_compat.is_array_api_obj(x) else np.from_dlpack(x),
                          dtype=None if dtype is None else _numpy_dtype(dtype))
        return self._xp.asarray(np.array(host, copy=True), device=self.device)  # never the caller's memory

    def to_numpy(self, x: Any) -> np.ndarray:
        if not self.is_native(x):
            return np.asarray(x)
        return np.from_dlpack(x, device="cpu", copy=True)

    # -- sharded row tables -----------------------------------------------------------------
    def create_table(self, values: np.ndarray, placement: Placement) -> ArrayAPIShardedTable:
        return ArrayAPIShardedTable([self.asarray(part) for part in shard(np.asarray(values), placement)], placement)

    def unshard(self, table: ArrayAPIShardedTable) -> np.ndarray:
        return unshard([self.to_numpy(part) for part in table.shards], table.placement)

    def gather(self, table: ArrayAPIShardedTable, ids: Any) -> Any:
        return kernels.gather(self._xp, table.shards, table.placement, self.asarray(ids, "int64"))

    def scatter(self, table: ArrayAPIShardedTable, ids: Any, rows: Any) -> ArrayAPIShardedTable:
        rows = self.asarray(rows)
        rows = rows if rows.dtype == table.dtype else self._xp.astype(rows, table.dtype)
        shards = kernels.scatter(self._xp, table.shards, table.placement, self.asarray(ids, "int64"), rows)
        return ArrayAPIShardedTable(shards, table.placement)

    #: How the segment sums finish their few hot ids (``kernels.Finish``; None: the library's
    #: ``cumulative_sum``, in row order only where its scan is sequential).
    hot_ids_finish: kernels.Finish | None = None

    def segment_sum(self, ids: Any, values: Any) -> tuple[Any, Any]:
        return kernels.segment_sum(self._xp, self.asarray(ids, "int64"), values, self.hot_ids_finish)

    def segment_sum_to(self, values: Any, segment_ids: Any, num_segments: int) -> Any:
        return kernels.segment_sum_to(self._xp, values, self.asarray(segment_ids, "int64"), int(num_segments),
                                      self.hot_ids_finish)


def _unusable(module: str, install: str, namespace: str | None = None, fix: str = "upgrade it") -> str | None:
    """Why ``module`` (its Array API namespace: ``namespace``) cannot back meshembed here."""
    try:
        version = str(getattr(importlib.import_module(namespace or module), "__array_api_version__", MIN_STANDARD))
    except ImportError as exc:
        return f"{module} is not installed ({exc}); pip install {install}"
    if version < MIN_STANDARD:
        return f"{module} is set to Array API {version} and meshembed's math needs {MIN_STANDARD} or newer; {fix}"
    return None


class ArrayAPIStrictBackend(ArrayAPIBackend):
    """The generic backend over ``array_api_strict``: the referee of standard-only code.

    Its arrays live on array-api-strict's second device (``"device1"``), as a GPU library's
    would: an implicit host conversion (``np.asarray`` of a backend array) or an array made
    without ``device=`` and mixed with them raises, so the core cannot lean on either."""

    name = "array_api_strict"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _unusable("array_api_strict", "array-api-strict", fix="leave ARRAY_API_STRICT_API_VERSION unset")

    def __init__(self, device: Any = None) -> None:
        strict = importlib.import_module("array_api_strict")
        super().__init__(strict, name="array_api_strict", device=device or strict.Device("device1"))


class CupyBackend(ArrayAPIBackend):
    """The generic backend over ``array_api_compat.cupy`` on one GPU (``device``: an int or a
    ``cupy.cuda.Device``; default the current device). Certified by the GPU conformance run
    (conformance/README.md); its segment sums finish in row order with a small CUDA kernel
    (``native.py``), since CuPy's scan is a tree."""

    name = "cupy"
    hot_ids_finish = staticmethod(native.rows_in_order)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        reason = _unusable("cupy", "cupy-cuda12x (or cupy-cuda13x, matching your CUDA)", "array_api_compat.cupy")
        if reason:
            return reason
        try:
            count = importlib.import_module("cupy").cuda.runtime.getDeviceCount()
        except Exception as exc:  # the CUDA runtime raises its own error types
            return f"CuPy finds no usable CUDA device ({exc})"
        return None if count else "CuPy finds no CUDA device"

    def __init__(self, device: Any = None) -> None:
        cupy = importlib.import_module("cupy")
        if device is None:
            device = cupy.cuda.Device()
        elif isinstance(device, int):
            device = cupy.cuda.Device(device)
        super().__init__(importlib.import_module("array_api_compat.cupy"), name="cupy", device=device)
        self._cupy = cupy

    def to_numpy(self, x: Any) -> np.ndarray:
        return self._cupy.asnumpy(x) if self.is_native(x) else np.asarray(x)
