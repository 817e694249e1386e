"""Row kernels generated from the core's math: one formula, no second copy in C++.

The core's update (:func:`meshembed.math.rule.apply_rule`) is pure Array-API code. It is run
once per (rule, number of arrays) on a *recorder* — a small symbolic ``xp`` whose arrays stand
for one element ``j`` of a row and whose dynamic hyper-parameters stand for the values of the
call — and the recorded graph (:class:`Graph`, backend-neutral: a CUDA emitter can read it
too) is translated op by op into a C++ loop ``for j in [0, dim)`` (:func:`emit_cpp`). The
emitter knows no formula; it only writes each recorded op in the recorded order.

Types follow what the NumPy reference does with the same code (NEP 50): the dynamic values
are Python floats there, so here they are ``double``, arithmetic among them stays double and
each is cast to the rows' dtype T where it meets an array; static Python numbers are written
exactly (``float.hex``) and cast to T where they meet an array; ``asarray(v, dtype=T)`` is T.
``maximum``/``minimum``/``sign``/``where`` keep NumPy's NaN and signed-zero behaviour (small
inline helpers in the generated source). Built with ``-ffp-contract=off`` (no fused
multiply-adds), so + − × ÷ sqrt give the reference's bits; pow/exp/log call libm (float64) or
the preamble's vectorizable float32 versions (<= 1 ulp of the correctly rounded result), which
may differ from NumPy's own SIMD versions by a few ulp (docs/internals.md "Generated kernels").

C ABI of each kernel (one per rule's static part and dtype T)::

    extern "C" void <symbol>(T* const* rows, const T* g, int64_t dim, const double* hp)

``rows[k]``: this row of array k (k = 0 the table, then the slots in ``rule.slot_names``
order), ``g``: the summed gradient row, ``hp``: the dynamic values in ``rule.dynamic`` order.
The row is read and written in place. Dense use: the whole flat tensor is one row.

Row-wise rules (``rule.math.row_slots``, fbgemm's row-wise optimizers): a row slot holds one
value per row, so ``rows[k]`` points at that one value (the driver steps it by 1, not ``dim``:
:attr:`RowKernel.widths`), read before the loop and written after it; ``xp.mean(x, axis=-1,
keepdims=True)`` is recorded as a reduction over the row, summed in NumPy's pairwise order
(``me_pairwise``: 8 accumulators, halves above 128 elements), so the mean is NumPy's bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from meshembed.errors import InputError
from meshembed.math.common import SymbolicScalar
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed_native import build as native

__all__ = ["Graph", "Node", "NotRecordable", "RowKernel", "emit_cpp", "float32_math", "prebuild", "record",
           "row_kernel"]

#: Most arrays (table + slots) one kernel takes: what the backends' drivers dispatch on.
MAX_ARRAYS = 8
_FLOATS = ("float32", "float64")
#: Algorithms never recorded: an XLA program (JAX only) and one with no public formula.
_NOT_ELEMENTWISE = ("user_defined_program", "mdl_adagrad_light")


class NotRecordable(Exception):
    """The update does something one row loop cannot express (a reduction, a shape, a
    Python branch on a value known only at run time, ...)."""


# -- the recorded graph ----------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One recorded value. ``op``: "row" (args: array k), "grad", "param" (args: index into
    hp), "const" (args: the Python value), else an op over earlier nodes (args: indices).
    ``dtype``: "float32" | "float64" | "bool"; ``weak``: a Python-number-like scalar
    (double / bool, as the reference's floats); ``varying``: depends on the element j."""

    op: str
    args: tuple
    dtype: str
    weak: bool
    varying: bool


@dataclass
class Graph:
    """The recorded update: nodes in recorded order and the output node of each array."""

    nodes: list[Node]
    outputs: tuple[int, ...]
    dtype: str
    n_arrays: int
    n_params: int
    row_arrays: tuple[int, ...] = ()  # arrays with one value per row (row-wise slots)


