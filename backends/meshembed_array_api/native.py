"""The generic backend's native code (a CUDA kernel compiled by CuPy). CuPy's ``finish`` for
the generic segment sums (``kernels.segment_sum``): the hot ids' remaining rows added in row
order, one thread per output element.

Why: CuPy's ``cumsum`` is a parallel (tree) scan, so its last element is not
``((a + b) + c) + ...``; the GPU conformance run found float32 sums one ulp off NumPy's
``np.add.at`` order (conformance/test_dynamic_vocab.py, SGD rows that must match bit for bit).
A loop per element in row order is NumPy's order exactly (additions only: no contraction).
"""

from __future__ import annotations

from typing import Any

_SOURCE = r"""
extern "C" __global__ void rows_in_order_{name}(const {ctype}* acc, const {ctype}* vals,
        const long long* starts, const long long* counts, {ctype}* out, long long k, long long d) {{
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= k * d) return;
    long long i = idx / d, j = idx - i * d;
    {ctype} s = acc[idx];
    const {ctype}* v = vals + starts[i] * d + j;
    for (long long t = 0; t < counts[i]; ++t) s = s + v[t * d];
    out[idx] = s;
}}
"""
_CTYPES = {"float32": "float", "float64": "double"}
_compiled: dict[str, Any] = {}


def _kernel(cupy: Any, dtype_name: str) -> Any:
    if dtype_name not in _compiled:
        src = _SOURCE.format(name=dtype_name, ctype=_CTYPES[dtype_name])
        _compiled[dtype_name] = cupy.RawKernel(src, f"rows_in_order_{dtype_name}")
    return _compiled[dtype_name]


def rows_in_order(xp: Any, acc: Any, svals: Any, starts: Any, counts: Any) -> Any:
    """``kernels.Finish`` on CuPy arrays (float32/float64; None for other dtypes, whose rounds
    then go on in order: integer sums are exact in any order, float16 is rare here)."""
    name = str(acc.dtype)
    if name not in _CTYPES:
        return None
    import cupy

    k = int(acc.shape[0])
    shape = tuple(int(n) for n in acc.shape)
    d = 1
    for n in shape[1:]:
        d *= n
    if k == 0 or d == 0:
        return acc
    a = cupy.ascontiguousarray(acc).reshape(k, d)
    v = cupy.ascontiguousarray(svals).reshape(int(svals.shape[0]), d)
    out = cupy.empty_like(a)
    threads = 256
    blocks = (k * d + threads - 1) // threads
    _kernel(cupy, name)((blocks,), (threads,),
                        (a, v, cupy.ascontiguousarray(starts, dtype=cupy.int64),
                         cupy.ascontiguousarray(counts, dtype=cupy.int64), out, cupy.int64(k), cupy.int64(d)))
    return out.reshape(shape)
