"""The JAX backend's CPU row kernels (XLA FFI, ``meshembed_jax/native.cc``).

They must give the numbers of the pure-XLA kernels they replace (and of the NumPy
reference), be what the compiled steps actually call, and fall back cleanly — with one
warning — where they cannot be built.
"""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.math.registry import OptimizerMath  # noqa: E402
from meshembed.math.rule import UpdateRule  # noqa: E402
from meshembed.sharding import Placement  # noqa: E402
from meshembed_jax import JaxBackend, native  # noqa: E402
from meshembed_numpy import NumpyBackend  # noqa: E402
from tests.jax_x64 import x64_where_named  # noqa: E402,F401

RTOL = {"float32": 2e-6, "float64": 1e-13}
needs_compiler = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="no C++ compiler on this machine: the backend uses its pure-XLA kernels (tested elsewhere)",
)


def _backend(monkeypatch, ffi: bool) -> JaxBackend:
    """A fresh backend (own kernel cache) tracing with or without the FFI row kernels; the
    XLA update step (the generated fused kernels: conformance/test_fused_kernels.py)."""
    return JaxBackend(cpu_kernels=ffi, fused=False)


def _rule(update, slots: tuple = ()) -> UpdateRule:
    """An UpdateRule over a custom row update ``update(xp, w, g, slots, *, lr)``."""
    return UpdateRule(math=OptimizerMath("custom", update, None, ()), slot_names=slots)


def _close(actual, expected, dtype: str) -> None:
    expected = np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


@needs_compiler
def test_kernels_build_and_register():
    assert native.load(), native._state.get("error")
    assert native.library_path().exists()


@needs_compiler
def test_compiled_steps_call_the_ffi_kernels(monkeypatch):
    """The lookup and the update lower to the FFI custom calls, and not when disabled."""
    from meshembed_jax import kernels

    for ffi in (True, False):
        be = _backend(monkeypatch, ffi)
        layout = be.layout(Placement(50, 1, "mod"))
        table = jnp.zeros((1, 50, 4), jnp.float32)
        ids = jnp.arange(16, dtype=jnp.int32)
        segs = jnp.arange(16, dtype=jnp.int32) // 2
        w = jnp.zeros((1,), jnp.float32)
        lookup = kernels.make_gather_combine(layout, 4, 16, 8, False)
        text = lookup.lower(table, ids, segs, w).as_text()
        assert ("meshembed_gather_combine" in text) == ffi
        update = kernels.make_update(layout, 4, 1, 16, "dense", lambda dyn, g, t: (t - g,), combined=True)
        text = update.lower((table,), ids, jnp.ones((8, 4), jnp.float32), segs, w, jnp.asarray(True), ()).as_text()
        for target in ("meshembed_dedup_sum", "meshembed_gather_rows", "meshembed_scatter_rows"):
            assert (target in text) == ffi, target


def _adagrad_like(xp, w, g, slots, *, lr):
    acc = slots[0] + g * g
    return w - lr * g / xp.sqrt(acc), (acc,)


def _make_fn(xp, lr=0.1) -> dict:
    """update_rows' rule arguments: an Adagrad-like row update touching a slot (two tables)."""
    return {"fn": _rule(_adagrad_like, ("acc",)), "values": (lr,)}


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shards,strategy", [(1, "mod"), (3, "div")])
@pytest.mark.parametrize("sorted_segments", [True, False])
def test_ffi_and_xla_kernels_agree(monkeypatch, dtype, shards, strategy, sorted_segments):
    """Lookup (weighted and not) and the fused update: FFI == pure XLA == NumPy, with
    duplicates, padding and segment ids in any order."""
    ref = NumpyBackend()
    placement = Placement(97, shards, strategy)
    rng = np.random.default_rng(shards + sorted_segments)
    values = rng.standard_normal((97, 6)).astype(dtype)
    n, segments = 700, 53
    ids = rng.integers(0, 97, size=n) ** 2 % 97  # many duplicates
    seg = rng.integers(0, segments, size=n)
    if sorted_segments:
        seg = np.sort(seg)
    w = rng.random(n).astype(dtype)
    g = rng.standard_normal((segments, 6)).astype(dtype)
    results = []
    for ffi in (True, False):
        be = _backend(monkeypatch, ffi)
        t = [be.create_table(values, placement), be.create_table(np.full_like(values, 0.1), placement)]
        outs = [be.to_numpy(be.gather_combine(t[0], be.asarray(ids), be.asarray(seg), segments, wt))
                for wt in (None, be.asarray(w))]
        t = be.update_rows(t, be.asarray(ids), be.asarray(g), **_make_fn(be.xp), grad_index=be.asarray(seg),
                           grad_weights=be.asarray(w))
        t = be.update_rows(t, be.asarray(ids[:300]), be.asarray(g[seg[:300]]), **_make_fn(be.xp))  # plain form
        results.append(outs + [be.unshard(x) for x in t])
    r = [ref.create_table(values, placement), ref.create_table(np.full_like(values, 0.1), placement)]
    expected = [ref.gather_combine(r[0], ids, seg, segments, wt) for wt in (None, w)]
    r = ref.update_rows(r, ids, g, **_make_fn(ref.xp), grad_index=seg, grad_weights=w)
    r = ref.update_rows(r, ids[:300], g[seg[:300]], **_make_fn(ref.xp))
    expected += [ref.unshard(x) for x in r]
    for ffi_out, xla_out, want in zip(*results, expected):
        _close(ffi_out, want, dtype)
        _close(ffi_out, xla_out, dtype)