class _Recorder:
    """The symbolic ``xp`` namespace: Array-API functions that append nodes."""

    float32 = np.dtype("float32")
    float64 = np.dtype("float64")
    bool = np.dtype("bool")

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._memo: dict[tuple, int] = {}

    # graph building
    def node(self, op: str, args: tuple, dtype: str, weak: bool = False) -> int:
        if op == "const":
            key = (op, _const_key(args[0]), dtype, weak)
            varying = False
        else:
            key = (op, args, dtype, weak)
            varying = op in ("row", "grad") or (op != "mean" and any(
                self.nodes[a].varying for a in args if op not in ("param", "rowval")))
        found = self._memo.get(key)
        if found is None:  # pure ops: one node per distinct (op, operands)
            found = self._memo[key] = len(self.nodes)
            self.nodes.append(Node(op, args, dtype, weak, varying))
        return found

    def wrap(self, index: int) -> Any:
        n = self.nodes[index]
        return SymbolicValue(self, index) if n.weak else SymbolicArray(self, index)

    def to(self, x: Any, dtype: str) -> int:
        """Operand ``x`` (symbolic or a Python/NumPy number) as a node of array dtype ``dtype``."""
        if isinstance(x, _Symbolic):
            n = self.nodes[x.index]
            if n.dtype == dtype and not n.weak:
                return x.index
            return self.node("cast", (x.index,), dtype)
        return self.node("const", (_py(x),), dtype)

    # the namespace
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotRecordable(f"xp.{name} is not an element-wise op a row kernel can record")

    def asarray(self, obj: Any, dtype: Any = None, device: Any = None, copy: Any = None) -> Any:
        if isinstance(obj, SymbolicArray):
            return obj if dtype is None else self.astype(obj, dtype)
        target = _dtype_name(dtype) if dtype is not None else _default_dtype(obj)
        return SymbolicArray(self, self.to(obj, target))

    def astype(self, x: Any, dtype: Any, copy: bool = True, device: Any = None) -> Any:
        return SymbolicArray(self, self.to(_array(self, x), _dtype_name(dtype)))

    def zeros_like(self, x: Any, dtype: Any = None, device: Any = None) -> Any:
        return self.full_like(x, 0, dtype=dtype)

    def ones_like(self, x: Any, dtype: Any = None, device: Any = None) -> Any:
        return self.full_like(x, 1, dtype=dtype)

    def full_like(self, x: Any, fill_value: Any, dtype: Any = None, device: Any = None) -> Any:
        target = _dtype_name(dtype) if dtype is not None else self.nodes[_array(self, x).index].dtype
        return SymbolicArray(self, self.to(fill_value, target))

    def mean(self, x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        """The row's mean, one value (a row-wise rule's reduction); only ``axis=-1, keepdims=True``."""
        if axis not in (-1, (-1,)) or keepdims is not True:
            raise NotRecordable("mean other than over the row with keepdims=True")
        x = _array(self, x)
        if self.nodes[x.index].dtype not in _FLOATS or not self.nodes[x.index].varying:
            raise NotRecordable("mean of a boolean or of a value that is the same along the row")
        return SymbolicArray(self, self.node("mean", (x.index,), self.nodes[x.index].dtype))

    def where(self, cond: Any, x1: Any, x2: Any) -> Any:
        if not any(isinstance(v, SymbolicArray) for v in (cond, x1, x2)):
            raise NotRecordable("where() of scalars only")
        c = cond.index if isinstance(cond, _Symbolic) and self.nodes[cond.index].dtype == "bool" else None
        if c is None:
            raise NotRecordable("where() with a condition that is not boolean")
        dtype = _result_dtype(self, (x1, x2))
        return SymbolicArray(self, self.node("where", (c, self.to(x1, dtype), self.to(x2, dtype)), dtype))


_UNARY = {"abs": "abs", "negative": "neg", "positive": "pos", "sign": "sign", "sqrt": "sqrt",
          "floor": "floor", "ceil": "ceil", "exp": "exp", "log": "log", "square": "square",
          "isnan": "isnan", "isinf": "isinf", "isfinite": "isfinite", "logical_not": "not"}
_BINARY = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div", "pow": "pow",
           "maximum": "max", "minimum": "min", "less": "lt", "less_equal": "le", "greater": "gt",
           "greater_equal": "ge", "equal": "eq", "not_equal": "ne", "logical_and": "and",
           "logical_or": "or", "logical_xor": "xor"}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_LOGICAL = ("and", "or", "xor", "not")
_PREDICATES = ("isnan", "isinf", "isfinite")


def _xp_unary(op: str) -> Any:
    def fn(self: _Recorder, x: Any) -> Any:
        return _unary(self, op, _array(self, x))
    fn.__name__ = op
    return fn


def _xp_binary(op: str) -> Any:
    def fn(self: _Recorder, x1: Any, x2: Any) -> Any:
        if not (isinstance(x1, SymbolicArray) or isinstance(x2, SymbolicArray)):
            raise NotRecordable(f"xp.{op} of scalars only (NumPy would return a float64 scalar)")
        return _binary(self, op, x1, x2)
    fn.__name__ = op
    return fn


for _name, _op in _UNARY.items():
    setattr(_Recorder, _name, _xp_unary(_op))
for _name, _op in _BINARY.items():
    setattr(_Recorder, _name, _xp_binary(_op))


def _const_key(v: Any) -> Any:
    return ("b", v) if isinstance(v, bool) else float(v).hex()  # keeps -0.0 apart from 0.0


def _py(x: Any) -> Any:
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, float, np.integer, np.floating)):
        return float(x)
    raise NotRecordable(f"an operand of type {type(x).__name__}")


def _dtype_name(dtype: Any) -> str:
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise NotRecordable(f"dtype {dtype!r}") from None
    if name not in (*_FLOATS, "bool"):
        raise NotRecordable(f"dtype {name}")
    return name


def _default_dtype(obj: Any) -> str:
    """NumPy's dtype for ``asarray(obj)`` without a dtype (a Python float: float64)."""
    if isinstance(obj, (bool, np.bool_)):
        return "bool"
    if isinstance(obj, np.generic):
        return _dtype_name(obj.dtype)
    if isinstance(obj, SymbolicValue):
        return "bool" if obj._node.dtype == "bool" else "float64"
    if isinstance(obj, (int, float)):
        return "float64"
    raise NotRecordable(f"asarray of {type(obj).__name__}")


def _array(rec: _Recorder, x: Any) -> "SymbolicArray":
    if not isinstance(x, SymbolicArray) or x.rec is not rec:
        raise NotRecordable(f"an element-wise function of a non-array ({type(x).__name__})")
    return x


def _result_dtype(rec: _Recorder, operands: Sequence[Any]) -> str:
    """NEP 50 result dtype: strong operands (arrays, NumPy scalars) decide; Python numbers and
    weak symbolic values take it (a weak float with only boolean arrays gives float64)."""
    strong = [rec.nodes[x.index].dtype for x in operands if isinstance(x, SymbolicArray)]
    strong += [_dtype_name(x.dtype) for x in operands if isinstance(x, np.generic)]
    floats = [d for d in strong if d != "bool"]
    if floats:
        return "float64" if "float64" in floats else "float32"
    weak_float = any((isinstance(x, SymbolicValue) and x._node.dtype != "bool")
                     or (isinstance(x, (int, float)) and not isinstance(x, bool)) for x in operands)
    return "float64" if weak_float else "bool"


