"""Dynamic vocabularies on every backend (docs/dynamic_vocab.md): the same keys give the same
rows and values over 1/2/4 shards, the same admission/eviction decision at every step, and a
checkpoint taken mid-run resumes bit for bit on another backend and shard count.

The reference is the NumPy backend on one shard. SGD with the sum combiner is bit-exact on
every backend (every row gets one summed gradient, added once), so rows and values compare
exactly; Adagrad with mean compares values to the float32 tolerance, decisions exactly.
A backend running several processes refuses dynamic tables (one host maps the keys): there
the test checks the refusal."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import meshembed as me
from conformance.test_engine import assert_same_state
from meshembed.errors import ConfigError

E = me.embedding
D, B, STEPS = 4, 8, 10
SPECS = {
    "after2-lru-ttl": E.DynamicVocabulary(admission=E.AfterOccurrences(2), eviction=(E.LRU(), E.TTL(4))),
    "prob-lfu": E.DynamicVocabulary(admission=E.Probability(0.6, seed=7), eviction=E.LFU()),
}


def config(spec: str, optimizer=None, combiner="sum") -> me.EmbeddingConfig:
    opt = optimizer or E.SGD(learning_rate=0.1)
    return me.EmbeddingConfig(
        tables=[me.TableConfig("item", 12, D, optimizer=opt, combiner=combiner, dynamic=SPECS[spec]),
                me.TableConfig("plain", 10, 2, optimizer=E.SGD(learning_rate=0.1))],
        features=[me.FeatureConfig("item", (B,), name="item"), me.FeatureConfig("item", (B, 3), name="history"),
                  me.FeatureConfig("plain", (B,), name="plain")],
        sharding_strategy="mod")


def batch(step: int) -> list:
    """Zipf-ranked 64-bit keys (negative ones too) whose vocabulary grows with the step."""
    rng = np.random.default_rng(500 + step)
    base = np.int64(-0x61C8864680B583EB) * (np.arange(30 + 3 * step, dtype=np.int64) + 1)  # wraps: any sign
    pick = lambda n: base[np.minimum(rng.zipf(1.3, n) - 1 + step, base.shape[0] - 1)]  # noqa: E731
    lengths = rng.integers(0, 4, B)
    return [pick(B), me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), pick(int(lengths.sum()))),
            rng.integers(0, 10, B)]


def train(emb, start: int, stop: int) -> list:
    """Steps [start, stop); the vocabulary arrays after each (the decisions)."""
    seen = []
    for s in range(start, stop):
        emb.enqueue(batch(s))
        acts = emb.dequeue()
        emb.apply_gradients([np.asarray(emb.backend.to_numpy(a)) * 0.5 - 0.25 for a in acts])
        seen.append(emb.vocabulary("item").to_arrays())
    return seen


def tables(emb) -> dict:
    return {t: emb.retrieve_parameters(t) for t in ("item", "plain")}


@functools.lru_cache(maxsize=None)
def reference(spec: str, adagrad: bool = False) -> tuple:
    cfg = config(spec, E.Adagrad(learning_rate=0.2), "mean") if adagrad else config(spec)
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=1, seed=3)
    steps = train(emb, 0, STEPS)
    return steps, tables(emb)


def engine(backend, cfg, shards, **kw):
    """The engine, or None after checking that a multi-process backend refuses the config."""
    if backend.processes > 1:
        with pytest.raises(ConfigError, match="dynamic vocabulary.*processes"):
            me.TPUEmbedding(cfg, backend=backend, num_shards=shards, **kw)
        return None
    return me.TPUEmbedding(cfg, backend=backend, num_shards=shards, **kw)


def same_decisions(got: list, want: list) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {step}: {k}")


def train_and_check(emb, want_steps) -> dict:
    """Train ``STEPS`` steps, check every step's decisions, return the tables."""
    same_decisions(train(emb, 0, STEPS), want_steps)
    return tables(emb)


@pytest.mark.parametrize("spec,shards", [("after2-lru-ttl", 1), ("after2-lru-ttl", 2), ("after2-lru-ttl", 4),
                                         ("prob-lfu", 2)])
def test_same_keys_same_rows_decisions_and_values(backend, spec, shards):
    want_steps, want_tables = reference(spec)
    stats = want_steps[-1]["scalars"]  # admitted, evicted, rejected all > 0: the stream exercises them
    assert (stats[3:] > 0).all(), stats
    emb = engine(backend, config(spec), shards, seed=3)
    if emb is None:
        return
    assert_same_state(train_and_check(emb, want_steps), want_tables, exact=True)


def test_adagrad_mean_same_decisions_values_within_tolerance(backend):
    want_steps, want_tables = reference("after2-lru-ttl", adagrad=True)
    emb = engine(backend, config("after2-lru-ttl", E.Adagrad(learning_rate=0.2), "mean"), 2, seed=3)
    if emb is None:
        return
    assert_same_state(train_and_check(emb, want_steps), want_tables, exact=False)


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("direction", ["from-numpy", "to-numpy"])
def test_checkpoint_mid_run_resumes_bit_identical_elsewhere(backend, tmp_path, spec, direction):
    """Half the run on one backend and shard count, saved, the rest on another: the same
    decisions and bits as the reference run without a break."""
    want_steps, want_tables = reference(spec)
    half = STEPS // 2
    if direction == "from-numpy":
        first = me.TPUEmbedding(config(spec), backend="numpy", num_shards=2, seed=3)
    else:
        first = engine(backend, config(spec), 4, seed=3)
        if first is None:
            return
    assert_steps = train(first, 0, half)
    same_decisions(assert_steps, want_steps[:half])
    first.save(tmp_path / "ckpt")
    if direction == "from-numpy":
        if backend.processes > 1:
            with pytest.raises(ConfigError, match="dynamic vocabulary.*processes"):
                me.TPUEmbedding.restore(tmp_path / "ckpt", backend=backend, num_shards=4)
            return
        resumed = me.TPUEmbedding.restore(tmp_path / "ckpt", backend=backend, num_shards=4)
    else:
        resumed = me.TPUEmbedding.restore(tmp_path / "ckpt", backend="numpy", num_shards=1)
    assert resumed.step == half and resumed.vocabulary("item").equal(first.vocabulary("item"))
    same_decisions(train(resumed, half, STEPS), want_steps[half:])
    got = tables(resumed)
    for t in want_tables:
        for k in want_tables[t]:
            np.testing.assert_array_equal(got[t][k], want_tables[t][k], err_msg=f"{t}.{k}")