@needs_compiler
@pytest.mark.parametrize("index_dtype", [jnp.int32, jnp.int64])
def test_raw_kernels_bounds_and_index_dtypes(index_dtype):
    """Rows outside [0, m) read as zeros and are never written; segment ids outside
    [0, S) are dropped; int32 and int64 ids; the dedup gives ascending rows (first-occurrence
    order for shards too large for its bitmap)."""
    assert native.load()
    table = jnp.arange(5 * 3, dtype=jnp.float32).reshape(5, 3)
    idx = jnp.asarray([4, 5, 0, 7, 2], index_dtype)  # 5 and 7: not owned (m = 5)
    rows = jax.jit(native.gather_rows)(table, idx)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(table)[[4, 0, 0, 0, 2]] * np.array([1, 0, 1, 0, 1])[:, None])
    new = jax.jit(native.scatter_rows)(table, idx, -jnp.ones((5, 3), jnp.float32))
    want = np.asarray(table).copy()
    want[[4, 0, 2]] = -1
    np.testing.assert_array_equal(np.asarray(new), want)

    segs = jnp.asarray([0, 1, 1, 0, 9], jnp.int32)  # 9: dropped
    out = jax.jit(lambda t, i, s: native.gather_combine(t, i, s, jnp.zeros((1,), jnp.float32), 2, False))(
        table, idx, segs)
    tab = np.asarray(table)
    np.testing.assert_array_equal(np.asarray(out), np.stack([tab[4], tab[0]]))

    ids = jnp.asarray([3, 1, 3, 9, 1, 0], index_dtype)  # 9: not owned
    grads = jnp.asarray(np.arange(6 * 2, dtype=np.float32).reshape(6, 2))
    none = jnp.zeros((1,), jnp.int32)
    uniq, gs, count = jax.jit(lambda i, g: native.dedup_sum(i, g, none, none, 5, 4, False, False))(ids, grads)
    assert int(count) == 3 and uniq.dtype == index_dtype
    np.testing.assert_array_equal(np.asarray(uniq), [0, 1, 3, 5])  # ascending rows; unused slot: m
    gn = np.asarray(grads)
    np.testing.assert_array_equal(np.asarray(gs), [gn[5], gn[1] + gn[4], gn[0] + gn[2], [0, 0]])
    # a shard too large for the bitmap: hash dedup, first-occurrence order, same sums
    big = 1 << 28
    uniq, gs, count = jax.jit(lambda i, g: native.dedup_sum(i, g, none, none, big, 4, False, False))(ids, grads)
    assert int(count) == 4  # 9 is owned here
    np.testing.assert_array_equal(np.asarray(uniq), [3, 1, 9, 0])
    np.testing.assert_array_equal(np.asarray(gs), [gn[0] + gn[2], gn[1] + gn[4], gn[3], gn[5]])
    # overflow: capacity 2 < 3 unique rows -> every slot says "write nothing"
    uniq, _, count = jax.jit(lambda i, g: native.dedup_sum(i, g, none, none, 5, 2, False, False))(ids, grads)
    assert int(count) == 3
    np.testing.assert_array_equal(np.asarray(uniq), [5, 5])


