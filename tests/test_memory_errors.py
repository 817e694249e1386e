"""Issue #31 item 11: an allocation whose size the user controls (a table, a batch's activations
or gradients, a table's update, a host copy, a dense optimizer's slots) that fails or cannot fit
is a ``meshembed.ResourceError`` — still a ``MemoryError`` — naming what, the bytes and the fix,
and nothing was changed.

Real failures, cheaply: sizes no process can address fail before any allocation; a moderate
allocation fails for real in a subprocess under ``RLIMIT_AS`` (the pytest process's limits are
never touched). There, 2 GiB of untouched address space (no RAM) is reserved first, so the limit
stays above each single allocation and the allocator itself fails, not meshembed's size check.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import meshembed as me
from meshembed.backend import memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Rows of the subprocess's arrays: a 256 MiB table / activation, a 16 MiB non-lazy table, a 16 MiB variable.
WIDE, DENSE, X = 2**20, 2**16, 2**22


def _refused(info: pytest.ExceptionInfo, *names: str) -> str:
    assert isinstance(info.value, MemoryError) and isinstance(info.value, me.MeshembedError)
    msg = str(info.value)
    for name in names:
        assert name in msg, (name, msg)
    assert "Fix:" in msg
    return msg


# ----------------------------------------------------------------------------- in this process
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_table_no_process_can_address_is_refused_before_allocating(backend):
    pytest.importorskip(backend)
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("huge", 2**40, 2**30, optimizer=me.embedding.Adagrad(0.1))],
                             features=[me.FeatureConfig("huge", (2,), name="f")])
    with pytest.raises(me.ResourceError) as info:
        me.TPUEmbedding(cfg, backend=backend, num_shards=1)
    _refused(info, "table 'huge'", f"{2 * 4 * 2**70:,} bytes", "(1099511627776, 1073741824)", "float32",
             "exceeds the largest array size this process can address", "No engine was created", "num_shards")


def test_batch_whose_activation_overflows_is_refused_at_enqueue():
    shape = (2**31 - 1,) * 3  # prod(shape) overflows int64; a valid config all the same
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 8, 4, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", shape, name="wide")])
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=1)
    before = emb.retrieve_parameters("t")["parameters"]
    ids = me.SparseIds(np.array([[0, 0, 0, 0]]), np.array([3]), np.array(list(shape) + [1]))
    with pytest.raises(me.ResourceError) as info:
        emb.enqueue([ids], training=True)
    n = (2**31 - 1) ** 3 * 4 * 4
    _refused(info, "activations of feature 'wide' (table 't')", f"{n:,} bytes", "Nothing was enqueued", "smaller batch")
    assert emb.pending is None and emb.step == 0
    np.testing.assert_array_equal(emb.retrieve_parameters("t")["parameters"], before)


def test_numpys_array_is_too_big_is_mapped():
    with pytest.raises(me.ResourceError) as info:
        with memory.allocating("the test's buffer", (8,)):
            np.empty(2**62, np.float32)  # NumPy: ValueError "array is too big"
    msg = _refused(info, "the test's buffer", "32 bytes", "array is too big")
    assert isinstance(info.value.__cause__, ValueError), msg


def test_other_errors_pass_through_unchanged():
    for exc in (ValueError("not a size"), RuntimeError("a kernel failed"), KeyError("k")):
        with pytest.raises(type(exc)) as info:
            with memory.allocating("x", (1,)):
                raise exc
        assert info.value is exc
    inner = me.ResourceError("inner")
    with pytest.raises(me.ResourceError) as info:
        with memory.allocating("outer", (1,)):
            raise inner
    assert info.value is inner


def test_torch_allocator_failure_is_mapped():
    torch = pytest.importorskip("torch")
    with pytest.raises(me.ResourceError) as info:
        with memory.allocating("a torch buffer", (2**46,), "uint8"):
            torch.empty(2**46, dtype=torch.uint8)  # 64 TiB: refused by the allocator at once
    _refused(info, "a torch buffer", f"{2**46:,} bytes", "RuntimeError")


# ------------------------------------------------------------------- real failures, RLIMIT_AS
_SCRIPT = r'''
import json, resource, sys, warnings
import numpy as np
import meshembed as me

backend = sys.argv[1]
MiB = 2**20
WIDE, DENSE, X = json.loads(sys.argv[2])  # rows of the 256 MiB table / activations, the non-lazy table, x
ballast = np.empty(2**31, np.uint8)  # address space only (never touched): the limit stays above each allocation


def vm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))


def attempt(name, fn, headroom):
    resource.setrlimit(resource.RLIMIT_AS, (vm() + headroom, resource.RLIM_INFINITY))
    try:
        fn()
        out[name] = None
    except BaseException as e:
        out[name] = [type(e).__name__, isinstance(e, MemoryError), str(e)]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def tables(emb):
    return {t: [a.copy() for a in emb.retrieve_parameters(t).values()] for t in emb.table_names}


def same(a, b):
    return all(np.array_equal(x, y) for t in a for x, y in zip(a[t], b[t]))


warnings.simplefilter("ignore")
out = {}
warm = me.EmbeddingConfig(tables=[me.TableConfig("w", 4, 2, optimizer=me.embedding.SGD(0.1))],
                          features=[me.FeatureConfig("w", (1,), name="w")])
me.TPUEmbedding(warm, backend=backend, num_shards=1).retrieve_parameters("w")  # the framework's libraries loaded
# a table of 1 GiB
cfg = me.EmbeddingConfig(tables=[me.TableConfig("big", WIDE, 64, optimizer=me.embedding.SGD(0.1))],
                         features=[me.FeatureConfig("big", (2,), name="f")])
attempt("table", lambda: me.TPUEmbedding(cfg, backend=backend, num_shards=1), 64 * MiB)

# activations and a zero gradient of 1 GiB (a wide feature, three ids)
cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 16, 64, optimizer=me.embedding.SGD(0.1))],
                         features=[me.FeatureConfig("t", (WIDE,), name="wide")])
emb = me.TPUEmbedding(cfg, backend=backend, num_shards=1)
emb.enqueue([me.SparseIds(np.array([[0, 0], [5, 0], [WIDE - 1, 0]]), np.array([1, 2, 3]), np.array([WIDE, 1]))],
            training=True)
before = tables(emb)
attempt("lookup", emb.dequeue, 64 * MiB)
out["lookup_kept"] = emb.pending is not None and same(before, tables(emb))
out["lookup_after"] = list(emb.dequeue()[0].shape)  # the same pending batch, memory back
attempt("zero_gradient", lambda: emb.apply_gradients([None]), 64 * MiB)
out["gradient_kept"] = emb.pending is not None and emb.step == 0 and same(before, tables(emb))
emb.apply_gradients([None])
out["gradient_after"] = emb.step

# a non-lazy Adam table's update (every row: 4 x 16 MiB) beside a small table
cfg = me.EmbeddingConfig(
    tables=[me.TableConfig("small", 32, 8, optimizer=me.embedding.SGD(0.5)),
            me.TableConfig("dense", DENSE, 64, optimizer=me.embedding.Adam(0.1, lazy_adam=False))],
    features=[me.FeatureConfig("small", (2,), name="s"), me.FeatureConfig("dense", (4,), name="d")])
emb = me.TPUEmbedding(cfg, backend=backend, num_shards=1)
emb.enqueue([np.array([1, 2]), np.array([0, 1, 2, 3])], training=True)
acts = emb.dequeue()
grads = [np.ones((2, 8), np.float32), np.ones((4, 64), np.float32)]
before = tables(emb)
attempt("update", lambda: emb.apply_gradients(grads), 8 * MiB)
out["update_kept"] = emb.pending is not None and emb.step == 0 and same(before, tables(emb))
emb.apply_gradients(grads)
out["update_after"] = emb.step
attempt("retrieve", lambda: emb.retrieve_parameters("dense"), 8 * MiB)
before, values = tables(emb), np.full((DENSE, 64), 0.5)  # float64: loading makes a float32 copy
attempt("load", lambda: emb.load_parameters("dense", values), 8 * MiB)
out["load_kept"] = same(before, tables(emb))

# the dense Adadelta's slots: those of a small variable are made, then one of a 16 MiB one fails
def variables():
    return [me.Variable(np.full(256, 0.5, np.float32), name="small", backend=backend),
            me.Variable(np.full(X, 0.5, np.float32), name="x", backend=backend)]


be = me.get_backend(backend)  # gradients on the backend already: no copy to fail first
grads = [be.asarray(np.full(256, 0.25, np.float32)), be.asarray(np.full(X, 0.25, np.float32))]
vs, opt = variables(), me.optimizers.Adadelta(learning_rate=1.0)
attempt("slots", lambda: opt.apply_gradients(list(zip(grads, vs))), 8 * MiB)
out["slots_kept"] = (not opt.built and len(opt.variables) == 1 and int(opt.iterations.numpy()) == 0
                     and all(bool(np.all(np.asarray(v.numpy()) == 0.5)) for v in vs))
opt.apply_gradients(list(zip(grads, vs)))
fresh = variables()
me.optimizers.Adadelta(learning_rate=1.0).apply_gradients(list(zip(grads, fresh)))
out["slots_after"] = [len(opt.variables), all(bool(np.array_equal(np.asarray(v.numpy()), np.asarray(w.numpy())))
                                              for v, w in zip(vs, fresh))]
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module", params=["numpy", "torch"])
def limited_run(request):
    """The script's results for one backend (one subprocess per backend: the imports dominate)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS and /proc/self/status are Linux's")
    pytest.importorskip(request.param)
    # glibc maps every block >= 128 KiB on its own and unmaps it when freed (no dynamic threshold
    # keeping freed memory mapped), so the headroom under the limit is what the next allocation gets
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    sizes = json.dumps([WIDE, DENSE, X])
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), request.param, sizes], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-4000:]
    return request.param, json.loads(lines[-1][len("RESULT"):])