def _unary(rec: _Recorder, op: str, x: "_Symbolic") -> Any:
    n = rec.nodes[x.index]
    if n.weak:  # Python arithmetic on a dynamic value: double
        if op not in ("neg", "pos", "abs") or n.dtype == "bool":
            raise NotRecordable(f"{op} of a dynamic scalar")
        return rec.wrap(rec.node(op, (x.index,), "float64", weak=True))
    if op == "pos":
        return x
    if op in _PREDICATES:
        if n.dtype == "bool":
            raise NotRecordable(f"{op} of a boolean array")
        return SymbolicArray(rec, rec.node(op, (x.index,), "bool"))
    if (op == "not") != (n.dtype == "bool"):
        raise NotRecordable(f"{op} of a {n.dtype} array")
    return SymbolicArray(rec, rec.node(op, (x.index,), n.dtype))


def _binary(rec: _Recorder, op: str, a: Any, b: Any) -> Any:
    if isinstance(a, _Symbolic) and a.rec is not rec or isinstance(b, _Symbolic) and b.rec is not rec:
        raise NotRecordable("values of two recordings")
    if not (isinstance(a, SymbolicArray) or isinstance(b, SymbolicArray)) and not (
            isinstance(a, np.generic) or isinstance(b, np.generic)):
        return _scalar_binary(rec, op, a, b)
    if op == "pow" and isinstance(a, SymbolicArray) and isinstance(b, (int, float, np.integer, np.floating)) \
            and not isinstance(b, bool) and rec.nodes[a.index].dtype in _FLOATS:
        fast = _fast_power(rec, a, float(b))  # ndarray ** scalar: NumPy's fast paths
        if fast is not None:
            return fast
    dtype = _result_dtype(rec, (a, b))
    if (op in _LOGICAL) != (dtype == "bool") and op not in _COMPARE:
        raise NotRecordable(f"{op} on {dtype}")
    out = "bool" if op in _COMPARE else dtype
    return SymbolicArray(rec, rec.node(op, (rec.to(a, dtype), rec.to(b, dtype)), out))


def _fast_power(rec: _Recorder, a: "SymbolicArray", e: float) -> Any:
    """``a ** e`` as NumPy computes it for these exponents (square, sqrt, reciprocal, ...)."""
    dtype = rec.nodes[a.index].dtype
    if e == 2.0:
        return SymbolicArray(rec, rec.node("mul", (a.index, a.index), dtype))
    if e == 0.5:
        return SymbolicArray(rec, rec.node("sqrt", (a.index,), dtype))
    if e == 1.0:
        return a
    if e == -1.0:
        return SymbolicArray(rec, rec.node("div", (rec.to(1.0, dtype), a.index), dtype))
    if e == 0.0:
        return SymbolicArray(rec, rec.to(1.0, dtype))
    return None


def _scalar_binary(rec: _Recorder, op: str, a: Any, b: Any) -> Any:
    """Python arithmetic between dynamic values and Python numbers: double (or bool)."""
    def operand(x: Any) -> int:
        if isinstance(x, SymbolicValue):
            return x.index if x._node.dtype == "float64" or op in _LOGICAL else rec.node("cast", (x.index,), "float64", True)
        return rec.node("const", (_py(x),) if op in _LOGICAL else (float(_py(x)),), "bool" if op in _LOGICAL else "float64", True)
    if op in _LOGICAL:
        if not all(isinstance(x, bool) or isinstance(x, SymbolicValue) and x._node.dtype == "bool" for x in (a, b)):
            raise NotRecordable(f"{op} of non-boolean scalars")
        return rec.wrap(rec.node(op, (operand(a), operand(b)), "bool", True))
    if op in ("max", "min"):
        raise NotRecordable(f"{op} of scalars only")
    out = "bool" if op in _COMPARE else "float64"
    return rec.wrap(rec.node(op, (operand(a), operand(b)), out, True))


class _Symbolic:
    """Operators shared by symbolic arrays and symbolic scalars."""

    __slots__ = ("rec", "index")
    __array_ufunc__ = None  # np.sqrt(x) and friends refuse instead of making object arrays

    def __init__(self, rec: _Recorder, index: int) -> None:
        self.rec = rec
        self.index = index

    @property
    def _node(self) -> Node:
        return self.rec.nodes[self.index]

    def __bool__(self) -> bool:
        raise NotRecordable("a Python branch on a value known only when the kernel runs")

    def __float__(self) -> float:
        raise NotRecordable("float() of a value known only when the kernel runs")

    __int__ = __index__ = __float__  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]

    def __neg__(self) -> Any:
        return _unary(self.rec, "neg", self)

    def __pos__(self) -> Any:
        return _unary(self.rec, "pos", self)

    def __abs__(self) -> Any:
        return _unary(self.rec, "abs", self)

    def __invert__(self) -> Any:
        if isinstance(self, SymbolicValue):
            raise NotRecordable("~ of a Python bool")
        return _unary(self.rec, "not", self)


def _dunder(op: str, reflected: bool = False) -> Any:
    def fn(self: _Symbolic, other: Any) -> Any:
        return _binary(self.rec, op, other, self) if reflected else _binary(self.rec, op, self, other)
    return fn


for _op, _names in {"add": ("add",), "sub": ("sub",), "mul": ("mul",), "div": ("truediv",),
                    "pow": ("pow",), "and": ("and",), "or": ("or",), "xor": ("xor",)}.items():
    for _n in _names:
        setattr(_Symbolic, f"__{_n}__", _dunder(_op))
        setattr(_Symbolic, f"__r{_n}__", _dunder(_op, reflected=True))
for _op in _COMPARE:
    setattr(_Symbolic, f"__{_op}__", _dunder(_op))


class SymbolicValue(_Symbolic, SymbolicScalar):
    """A dynamic hyper-parameter (or Python arithmetic on one): a weak double or bool."""

    __slots__ = ()


class SymbolicArray(_Symbolic):
    """One element of a row (or a value broadcast over it) of dtype ``.dtype``."""

    __slots__ = ()
    device = "cpu"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._node.dtype)

    @property
    def shape(self) -> Any:
        raise NotRecordable("the shape of a row (a row kernel sees one element)")

    ndim = size = shape
    mT = T = shape


