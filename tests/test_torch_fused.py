"""What only the torch backend's fused CPU updates (``meshembed_torch/native.py``, driving
generated row kernels) have: the fallback when the driver cannot be built, the driver's own
refusal of a bad gradient index, and the selection of a kernel (a plain callable, mixed dtypes
and a wrong value count take the core function). Everything both backends' fused kernels do —
equal to NumPy bit for bit, on every optimizer, dtype and option, through the engine, update_rows
and the dense optimizer — is the conformance module conformance/test_fused_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install 'meshembed[torch]'")

import meshembed as me  # noqa: E402
from conformance.kernel_cases import IDS, RULES, train  # noqa: E402
from meshembed_torch import native  # noqa: E402


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_fused_state", {})
    with pytest.warns(RuntimeWarning, match="fused CPU updates are unavailable"):
        fused = train("torch", "adagrad", "sum", 1, 8, steps=2)
    reference = train("numpy", "adagrad", "sum", 1, 8, steps=2)
    np.testing.assert_allclose(fused["parameters"], reference["parameters"], rtol=2e-6, atol=1e-7)


def _adagrad_table():
    """A torch engine's 50 x 8 Adagrad table: (backend, its arrays, its rule, copies of them)."""
    from meshembed.embedding.updates import make_rule

    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 50, 8, optimizer=me.embedding.Adagrad(learning_rate=0.1))],
                             features=[me.FeatureConfig("t", (4,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="torch")
    state = emb.state.tables[0]
    return emb.backend, state, make_rule(emb.layout.tables[0]), [t.data.clone() for t in state]


def test_bad_gradient_index_raises_and_changes_nothing():
    """Called directly (the engine builds valid indices itself), an index outside the
    gradient rows is an InputError raised before anything is written."""
    be, state, fn, before = _adagrad_table()
    ids, grads = torch.tensor([1, 2, 2, 7]), torch.ones(3, 8)
    calls = be.stats().get("fused_updates", 0)
    be.update_rows(state, ids, grads, fn, values=(0.1,), grad_index=torch.tensor([0, 1, 2, 2]))
    assert be.stats().get("fused_updates", 0) == calls + 1 and not torch.equal(state[0].data, before[0])
    before = [t.data.clone() for t in state]
    with pytest.raises(me.errors.InputError, match="grad_index"):
        be.update_rows(state, ids, grads, fn, values=(0.1,), grad_index=torch.tensor([0, 1, 3, 2]))
    for t, b in zip(state, before):
        assert torch.equal(t.data, b)


def test_not_taken_for_a_plain_callable_or_mixed_dtypes():
    vocab, dim = 40, 13
    rule = RULES[IDS.index("adagrad-base-none-float32")]
    table = torch.zeros(vocab, dim)
    acc = torch.ones(vocab, dim)
    grads = torch.ones(4, dim)
    assert native.kernel_for(lambda g, *rows: rows, (0.1,), [table, acc], grads, 4, None, None) is None
    assert native.kernel_for(rule, (0.1,), [table, acc.double()], grads, 4, None, None) is None
    assert native.kernel_for(rule, (0.1,), [table, acc], grads.double(), 4, None, None) is None
    assert native.kernel_for(rule, (0.1, 0.2), [table, acc], grads, 4, None, None) is None  # core reports it
    kernel = native.kernel_for(rule, (0.1,), [table.double(), acc.double()], grads.double(), 4, None, None)
    assert kernel is not None and kernel[0].dtype == "float64" and kernel[1] == (0.1,)


def test_the_switch_is_the_backends():
    """``TorchBackend(fused=False)`` (or ``MESHEMBED_TORCH_FUSED=0`` when it is made) turns
    every generated kernel off; the capability says so."""
    from meshembed_torch import TorchBackend

    off = TorchBackend(device="cpu", fused=False)
    assert not off.capabilities.generated_kernels and off.in_place_group(RULES[0]) != 64
    assert TorchBackend(device="cpu").capabilities.generated_kernels


@pytest.mark.parametrize("name", ["stochastic_gradient_descent-base-none-float32", "adagrad-base-none-float32",
                                  "adam-base-none-float64"])
@pytest.mark.parametrize("form", ["rows", "index", "weighted"])
@pytest.mark.parametrize("dim", [16, 13])
def test_threads_split_the_rows_bit_for_bit(name, form, dim):
    """Enough unique rows (> 256 a thread) for the driver to split them between 1, 2 and 3
    threads — each thread sums and updates its own rows (the pooled step's one pass), or with
    the check and one gradient row per id sums first, then updates — equal to NumPy bit for
    bit, with and without the NaN/Inf check; a NaN then writes nothing, whatever the split."""
    from conformance.kernel_cases import LIBM_NUMPY, mixture, values_for
    from meshembed.math.rule import apply_rule

    rule = RULES[IDS.index(name)]
    rng = np.random.default_rng(dim)
    vocab, n, dtype = 4000, 20_000, rule.dtype  # 3 threads: >= 4 Ki contributions, 256 rows each
    ids = (rng.zipf(1.2, size=n) - 1) % vocab
    tables = [mixture(rng, (vocab, dim), dtype)] + [mixture(rng, (vocab, dim), dtype, signed=False)
                                                     for _ in rule.slot_names]
    if form == "rows":
        grads, index, weights = rng.standard_normal((n, dim)).astype(dtype), None, None
    else:
        grads, index = rng.standard_normal((700, dim)).astype(dtype), rng.integers(0, 700, size=n)
        weights = rng.uniform(0.1, 2.0, size=n).astype(dtype) if form == "weighted" else None
    values = values_for(rule)
    rows = grads if index is None else grads[index] * (1.0 if weights is None else weights.reshape(-1, 1))
    uids, g = me.get_backend("numpy").segment_sum(ids, rows.astype(dtype))
    assert uids.size > 3 * 256
    with np.errstate(all="ignore"):
        new = apply_rule(LIBM_NUMPY, rule, values, g, *(t[uids] for t in tables))
    want = [t.copy() for t in tables]
    for w, r in zip(want, new):
        w[uids] = r
    t_grads = torch.from_numpy(grads)
    t_index = None if index is None else torch.from_numpy(index)
    t_weights = None if weights is None else torch.from_numpy(weights)
    kernel = native.kernel_for(rule, values, [torch.from_numpy(t) for t in tables], t_grads, n, t_index, t_weights)
    assert kernel is not None
    for threads in (1, 2, 3):
        for check in (False, True):
            datas = [torch.from_numpy(t.copy()) for t in tables]
            native.update(kernel, torch.from_numpy(ids), t_grads, t_index, t_weights, datas, threads, check)
            for k, (d, w) in enumerate(zip(datas, want)):
                assert np.array_equal(d.numpy(), w, equal_nan=True), (threads, check, k)
        bad = grads.copy()
        bad[grads.shape[0] // 2, dim // 2] = np.nan
        datas = [torch.from_numpy(t.copy()) for t in tables]
        with pytest.raises(me.errors.NonFiniteError):
            native.update(kernel, torch.from_numpy(ids), torch.from_numpy(bad), t_index, t_weights, datas, threads,
                             True)
        for d, t in zip(datas, tables):
            assert np.array_equal(d.numpy(), t, equal_nan=True)



@pytest.mark.parametrize("dtype,dim", [("float32", 16), ("float32", 13), ("float64", 64)])
def test_pooled_lookup_in_one_pass(dtype, dim):
    """``gather_combine`` of sorted segments is one C++ pass (``native.pooled_sum``): the bits
    of the general path (``embedding_bag``), on 1, 2 and 3 threads (50,000 ids: 16 Ki a
    thread), empty segments zero; a bad id is the general path's InputError, unsorted segments
    its sort."""
    from meshembed.sharding import Placement
    from meshembed_torch import TorchBackend

    rng = np.random.default_rng(dim)
    on, off = TorchBackend(device="cpu"), TorchBackend(device="cpu", fused=False)
    values = rng.standard_normal((5000, dim)).astype(dtype)
    tables = [be.create_table(values, Placement(5000)) for be in (on, off)]
    n, segments = 50_000, 9000
    ids = torch.from_numpy((rng.zipf(1.2, n) - 1) % 5000)
    slots = torch.from_numpy(np.sort(rng.integers(0, 8000, n)))  # segments 8000.. and some others empty
    want = off.gather_combine(tables[1], ids, slots, segments)
    assert torch.equal(on.gather_combine(tables[0], ids, slots, segments), want)
    for threads in (1, 2, 3):
        got = native.pooled_sum(tables[0].data, ids, slots, segments, threads)
        assert got is not None and got.shape == (segments, dim) and torch.equal(got, want), threads
    assert native.pooled_sum(tables[0].data, ids, slots.flip(0), segments, 2) is None  # not sorted
    shuffled = torch.from_numpy(rng.permutation(n))
    assert torch.equal(on.gather_combine(tables[0], ids[shuffled], slots[shuffled], segments),
                       off.gather_combine(tables[1], ids[shuffled], slots[shuffled], segments))
    for bad in (-1, 5000):
        wrong = ids.clone()
        wrong[12345] = bad
        assert native.pooled_sum(tables[0].data, wrong, slots, segments, 2) is None
        with pytest.raises(me.errors.InputError, match="Expected ids in"):
            on.gather_combine(tables[0], wrong, slots, segments)
    assert native.pooled_sum(tables[0].data, ids, slots, int(slots.max()), 2) is None  # a segment past the count
    # the segments' offsets given (ragged row splits): read instead of the slots' scan, same bits
    offsets = torch.searchsorted(slots, torch.arange(segments + 1))
    for threads in (1, 2):
        got = native.pooled_sum(tables[0].data, ids, slots, segments, threads, offsets)
        assert got is not None and torch.equal(got, want), threads
    assert torch.equal(on.gather_combine(tables[0], ids, slots, segments, offsets=offsets), want)
    for broken in (offsets.flip(0), offsets - 1, offsets.clamp(max=n - 1)):  # decreasing, not from 0, not to n
        assert native.pooled_sum(tables[0].data, ids, slots, segments, 2, broken) is None
    # offsets of the wrong length or dtype are not read: the slots are scanned
    got = native.pooled_sum(tables[0].data, ids, slots, segments, 2, offsets[:-1])
    assert got is not None and torch.equal(got, want)
    got = native.pooled_sum(tables[0].data, ids, slots, segments, 2, offsets.to(torch.int32))
    assert got is not None and torch.equal(got, want)


def test_a_batch_shares_its_arrays_with_torch_and_stays_read_only(monkeypatch):
    """``Batch.device_array`` hands torch the batch's own memory (``torch.from_numpy`` would
    copy a read-only array: 2 MB a W1 step) and the batch's arrays stay read-only; a ragged
    feature's row splits reach the pooled lookup as its offsets."""
    from meshembed.embedding import batch as batches
    from meshembed_torch import TorchBackend, backend as torch_backend

    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=50, dimension=8, combiner="sum",
                               optimizer=me.embedding.SGD(learning_rate=0.1))],
                             features=[me.FeatureConfig(table="t", input_shape=(4,), name="f")])
    emb = me.TPUEmbedding(cfg, backend=TorchBackend(device="cpu"), num_shards=1)
    rg = me.RaggedIds.from_lists([[1, 2, 3], [], [4, 4], [7]])
    batch = batches.prepare(emb.layout, [rg])
    d = batch.features[0]
    assert d.offsets.tolist() == [0, 3, 3, 5, 6]
    for name in ("ids", "slots"):
        held = getattr(d, name)
        assert np.shares_memory(batch.device_array(emb.backend, 0, name).numpy(), held), name
        assert not held.flags.writeable, name
    seen, pooled_sum = [], native.pooled_sum

    def spy(*args):
        seen.append(args[-1])
        return pooled_sum(*args)

    monkeypatch.setattr(torch_backend.native, "pooled_sum", spy)
    emb.enqueue([rg], training=False)
    got = emb.dequeue()[0]
    rows = emb.retrieve_parameters("t")["parameters"]
    want = np.stack([rows[[1, 2, 3]].sum(0), np.zeros(8, np.float32), rows[[4, 4]].sum(0), rows[7]])
    assert np.array_equal(np.asarray(got), want)
    assert len(seen) == 1 and seen[0].tolist() == [0, 3, 3, 5, 6]


