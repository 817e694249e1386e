"""Dynamic vocabularies inside jitted me.jax (backends/meshembed_jax/frontend/dynamic.py) against the NumPy
reference (meshembed.embedding.dynamic.assign and the NumPy engine): the same keys give the same
rows, admissions, evictions, statistics and values, a checkpoint mid-run resumes on either side,
and one compiled program serves every step."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.embedding import dynamic as dv  # noqa: E402
from meshembed.errors import ConfigError, InputError  # noqa: E402
from meshembed_jax.frontend import dynamic as jdyn  # noqa: E402
from tests.jax_x64 import x64_where_named  # noqa: E402,F401

E = me.embedding
D = 4
B = 8


# ----------------------------------------------------------------------------- the 64-bit words
def test_hashes_and_buckets_match_the_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    keys = np.concatenate([rng.integers(-2**63, 2**63 - 1, 2000, dtype=np.int64),
                           np.array([0, -1, 1, 2**63 - 1, -2**63], np.int64)])
    words = tuple(jnp.asarray(w) for w in jdyn.to_words(keys))
    for salts in [(), (0,), (7, dv.DynamicVocabulary.__name__.__len__(), 123456789)]:
        got = jdyn.hash_words(words, jdyn._const(jdyn.salt_prefix(*salts)))
        np.testing.assert_array_equal(jdyn.from_words(*got).view(np.uint64), dv.hash_keys(keys, *salts))
    h = dv.hash_keys(keys, 5)
    hw = tuple(jnp.asarray(w) for w in jdyn.to_words(h.view(np.int64)))
    for width in (16, 100, 12345, 2**31 - 1, 2**31):
        np.testing.assert_array_equal(np.asarray(jdyn.mod_words(hw, width)), (h % np.uint64(width)).astype(np.int64))
    np.testing.assert_array_equal(jdyn.from_words(*jdyn.to_words(keys)), keys)


# ----------------------------------------------------------------------------- assign vs dynamic.assign
SPECS = {  # every admission and pressure order, TTL with and without one, a sketch of a width not a power of 2
    "always_lru_ttl": dv.DynamicVocabulary(eviction=(dv.LRU(), dv.TTL(2))),
    "after_n_ttl": dv.DynamicVocabulary(admission=dv.AfterOccurrences(2, sketch_width=37, sketch_depth=3,
                                                                        halve_every=3, seed=4),
                                        eviction=dv.TTL(3)),
    "probability_lfu": dv.DynamicVocabulary(admission=dv.Probability(0.45, seed=9), eviction=(dv.LFU(), dv.TTL(4))),
}


def zipf_keys(rng, n, step, vocab=80):
    """Zipf-like ranks over a vocabulary that grows with the step, as 64-bit keys of any sign."""
    ranks = np.minimum(rng.zipf(1.3, n) - 1 + 2 * step, vocab + 3 * step)
    return dv.hash_keys(ranks.astype(np.int64), 77).view(np.int64)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_assign_under_jit_matches_the_reference(name):
    spec, capacity, n = SPECS[name], 12, 24
    tv = jdyn.TableVocab(0, "t", spec, capacity, D, E.Constant(0.0), 0, ())
    ref = dv.new_state(spec, capacity)
    arrs = jax.tree.map(jnp.asarray, jdyn.to_arrays(ref))

    @jax.jit
    def step_fn(arrs, lo, hi, valid, step):
        return jdyn.assign(tv, arrs, lo, hi, valid, step, True)

    rng = np.random.default_rng(1)
    seen_evictions = 0
    for step in range(24):
        m = 0 if step == 7 else int(rng.integers(1, n + 1))  # step 7: no key at all (padding only)
        keys = zipf_keys(rng, m, step)
        lo, hi = (np.zeros(n, np.uint32) for _ in range(2))
        lo[:m], hi[:m] = jdyn.to_words(keys)
        valid = np.arange(n) < m
        rows, arrs, gr, _, _, take = step_fn(arrs, lo, hi, valid, np.int32(step))
        want_rows, ref, fresh = dv.assign(ref, keys, step)
        np.testing.assert_array_equal(np.asarray(rows)[:m], want_rows)
        assert (np.asarray(rows)[m:] == -1).all()
        np.testing.assert_array_equal(np.sort(np.asarray(gr)[np.asarray(take)]), fresh)
        got = jdyn.from_arrays(tv, arrs)
        assert got.equal(ref), (step, got.stats, ref.stats)
        seen_evictions = ref.stats["evicted"]
    assert seen_evictions > 0 and ref.stats["admitted"] > capacity  # the stream put the table under pressure
    if isinstance(spec.admission, (dv.AfterOccurrences, dv.Probability)):
        assert ref.stats["rejected"] > 0
    assert step_fn._cache_size() == 1


# ----------------------------------------------------------------------------- whole steps vs the engine
def config(spec, optimizer=None, combiner="sum", capacity=24):
    optimizer = optimizer or E.SGD(learning_rate=0.1)
    return me.EmbeddingConfig(
        tables=[me.TableConfig("item", capacity, D, optimizer=optimizer, combiner=combiner, dynamic=spec),
                me.TableConfig("plain", 10, 2, optimizer=E.SGD(learning_rate=0.1))],
        features=[me.FeatureConfig("item", (B,), name="item"), me.FeatureConfig("item", (B, 3), name="history"),
                  me.FeatureConfig("plain", (B,), name="plain")],
        sharding_strategy="mod")


def stream(step):
    """The keys of step ``step``: a dense feature, a ragged one (padding inside the capacity), a plain one."""
    rng = np.random.default_rng(1000 + step)
    lengths = rng.integers(0, 5, B)
    hist = me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), zipf_keys(rng, int(lengths.sum()), step))
    return [zipf_keys(rng, B, step), hist, rng.integers(0, 10, B)]


CAPS = {"item": B, "history": 4 * B, "plain": B}


def grads_of(acts):
    return [a * 0.5 - 0.25 for a in acts]


def jitted_step():
    @jax.jit
    def step(state, kb):
        state, batch = me.jax.map_keys(state, kb)
        acts = me.jax.lookup(state, batch)
        grads = {k: v * 0.5 - 0.25 for k, v in acts.items()}
        return me.jax.apply_gradients(state, batch, grads), acts, batch.ids
    return step


def engine_step(emb, s):
    emb.enqueue(stream(s))
    rows = [np.asarray(f.ids) for f in emb.pending.features]
    acts = [np.asarray(emb.backend.to_numpy(a)) for a in emb.dequeue()]
    emb.apply_gradients(grads_of(acts))
    return acts, rows


CASES = {  # name: (spec, optimizer, combiner, tolerance of the values: 0 = the same bits); "int64": x64 on
    "always_lru": (dv.DynamicVocabulary(), None, "sum", 0.0),
    "after_n_ttl": (dv.DynamicVocabulary(admission=dv.AfterOccurrences(2, sketch_width=64, halve_every=4),
                                         eviction=dv.TTL(3)), E.Adagrad(learning_rate=0.2), "mean", 0.0),
    "lfu_int64": (dv.DynamicVocabulary(eviction=dv.LFU()), E.SGD(learning_rate=0.1), "sqrtn", 0.0),
}


def check_same(state, emb, tol):
    for name in ("item", "plain"):
        got, want = state.parameters(name), emb.retrieve_parameters(name)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol)
    assert me.jax.vocabulary(state, "item").equal(emb.vocabulary("item"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_jitted_steps_match_the_numpy_engine(case):
    spec, opt, combiner, tol = CASES[case]
    cfg = config(spec, opt, combiner)
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=2, seed=5)
    state = me.jax.init(cfg, num_shards=2, seed=5)
    check_same(state, emb, 0.0)
    step = jitted_step()
    dyn_features = (0, 1)
    for s in range(10):
        kb = me.jax.prepare(state, stream(s), capacity=CAPS)
        state, acts, ids = step(state, kb)
        want_acts, want_rows = engine_step(emb, s)
        for k, name in enumerate(("item", "history", "plain")):  # a dict comes back from jit sorted by key
            np.testing.assert_allclose(np.asarray(acts[name]), want_acts[k], rtol=tol, atol=tol)
        for k in dyn_features:  # rows per position: the engine's batch leaves keys without a row out
            real = np.asarray(kb.batch.slots[k]) < kb.features[k].num_slots
            r = np.asarray(ids[k])[real]
            np.testing.assert_array_equal(r[r >= 0], want_rows[k])
        check_same(state, emb, tol)
    st = emb.vocabulary("item").stats
    assert st["evicted"] > 0 and st["admitted"] > 24, st  # capacity 24: under pressure
    if not isinstance(spec.admission, dv.Always):
        assert st["rejected"] > 0
    assert step._cache_size() == 1  # one program for every step
    assert state.step.dtype == (jnp.int64 if case.endswith("int64") else jnp.int32)


def test_checkpoint_mid_run_resumes_equal_both_ways(tmp_path):
    spec, opt, combiner, _ = CASES["after_n_ttl"]
    cfg = config(spec, opt, combiner)
    step = jitted_step()
    straight = me.TPUEmbedding(cfg, backend="numpy", num_shards=2, seed=5)  # what both resumes must equal
    for s in range(4):
        engine_step(straight, s)
    straight.save(tmp_path / "from_numpy")
    for s in range(4, 8):
        engine_step(straight, s)
    # me.jax -> checkpoint -> the NumPy engine on 4 shards
    state = me.jax.init(cfg, num_shards=2, seed=5)
    for s in range(4):
        state = step(state, me.jax.prepare(state, stream(s), capacity=CAPS))[0]
    me.jax.save(state, tmp_path / "from_jax")
    emb = me.TPUEmbedding.restore(tmp_path / "from_jax", backend="numpy", num_shards=4)
    assert emb.vocabulary("item").equal(me.jax.vocabulary(state, "item"))
    for s in range(4, 8):
        engine_step(emb, s)
    for name in ("item", "plain"):
        for k, v in straight.retrieve_parameters(name).items():
            np.testing.assert_array_equal(emb.retrieve_parameters(name)[k], v)
    assert emb.vocabulary("item").equal(straight.vocabulary("item"))
    # the NumPy engine -> checkpoint -> me.jax (jitted steps)
    resumed = me.jax.restore(tmp_path / "from_numpy")
    for s in range(4, 8):
        resumed = step(resumed, me.jax.prepare(resumed, stream(s), capacity=CAPS))[0]
    check_same(resumed, straight, 0.0)
    assert int(resumed.step) == straight.step == 8


def test_restore_asks_again_for_a_callable_initializer(tmp_path):
    def init(shape, dtype=None, rng=None):
        return np.full(shape, 0.125, np.float32)

    cfg = config(dv.DynamicVocabulary())
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1, initializers={"item": init})
    engine_step(emb, 0)
    emb.save(tmp_path / "c")
    with pytest.raises(InputError, match=r"initializers=\{'item'"):
        me.jax.restore(tmp_path / "c")
    state = me.jax.restore(tmp_path / "c", initializers={"item": init})
    check_same(state, emb, 0.0)
    assert me.jax.to_engine(state).dynamic_initializers["item"] is init


def test_inference_reads_without_changing_anything():
    cfg = config(dv.DynamicVocabulary())
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    engine_step(emb, 0)
    state = me.jax.from_engine(emb)
    before = me.jax.vocabulary(state, "item")
    feats = stream(1)
    feats[0] = np.concatenate([before.resident()[0][:4], np.array([123, -5, 7, 9], np.int64)])
    kb = me.jax.prepare(state, feats, capacity=CAPS)
    after, batch = jax.jit(lambda st, kb: me.jax.map_keys(st, kb, training=False))(state, kb)
    assert me.jax.vocabulary(after, "item").equal(before)
    np.testing.assert_array_equal(np.asarray(batch.ids[0]), before.rows_of(feats[0]))
    acts = me.jax.lookup(after, batch)["item"]
    assert np.all(np.asarray(acts)[4:] == 0) and np.all(np.abs(np.asarray(acts)[:4]).sum(axis=1) > 0)
    for k, v in state.parameters("item").items():
        np.testing.assert_array_equal(after.parameters("item")[k], v)


def test_refusals_name_the_policy_and_the_fix():
    cfg = config(dv.DynamicVocabulary(eviction=(dv.LRU(), dv.NormBelow(0.1))))
    with pytest.raises(ConfigError, match="NormBelow"):
        me.jax.init(cfg)
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    with pytest.raises(ConfigError, match="NormBelow"):
        me.jax.from_engine(emb)
    state = me.jax.init(config(dv.DynamicVocabulary()), num_shards=1)
    kb = me.jax.prepare(state, stream(0), capacity=CAPS)
    with pytest.raises(InputError, match="map_keys"):
        me.jax.lookup(state, kb)
    with pytest.raises(InputError, match="map_keys"):
        me.jax.map_keys(state, kb.batch)
    with pytest.raises(InputError, match="dynamic tables"):
        me.jax.map_keys(type(state)(state.tables, state.step, state._static, {}), kb)


EIGHT_DEVICES = """
import jax, numpy as np, meshembed as me
from tests.test_jax_dynamic_vocab_jit import CAPS, CASES, check_same, config, engine_step, jitted_step, stream
assert jax.device_count() == 8
spec, opt, combiner, _ = CASES["after_n_ttl"]
cfg = config(spec, opt, combiner)
emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=3, seed=5)
state, step = me.jax.init(cfg, num_shards=8, seed=5), jitted_step()
for s in range(6):
    state = step(state, me.jax.prepare(state, stream(s), capacity=CAPS))[0]
    engine_step(emb, s)
    check_same(state, emb, 0.0)
assert step._cache_size() == 1 and len(state.tables["item"]["parameters"].sharding.device_set) == 8
state, batch = me.jax.map_keys(state, me.jax.prepare(state, stream(6), capacity=CAPS))  # eager: one program too
emb.enqueue(stream(6))
real = np.asarray(batch.slots[0]) < batch.features[0].num_slots
r = np.asarray(batch.ids[0])[real]
np.testing.assert_array_equal(r[r >= 0], emb.pending.features[0].ids)
assert me.jax.vocabulary(state, "item").equal(emb.vocabulary("item"))
st = emb.vocabulary("item").stats
assert st["evicted"] > 0 and st["rejected"] > 0, st
print("EIGHT OK")
"""


def test_eight_devices_sharded_tables_match_the_engine():
    """The key tables replicated, the tables over 8 devices (the re-initialisation scatters into
    the shards, the host callback's values reach every device), 3 NumPy shards: the same bits."""
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], capture_output=True, text=True, env=env, cwd=root,
                          timeout=600)
    assert proc.returncode == 0 and "EIGHT OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