def record(rule: UpdateRule, n_arrays: int) -> Graph:
    """Run :func:`apply_rule` on the recorder: the graph of ``rule`` over ``n_arrays`` arrays
    (the table and its slots) of ``rule.dtype``. Raises NotRecordable (or whatever the
    update raises) when it is not one element-wise row loop."""
    if rule.algorithm in _NOT_ELEMENTWISE:
        raise NotRecordable(f"{rule.algorithm} is not an element-wise formula")
    if rule.dtype not in _FLOATS:
        raise NotRecordable(f"dtype {rule.dtype}")
    if not 1 <= n_arrays <= MAX_ARRAYS:
        raise NotRecordable(f"{n_arrays} arrays (a kernel takes 1 to {MAX_ARRAYS})")
    rec = _Recorder()
    dtype = rule.dtype
    row_arrays = _row_arrays(rule, n_arrays)
    rows = [SymbolicArray(rec, rec.node("rowval" if k in row_arrays else "row", (k,), dtype)) for k in range(n_arrays)]
    grads = SymbolicArray(rec, rec.node("grad", (), dtype))
    values = [SymbolicValue(rec, rec.node("param", (i,), "float64", weak=True)) for i in range(len(rule.dynamic))]
    out = apply_rule(rec, rule, values, grads, rows[0], *rows[1:])
    if len(out) != n_arrays:
        raise NotRecordable(f"the update returns {len(out)} arrays for {n_arrays}")
    outputs = []
    for k, x in enumerate(out):
        if not isinstance(x, SymbolicArray) or x.rec is not rec or x._node.dtype == "bool":
            raise NotRecordable(f"an output that is not a float row ({type(x).__name__})")
        if k in row_arrays and x._node.varying:
            raise NotRecordable(f"array {k} holds one value per row, but its update varies along the row")
        outputs.append(rec.to(x, dtype))  # stored into a row of dtype T
    return Graph(rec.nodes, tuple(outputs), dtype, n_arrays, len(rule.dynamic), row_arrays)


def _row_arrays(rule: UpdateRule, n_arrays: int) -> tuple[int, ...]:
    """Indices (0 = the table) of the arrays holding one value per row."""
    row_slots = getattr(rule.math, "row_slots", ())
    return tuple(k + 1 for k, name in enumerate(rule.slot_names[:n_arrays - 1]) if name in row_slots)


# -- the C++ emitter -------------------------------------------------------------------------

_LIBM = ("pow", "exp", "log")
_CTYPE = {"float32": "float", "float64": "double", "bool": "bool"}
_EXPR = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "neg": "(-{0})", "pos": "{0}", "abs": "std::fabs({0})", "sqrt": "std::sqrt({0})",
    "floor": "std::floor({0})", "ceil": "std::ceil({0})", "exp": "me_exp({0})", "log": "me_log({0})",
    "square": "({0} * {0})", "pow": "me_pow({0}, {1})", "max": "me_max({0}, {1})", "min": "me_min({0}, {1})",
    "sign": "me_sign({0})", "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "and": "({0} && {1})", "or": "({0} || {1})", "xor": "({0} != {1})",
    "not": "(!{0})", "where": "({0} ? {1} : {2})", "isnan": "({0} != {0})", "isinf": "std::isinf({0})",
    "isfinite": "std::isfinite({0})",
}