def _failed(result, *names: str) -> str:
    assert result is not None, "the allocation did not fail under the limit"
    kind, is_memory_error, msg = result
    assert kind == "ResourceError" and is_memory_error, msg
    assert "that allocation failed" in msg, msg  # the allocator failed, not the size check
    for name in names:
        assert name in msg, (name, msg)
    assert "Fix:" in msg
    return msg


def test_table_allocation_failure(limited_run):
    backend, out = limited_run
    _failed(out["table"], "table 'big'", f"backend '{backend}'", f"{WIDE * 64 * 4:,} bytes", f"({WIDE}, 64)",
            "No engine was created")


def test_lookup_and_zero_gradient_failures_change_nothing(limited_run):
    _, out = limited_run
    _failed(out["lookup"], "activations of feature 'wide' (table 't')", f"{WIDE * 64 * 4:,} bytes", "smaller batch")
    assert out["lookup_kept"] and out["lookup_after"] == [WIDE, 64]
    _failed(out["zero_gradient"], "zero gradient of feature 'wide'", f"{WIDE * 64 * 4:,} bytes")
    assert out["gradient_kept"] and out["gradient_after"] == 1


def test_table_update_failure_changes_no_table(limited_run):
    _, out = limited_run
    msg = _failed(out["update"], "update of table 'dense'", f"{4 * DENSE * 64 * 4:,} bytes",
                  "The tables, slots and the pending batch are unchanged")
    assert "'small'" not in msg
    assert out["update_kept"] and out["update_after"] == 1