@needs_compiler
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_all_finite_kernel_is_the_guard(dtype, bad):
    """The NaN/Inf guard's FFI kernel (``finite_guard`` on a CPU device): false as soon as
    one element of one array is NaN or ±Inf, wherever it sits (several arrays; one large
    enough for several parallel ranges); the largest finite values and subnormals pass."""
    from meshembed_jax.backend import JaxBackend

    assert native.load()
    big = np.full(1_000_003, np.finfo(dtype).max, dtype)
    big[::7] = np.finfo(dtype).smallest_subnormal
    small = np.arange(5, dtype=dtype)
    for where in (0, 999_999) if bad is not None else (None,):
        arrays = [small.copy(), big.copy()]
        if bad is not None:
            arrays[1][where] = bad
        got = jax.jit(lambda *xs: native.all_finite(list(xs)))(*arrays)
        assert bool(got) is (bad is None), (bad, where)
        be = JaxBackend()
        hlo = jax.jit(lambda *xs: native.all_finite(list(xs))).lower(*arrays).as_text()
        assert "meshembed_all_finite" in hlo
        assert bool(be.finite_guard(arrays)) is (bad is None)


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path):
    """No compiler: one RuntimeWarning naming the fix, then the pure-XLA kernels."""
    saved = dict(native._state)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path))
    native._state.clear()
    try:
        with pytest.warns(RuntimeWarning, match="MESHEMBED_JAX_CPU_KERNELS=0"):
            assert native.usable("cpu", np.float32) is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only once
            assert native.usable("cpu", np.float32) is False
        be = JaxBackend()
        t = be.create_table(np.ones((10, 2), np.float32), Placement(10, 1, "mod"))
        out = be.gather_combine(t, be.asarray(np.array([1, 2, 2])), be.asarray(np.array([0, 0, 1])), 2)
        np.testing.assert_array_equal(np.asarray(out), [[2, 2], [1, 1]])
    finally:
        native._state.clear()
        native._state.update(saved)


def test_other_platforms_and_dtypes_use_xla():
    assert native.usable("tpu", np.float32) is False
    assert native.usable("gpu", np.float32) is False
    assert native.usable("cpu", np.float16) is False


def test_huge_page_hint_keeps_the_table(monkeypatch):
    """Collapsing a CPU table's buffer to 2 MiB pages is a hint: values and updates are
    unchanged whether or not the kernel honours it."""
    from meshembed_jax import table as layout

    monkeypatch.setattr(layout, "HUGE_PAGE_MIN_BYTES", 1 << 21)
    be = me.get_backend("jax")
    values = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)  # 4 MiB
    t = be.create_table(values, Placement(4096, 1, "mod"))
    layout.collapse_to_huge_pages(t.data)  # again: idempotent
    np.testing.assert_array_equal(be.unshard(t), values)
    t = be.update_rows([t], be.asarray(np.array([5, 4000])), be.asarray(np.ones((2, 256), np.float32)),
                       _rule(lambda xp, w, g, slots, *, lr: (w - lr * g, slots)), values=(1.0,))[0]
    expected = values.copy()
    expected[[5, 4000]] -= 1
    np.testing.assert_array_equal(be.unshard(t), expected)


@needs_compiler
@pytest.mark.parametrize("descent", ["none", "first", "last", "middle"])
def test_gather_combine_takes_the_sorted_path_only_for_non_decreasing_segments(descent):
    """The pooled kernel reads segments by binary search when they never decrease (its test
    of the whole array is a vectorised pass): one descent anywhere, first or last pair
    included, must send it to the grouping path, with the reference's sums either way."""
    assert native.load()
    rng = np.random.default_rng(7)
    n, s, m = 4099, 600, 50
    table = rng.standard_normal((m, 8)).astype(np.float32)
    ids = rng.integers(0, m, n).astype(np.int32)
    segs = np.sort(rng.integers(0, s, n)).astype(np.int32)
    at = {"none": None, "first": 1, "last": n - 1, "middle": n // 2}[descent]
    if at is not None:
        segs[at] = segs[at - 1] - 1 if segs[at - 1] > 0 else segs[at - 1]
        segs[at - 1] = max(segs[at - 1], 1)
        segs[at] = segs[at - 1] - 1
    assert (np.diff(segs) >= 0).all() == (at is None)
    want = np.zeros((s, 8), np.float64)
    for i, g in zip(ids, segs):  # batch order, in float32 as the kernel
        want[g] = np.float32(want[g] + table[i])
    out = jax.jit(lambda t, i, g: native.gather_combine(t, i, g, jnp.zeros((1,), jnp.float32), s, False))(
        jnp.asarray(table), jnp.asarray(ids), jnp.asarray(segs))
    np.testing.assert_array_equal(np.asarray(out), want.astype(np.float32))