#: NumPy's NaN and signed-zero behaviour: maximum(a, b) = a if a > b or a is NaN, else b (so
#: maximum(-0., 0.) = 0. and maximum(0., -0.) = -0., as np.maximum); sign(±0) = +0, sign(NaN) = NaN.
PREAMBLE = """\
#include <cmath>
#include <cstdint>
namespace {
// (written as nested selects: GCC vectorizes a clamp of these, not of the `(a > b) | (a != a)` form)
template <class T> inline T me_max(T a, T b) { return (a != a) ? a : ((a > b) ? a : b); }
template <class T> inline T me_min(T a, T b) { return (a != a) ? a : ((a < b) ? a : b); }
template <class T> inline T me_sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : (x == T(0) ? T(0) : x)); }
// A C library call's operand known at compile time stays opaque: GCC would otherwise turn
// powf(x, 0.5f) into sqrtf(x) or fold exp(c) itself, not the library's (NumPy-like) result.
template <class T> inline T me_opaque(T v) { volatile T t = v; return t; }
// Float32 pow/exp/log computed in double with plain IEEE operations (+ - * / fma, bit masks;
// no C library call, no table), so the loop vectorizes and the result does not depend on the
// vector width or the remainder. pow(x, y) = 2^(y log2|x|) is within 1 ulp of the correctly
// rounded result: the double before rounding has a relative error <= 1.9e-9 (exp2) + |u| ln2
// 4.3e-12 (log2; |u| = |y log2|x|| <= 150 wherever the float result is neither 0 nor inf) +
// ~1e-15 (rounding) < 2.4e-9 = 2^-28.6, far below the 2^-24 (half the smallest relative ulp)
// that moves a rounded float result by 1 ulp at most; exp and log the same, with less error.
// (Alternatives measured slower: docs/benchmarks.md, "Measurements behind design choices in
// the code", Core.)
inline double me_bits_d(uint64_t b) { double d; __builtin_memcpy(&d, &b, 8); return d; }
inline uint64_t me_d_bits(double d) { uint64_t b; __builtin_memcpy(&b, &d, 8); return b; }
// c ? a : b as bit masks: GCC merges chains of ?: into n-way choices it will not vectorize.
inline double me_sel(bool c, double a, double b) {
  const uint64_t m = 0ull - static_cast<uint64_t>(c);
  return me_bits_d((me_d_bits(a) & m) | (me_d_bits(b) & ~m));
}
inline float me_sel(bool c, float a, float b) {
  uint32_t ab, bb; __builtin_memcpy(&ab, &a, 4); __builtin_memcpy(&bb, &b, 4);
  const uint32_t m = 0u - static_cast<uint32_t>(c), r = (ab & m) | (bb & ~m);
  float f; __builtin_memcpy(&f, &r, 4); return f;
}
// log2(a) for a finite double a > 0 of float precision, relative error <= 4.3e-12 (2^-37.7):
// a = z 2^k with z in [sqrt(1/2), sqrt(2)) (the bits of a minus those of sqrt(1/2) give k),
// s = (z - 1) / (z + 1) (both exact), log2(z) = s P(s^2), P the degree-4 minimax (relative
// error) of 2 atanh(s) / (s ln 2) on s^2 <= 0.02944 (a Remez fit; the bound: test_codegen.py).
inline double me_log2_core(double a) {
  const uint64_t b = me_d_bits(a), t = b - 0x3FE6A09E667F3BCDull;
  const int64_t k = static_cast<int64_t>(t) >> 52;
  const double z = me_bits_d(b - (t & 0xFFF0000000000000ull)), s = (z - 1.0) / (z + 1.0), w = s * s;
  double p = std::fma(0x1.5ce7cd9139f0cp-2, w, 0x1.a58d8fc0aa828p-2);
  p = std::fma(p, w, 0x1.27777fda66c82p-1); p = std::fma(p, w, 0x1.ec709d12e1553p-1);
  p = std::fma(p, w, 0x1.71547652bede5p+1);
  return std::fma(s, p, static_cast<double>(k));
}
// 2^u for the float range, relative error <= 1.9e-9 (2^-29): u clamped to [-160, 140] (beyond:
// 0 / inf once rounded to float; NaN stays NaN), u = k + r with k = round(u), |r| <= 1/2, 2^r
// the degree-6 minimax polynomial (relative error), 2^k from the bits.
inline double me_exp2_core(double u) {
  u = me_sel(u > 140.0, 140.0, u);
  u = me_sel(u < -160.0, -160.0, u);
  const double sh = u + 0x1.8p52, r = u - (sh - 0x1.8p52);  // round(u) in the low bits
  double p = std::fma(0x1.41d333a1fbff9p-13, r, 0x1.5f456a867c735p-10);
  p = std::fma(p, r, 0x1.3b2dbbc0aa7a3p-7); p = std::fma(p, r, 0x1.c6aed4b95c606p-5);
  p = std::fma(p, r, 0x1.ebfbdadcb136fp-3); p = std::fma(p, r, 0x1.62e430c7e91afp-1);
  p = std::fma(p, r, 0x1.00000002614ffp+0);
  const uint64_t kb = me_d_bits(sh) - me_d_bits(0x1.8p52);  // k as a two's-complement integer
  return p * me_bits_d((kb + 1023ull) << 52);
}
inline float me_expf(float x) { return static_cast<float>(me_exp2_core(static_cast<double>(x) * 0x1.71547652b82fep+0)); }
inline float me_logf(float x) {
  const float r = static_cast<float>(me_log2_core(x) * 0x1.62e42fefa39efp-1);
  // C99's cases, one select: x < 0 -> NaN; 0, inf, NaN -> (x - 1) inf = -inf, inf, NaN
  const float s = me_sel(x < 0.0f, __builtin_nanf(""), (x - 1.0f) * __builtin_inff());
  return me_sel((x > 0.0f) & (x < __builtin_inff()), r, s);
}
inline float me_powf_any(float x, float y) {
  const float ax = std::fabs(x);
  // |x| = 0, inf or NaN gives the log2 core a finite value, put right below in float (cheaper
  // than a select in double): C99's 0 / inf by the sign of y (y NaN stays NaN), then NaN, sign, 1
  float r = static_cast<float>(me_exp2_core(static_cast<double>(y) * me_log2_core(ax)));
  r = me_sel(((ax == 0.0f) | (ax == __builtin_inff())) & (y == y),
             me_sel((ax == 0.0f) == (y > 0.0f), 0.0f, __builtin_inff()), r);
  const float yr = std::rint(y), hr = std::rint(y * 0.5f);
  const bool integer = yr == y, odd = integer & (std::fabs(y) < 0x1p24f) & (hr != y * 0.5f);
  uint32_t xb; __builtin_memcpy(&xb, &x, 4);
  r = me_sel(((xb >> 31) != 0u) & odd, -r, r);
  r = me_sel((ax != ax) | ((x < 0.0f) & (x > -__builtin_inff()) & !integer), __builtin_nanf(""), r);
  return me_sel((y == 0.0f) | (x == 1.0f) | ((x == -1.0f) & (std::fabs(y) == __builtin_inff())), 1.0f, r);
}
// pow(x, 1/2) and pow(x, -1/2) (AdagradMomentum's default exponent, typical probability
// exponents): a square root (in double for the reciprocal), correctly rounded but for a double
// rounding, and C99's cases (-0 -> +0 / +inf, -inf -> +inf / +0). Chosen by value, so a kernel
// with the exponent as a constant (GCC drops the other branches) and float32_math agree.
inline float me_pow_half(float x) { return me_sel(x == -__builtin_inff(), __builtin_inff(), std::sqrt(x + 0.0f)); }
inline float me_pow_mhalf(float x) {
  const float r = static_cast<float>(1.0 / std::sqrt(static_cast<double>(x) + 0.0));
  return me_sel(x == -__builtin_inff(), 0.0f, r);
}
inline float me_powf(float x, float y) {
  return me_sel(y == 0.5f, me_pow_half(x), me_sel(y == -0.5f, me_pow_mhalf(x), me_powf_any(x, y)));
}
// float32: the vectorizable versions above; float64 (and mixed operands): the C library's.
inline float me_pow(float x, float y) { return me_powf(x, y); }
inline double me_pow(double x, double y) { return std::pow(x, y); }
inline float me_exp(float x) { return me_expf(x); }
inline double me_exp(double x) { return std::exp(x); }
inline float me_log(float x) { return me_logf(x); }
inline double me_log(double x) { return std::log(x); }
// NumPy's pairwise sum of e(0) ... e(n-1) (its float and double add.reduce over a contiguous
// row): a plain loop below 8 elements, 8 accumulators up to 128, halves (cut at a multiple of
// 8) above. The row-wise rules' mean, so the generated kernels give NumPy's bits.
template <class T, class E>
inline T me_pairwise_at(const E& e, int64_t lo, int64_t n) {
  if (n < 8) {
    T res = T(0);
    for (int64_t i = 0; i < n; ++i) res += e(lo + i);
    return res;
  }
  if (n <= 128) {
    T r[8];
    for (int k = 0; k < 8; ++k) r[k] = e(lo + k);
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int k = 0; k < 8; ++k) r[k] += e(lo + i + k);
    T res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += e(lo + i);
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return me_pairwise_at<T>(e, lo, n2) + me_pairwise_at<T>(e, lo + n2, n - n2);
}
template <class T, class E>
inline T me_pairwise(const E& e, int64_t n) { return me_pairwise_at<T>(e, 0, n); }
}  // namespace
"""


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if math.isnan(v):
        return "__builtin_nan(\"\")"
    if math.isinf(v):
        return "__builtin_inf()" if v > 0 else "(-__builtin_inf())"
    return f"({float(v).hex()})"


