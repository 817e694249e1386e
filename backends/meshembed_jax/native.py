"""The JAX backend's native code: the CPU row kernels (``native.cc``), built on first use and
registered with XLA's FFI.

Why: XLA's CPU gathers and scatters move rows element by element on one thread, which made
the W1 step several times slower than the torch backend (docs/benchmarks.md). These kernels
move and sum rows on XLA's intra-op thread pool. They hold no formula: the fused updates
(``fused_update``, ``dense_update``) call the rule's row kernel generated from the core's math
by ``meshembed_native.codegen`` (:func:`row_kernel`), whose address they take as an attribute.

The shared library is compiled once per source/jax version with the system C++ compiler
(``$CXX`` or ``g++``) into ``$MESHEMBED_CACHE`` (default ``~/.cache/meshembed``), see
:mod:`meshembed_native.build`. Where it cannot be built (no compiler) or on another
platform the backend uses its pure-XLA kernels, which compute the same numbers;
``JaxBackend(cpu_kernels=False)`` / ``MESHEMBED_JAX_CPU_KERNELS=0`` force them, and
``JaxBackend(fused=False)`` / ``MESHEMBED_JAX_FUSED=0`` the XLA update step (the backend's
constructor reads the environment, once; nothing here does).
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from meshembed_native import build as native_build

_SOURCE = Path(__file__).with_name("native.cc")
_TARGETS = {
    "meshembed_gather_combine": "MeshembedGatherCombine",
    "meshembed_dedup_sum": "MeshembedDedupSum",
    "meshembed_gather_rows": "MeshembedGatherRows",
    "meshembed_scatter_rows": "MeshembedScatterRows",
    "meshembed_fused_update": "MeshembedFusedUpdate",
    "meshembed_dense_update": "MeshembedDenseUpdate",
    "meshembed_all_finite": "MeshembedAllFinite",
}
_state: dict[str, Any] = {}


def _key() -> str:
    import jax
    import jaxlib

    return f"jax {jax.__version__} jaxlib {jaxlib.__version__}"


def library_path() -> Path:
    return native_build.library_path(_SOURCE, "jax_native", _key())


def build() -> Path:
    """Compile the kernels against jax's FFI headers (once; see :mod:`meshembed_native.build`)."""
    import jax.ffi

    return native_build.build_library(_SOURCE, "jax_native", _key(), include_dirs=[jax.ffi.include_dir()])


def load() -> bool:
    """Build (once), load and register the kernels; False (with one warning) if impossible."""
    if "ok" in _state:
        return _state["ok"]
    try:
        import jax.ffi

        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _state["lib"] = lib
        _state["ok"] = True
    except Exception as exc:  # no compiler, old jax without FFI, ...
        _state["ok"] = False
        _state["error"] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"meshembed: the JAX CPU row kernels are unavailable ({_state['error'][:500]}); using the "
            "pure-XLA kernels (same numbers, slower). Set MESHEMBED_JAX_CPU_KERNELS=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _state["ok"]


def usable(platform: str, *dtypes: Any) -> bool:
    """Whether a kernel for ``platform`` with these row dtypes can use the FFI kernels (built
    and loaded here; whether the caller wants them is its own switch)."""
    if platform != "cpu":
        return False
    if any(np.dtype(d) not in (np.float32, np.float64) for d in dtypes):
        return False
    return load()


# -- wrappers (call inside jit / shard_map; shapes are per device) -----------------------
def _vary_like(outs: Any, *inputs: Any) -> Any:
    """Give FFI results the device-variance of their inputs: under ``shard_map`` an FFI
    call's results are typed as replicated, which loop carries (and psum) reject."""
    import jax
    from jax import lax

    def varying(x: Any) -> set:
        aval = jax.typeof(x)
        mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older: ``vma``
        return set(mat.varying if mat is not None else getattr(aval, "vma", ()) or ())

    axes = set().union(*(varying(x) for x in inputs))
    if not axes or not hasattr(lax, "pcast"):
        return outs

    def one(y: Any) -> Any:
        missing = tuple(sorted(axes - varying(y)))
        return lax.pcast(y, missing, to="varying") if missing else y

    return jax.tree.map(one, outs)


def gather_combine(table: Any, ids: Any, segs: Any, w: Any, num_segments: int, weighted: bool) -> Any:
    import jax

    out = jax.ShapeDtypeStruct((num_segments, table.shape[1]), table.dtype)
    return _vary_like(jax.ffi.ffi_call("meshembed_gather_combine", out)(table, ids, segs, w, weighted=weighted),
                      table, ids, segs, w)


