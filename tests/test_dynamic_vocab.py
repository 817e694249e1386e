"""Dynamic vocabularies (embedding/dynamic.py, docs/dynamic_vocab.md): raw int64 keys mapped
to rows on the host, admission and eviction driven by the step counter, checkpointed.

The same keys give the same rows, decisions and values on every backend and shard count; a
checkpoint taken mid-run resumes bit for bit, also on another backend and shard count."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import batch as batches
from meshembed.embedding import dynamic as dv
from meshembed.errors import CheckpointError, ConfigError, InputError

BACKENDS = ["numpy", "torch", "jax", "array_api_strict"]
D = 4
B = 8


def backend_or_skip(name: str) -> str:
    if name not in me.available_backends():
        pytest.skip(f"backend {name} not available")
    return name


# ----------------------------------------------------------------------------- assign: exact semantics
def run(spec, batches_, capacity=4, **kw):
    st = dv.new_state(spec, capacity)
    out = []
    for step, keys in enumerate(batches_):
        rows, st, fresh = dv.assign(st, np.asarray(keys, np.int64), step, **kw)
        out.append((rows.tolist(), fresh.tolist()))
    return st, out


def test_always_lru_by_hand():
    spec = dv.DynamicVocabulary(capacity=3)
    st, out = run(spec, [[10, 20, 10], [30, 40], [20, 50]], capacity=3)
    # step 0: 10 -> 0, 20 -> 1 (first occurrence order); step 1: 30 -> row 2 (free), 40 evicts the
    # LRU resident (10 and 20 both last seen at 0: the lower count goes, 20 with 1 < 2)
    assert out[0] == ([0, 1, 0], [0, 1])
    assert out[1] == ([2, 1], [1, 2])
    # step 2: 20 is gone (evicted at step 1), so 20 and 50 are both new: the victims are 10 (row 0,
    # last seen 0), then 40 (row 1: 30 and 40 were last seen at 1 with count 1; the lower row goes)
    assert out[2] == ([0, 1], [0, 1])
    assert sorted(st.row_key[st.used].tolist()) == [20, 30, 50]
    assert st.stats == {"sketch_halved_at": 0, "lookups": 7, "hits": 0, "admitted": 6, "evicted": 3, "rejected": 0}


def test_lfu_evicts_the_least_frequent():
    spec = dv.DynamicVocabulary(capacity=3, eviction=dv.LFU())
    st, out = run(spec, [[1, 1, 1, 2, 3, 3], [4]], capacity=3)
    assert out[1] == ([1], [1])  # key 2 (count 1) goes, not 1 (3) or 3 (2)
    assert set(st.row_key[st.used].tolist()) == {1, 3, 4}


def test_keys_seen_at_this_step_are_never_evicted():
    spec = dv.DynamicVocabulary(capacity=2)
    st, out = run(spec, [[1, 2, 3, 4]], capacity=2)
    assert out[0] == ([0, 1, -1, -1], [0, 1])  # no victim: 1 and 2 were seen at step 0
    assert st.stats["rejected"] == 2


def test_without_a_pressure_order_new_keys_wait():
    spec = dv.DynamicVocabulary(capacity=2, eviction=dv.TTL(1))
    st, out = run(spec, [[1, 2], [3], [3], [3]], capacity=2)
    # TTL(1): at step s a key with s - last_seen > 1 expires: 1 and 2 (seen at 0) expire at step 2
    assert out[1] == ([-1], [])
    assert out[2] == ([0], [0])
    assert out[3] == ([0], [])


def test_ttl_expiry_is_in_steps():
    spec = dv.DynamicVocabulary(capacity=4, eviction=(dv.LRU(), dv.TTL(2)))
    st, _ = run(spec, [[1, 2], [1], [1], [1], [3]], capacity=4)
    # key 2, last seen at 0, expires at step 3 (3 - 0 > 2); 1 stays (seen at 3)
    assert sorted(st.row_key[st.used].tolist()) == [1, 3]
    assert st.stats["evicted"] == 1


def test_norm_below_needs_norms_and_evicts_small_rows():
    spec = dv.DynamicVocabulary(capacity=4, eviction=dv.NormBelow(0.5, every=2))
    st = dv.new_state(spec)
    _, st, _ = dv.assign(st, [1, 2, 3], 0, norms=np.zeros(4))  # nothing resident: no norms needed yet
    with pytest.raises(InputError, match="NormBelow"):
        dv.assign(st, [4], 2)
    _, st1, _ = dv.assign(st, [4], 1)  # not a multiple of every=2: no check
    assert st1.size == 4
    norms = np.array([0.1, 1.0, 0.2, 0.0])
    rows, st2, fresh = dv.assign(st, [3, 9], 2, norms=norms)
    # rows 0 (key 1) and 2 (key 3) are below 0.5, but key 3 is in this batch: kept... no: expiry
    # runs before the lookup, and key 3 was seen at step 0 < 2, so it goes and comes back as new
    assert sorted(st2.row_key[st2.used].tolist()) == [2, 3, 9]
    assert fresh.tolist() == [0, 2] and rows.tolist() == [0, 2]


def test_after_occurrences_counts_every_position():
    spec = dv.DynamicVocabulary(capacity=8, admission=dv.AfterOccurrences(3, sketch_width=1 << 12))
    st, out = run(spec, [[5, 6], [5, 5], [6, 7]], capacity=8)
    assert out[0][0] == [-1, -1]
    assert out[1][0] == [0, 0]  # 5 reaches 3 occurrences in step 1
    assert out[2][0] == [-1, -1]  # 6 has 2, 7 has 1
    assert st.stats["rejected"] == 4


def test_after_occurrences_halving():
    spec = dv.DynamicVocabulary(capacity=8, admission=dv.AfterOccurrences(2, sketch_width=1 << 12, halve_every=2))
    _, out = run(spec, [[5], [], [5]], capacity=8)
    assert out[2][0] == [-1]  # the count of 1 was halved to 0 at step 2


def test_probability_is_a_function_of_seed_key_and_step():
    spec = dv.DynamicVocabulary(capacity=100_000, admission=dv.Probability(0.25, seed=7))
    keys = np.arange(20_000, dtype=np.int64) * 7919
    rows, _, _ = dv.assign(dv.new_state(spec), keys, 3)
    admitted = rows >= 0
    assert abs(admitted.mean() - 0.25) < 0.02
    # the same key decides the same in any batch order, with repeats, alone
    rev, _, _ = dv.assign(dv.new_state(spec), np.concatenate([keys[::-1], keys[:100]]), 3)
    assert np.array_equal(rev[:20_000][::-1] >= 0, admitted)
    alone = [dv.assign(dv.new_state(spec), keys[k:k + 1], 3)[0][0] >= 0 for k in range(50)]
    assert alone == admitted[:50].tolist()
    other_step, _, _ = dv.assign(dv.new_state(spec), keys, 4)
    assert not np.array_equal(other_step >= 0, admitted)


def test_protected_rows_and_inference_and_purity():
    spec = dv.DynamicVocabulary(capacity=2)
    _, st, _ = dv.assign(dv.new_state(spec), [1, 2], 0)
    before = st.to_arrays()
    rows, same, fresh = dv.assign(st, [3, 1], 1, training=False)
    assert same is st and rows.tolist() == [-1, 0] and fresh.size == 0
    rows, new, _ = dv.assign(st, [3], 1, protect=np.array([0]))  # row 0 (key 1) protected: key 2 goes
    assert rows.tolist() == [1] and new.row_key.tolist() == [1, 3]
    after = st.to_arrays()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # assign is pure
    _, inplace, _ = dv.assign(st, [3], 1, inplace=True)
    assert inplace is st


@pytest.mark.parametrize("order", [dv.LRU(), dv.LFU()])
def test_hash_and_sorted_index_agree(order):
    rng = np.random.default_rng(0)
    states = {kind: dv.new_state(dv.DynamicVocabulary(capacity=64, index=kind, eviction=(order, dv.TTL(5))))
              for kind in dv.INDEXES}
    for step in range(60):
        keys = (rng.zipf(1.3, size=40) % 500).astype(np.int64) * -1_000_003
        results = {k: dv.assign(s, keys, step) for k, s in states.items()}
        (r1, s1, f1), (r2, s2, f2) = results.values()
        assert np.array_equal(r1, r2) and np.array_equal(f1, f2)
        states = {k: r[1] for k, r in results.items()}
    a, b = states.values()
    assert all(np.array_equal(x, y) for x, y in zip(a.to_arrays().values(), b.to_arrays().values()))
    for st in states.values():  # the index agrees with the row arrays
        keys, rows = st.resident()
        assert np.array_equal(st.rows_of(keys), rows)


def test_hash_index_survives_many_evictions():
    """Tombstones trigger rebuilds; every lookup stays right."""
    spec = dv.DynamicVocabulary(capacity=16)
    st = dv.new_state(spec)
    for step in range(300):
        keys = np.arange(step * 5, step * 5 + 10, dtype=np.int64)
        rows, st, _ = dv.assign(st, keys, step)
        assert np.array_equal(st.rows_of(keys), rows)
        assert st.index.live == st.size
    keys, rows = st.resident()
    assert np.array_equal(st.rows_of(keys), rows) and np.all(st.rows_of(np.arange(1000)) == -1)


def test_keyed_initial_values_depend_on_the_key_only():
    from meshembed.embedding.initializers import Constant, TruncatedNormal

    keys = np.array([5, -3, 2**62, 5], np.int64)
    v = dv.keyed_initial_values(None, keys, 16, seed=1, table_index=0)
    assert v.dtype == np.float32 and v.shape == (4, 16)
    assert np.array_equal(v[0], v[3])
    assert np.array_equal(dv.keyed_initial_values(None, keys[1:2], 16, 1, 0), v[1:2])
    assert not np.array_equal(dv.keyed_initial_values(None, keys, 16, 2, 0), v)  # seed
    assert not np.array_equal(dv.keyed_initial_values(None, keys, 16, 1, 1), v)  # table
    big = dv.keyed_initial_values(TruncatedNormal(0.0, 1.0), np.arange(4000), 64, 0, 0)
    assert np.abs(big).max() <= 2.0 and abs(big.mean()) < 0.01 and 0.85 < big.std() < 0.9  # 2-sigma cut: 0.88
    assert np.all(dv.keyed_initial_values(Constant(0.5), keys, 3, 0, 0) == 0.5)
    custom = dv.keyed_initial_values(lambda shape, rng: rng.uniform(size=shape), keys, 3, 0, 0)
    assert np.array_equal(custom[0], custom[3]) and not np.array_equal(custom[0], custom[1])


def test_spec_checks_and_json():
    with pytest.raises(ConfigError, match="admission"):
        dv.DynamicVocabulary(admission="always")
    with pytest.raises(ConfigError, match="at most one"):
        dv.DynamicVocabulary(eviction=(dv.LRU(), dv.LFU()))
    with pytest.raises(ConfigError, match="p"):
        dv.Probability(0.0)
    with pytest.raises(ConfigError, match="capacity equal to vocabulary_size"):
        me.TableConfig("t", 10, 4, dynamic=dv.DynamicVocabulary(capacity=11))
    with pytest.raises(ConfigError, match="DynamicVocabulary or None"):
        me.TableConfig("t", 10, 4, dynamic=5)
    spec = dv.DynamicVocabulary(capacity=9, admission=dv.AfterOccurrences(3, halve_every=10),
                                eviction=(dv.LFU(), dv.TTL(4), dv.NormBelow(0.1, 3)), index="sorted")
    assert dv.spec_from_json(json.loads(json.dumps(dv.spec_to_json(spec)))) == spec


# ----------------------------------------------------------------------------- the engine
def config(spec=None, optimizer=None, combiner="sum", capacity=16):
    spec = spec or dv.DynamicVocabulary(eviction=(dv.LRU(), dv.TTL(6)))
    optimizer = optimizer or me.embedding.SGD(learning_rate=0.1)
    return me.EmbeddingConfig(
        tables=[me.TableConfig("item", capacity, D, optimizer=optimizer, combiner=combiner, dynamic=spec),
                me.TableConfig("plain", 10, 2, optimizer=me.embedding.SGD(learning_rate=0.1))],
        features=[me.FeatureConfig("item", (B,), name="item"), me.FeatureConfig("item", (B, 3), name="history"),
                  me.FeatureConfig("plain", (B,), name="plain")],
        sharding_strategy="mod")


def stream(step, vocab=60):
    """Zipf-ish 64-bit keys (a new vocabulary part every few steps) and a plain feature."""
    rng = np.random.default_rng(1000 + step)
    base = np.int64(0x5DEECE66D) * (np.arange(vocab + 4 * step, dtype=np.int64) + 1)  # 64-bit keys, wrapping
    pick = lambda n: base[np.minimum(rng.zipf(1.4, n) - 1 + step, base.shape[0] - 1)]  # noqa: E731
    lengths = rng.integers(0, 5, B)
    hist = me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), pick(int(lengths.sum())))
    return [pick(B), hist, rng.integers(0, 10, B)]


def train(emb, steps, start=0):
    for s in range(start, start + steps):
        emb.enqueue(stream(s))
        acts = emb.dequeue()
        emb.apply_gradients([np.asarray(emb.backend.to_numpy(a)) * 0.5 - 0.25 for a in acts])


# The same keys -> the same rows, decisions and values on every backend over 1/2/4 shards, and a checkpoint
# resumed on another backend and shard count: conformance/test_dynamic_vocab.py (runs per backend).


def test_unadmitted_keys_read_zeros_and_get_no_update():
    spec = dv.DynamicVocabulary(admission=dv.AfterOccurrences(2, sketch_width=1 << 10))
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 8, D, optimizer=me.embedding.Adam(learning_rate=0.1), combiner="mean",
                               dynamic=spec)],
        features=[me.FeatureConfig("t", (2,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="numpy", seed=0)
    before = emb.retrieve_parameters("t")
    emb.enqueue([me.RaggedIds.from_lists([[7, 7], [9]])])  # 7 reaches 2 occurrences, 9 has 1
    acts = np.asarray(emb.dequeue()[0])
    row7 = emb.vocabulary("t").rows_of([7])[0]
    assert emb.vocabulary("t").rows_of([9])[0] == -1
    table = emb.retrieve_parameters("t")["parameters"]
    np.testing.assert_array_equal(acts[0], table[row7])  # mean of 7 and 7
    np.testing.assert_array_equal(acts[1], np.zeros(D))  # 9 reads zeros
    emb.apply_gradients([np.ones((2, D), np.float32)])
    after = emb.retrieve_parameters("t")
    changed = np.flatnonzero(np.any(after["parameters"] != before["parameters"], axis=1))
    assert changed.tolist() == [row7]  # only 7's row; Adam's zero-gradient momentum never ran on 9
    for slot in ("momenta", "velocities"):
        assert np.flatnonzero(np.any(after[slot] != 0, axis=1)).tolist() == [row7]
    # a mean over [admitted, unadmitted] divides by both: the missing key counts as a zero row
    emb.enqueue([me.RaggedIds.from_lists([[7, 11], []])])
    acts = np.asarray(emb.dequeue()[0])
    np.testing.assert_allclose(acts[0], emb.retrieve_parameters("t")["parameters"][row7] / 2, rtol=1e-7)
    emb.apply_gradients([np.ones((2, D), np.float32)])


def test_a_batch_of_only_unadmitted_keys():
    spec = dv.DynamicVocabulary(admission=dv.Probability(1e-9))
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 4, D, optimizer=me.embedding.SGD(0.1), dynamic=spec)],
                             features=[me.FeatureConfig("t", (3,), name="f")])
    for backend in BACKENDS:
        emb = me.TPUEmbedding(cfg, backend=backend_or_skip(backend), seed=0)
        before = emb.retrieve_parameters("t")["parameters"]
        emb.enqueue([np.array([1, 2, 3])])
        assert np.all(np.asarray(emb.backend.to_numpy(emb.dequeue()[0])) == 0)
        emb.apply_gradients([np.ones((3, D), np.float32)])
        np.testing.assert_array_equal(emb.retrieve_parameters("t")["parameters"], before)
        assert emb.vocabulary("t").stats["rejected"] == 3 and emb.step == 1


def test_inference_reads_without_changing_the_vocabulary():
    emb = me.TPUEmbedding(config(), backend="numpy", seed=3)
    train(emb, 3)
    before = emb.vocabulary("item").to_arrays()
    tables = emb.retrieve_parameters("item")["parameters"]
    emb.enqueue(stream(50), training=False)
    acts = emb.dequeue()
    after = emb.vocabulary("item").to_arrays()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    np.testing.assert_array_equal(emb.retrieve_parameters("item")["parameters"], tables)
    assert acts[0].shape == (B, D)


def test_keys_are_any_int64_and_readmission_restarts_from_the_same_values():
    spec = dv.DynamicVocabulary(eviction=dv.TTL(0))
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 4, D, optimizer=me.embedding.SGD(1.0), dynamic=spec)],
                             features=[me.FeatureConfig("t", (2,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="numpy", seed=9)
    keys = np.array([-(2**63), 2**63 - 1])
    emb.enqueue([keys])
    first = np.asarray(emb.dequeue()[0]).copy()
    np.testing.assert_array_equal(first, dv.keyed_initial_values(None, keys, D, 9, 0))
    emb.apply_gradients([np.ones((2, D), np.float32)])
    emb.enqueue([np.array([1, 2])])  # TTL(0): both keys expire at step 1
    emb.dequeue()
    emb.apply_gradients([np.ones((2, D), np.float32)])
    emb.enqueue([keys])  # re-admitted: their initial values again, not the trained ones
    np.testing.assert_array_equal(np.asarray(emb.dequeue()[0]), first)
    emb.discard()
    emb.enqueue([np.array([2**64 - 1, 5], dtype=np.uint64)])  # uint64 keys: their int64 bit patterns
    assert emb.vocabulary("t").rows_of([-1])[0] >= 0


def test_export_dynamic_for_serving():
    emb = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=3)
    train(emb, 5)
    keys, values = emb.export_dynamic("item")
    st = emb.vocabulary("item")
    assert keys.dtype == np.int64 and np.all(np.diff(keys) > 0) and keys.shape[0] == st.size
    table = emb.retrieve_parameters("item")["parameters"]
    np.testing.assert_array_equal(values, table[st.rows_of(keys)])
    with pytest.raises(InputError, match="no dynamic vocabulary"):
        emb.export_dynamic("plain")


def test_a_batch_of_rows_is_refused_by_a_dynamic_engine():
    emb = me.TPUEmbedding(config(), backend="numpy", seed=3)
    ids = [np.zeros(B, np.int64), me.RaggedIds.from_lists([[]] * B), np.zeros(B, np.int64)]
    with pytest.raises(InputError, match="key_layout"):
        emb.enqueue_batch(batches.prepare(emb.layout, ids))
    emb.enqueue_batch(batches.prepare(emb.key_layout, ids))  # keys: mapped
    assert emb.pending.layout == emb.layout


def test_pipelined_engine_keeps_the_kept_steps_rows():
    """The pipelined schedule applies step t after step t+1's lookup: step t's rows must
    survive step t+1's assignment, and the run equals the step functions in that order."""
    spec = dv.DynamicVocabulary(eviction=dv.LRU())
    cfg = config(spec=spec, capacity=6)
    emb = me.TPUEmbedding(cfg, backend="numpy", seed=3, pipelined=True)
    previous = None
    for s in range(8):
        emb.enqueue(stream(s))
        vocab = emb.vocabulary("item")
        if previous is not None:  # the kept batch's rows still hold the keys it was mapped with
            rows, keys = previous
            np.testing.assert_array_equal(vocab.row_key[rows], keys)
        rows = np.concatenate([emb.pending.features[k].ids for k in (0, 1)])
        previous = rows, vocab.row_key[rows].copy()
        emb.dequeue()
        emb.apply_gradients([np.zeros(emb.output_shape(f), np.float32) for f in emb.feature_names])
    emb.flush()
    assert emb.step == 8 and emb.vocabulary("item").stats["evicted"] > 0