def _cone(graph: Graph, roots: Iterable[int], through_means: bool) -> set[int]:
    """The nodes ``roots`` read, transitively (a mean's argument only ``through_means``)."""
    live = set(roots)
    for i in range(len(graph.nodes) - 1, -1, -1):
        n = graph.nodes[i]
        if i in live and n.op not in ("const", "param", "row", "rowval", "grad") and (through_means or n.op != "mean"):
            live.update(n.args)
    return live


def _statement(graph: Graph, i: int) -> str:
    n = graph.nodes[i]
    ctype = "double" if n.weak and n.dtype == "float64" else _CTYPE[n.dtype]
    if n.op == "row":
        expr = f"r{n.args[0]}[j]"
    elif n.op == "rowval":
        expr = f"r{n.args[0]}[0]"
    elif n.op == "grad":
        expr = "g[j]"
    elif n.op == "param":
        expr = f"hp[{n.args[0]}]"
    elif n.op == "const":
        expr = _literal(n.args[0]) if n.weak or n.dtype == "bool" else f"static_cast<{ctype}>({_literal(n.args[0])})"
    elif n.op == "cast":
        expr = f"({'x%d' % n.args[0]} != 0)" if n.dtype == "bool" else f"static_cast<{ctype}>(x{n.args[0]})"
    elif n.op == "mean":  # NumPy's mean: 0 + the pairwise sum, / dim in the row's dtype
        expr = f"(({ctype})0 + me_pairwise<{ctype}>(e{i}, dim)) / static_cast<{ctype}>(dim)"
    else:
        opaque = n.op in _LIBM and n.dtype != "float32"  # (float32: no C library call to keep)
        names = [f"me_opaque(x{a})" if opaque and not graph.nodes[a].varying else f"x{a}" for a in n.args]
        expr = _EXPR[n.op].format(*names)
    return f"const {ctype} x{i} = {expr};"


def emit_cpp(graph: Graph, symbol: str) -> str:
    """The C++ function ``symbol`` (C ABI above) computing ``graph``; no preamble. Values that
    are the same along the row come first (a mean after a lambda giving its argument at
    element j), then the loop over the row, then the row slots' stores."""
    live = _cone(graph, graph.outputs, through_means=True)
    in_loop = _cone(graph, graph.outputs, through_means=False)
    t = _CTYPE[graph.dtype]
    before, inside = [], []
    for i, n in enumerate(graph.nodes):
        if i not in live:
            continue
        if n.op == "mean":
            arg = n.args[0]
            body = [_statement(graph, a) for a in sorted(_cone(graph, [arg], through_means=False))
                    if graph.nodes[a].varying]
            before.append(f"auto e{i} = [&](int64_t j) -> {_CTYPE[n.dtype]} {{ " + " ".join(body) + f" return x{arg}; }};")
        if n.varying:
            if i in in_loop:
                inside.append(_statement(graph, i))
        else:
            before.append(_statement(graph, i))
    stores = [f"r{k}[j] = x{o};" for k, o in enumerate(graph.outputs)
              if k not in graph.row_arrays and not (graph.nodes[o].op == "row" and graph.nodes[o].args[0] == k)]
    after = [f"r{k}[0] = x{o};" for k, o in enumerate(graph.outputs)
             if k in graph.row_arrays and not (graph.nodes[o].op == "rowval" and graph.nodes[o].args[0] == k)]
    lines = [f'extern "C" void {symbol}({t}* const* rows, const {t}* g_, int64_t dim, const double* hp) {{']
    lines += [f"  {t}* __restrict r{k} = rows[{k}];" for k in range(graph.n_arrays)]
    lines += [f"  const {t}* __restrict g = g_;", "  (void)g; (void)hp;"]
    lines += [f"  {s}" for s in before]
    lines += ["  for (int64_t j = 0; j < dim; ++j) {"] + [f"    {s}" for s in inside + stores] + ["  }"]
    lines += [f"  {s}" for s in after] + ["}"]
    return "\n".join(lines) + "\n"


# -- building and loading --------------------------------------------------------------------