def test_host_copy_failure(limited_run):
    _, out = limited_run
    _failed(out["retrieve"], "host copy of table 'dense'", f"{DENSE * 64 * 4:,} bytes", "shard_id")


def test_load_failure_loads_nothing(limited_run):
    _, out = limited_run
    _failed(out["load"], "float32 copy of `parameters` for table 'dense'", f"{DENSE * 64 * 4:,} bytes",
            "Nothing was loaded")
    assert out["load_kept"]


def test_dense_adadelta_slot_failure_leaves_the_optimizer_unbuilt(limited_run):
    backend, out = limited_run
    _failed(out["slots"], "optimizer slot 'accumulated_", "/x' of 'Adadelta'", f"backend '{backend}'",
            f"{X * 4:,} bytes", f"({X},)", "float32", "The optimizer is unchanged")
    assert out["slots_kept"]  # the small variable's slots, made first, are gone too
    assert out["slots_after"] == [5, True]  # built once, then the same step as a fresh optimizer's


def test_no_limit_was_changed_here():
    assert resource.getrlimit(resource.RLIMIT_AS) == _LIMITS


_LIMITS = resource.getrlimit(resource.RLIMIT_AS)


_IMPORTS_SCRIPT = """
import sys, numpy as np, meshembed as me
cfg = me.EmbeddingConfig(tables=[me.TableConfig("d", 64, 4, optimizer=me.embedding.Adam(0.1, lazy_adam=False))],
                         features=[me.FeatureConfig("d", (4,), name="f")])
emb = me.TPUEmbedding(cfg, backend=sys.argv[1], num_shards=1)
emb.enqueue([np.array([1, 2, 3, 4])])
emb.dequeue()
grads = [emb.backend.asarray(np.ones((4, 4), np.float32))]
before = set(sys.modules)
emb.apply_gradients(grads)
print("NEW", sorted(set(sys.modules) - before))
"""


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_non_lazy_update_imports_nothing(backend):
    """An import in the middle of an update maps shared objects: short of memory it fails as an
    ImportError, not the update's ResourceError (the limited run above). The every-row padding
    of a non-lazy optimizer once imported NumPy's Array API wrapper for the host ids there on
    torch. A fresh interpreter, so that no earlier test has made the imports already."""
    pytest.importorskip(backend)
    run = subprocess.run([sys.executable, "-c", _IMPORTS_SCRIPT, backend], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("NEW")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-2000:]
    assert lines[-1] == "NEW []", lines[-1]