def test_dynamic_tables_refused_where_keys_cannot_be_mapped():
    cfg = config()
    with pytest.raises(ConfigError, match="dynamic vocabulary"):
        dv.refuse(cfg, "me.jax")
    dv.refuse(me.EmbeddingConfig(tables=[me.TableConfig("t", 4, 2, optimizer=me.embedding.SGD(0.1))],
                                 features=[me.FeatureConfig("t", (2,))]), "me.jax")  # nothing dynamic: fine


# ----------------------------------------------------------------------------- checkpoints
def saved(tmp_path, spec=None, **kw):
    emb = me.TPUEmbedding(config(spec=spec), backend="numpy", seed=3, **kw)
    train(emb, 4)
    return emb, emb.save(tmp_path / "ckpt")


def rewrite(path, name, fn):
    """Change one dynamic array and re-sign the files (so only the value checks can refuse it)."""
    import hashlib

    from meshembed.embedding import checkpoint

    path = pathlib.Path(path)
    with np.load(path / "arrays.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays[name] = fn(arrays[name])
    with open(path / "arrays.npz", "wb") as fh:
        np.savez(fh, **arrays)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("manifest_sha256")
    entry = manifest["files"]["arrays.npz"]
    entry["sha256"] = hashlib.sha256((path / "arrays.npz").read_bytes()).hexdigest()
    entry["size"] = (path / "arrays.npz").stat().st_size
    manifest["manifest_sha256"] = hashlib.sha256(checkpoint._canonical(manifest)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name, fn, match", [
    ("t0.dynamic.used", lambda a: a + 2, "other than 0 and 1"),
    ("t0.dynamic.row_key", lambda a: np.zeros_like(a), "one key two rows"),
    ("t0.dynamic.count", lambda a: a.astype(np.int32), "dtype int32"),
    ("t0.dynamic.last_seen", lambda a: a - 100, "negative"),
])
def test_a_damaged_vocabulary_is_refused(tmp_path, name, fn, match):
    _, path = saved(tmp_path)
    rewrite(path, name, fn)
    with pytest.raises(CheckpointError, match=match):
        me.TPUEmbedding.restore(path)