def test_bad_ids_are_checked_by_the_fused_update_and_change_nothing():
    """The fused update checks the ids' range in its own first pass (no separate pass in the
    backend): an id outside the vocabulary is the same InputError as on every path, raised
    before anything is written — also beside a gradient of the wrong shape."""
    be, state, fn, before = _adagrad_table()
    calls = be.stats().get("fused_updates", 0)
    for bad in (-1, 50):
        ids = torch.tensor([1, 2, bad, 7])
        with pytest.raises(me.errors.InputError, match=r"Expected ids in \[0, 50\)"):
            be.update_rows(state, ids, torch.ones(4, 8), fn, values=(0.1,))
        with pytest.raises(me.errors.InputError, match=r"Expected ids in \[0, 50\)"):
            be.update_rows(state, ids, torch.ones(3, 8), fn, values=(0.1,), grad_index=torch.tensor([0, 1, 2, 2]))
        with pytest.raises(me.errors.InputError, match=r"Expected ids in \[0, 50\)"):
            be.update_rows(state, ids, torch.ones(5, 8), fn, values=(0.1,))  # and a wrong gradient shape
    for t, b in zip(state, before):
        assert torch.equal(t.data, b)
    assert be.stats().get("fused_updates", 0) == calls
    be.update_rows(state, torch.tensor([1, 2, 49, 7]), torch.ones(4, 8), fn, values=(0.1,))
    assert be.stats().get("fused_updates", 0) == calls + 1 and not torch.equal(state[0].data, before[0])


