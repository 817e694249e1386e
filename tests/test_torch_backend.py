"""Torch backend, single process: protocol-level parity with the NumPy reference backend.

Row i of a test table holds i (+ column/1000) so a misplaced row is obvious.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch (pip install 'meshembed[torch]')")

import meshembed as me  # noqa: E402
from meshembed.errors import InputError  # noqa: E402
from meshembed.math import AdagradSlots, adagrad  # noqa: E402
from meshembed.sharding import Placement  # noqa: E402
from meshembed_numpy import NumpyBackend  # noqa: E402
from meshembed_torch import TorchBackend, TorchShardedTable  # noqa: E402
from meshembed_torch import kernels  # noqa: E402

SHARDINGS = [(v, n, s) for v, n in [(13, 1), (13, 2), (13, 3), (16, 8), (10, 3), (37, 8)] for s in ("mod", "div")]
DTYPES = ["float32", "float64"]
TOL = {"float32": 2e-6, "float64": 1e-13}


@pytest.fixture(scope="module")
def tb() -> TorchBackend:
    return TorchBackend(device="cpu")


@pytest.fixture(scope="module")
def nb() -> NumpyBackend:
    return NumpyBackend()


def _table(vocab: int, dim: int, dtype: str) -> np.ndarray:
    return (np.arange(vocab)[:, None] + np.arange(dim)[None, :] / 1000.0).astype(dtype)


def _optimizer_rule(name: str):
    """(UpdateRule, values, slot initial values): the core's rule, as the engine builds it."""
    from meshembed.math import UpdateRule, get_math

    if name == "adagrad":
        return UpdateRule(get_math("adagrad"), ("accumulators",)), (0.1,), (0.1,)
    return (UpdateRule(get_math("adadelta"), ("accumulators", "updates"), static=(("epsilon", 1e-6), ("rho", 0.9))),
            (0.5,), (0.05, 0.02))


def test_registered_and_available():
    assert "torch" in me.available_backends()
    b = me.get_backend("torch")
    assert isinstance(b, TorchBackend)
    caps = b.capabilities
    assert caps.autodiff and caps.distributed and caps.float64 and caps.in_place