def test_manifest_dynamic_entry_is_checked(tmp_path):
    _, path = saved(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tables"][0]["dynamic"]["spec"]["eviction"] = [{"kind": "LRU"}, {"kind": "LFU"}]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json"):
        me.TPUEmbedding.restore(path)


def test_a_callable_initializer_must_be_passed_again(tmp_path):
    def init(shape, rng):
        return rng.uniform(-0.1, 0.1, size=shape)

    _, path = saved(tmp_path, initializers={"item": init})
    with pytest.raises(InputError, match="initializers="):
        me.TPUEmbedding.restore(path)
    emb = me.TPUEmbedding.restore(path, initializers={"item": init})
    assert emb.dynamic_initializers["item"] is init


def test_the_proto_stays_tensorflow_readable():
    cfg = config()
    back = me.EmbeddingConfig.from_proto(cfg.to_proto())  # the proto has no dynamic option
    assert back.tables[0].dynamic is None and back.tables[0].vocabulary_size == 16


# ----------------------------------------------------------------------------- example and benchmark
def test_example_trains_on_a_growing_vocabulary(capsys):
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dynamic_vocab.py"
    spec = importlib.util.spec_from_file_location("dynamic_vocab_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--steps", "100", "--every", "50"])
    assert out["last_loss"] < out["first_loss"]
    assert out["keys_seen"] > out["resident"] == 2048  # more keys passed than the table holds
    assert "hit rate" in capsys.readouterr().out