def dedup_sum(ids: Any, grads: Any, segs: Any, w: Any, m: int, capacity: int, combined: bool,
              weighted: bool) -> tuple[Any, Any, Any]:
    """-> (unique rows [capacity] (m = unused; all m on overflow), summed grads, count)."""
    import jax
    import jax.numpy as jnp

    outs = (
        jax.ShapeDtypeStruct((capacity,), ids.dtype),
        jax.ShapeDtypeStruct((capacity, grads.shape[1]), grads.dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    res = jax.ffi.ffi_call("meshembed_dedup_sum", outs)(
        ids, grads, segs, w, m=int(m), combined=combined, weighted=weighted
    )
    return _vary_like(tuple(res), ids, grads, segs, w)


def gather_rows(table: Any, idx: Any, shape: tuple[int, ...] | None = None) -> Any:
    """``table[idx]``, zeros for rows outside the table; ``shape``: the result's shape (its
    last axis ``D``, ``len(idx)`` rows): made in that shape, XLA would copy a reshape of it."""
    import jax

    out = jax.ShapeDtypeStruct(shape or (idx.shape[0], table.shape[1]), table.dtype)
    return _vary_like(jax.ffi.ffi_call("meshembed_gather_rows", out)(table, idx), table, idx)


def gather_rows_into(table: Any, idx: Any, dst: Any) -> Any:
    """:func:`gather_rows` written over ``dst`` (the result aliases it: donate it), in its shape."""
    import jax

    out = jax.ShapeDtypeStruct(dst.shape, table.dtype)
    call = jax.ffi.ffi_call("meshembed_gather_rows", out, input_output_aliases={2: 0})
    return _vary_like(call(table, idx, dst), table, idx)


def scatter_rows(table: Any, idx: Any, rows: Any) -> Any:
    """In place: the output aliases ``table`` (donated by the caller's jit)."""
    import jax

    out = jax.ShapeDtypeStruct(table.shape, table.dtype)
    res = jax.ffi.ffi_call("meshembed_scatter_rows", out, input_output_aliases={0: 0})(table, idx, rows)
    return _vary_like(res, table, idx, rows)


def fused_update(tables: list, ids: Any, grads: Any, segs: Any, w: Any, hp: Any, address: int,
                 combined: bool, weighted: bool) -> list:
    """The generated row kernel at ``address`` over ``tables`` (the table, then its slots; 1..8,
    all float32 or all float64), in place (the results alias the donated tables); ``hp`` =
    the kernel's parameter block (see :func:`hp_block`)."""
    import jax

    outs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables]
    aliases = {5 + k: k for k in range(len(tables))}
    res = jax.ffi.ffi_call("meshembed_fused_update", outs, input_output_aliases=aliases)(
        hp, ids, grads, segs, w, *tables, fn=np.int64(address), combined=combined, weighted=weighted,
    )
    return list(_vary_like(list(res), *tables, ids, grads))


def all_finite(arrays: list) -> Any:
    """A boolean scalar: whether every element of every (float32/float64) array is finite."""
    import jax
    import jax.numpy as jnp

    return jax.ffi.ffi_call("meshembed_all_finite", jax.ShapeDtypeStruct((), jnp.bool_))(*arrays)


def dense_update(hp: Any, grads: list, targets: list, kernel: Any) -> list:
    """The generated row kernel ``kernel`` (a ``codegen.RowKernel``) over dense tensors in
    place: ``hp`` = ``[count, kernel.n_params]`` parameter blocks (:func:`hp_block`), one per
    tensor; ``targets[k][n]`` = array k (the variable, then its slots) of tensor n; returns the
    new targets in the same layout (aliasing the donated ones)."""
    import jax

    count, k_targets = len(grads), len(targets)
    flat = [t for per_k in targets for t in per_k]
    outs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in flat]
    aliases = {1 + count + i: i for i in range(len(flat))}
    res = jax.ffi.ffi_call("meshembed_dense_update", outs, input_output_aliases=aliases)(
        hp, *grads, *flat, fn=np.int64(kernel.address), count=count
    )
    return [list(res[k * count:(k + 1) * count]) for k in range(k_targets)]


def narrow_int64(host: np.ndarray, out: np.ndarray) -> tuple[int, int] | None:
    """``out[:] = host`` (int64 -> int32, both C-contiguous, same size) in one C pass that also
    finds ``(min, max)`` of ``host`` (returned; the caller checks them before using ``out``), or
    None where the library is not loaded (the caller's NumPy passes then run)."""
    lib = _state.get("lib")
    if lib is None or host.size == 0:
        return None
    fn = _state.get("narrow")
    if fn is None:
        fn = _state["narrow"] = lib.meshembed_narrow_int64
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    bounds = np.empty(2, np.int64)
    fn(host.ctypes.data, out.ctypes.data, host.size, bounds.ctypes.data, bounds.ctypes.data + 8)
    return int(bounds[0]), int(bounds[1])


def hp_block(params: Any) -> np.ndarray:
    """Host parameter blocks (one row of ``RowKernel.params`` per tensor, or one flat row) as
    the FFI kernels read them: the float64 values' bits as uint32 pairs, so the doubles reach
    the kernel unrounded whether or not jax_enable_x64 is on."""
    block = np.ascontiguousarray(np.asarray(params, np.float64))
    return block.view(np.uint32)


def traced_hp(values: Any) -> Any:
    """The parameter block of traced values (inside a user's jit): float64 with x64 on, else
    float32 (the kernel widens it; such values are float32 already)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    return jnp.stack([jnp.asarray(v).astype(dtype).reshape(()) for v in values])


_kernels: dict[tuple, Any] = {}


def row_kernel(rule: Any, n_arrays: int, dtype: Any) -> Any:
    """The generated row kernel of ``rule`` over ``n_arrays`` ``dtype`` arrays
    (``meshembed_native.codegen.row_kernel``), or None: the rule cannot be generated or no
    compiler. Cached per (rule, n_arrays, dtype)."""
    import dataclasses

    name = np.dtype(dtype).name
    key = (rule, n_arrays, name)
    if key not in _kernels:
        from meshembed_native import codegen

        if rule.dtype != name:
            rule = dataclasses.replace(rule, dtype=name)
        _kernels[key] = codegen.row_kernel(rule, n_arrays)
    return _kernels[key]


if __name__ == "__main__":  # python -m meshembed_jax.native: build and report
    print(build() if load() else _state.get("error"), file=sys.stderr)