def test_imports_and_reports_without_torch():
    """With torch unimportable the package still imports; discovery omits the backend."""
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:  # `import torch` raises ImportError, as where torch is not installed
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"No module named {name!r}")

        # (a meta-path finder, not sys.modules["torch"] = None: array-api-compat reads that
        # None as the torch module when it classifies arrays)
        sys.meta_path.insert(0, NoTorch())
        import meshembed as me
        from meshembed_torch import TorchBackend
        from meshembed_torch.dense import TorchDenseMixin  # torch is imported lazily there too
        assert TorchDenseMixin in TorchBackend.__mro__
        reason = TorchBackend.unavailable_reason()
        assert reason and "torch is not installed" in reason, reason
        assert "torch" not in me.available_backends()
        try:
            me.get_backend("torch")
        except me.BackendUnavailableError as exc:
            assert "torch" in str(exc)
        else:
            raise AssertionError("expected BackendUnavailableError")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_and_shard_views(tb, vocab, shards, strategy, dtype):
    values = _table(vocab, 4, dtype)
    p = Placement(vocab, shards, strategy)
    table = tb.create_table(values, p)
    assert isinstance(table, TorchShardedTable) and table.shape == (vocab, 4)
    assert table.dtype == getattr(torch, dtype)
    out = tb.unshard(table)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, values)
    for s, view in table.shards.items():  # each logical shard holds exactly Placement's rows
        np.testing.assert_array_equal(view.numpy(), values[p.global_ids(s)])
    out[0, 0] = -1.0  # unshard returns a copy
    assert tb.unshard(table)[0, 0] == values[0, 0]


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_match_numpy(tb, nb, vocab, shards, strategy, dtype):
    values = _table(vocab, 3, dtype)
    p = Placement(vocab, shards, strategy)
    t, n = tb.create_table(values, p), nb.create_table(values, p)
    ids = np.array([vocab - 1, 0, 2, 2, vocab - 1, 1, vocab // 2], dtype=np.int64)
    np.testing.assert_array_equal(tb.to_numpy(tb.gather(t, tb.asarray(ids))), nb.gather(n, ids))
    uids = np.array([vocab - 1, 0, vocab // 2], dtype=np.int64)
    rows = -np.arange(9, dtype=dtype).reshape(3, 3)
    tb.scatter(t, tb.asarray(uids), tb.asarray(rows))
    nb.scatter(n, uids, rows)
    np.testing.assert_array_equal(tb.unshard(t), nb.unshard(n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,high", [(0, 5), (1, 5), (200, 20), (5000, 100_000)])
def test_segment_sum_matches_numpy_bitwise(tb, nb, dtype, n, high):
    """Stable sort + embedding_bag adds each group in input order, as np.add.at does."""
    rng = np.random.default_rng(n)
    ids = rng.integers(0, high, size=n)
    vals = rng.standard_normal((n, 5)).astype(dtype)
    u, s = tb.segment_sum(tb.asarray(ids), tb.asarray(vals))
    eu, es = nb.segment_sum(ids, vals)
    np.testing.assert_array_equal(tb.to_numpy(u), eu)
    assert tb.to_numpy(s).dtype == np.dtype(dtype)
    np.testing.assert_allclose(tb.to_numpy(s), es, rtol=TOL[dtype], atol=TOL[dtype])


def test_segment_sum_integer_and_3d_values(tb, nb):
    ids = np.array([3, 1, 3, 0, 1], dtype=np.int64)
    ivals = np.arange(10, dtype=np.int64).reshape(5, 2)
    u, s = tb.segment_sum(tb.asarray(ids), tb.asarray(ivals))
    np.testing.assert_array_equal(tb.to_numpy(s), nb.segment_sum(ids, ivals)[1])
    fvals = np.arange(30, dtype=np.float32).reshape(5, 3, 2)
    u, s = tb.segment_sum(tb.asarray(ids), tb.asarray(fvals))
    assert tuple(s.shape) == (3, 3, 2)
    np.testing.assert_array_equal(tb.to_numpy(s), nb.segment_sum(ids, fvals)[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sorted_ids", [True, False])
def test_segment_sum_to_matches_numpy(tb, nb, dtype, sorted_ids):
    rng = np.random.default_rng(3)
    seg = rng.integers(0, 7, size=60)
    if sorted_ids:
        seg = np.sort(seg)
    vals = rng.standard_normal((60, 4)).astype(dtype)
    out = tb.segment_sum_to(tb.asarray(vals), tb.asarray(seg), 9)  # segments 7, 8 stay empty
    np.testing.assert_allclose(tb.to_numpy(out), nb.segment_sum_to(vals, seg, 9), rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.raises(IndexError):
        tb.segment_sum_to(tb.asarray(vals), tb.asarray(seg), 5)


@pytest.mark.parametrize("vocab,shards,strategy", SHARDINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", ["adagrad", "adadelta"])
def test_update_rows_matches_numpy(tb, nb, vocab, shards, strategy, dtype, opt):
    rng = np.random.default_rng(vocab * shards)
    p = Placement(vocab, shards, strategy)
    values = _table(vocab, 4, dtype)
    rule, hv, inits = _optimizer_rule(opt)
    ts = [tb.create_table(values, p)] + [tb.create_table(np.full_like(values, v), p) for v in inits]
    ns = [nb.create_table(values, p)] + [nb.create_table(np.full_like(values, v), p) for v in inits]
    for _ in range(3):
        ids = rng.integers(0, vocab, size=2 * vocab)
        grads = rng.standard_normal((ids.size, 4)).astype(dtype)
        ts = tb.update_rows(ts, tb.asarray(ids), tb.asarray(grads), rule, values=hv)
        ns = nb.update_rows(ns, ids, grads, rule, values=hv)
    for a, b in zip(ts, ns):
        np.testing.assert_allclose(tb.unshard(a), nb.unshard(b), rtol=TOL[dtype], atol=TOL[dtype])


def test_update_rows_from_sample_gradients(tb, nb):
    """``grad_index``/``grad_weights`` equal expanding the per-sample gradients first."""
    rng = np.random.default_rng(7)
    p = Placement(50, 3, "mod")
    values = _table(50, 4, "float32")
    rule, hv, inits = _optimizer_rule("adagrad")
    ts = [tb.create_table(values, p), tb.create_table(np.full_like(values, inits[0]), p)]
    ns = [nb.create_table(values, p), nb.create_table(np.full_like(values, inits[0]), p)]
    ids = rng.integers(0, 50, size=40)
    sample = np.repeat(np.arange(10), 4)
    w = rng.uniform(0.1, 1.0, size=40).astype(np.float32)
    g = rng.standard_normal((10, 4)).astype(np.float32)
    tb.update_rows(ts, tb.asarray(ids), tb.asarray(g), rule, values=hv, grad_index=tb.asarray(sample),
                   grad_weights=tb.asarray(w))
    nb.update_rows(ns, ids, g[sample] * w[:, None], rule, values=hv)
    for a, b in zip(ts, ns):
        np.testing.assert_allclose(tb.unshard(a), nb.unshard(b), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_gather_combine_equals_gather_then_segment_sum(tb, strategy):
    rng = np.random.default_rng(11)
    values = rng.standard_normal((40, 6)).astype(np.float32)
    t = tb.create_table(values, Placement(40, 3, strategy))
    ids = rng.integers(0, 40, size=30)
    seg = np.sort(rng.integers(0, 12, size=30))
    w = rng.uniform(size=30).astype(np.float32)
    out = tb.gather_combine(t, tb.asarray(ids), tb.asarray(seg), 12, weights=tb.asarray(w))
    expected = np.zeros((12, 6), np.float32)
    np.add.at(expected, seg, values[ids] * w[:, None])
    np.testing.assert_allclose(tb.to_numpy(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seg", [[0, 0, 2, 2, 2, 5], [1, 1, 3], [3, 1, 1, 4, 0, 0], [5]])
def test_sorted_offsets_and_gather_combine_with_gaps_and_unsorted_segments(tb, seg):
    """One ``unique_consecutive`` pass gives the bag offsets of sorted segment ids (empty
    segments included) and says None for unsorted ones, which gather_combine then sorts."""
    from meshembed_torch import kernels

    seg = np.array(seg)
    sorted_ok = bool(np.all(np.diff(seg) >= 0))
    offsets = kernels.sorted_offsets(torch.from_numpy(seg), 6)
    if sorted_ok:
        np.testing.assert_array_equal(offsets.numpy(), np.searchsorted(seg, np.arange(6)))
    else:
        assert offsets is None
    rng = np.random.default_rng(len(seg))
    values = rng.standard_normal((9, 3)).astype(np.float32)
    t = tb.create_table(values, Placement(9, 2, "mod"))
    ids = rng.integers(0, 9, size=seg.size)
    w = rng.uniform(size=seg.size).astype(np.float32)
    expected = np.zeros((6, 3), np.float32)
    np.add.at(expected, seg, values[ids] * w[:, None])
    out = tb.gather_combine(t, tb.asarray(ids), tb.asarray(seg), 6, weights=tb.asarray(w))
    np.testing.assert_allclose(tb.to_numpy(out), expected, rtol=1e-5, atol=1e-6)
    n = int(seg.max())  # one segment too few: the largest id is out of range
    with pytest.raises(InputError, match=rf"\[0, {n}\)"):
        tb.gather_combine(t, tb.asarray(ids), tb.asarray(seg), n)
    with pytest.raises(IndexError, match=rf"\[0, {n}\)"):
        tb.segment_sum_to(tb.asarray(values[ids]), tb.asarray(seg), n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_malloc_tuning_once_per_process_and_opt_out():
    """A large CPU table tunes glibc's thresholds once; MESHEMBED_TORCH_MALLOC_TUNING=0 opts out."""
    import platform

    code = ("import numpy as np; from meshembed_torch import TorchBackend, kernels; "
            "from meshembed.sharding import Placement; "
            "assert kernels._malloc_state == []; "
            "TorchBackend().create_table(np.zeros((1 << 18, 32), np.float32), Placement(1 << 18, 1, 'div')); "
            "print(kernels._malloc_state)")
    for env, expected in (("1", platform.libc_ver()[0] == "glibc"), ("0", False)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MESHEMBED_TORCH_MALLOC_TUNING": env})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"[{expected}]", out.stdout


def test_update_rows_touched_with_zero_gradient_still_updates(tb):
    """Lazy but 'touched means looked up': a zero net gradient still runs the rule on the row
    (here SGD whose weight clip [1, inf) moves every row it runs on to 1)."""
    from meshembed.math import UpdateRule, get_math

    p = Placement(6, 2, "mod")
    t = tb.create_table(np.zeros((6, 2), np.float32), p)
    ids = np.array([4, 4], dtype=np.int64)
    grads = np.array([[1.0, -2.0], [-1.0, 2.0]], dtype=np.float32)
    rule = UpdateRule(get_math("stochastic_gradient_descent"), (), weight_clip=(1.0, np.inf))
    tb.update_rows([t], tb.asarray(ids), tb.asarray(grads), rule, values=(0.1,))
    expected = np.zeros((6, 2), np.float32)
    expected[4] = 1.0
    np.testing.assert_array_equal(tb.unshard(t), expected)


def test_out_of_range_ids_raise(tb):
    from meshembed.math import UpdateRule, get_math

    sgd = UpdateRule(get_math("stochastic_gradient_descent"), ())
    t = tb.create_table(_table(10, 2, "float32"), Placement(10, 3, "mod"))
    for bad in ([10], [-1]):
        with pytest.raises(InputError, match=r"\[0, 10\)"):
            tb.gather(t, tb.asarray(np.array(bad)))
        with pytest.raises(InputError):
            tb.update_rows([t], tb.asarray(np.array(bad)), tb.asarray(np.ones((1, 2), np.float32)), sgd,
                           values=(0.1,))
    with pytest.raises(InputError, match="integer"):
        tb.gather(t, tb.asarray(np.array([1.0])))


def test_asarray_passes_tensors_through_and_detaches(tb):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tb.asarray(x) is x
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    loss.backward()
    g = tb.asarray(w.grad)
    assert g.data_ptr() == w.grad.data_ptr()
    y = tb.asarray(w)  # a parameter: detached, same storage, no copy
    assert not y.requires_grad and y.data_ptr() == w.data_ptr()
    assert tb.asarray(x, dtype="float64").dtype == torch.float64
    assert tb.asarray(x, dtype=np.float32) is x


def test_asarray_numpy_python_and_readonly(tb):
    a = np.arange(4, dtype=np.float32)
    t = tb.asarray(a)
    assert t.data_ptr() == a.ctypes.data  # shared, not copied
    ro = np.arange(3.0)
    ro.flags.writeable = False
    assert tb.asarray(ro).dtype == torch.float64
    assert tb.asarray([1, 2], dtype="int64").dtype == torch.int64
    assert tb.asarray(1.5).dtype == torch.float64  # NumPy's promotion, as the reference backend
    assert tb.asarray(a[::-1]).tolist() == [3.0, 2.0, 1.0, 0.0]
    be = np.arange(3, dtype=">f4")
    assert tb.asarray(be).tolist() == [0.0, 1.0, 2.0]
    assert tb.to_numpy(tb.asarray(np.float32(2.0))).dtype == np.float32


def test_to_numpy_and_is_native(tb):
    x = torch.ones(2, requires_grad=True) * 3
    out = tb.to_numpy(x)
    assert isinstance(out, np.ndarray) and out.tolist() == [3.0, 3.0]
    assert tb.is_native(x) and not tb.is_native(np.ones(2))
    assert tb.to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype == np.float32


def test_xp_runs_core_math(tb):
    xp = tb.xp
    p = torch.ones(3)
    new_p, slots = adagrad(xp, p, torch.full((3,), 2.0), AdagradSlots(torch.zeros(3)), lr=0.5)
    np.testing.assert_allclose(new_p.numpy(), 1 - 0.5 * 2 / 2)


def test_kernels_rowmap_matches_placement():
    for vocab, n, strategy in SHARDINGS:
        p = Placement(vocab, n, strategy)
        rm = kernels.RowMap(vocab, n, strategy, tuple(range(n)), torch.device("cpu"))
        ids = torch.arange(vocab)
        np.testing.assert_array_equal(rm.owner(ids).numpy(), p.owner(np.arange(vocab)))
        # storage row = offset of the owning shard + local row
        starts = np.cumsum([0] + list(p.shard_sizes))[:-1]
        expected = starts[p.owner(np.arange(vocab))] + p.local_row(np.arange(vocab))
        np.testing.assert_array_equal(rm.local_index(ids).numpy(), expected)


def test_compile_policy(tb):
    """Small inputs stay eager (no compile cost); an invalid mode is rejected."""
    calls = []

    def f(x):
        calls.append(1)
        return x * 2 + 1

    g = tb.compile(f)
    assert g.__wrapped__ is f
    np.testing.assert_array_equal(g(torch.ones(3)).numpy(), [3.0, 3.0, 3.0])
    assert calls  # ran eagerly (a compiled graph would not call back into Python)
    assert tb._compiled_updates == {}  # the small update_rows tests above never compiled anything
    assert TorchBackend(compile=False)._compile_mode == "never"
    with pytest.raises(ValueError, match="compile"):
        TorchBackend(compile="sometimes")


def test_compiled_update_rows_matches_numpy(nb, monkeypatch):
    """The torch.compile'd gather → fn → scatter gives the eager/NumPy numbers."""
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", "0")  # the compiled path, not the registered kernels
    tc = TorchBackend(device="cpu", compile="always")
    p = Placement(64, 3, "mod")
    values = _table(64, 8, "float32")
    rng = np.random.default_rng(2)
    for opt in ("adagrad", "adadelta"):
        rule, hv, inits = _optimizer_rule(opt)
        ts = [tc.create_table(values, p)] + [tc.create_table(np.full_like(values, v), p) for v in inits]
        ns = [nb.create_table(values, p)] + [nb.create_table(np.full_like(values, v), p) for v in inits]
        for size in (50, 37):  # a second shape reuses the dynamic-shape kernel
            ids = rng.integers(0, 64, size=size)
            grads = rng.standard_normal((size, 8)).astype(np.float32)
            tc.update_rows(ts, tc.asarray(ids), tc.asarray(grads), rule, values=hv)
            nb.update_rows(ns, ids, grads, rule, values=hv)
        for a, b in zip(ts, ns):
            np.testing.assert_allclose(tc.unshard(a), nb.unshard(b), rtol=1e-5, atol=1e-6)
    assert len(tc._compiled_updates) == 2 and not tc._compile_broken


def test_compiled_update_rows_exact_when_learning_rate_changes(nb):
    """Regression: with dynamo's symbolic floats the compiled FTRL drifted once lr changed;
    the rule's lr is a tensor input, so every value runs the one compiled kernel, exactly."""
    from meshembed.math import UpdateRule, get_math

    tc = TorchBackend(device="cpu", compile="always")
    hp = dict(l1=0.01, l2=0.02, lr_power=-0.5, multiply_linear_by_lr=True, beta=0.0, allow_zero_accumulator=False)
    rule = UpdateRule(get_math("ftrl"), ("accumulators", "linears"), static=tuple(sorted(hp.items())))

    p = Placement(40, 2, "div")
    values = _table(40, 3, "float32")
    ts = [tc.create_table(values, p), tc.create_table(np.full_like(values, 0.1), p), tc.create_table(np.zeros_like(values), p)]
    ns = [nb.create_table(values, p), nb.create_table(np.full_like(values, 0.1), p), nb.create_table(np.zeros_like(values), p)]
    rng = np.random.default_rng(4)
    for lr in (0.5, 0.1, 0.3, 0.2, 0.7):
        ids = rng.integers(0, 40, size=30)
        grads = rng.standard_normal((30, 3)).astype(np.float32)
        tc.update_rows(ts, tc.asarray(ids), tc.asarray(grads), rule, values=(lr,))
        nb.update_rows(ns, ids, grads, rule, values=(lr,))
        for a, b in zip(ts, ns):
            np.testing.assert_allclose(tc.unshard(a), nb.unshard(b), rtol=1e-5, atol=1e-6, err_msg=f"lr={lr}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tables_match_cpu():
    cuda, cpu = TorchBackend(device="cuda"), TorchBackend(device="cpu")
    p = Placement(33, 4, "mod")
    values = _table(33, 8, "float32")
    rule, hv, inits = _optimizer_rule("adagrad")
    tc = [cuda.create_table(values, p), cuda.create_table(np.full_like(values, inits[0]), p)]
    th = [cpu.create_table(values, p), cpu.create_table(np.full_like(values, inits[0]), p)]
    ids = np.random.default_rng(0).integers(0, 33, 100)
    g = np.random.default_rng(1).standard_normal((100, 8)).astype(np.float32)
    assert tc[0].device.type == "cuda"
    cuda.update_rows(tc, cuda.asarray(ids), cuda.asarray(g), rule, values=hv)
    cpu.update_rows(th, cpu.asarray(ids), cpu.asarray(g), rule, values=hv)
    for a, b in zip(tc, th):
        np.testing.assert_allclose(cuda.unshard(a), cpu.unshard(b), rtol=1e-5, atol=1e-6)


def test_capabilities_are_made_once_per_state_they_depend_on():
    """The dense optimizer asks for ``capabilities`` once per variable: the same object comes
    back while nothing it depends on changes, and a switch it reads (``fused``) still counts."""
    from meshembed_torch import TorchBackend

    be = TorchBackend(device="cpu")
    caps = be.capabilities
    assert be.capabilities is caps and caps.generated_kernels == be.fused
    be.fused = not be.fused
    assert be.capabilities.generated_kernels is be.fused and be.capabilities is not caps
    be.fused = not be.fused
    assert be.capabilities is caps