@dataclass(frozen=True)
class RowKernel:
    """A compiled row kernel of ``rule`` over ``n_arrays`` arrays of ``dtype``.

    ``address``: the C function pointer (valid while the process lives); ``params(values)``:
    the ``hp`` block for this call's dynamic values (``rule.dynamic`` order)."""

    rule: UpdateRule
    n_arrays: int
    dtype: str
    symbol: str
    address: int
    n_params: int
    source: str = field(repr=False, compare=False)
    graph: Graph = field(repr=False, compare=False, hash=False)

    def params(self, values: Sequence[Any]) -> tuple[float, ...]:
        if len(values) != self.n_params:
            raise InputError(
                f"Invalid `values` for the {self.rule.algorithm!r} kernel. Expected {self.n_params} values "
                f"for {self.rule.dynamic}. Received: {len(values)}")
        return tuple(float(v) for v in values)

    @property
    def calls_libm(self) -> bool:
        """Whether the kernel calls pow/exp/log, whose float32 results are its own (within 1
        ulp), not NumPy's."""
        return any(n.op in _LIBM for n in self.graph.nodes)

    @property
    def widths(self) -> tuple[int, ...]:
        """Per array: 1 for a row slot (one value per row: the driver steps its pointer by 1),
        0 for an array with the row's width ``dim``."""
        return tuple(1 if k in self.graph.row_arrays else 0 for k in range(self.n_arrays))

    def apply(self, arrays: Sequence[np.ndarray], grads: np.ndarray, values: Sequence[Any]) -> None:
        """Run on NumPy arrays in place (the table and its slots, each shaped like ``grads``, a
        row slot ``[rows, 1]`` for ``[rows, dim]`` gradients, one call per row): for tests and
        dense use; every array C-contiguous of ``dtype``."""
        arrays = list(arrays)
        rowwise = bool(self.graph.row_arrays)
        shapes = [(grads.shape[0], 1) if rowwise and w else grads.shape for w in self.widths]
        if len(arrays) != self.n_arrays or (rowwise and grads.ndim != 2) or any(
                not isinstance(a, np.ndarray) or a.dtype != self.dtype or not a.flags.c_contiguous
                or not a.flags.writeable or a.shape != shape for a, shape in zip(arrays, shapes)):
            raise InputError(f"Invalid `arrays`. Expected {self.n_arrays} writable C-contiguous {self.dtype} arrays "
                             f"of shapes {shapes}.")
        if grads.dtype != self.dtype or not grads.flags.c_contiguous:
            raise InputError(f"Invalid `grads`. Expected a C-contiguous {self.dtype} array. Received: {grads.dtype}")
        hp = (ctypes.c_double * max(1, self.n_params))(*self.params(values))
        if not rowwise:
            ptrs = (ctypes.c_void_p * self.n_arrays)(*(a.ctypes.data for a in arrays))
            _call_type(self.address)(ptrs, grads.ctypes.data, grads.size, hp)
            return
        dim, size = grads.shape[1], grads.itemsize
        for r in range(grads.shape[0]):
            ptrs = (ctypes.c_void_p * self.n_arrays)(*(a.ctypes.data + r * (1 if w else dim) * size
                                                      for a, w in zip(arrays, self.widths)))
            _call_type(self.address)(ptrs, grads.ctypes.data + r * dim * size, dim, hp)


_CALL = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


def _call_type(address: int) -> Any:
    return _CALL(address)


_lock = threading.RLock()
_kernels: dict[Any, RowKernel | None] = {}
_libraries: dict[str, ctypes.CDLL] = {}
_warned = [False]
STEM = "meshembed_rk"
#: -fno-trapping-math lets GCC compute both sides of a select (the float32 pow/exp/log's special
#: cases) and so vectorize the loop; it changes no result (FP exception flags are never read).
FLAGS = (*native.FLAGS, "-fno-trapping-math")


def _source_dir() -> Path:
    return native.cache_dir() / "generated"


def _write(path: Path, text: str) -> Path:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def _generate(rule: UpdateRule, n_arrays: int) -> tuple[Graph, str, str] | None:
    """``(graph, symbol, full source)``, or None where the rule cannot be recorded."""
    try:
        graph = record(rule, n_arrays)
    except Exception:  # NotRecordable, NotImplementedError (no formula), a custom update's own error
        return None
    body = emit_cpp(graph, "SYMBOL")
    symbol = f"{STEM}_{graph.dtype}_{hashlib.sha256((PREAMBLE + body).encode()).hexdigest()[:16]}"
    return graph, symbol, PREAMBLE + body.replace("SYMBOL", symbol, 1)


def _load(path: Path, symbol: str) -> int:
    lib = _libraries.get(str(path))
    if lib is None:
        lib = _libraries[str(path)] = ctypes.CDLL(str(path))
    return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value


def prebuild(items: Iterable[tuple[UpdateRule, int]]) -> list[RowKernel | None]:
    """:func:`row_kernel` for each ``(rule, n_arrays)``, compiling every kernel not yet in the
    disk cache in one compiler run (each kernel's own cache entry then links to that one
    library, so a later process finds it by its own source)."""
    items = list(items)
    with _lock:
        out: list[Any] = [None] * len(items)
        todo: dict[int, tuple[Any, Graph, str, str, Path]] = {}
        for rule, n_arrays in items:  # every input checked before anything is cached
            if not isinstance(n_arrays, int) or isinstance(n_arrays, bool) or n_arrays < 1:
                raise InputError(f"Invalid `n_arrays`. Expected an int >= 1 (the table and its slots). "
                                 f"Received: n_arrays={n_arrays!r}")
            if not isinstance(rule, UpdateRule):
                raise InputError(f"Invalid `rule`. Expected an UpdateRule. Received: {type(rule).__name__}")
        for i, (rule, n_arrays) in enumerate(items):
            key = _key(rule, n_arrays)
            if key is not None and key in _kernels:
                out[i] = _kernels[key]
                continue
            made = _generate(rule, n_arrays)
            if made is None:
                _remember(key, None)
                continue
            graph, symbol, source = made
            src = _write(_source_dir() / f"{symbol}.cc", source)
            todo[i] = (key, graph, symbol, source, native.library_path(src, STEM, flags=FLAGS))
        missing = {t[2]: t for t in todo.values() if not t[4].exists()}
        failed = False
        if missing:
            failed = not _build(list(missing.values()))
        for i, (key, graph, symbol, source, path) in todo.items():
            rule, n_arrays = items[i]
            kernel = None
            if not failed:
                kernel = RowKernel(rule, n_arrays, graph.dtype, symbol, _load(path, symbol), graph.n_params,
                                   source, graph)
            out[i] = kernel
            _remember(key, kernel)
        return out