def test_helpers_concurrent_callers_and_fork():
    """The drivers' helper threads (``Helpers`` in native_fused.cc): two Python threads calling at
    once (ctypes releases the GIL; the second runs its chunks itself) and a forked child (runs
    everything on its calling thread) get the same bits as one call on one thread."""
    import os
    import threading

    rng = np.random.default_rng(5)
    data = torch.from_numpy(rng.standard_normal((3000, 16)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, 3000, 70_000))
    slots = torch.from_numpy(np.sort(rng.integers(0, 9000, 70_000)))
    want = native.pooled_sum(data, ids, slots, 9000, 1)
    assert want is not None and torch.equal(native.pooled_sum(data, ids, slots, 9000, 2), want)
    got: list = []

    def call() -> None:
        for _ in range(20):
            got.append(native.pooled_sum(data, ids, slots, 9000, 3))

    workers = [threading.Thread(target=call) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(got) == 40 and all(torch.equal(g, want) for g in got)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the same bits (no helpers, no deadlock); compared
        try:        # in NumPy: torch's own OpenMP ops may hang in a forked child (GNU OpenMP)
            out = native.pooled_sum(data, ids, slots, 9000, 2)
            os._exit(0 if np.array_equal(out.numpy(), want.numpy()) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# -- low-precision tables: the pooled lookup and the gather that widen as they read ------------------
def _patterns(rng, rows, dim):
    """int16 patterns of every kind: random ones (NaN, inf and subnormal patterns among them)
    and the specials themselves."""
    data = rng.integers(-32768, 32768, (rows, dim)).astype(np.int16)
    specials = np.array([0, -32768, 1, 0x7F80, 0x7FC1, 0x7F81, 0x7C00, 0x7C01, 0x7E00, 0x03FF, -1, -0x0081],
                        dtype=np.int64).astype(np.int16)
    data[: len(specials), 0] = specials
    return data


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_pooled_lookup_and_gather_widen_as_they_read(dtype):
    """``native.pooled_sum_16`` gives the bits of the widen-then-sum path (the core's exact
    widening, then ``pooled_sum`` / ``embedding_bag`` over the float32 rows) and
    ``native.gather_rows_16`` the widened rows themselves, NaN payloads and all, on 1-3
    threads (50,000 ids); a bad id, unsorted slots or broken offsets: None (the caller's
    general path); the backend methods count their runs and give way with the kernels off."""
    from meshembed.embedding.precision import from_storage
    from meshembed.sharding import Placement
    from meshembed_torch import TorchBackend

    rng = np.random.default_rng(7)
    on, off = TorchBackend(device="cpu"), TorchBackend(device="cpu", fused=False)
    patterns = _patterns(rng, 5000, 16)
    widened = torch.from_numpy(from_storage(patterns, dtype))
    table = on.create_table(patterns, Placement(5000))
    n, segments = 50_000, 9000
    ids = torch.from_numpy((rng.zipf(1.2, n) - 1) % 5000)
    ids[:12] = torch.arange(12)  # the special patterns' rows
    slots = torch.from_numpy(np.sort(rng.integers(0, 8000, n)))
    want = native.pooled_sum(widened, ids, slots, segments, 1)
    for threads in (1, 2, 3):
        got = native.pooled_sum_16(table.data, ids, slots, segments, dtype, threads)
        assert got is not None and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), threads
        rows = native.gather_rows_16(table.data, ids, dtype, threads)
        assert torch.equal(rows.view(torch.int32), widened[ids].view(torch.int32)), threads
    offsets = torch.searchsorted(slots, torch.arange(segments + 1))
    got = native.pooled_sum_16(table.data, ids, slots, segments, dtype, 2, offsets)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert native.pooled_sum_16(table.data, ids, slots.flip(0), segments, dtype, 2) is None  # not sorted
    assert native.pooled_sum_16(table.data, ids, slots, segments, dtype, 2, offsets.flip(0)) is None
    assert native.pooled_sum_16(table.data, ids, slots, segments, "float32", 2) is None
    assert native.pooled_sum_16(widened, ids, slots, segments, dtype, 2) is None  # not patterns
    for bad in (-1, 5000):
        wrong = ids.clone()
        wrong[12345] = bad
        assert native.pooled_sum_16(table.data, wrong, slots, segments, dtype, 2) is None
        assert native.gather_rows_16(table.data, wrong, dtype, 2) is None
    # the backend's methods: the kernels' results, counted; with the kernels off, None
    before = dict(on.stats())
    got = on.gather_combine_low_precision(table, ids, slots, segments, dtype, offsets=offsets.numpy())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(on.gather_widened(table, ids, dtype).view(torch.int32), widened[ids].view(torch.int32))
    after = on.stats()
    assert after["pooled_low_precision_lookups"] == before.get("pooled_low_precision_lookups", 0) + 1
    assert after["widened_low_precision_gathers"] == before.get("widened_low_precision_gathers", 0) + 1
    off_table = off.create_table(patterns, Placement(5000))
    assert off.gather_combine_low_precision(off_table, ids, slots, segments, dtype) is None
    assert off.gather_widened(off_table, ids, dtype) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_low_precision_engine_lookup_and_update_take_the_widening_kernels(dtype, combiner):
    """A 16-bit table on torch: the engine's pooled lookup (sum combiner) runs
    ``gather_combine_low_precision`` and its update ``gather_widened``, with the bits of the
    same engine with the fused kernels off (the gather-widen-combine path) and of NumPy;
    a mean combiner's lookup (weights) keeps the general path, same bits."""
    from meshembed_torch import TorchBackend

    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=300, dimension=16, combiner=combiner,
                               optimizer=me.embedding.Adagrad(learning_rate=0.1),
                               precision=me.embedding.Precision(parameters=dtype, rounding="stochastic", seed=5))],
        features=[me.FeatureConfig(table="t", input_shape=(24,), name="f")])
    rng = np.random.default_rng(3)
    on = TorchBackend(device="cpu")
    runs = [me.TPUEmbedding(cfg, backend=b, num_shards=1, seed=1)
            for b in (on, TorchBackend(device="cpu", fused=False), "numpy")]
    for _ in range(3):
        splits = np.concatenate([[0], np.sort(rng.integers(0, 120, 23)), [120]])
        feature = me.RaggedIds(splits, rng.integers(0, 300, 120))
        grad = rng.standard_normal((24, 16)).astype(np.float32)
        acts = []
        for emb in runs:
            emb.enqueue([feature])
            acts.append(np.asarray(emb.backend.to_numpy(emb.dequeue()[0])))
            emb.apply_gradients([grad])
        for a in acts[1:]:
            assert np.array_equal(acts[0].view(np.int32), a.view(np.int32))
    states = [e.retrieve_parameters("t") for e in runs]
    for s in states[1:]:
        for k in states[0]:
            assert np.array_equal(states[0][k].view(np.int32), s[k].view(np.int32)), k
    stats = on.stats()
    assert stats.get("pooled_low_precision_lookups", 0) == (3 if combiner == "sum" else 0)
    assert stats["widened_low_precision_gathers"] >= 3