def test_benchmark_quick():
    from benchmarks.dynamic_vocab import main

    rows = main(["--quick"])
    impls = {r["implementation"] for r in rows}
    assert "Python dict + OrderedDict LRU" in impls and "meshembed hash index (pure)" in impls
    assert all(r["keys_per_s"] > 0 and r["full"] for r in rows)
    mapping = [r for r in rows if r["case"] == "host mapping"]
    assert len({round(r["hit_rate"], 6) for r in mapping if r["implementation"].startswith("meshembed")}) == 1


def test_low_precision_dynamic_table(tmp_path):
    """A bfloat16 dynamic table: keyed initial values rounded to its storage, exported and
    resumed as exact float32 values."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 32, D, optimizer=me.embedding.SGD(0.1), combiner="sum",
                               precision=me.embedding.Precision(parameters="bfloat16", rounding="nearest"),
                               dynamic=dv.DynamicVocabulary(eviction=dv.LFU()))],
        features=[me.FeatureConfig("t", (B,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="numpy", seed=2)
    rng = np.random.default_rng(0)
    for _ in range(6):
        emb.enqueue([rng.integers(-1000, 1000, B) * 977])
        emb.dequeue()
        emb.apply_gradients([np.ones((B, D), np.float32)])
    keys, values = emb.export_dynamic("t")
    table = emb.retrieve_parameters("t")["parameters"]
    np.testing.assert_array_equal(values, table[emb.vocabulary("t").rows_of(keys)])
    assert np.array_equal(values.astype(np.float32).view(np.uint32) & 0xFFFF, np.zeros_like(values, np.uint32))
    restored = me.TPUEmbedding.restore(emb.save(tmp_path / "ckpt"))
    k2, v2 = restored.export_dynamic("t")
    np.testing.assert_array_equal(k2, keys)
    np.testing.assert_array_equal(v2, values)


def test_me_tpu_maps_keys_through_the_engine(monkeypatch):
    """me.tpu's enqueue is the engine's: once its TableConfig passes `dynamic=` to the
    engine's TableConfig (the one missing piece, see docs/dynamic_vocab.md), keys are mapped.
    Here the pass-through is patched in."""
    from meshembed.tpu import TableConfig as TFTable

    original = TFTable._engine

    def with_dynamic(self, name, optimizer):
        return original(self, name, optimizer).replace(dynamic=dv.DynamicVocabulary())

    monkeypatch.setattr(TFTable, "_engine", with_dynamic)
    E = me.tpu
    table = E.TableConfig(vocabulary_size=8, dim=D, name="item", combiner="sum")
    emb = E.TPUEmbedding(feature_config={"item": E.FeatureConfig(table)}, optimizer=E.SGD(learning_rate=0.5))
    keys = np.array([10**15, -7, 10**15])
    emb.enqueue({"item": keys}, training=True)
    acts = emb.dequeue()
    vocab = emb.engine.vocabulary("item")
    np.testing.assert_array_equal(np.asarray(acts["item"])[0], np.asarray(acts["item"])[2])
    np.testing.assert_array_equal(np.asarray(acts["item"]),
                                  dv.keyed_initial_values(None, keys, D, 0, 0))
    emb.apply_gradients({"item": np.ones((3, D), np.float32)})
    assert vocab.size == 2 and emb.engine.vocabulary("item").stats["lookups"] == 3