def _build(pending: list[tuple[Any, Graph, str, str, Path]]) -> bool:
    """Compile ``pending`` kernels (one library when several); False (one warning per
    process) where no compiler works."""
    try:
        if len(pending) == 1:
            native.build_library(_source_dir() / f"{pending[0][2]}.cc", STEM, flags=FLAGS)
            return True
        combined = PREAMBLE + "".join(t[3][len(PREAMBLE):] for t in pending)
        name = hashlib.sha256(combined.encode()).hexdigest()[:16]
        lib = native.build_library(_write(_source_dir() / f"batch_{name}.cc", combined), STEM + "_batch", flags=FLAGS)
        for t in pending:  # each kernel's own cache entry: a link to the batch library
            tmp = t[4].with_name(f".{t[4].name}.{os.getpid()}.tmp")
            if tmp.exists() or tmp.is_symlink():
                tmp.unlink()
            try:
                os.symlink(lib, tmp)
            except OSError:  # no symbolic links here: a copy (dlopen loads it separately)
                shutil.copyfile(lib, tmp)
            os.replace(tmp, t[4])
        return True
    except (native.BuildError, OSError) as exc:  # no compiler, a compiler that fails
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(f"meshembed: generated row kernels are unavailable ({str(exc)[:500]}); the core "
                          "functions run instead (same numbers).", RuntimeWarning, stacklevel=4)
        return False


def _key(rule: UpdateRule, n_arrays: int) -> Any:
    try:
        key = (rule, n_arrays)
        hash(key)
        return key
    except TypeError:  # a static hyper-parameter that is not hashable: not memoised
        return None


def _remember(key: Any, kernel: RowKernel | None) -> None:
    if key is not None:
        _kernels[key] = kernel


_MATH_SOURCE = """
extern "C" void me_math_pow(const float* x, const float* y, float* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = me_pow(x[j], y[j]);
}
extern "C" void me_math_exp(const float* x, const float* y, float* o, int64_t n) {
  (void)y; for (int64_t j = 0; j < n; ++j) o[j] = me_exp(x[j]);
}
extern "C" void me_math_log(const float* x, const float* y, float* o, int64_t n) {
  (void)y; for (int64_t j = 0; j < n; ++j) o[j] = me_log(x[j]);
}
extern "C" void me_math_log2_core(const double* x, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = me_log2_core(x[j]);
}
extern "C" void me_math_exp2_core(const double* x, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = me_exp2_core(x[j]);
}
"""
_math_state: dict = {}


def _math_lib() -> Any:
    f, d, n = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double), ctypes.c_int64
    signatures = {**{f"me_math_{name}": (None, [f, f, f, n]) for name in _LIBM},
                  **{f"me_math_{name}_core": (None, [d, d, n]) for name in ("log2", "exp2")}}
    lib = native.load_once(_math_state, _write(_source_dir() / "math_f32.cc", PREAMBLE + _MATH_SOURCE),
                           "meshembed_math", signatures, "the generated float32 math", flags=FLAGS)
    if lib is None:
        raise native.BuildError("no C++ compiler: the generated float32 math cannot be built")
    return lib


def _float32_math_core(name: str, x: np.ndarray) -> np.ndarray:
    """The double-precision ``log2``/``exp2`` cores of the float32 math over float64 ``x``
    (their error bounds are tested on their own)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    out = np.empty(x.shape, np.float64)
    ptr = ctypes.POINTER(ctypes.c_double)
    getattr(_math_lib(), f"me_math_{name}_core")(x.ctypes.data_as(ptr), out.ctypes.data_as(ptr), out.size)
    return out


def float32_math(name: str, *args: Any) -> np.ndarray:
    """The generated kernels' float32 ``pow``/``exp``/``log`` (``name``) element-wise over
    ``args`` (broadcast, as float32): the reference tests compare a kernel with bit for bit."""
    if name not in _LIBM or len(args) != (2 if name == "pow" else 1):
        raise InputError(f"Invalid `name`/arguments. Expected 'pow' (2 arrays), 'exp' or 'log' (1). "
                         f"Received: name={name!r} with {len(args)} argument(s)")
    ptr = ctypes.POINTER(ctypes.c_float)
    lib = _math_lib()
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in np.broadcast_arrays(*args)]
    out = np.empty(arrays[0].shape, np.float32)
    x, y = arrays[0], arrays[-1]
    getattr(lib, f"me_math_{name}")(x.ctypes.data_as(ptr), y.ctypes.data_as(ptr), out.ctypes.data_as(ptr), out.size)
    return out


def row_kernel(rule: UpdateRule, n_arrays: int) -> RowKernel | None:
    """The generated kernel computing ``rule`` over ``n_arrays`` arrays (the table and its
    slots) of ``rule.dtype``, compiled on first use and cached (memory and disk); None when
    the rule is not one element-wise loop (user_defined_program, mdl_adagrad_light, an op
    such as a reduction, a custom update that cannot be recorded) or no compiler works (one
    RuntimeWarning per process)."""
    key = _key(rule, n_arrays) if isinstance(rule, UpdateRule) else None
    if key is not None:
        with _lock:
            if key in _kernels:
                return _kernels[key]
    return prebuild([(rule, n_arrays)])[0]
