"""Low-precision tables (#32, docs/low_precision.md): bfloat16 / float16 storage, rounding to
nearest or stochastically with Philox-4x32-10 random bits, the same bits on every backend and
shard count, checkpoints that resume bit for bit.

* ``meshembed.math.rounding`` against independent references: Random123's known-answer
  vectors (and TensorFlow's stateless Philox where installed), IEEE casts (``np.float16``,
  ``ml_dtypes.bfloat16``) for round-to-nearest and widening, and an exact rational reading of
  the documented stochastic rule;
* the engine: stored bits identical on numpy, torch, jax and array_api_strict over 1, 2 and 4
  shards (and 8 JAX devices in a subprocess), independent of batch order; SR unbiased where
  round-to-nearest stalls; checkpoints; me.torch / me.tpu / me.jax.

This file is also the worker of the 8-device JAX run (``python tests/test_low_precision.py jax8 OUT``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

import meshembed as me
from meshembed.math.rounding import philox4x32, random_words, round_bits, widen_bits

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = ("numpy", "torch", "jax", "array_api_strict")
P = me.embedding.Precision


def _xp():
    import array_api_compat.numpy as xp

    return xp


def _usable(name: str) -> bool:
    return name in me.available_backends()


# -- the generator ---------------------------------------------------------------------------------
def _philox_reference(ctr, key, rounds=10):
    """Philox-4x32 with Python ints (Random123's definition, no limbs)."""
    c, (k0, k1) = [int(x) for x in ctr], key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
    return c


def _words(ctr_arrays, key):
    """philox4x32 of uint32 host arrays, back as uint32 arrays."""
    limbs = [(np.asarray(c, np.int64) & 0xFFFF).astype(np.int32) for c in ctr_arrays]
    his = [(np.asarray(c, np.int64) >> 16).astype(np.int32) for c in ctr_arrays]
    out = philox4x32(_xp(), list(zip(limbs, his)), key)
    return [np.asarray(lo).astype(np.uint32) | (np.asarray(hi).astype(np.uint32) << 16) for lo, hi in out]


# Random123's kat_vectors for philox4x32_10: (counter, key, output)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert tuple(_philox_reference(ctr, key)) == want
    got = _words([np.array([c], np.uint32) for c in ctr], key)
    assert tuple(int(w[0]) for w in got) == want


def test_philox_limbs_match_the_reference_on_random_counters():
    rng = np.random.default_rng(0)
    ctr = [rng.integers(0, 2**32, 300, dtype=np.uint64).astype(np.uint32) for _ in range(4)]
    key = (int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32)))
    got = _words(ctr, key)
    for i in range(300):
        assert [int(w[i]) for w in got] == _philox_reference([c[i] for c in ctr], key)


def test_philox_matches_tensorflow_stateless():
    """TensorFlow's stateless Philox (alg=1) is Philox-4x32-10 with key = k1 << 32 | k0 and
    counter words (c1 << 32 | c0, c3 << 32 | c2): the same words, an independent implementation."""
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(1)
    for _ in range(5):
        c = [int(x) for x in rng.integers(0, 2**32, 4)]
        k = [int(x) for x in rng.integers(0, 2**32, 2)]
        out = tf.raw_ops.StatelessRandomUniformFullIntV2(
            shape=[4], key=tf.constant([k[1] << 32 | k[0]], tf.uint64),
            counter=tf.constant([c[1] << 32 | c[0], c[3] << 32 | c[2]], tf.uint64), alg=1, dtype=tf.uint32).numpy()
        got = _words([np.array([x], np.uint32) for x in c], tuple(k))
        assert [int(w[0]) for w in got] == [int(x) for x in out]


def test_random_words_layout():
    """Value (i, j) is word j % 4 of philox(counter=(j // 4, row lo, row hi, step), key=(seed, stream)), low 31 bits."""
    rows = np.array([5, 0, 2**33 + 7], np.int64)
    out = np.asarray(random_words(_xp(), 11, 300, 9, rows, 6))
    assert out.shape == (3, 6) and out.dtype == np.int32
    for i, row in enumerate(rows):
        for j in range(6):
            ref = _philox_reference((j // 4, row & 0xFFFFFFFF, row >> 32, 9), (11, 300))[j % 4]
            assert out[i, j] == ref & 0x7FFFFFFF


# -- rounding -----------------------------------------------------------------------------------
def _patterns(n=400_000, seed=0):
    """float32 bit patterns: random, every class and edge (zeros, subnormals, float16's
    subnormal range and overflow edge, inf, NaNs) with both signs."""
    rng = np.random.default_rng(seed)
    edges = np.array([0, 1, 0x7FFFFF, 0x800000, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7F7FFFFF,
                      0x7F7F8000, 0x7F7F7FFF, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,
                      0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x33800000, 0x337FFFFF, 0x3F800000,
                      0x3F808000, 0x3F818000], np.uint32)
    parts = [rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32), edges,
             rng.integers(0x2F000000, 0x39000000, n // 4, dtype=np.uint64).astype(np.uint32)]
    bits = np.concatenate(parts)
    return np.concatenate([bits, bits ^ 0x80000000])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_nearest_is_the_ieee_cast(dtype):
    bits = _patterns()
    f = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "float16":
            ref = f.astype(np.float16)
        else:
            ml_dtypes = pytest.importorskip("ml_dtypes")
            ref = f.astype(ml_dtypes.bfloat16)
    got = np.asarray(round_bits(_xp(), bits.view(np.int32), dtype, "nearest"))
    assert got.dtype == np.int16
    nan = np.isnan(f)
    assert np.array_equal(got.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    back = np.asarray(widen_bits(_xp(), got, dtype)).view(np.float32)
    assert np.array_equal(np.isnan(back), nan)  # NaN stays NaN (quiet), whatever its payload
    assert np.array_equal(np.signbit(back[nan]), np.signbit(f[nan]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_widening_is_exact_for_every_pattern(dtype):
    every = np.arange(2**16, dtype=np.uint16)
    got = np.asarray(widen_bits(_xp(), every.view(np.int16), dtype)).view(np.uint32)
    if dtype == "float16":
        ref = every.view(np.float16).astype(np.float32).view(np.uint32)
    else:
        ref = every.astype(np.uint32) << 16  # bfloat16 is the high half of float32
    assert np.array_equal(got, ref)


def _sr_reference(x: np.float32, r: int, dtype: str) -> int:
    """The documented stochastic rule read on exact values (Fractions): the 16-bit pattern."""
    bits = int(np.array(x, np.float32).view(np.uint32))
    sign, mag = bits >> 31, bits & 0x7FFFFFFF
    if mag > 0x7F800000:  # NaN: quiet, top payload bits kept
        h = ((mag >> 16) | 0x40) if dtype == "bfloat16" else (0x7E00 | ((mag >> 13) & 0x3FF))
        return h | sign << 15
    if mag == 0x7F800000:
        return (0x7F80 if dtype == "bfloat16" else 0x7C00) | sign << 15
    e, m = mag >> 23, mag & 0x7FFFFF
    value = Fraction((m | (0x800000 if e else 0)), 1) * Fraction(2) ** (max(e, 1) - 150)
    if dtype == "bfloat16":  # quantum: 2**(E - 7) (E: the unbiased exponent, subnormals as E = -126)
        q, k = Fraction(2) ** (max(e, 1) - 127 - 7), 16
        n = int(value / q + Fraction(r & 0xFFFF, 2**16))  # value / q has at most 16 fractional bits
        # n counts quanta of the value's binade; back to a pattern through float32
        out = float(n * q)
        if out >= 2.0**128:
            return 0x7F80 | sign << 15
        return int(np.array(out, np.float32).view(np.uint32)) >> 16 | sign << 15
    if e >= 113:  # float16's normal range: quantum 2**(E - 10), 13 random bits
        q = Fraction(2) ** (e - 127 - 10)
        n = int(value / q + Fraction(r & 0x1FFF, 2**13))
        out = n * q
        if out >= 65536:
            return 0x7C00 | sign << 15
        return int(np.array(float(out), np.float16).view(np.uint16)) | sign << 15
    t = 126 - max(e, 1)  # subnormal float16 (quantum 2**-24): value / 2**-24 has t fractional bits
    k = min(t, 30)  # at most 30 of them take part: the value truncated to k fractional bits
    units = value * 2**24
    truncated = Fraction(int(units * 2**k), 2**k)
    n = int(truncated + Fraction(r & ((1 << k) - 1), 2**k))
    return n | sign << 15


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_matches_the_exact_definition(dtype):
    bits = _patterns(n=3000, seed=3)
    rng = np.random.default_rng(4)
    r = rng.integers(0, 2**31, bits.shape[0], dtype=np.int64).astype(np.int32)
    got = np.asarray(round_bits(_xp(), bits.view(np.int32), dtype, "stochastic", r)).view(np.uint16)
    f = bits.view(np.float32)
    for i in range(bits.shape[0]):
        assert int(got[i]) == _sr_reference(f[i], int(r[i]), dtype), (hex(int(bits[i])), int(r[i]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_is_unbiased_where_nearest_stalls(dtype):
    """1 + 1e-3/64 rounded many times: nearest always gives 1 (the update is lost), the mean of
    the stochastic results is the float32 value within 4 standard errors; values already on
    the grid never move."""
    n = 200_000
    x = np.full(n, np.float32(1) + np.float32(1e-3 / 64), np.float32)
    r = np.asarray(random_words(_xp(), 0, 0, 0, np.arange(n), 1)).reshape(-1)
    xp = _xp()
    near = np.asarray(widen_bits(xp, round_bits(xp, x.view(np.int32), dtype, "nearest"), dtype)).view(np.float32)
    sr = np.asarray(widen_bits(xp, round_bits(xp, x.view(np.int32), dtype, "stochastic", r), dtype)).view(np.float32)
    assert np.all(near == 1.0)
    ulp = 2.0**-7 if dtype == "bfloat16" else 2.0**-10
    assert set(np.unique(sr)) <= {1.0, 1.0 + ulp}
    p = (float(x[0]) - 1.0) / ulp
    assert abs(sr.astype(np.float64).mean() - float(x[0])) < 4 * ulp * np.sqrt(p * (1 - p) / n)
    grid = np.asarray(widen_bits(xp, round_bits(xp, x.view(np.int32), dtype, "nearest"), dtype)).view(np.float32)
    again = np.asarray(widen_bits(xp, round_bits(xp, grid.view(np.int32), dtype, "stochastic", r), dtype))
    assert np.array_equal(again.view(np.float32), grid)


def test_rounding_runs_on_every_namespace():
    """The same int16 patterns from torch, JAX and array_api_strict as from NumPy (the ops are
    integer arithmetic over int32: no uint32, no int64)."""
    bits = _patterns(n=20_000, seed=5).view(np.int32)
    r = np.random.default_rng(6).integers(0, 2**31, bits.shape[0], dtype=np.int64).astype(np.int32)
    want = {(d, m): np.asarray(round_bits(_xp(), bits, d, m, r)) for d in ("bfloat16", "float16")
            for m in ("nearest", "stochastic")}
    widened = {d: np.asarray(widen_bits(_xp(), want[(d, "nearest")], d)) for d in ("bfloat16", "float16")}
    for name in BACKENDS[1:]:
        if not _usable(name):
            continue
        be = me.get_backend(name)
        xb, rb = be.asarray(bits), be.asarray(r)
        for (d, m), ref in want.items():
            got = be.to_numpy(round_bits(be.xp, xb, d, m, rb))
            assert np.array_equal(got, ref), (name, d, m)
        for d, ref in widened.items():
            assert np.array_equal(be.to_numpy(widen_bits(be.xp, be.asarray(want[(d, "nearest")]), d)), ref), name
        words = be.to_numpy(random_words(be.xp, 3, 5, 7, np.array([1, 9, 2**40]), 5))
        assert np.array_equal(words, np.asarray(random_words(_xp(), 3, 5, 7, np.array([1, 9, 2**40]), 5))), name


# -- config ------------------------------------------------------------------------------------
def test_precision_spec():
    p = P(parameters="bf16", slots={"accumulators": np.float16}, rounding="Nearest", seed=3)
    assert (p.parameters, p.slot_dtype("accumulators"), p.slot_dtype("other"), p.rounding) == \
        ("bfloat16", "float16", "float32", "nearest")
    assert P.from_json(json.loads(json.dumps(p.to_json()))) == p and hash(p) == hash(P.from_json(p.to_json()))
    for bad in (dict(parameters="int8"), dict(slots={"a": "float64"}), dict(rounding="up"), dict(seed=-1),
                dict(seed=2**32), dict(seed=1.5), dict(slots={1: "float16"})):
        with pytest.raises(me.ConfigError):
            P(**bad)
    with pytest.raises(me.ConfigError, match="precision"):
        me.TableConfig(name="t", vocabulary_size=4, dimension=2, precision="bfloat16")


def test_proto_is_unchanged_by_the_extension():
    """The serialized TPUEmbeddingConfiguration stays what TF reads: the precision is not in it."""
    def cfg(p):
        return me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=10, dimension=4,
                                                         optimizer=me.embedding.SGD(0.1), precision=p)],
                                  features=[me.FeatureConfig(table="t", input_shape=(2,), name="f")])
    assert cfg(P(parameters="bfloat16")).to_proto() == cfg(None).to_proto()
    assert cfg(P(parameters="bfloat16")) != cfg(None)


def test_unknown_slot_and_unsupported_routes_are_refused():
    def cfg(p, **opt):
        return me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=10, dimension=4,
                                                         optimizer=me.embedding.Adagrad(0.1, **opt), precision=p)],
                                  features=[me.FeatureConfig(table="t", input_shape=(2,), name="f")])
    with pytest.raises(me.ConfigError, match="momenta"):
        me.TPUEmbedding(cfg(P(slots={"momenta": "bfloat16"})), backend="numpy")
    with pytest.raises(me.ConfigError, match="gradient accumulation"):
        me.TPUEmbedding(cfg(P(parameters="bfloat16"), use_gradient_accumulation=False), backend="numpy")


# -- the engine --------------------------------------------------------------------------------
V, D = 97, 7


def _config(rounding="stochastic", seed=5):
    return me.EmbeddingConfig(
        tables=[
            me.TableConfig(name="bf", vocabulary_size=V, dimension=D, combiner="mean",
                           optimizer=me.embedding.Adagrad(learning_rate=0.3),
                           precision=P(parameters="bfloat16", slots="bfloat16", rounding=rounding, seed=seed)),
            me.TableConfig(name="fp", vocabulary_size=V, dimension=D, combiner="sum",
                           optimizer=me.embedding.Adam(learning_rate=0.05),
                           precision=P(parameters="float16", slots={"velocities": "bfloat16"}, rounding=rounding,
                                       seed=seed)),
            me.TableConfig(name="f32", vocabulary_size=V, dimension=D, optimizer=me.embedding.SGD(0.1)),
        ],
        features=[
            me.FeatureConfig(table="bf", input_shape=(12,), name="bag"),
            me.FeatureConfig(table="bf", input_shape=(6, 3), name="seq"),
            me.FeatureConfig(table="fp", input_shape=(12,), name="fp_ids"),
            me.FeatureConfig(table="f32", input_shape=(12,), name="plain"),
        ])


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        bag = me.RaggedIds.from_lists([list(rng.integers(0, V, rng.integers(1, 5))) for _ in range(12)])
        feats = [bag, rng.integers(0, V, (6, 3)), rng.integers(0, V, 12), rng.integers(0, V, 12)]
        grads = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((12, D), (6, 3, D), (12, D), (12, D))]
        out.append((feats, grads))
    return out


def _train(emb, batches):
    acts = []
    for feats, grads in batches:
        emb.enqueue(feats)
        acts.append([emb.backend.to_numpy(a) for a in emb.dequeue()])
        emb.apply_gradients(grads)
    return acts


def _state(emb):
    return {t: {k: v.copy() for k, v in emb.retrieve_parameters(t).items()} for t in emb.table_names}


def _assert_same_bits(a, b, what=""):
    for t in a:
        for k in a[t]:
            assert np.array_equal(a[t][k].view(np.uint32), b[t][k].view(np.uint32)), (what, t, k)


@pytest.fixture(scope="module")
def reference():
    emb = me.TPUEmbedding(_config(), backend="numpy", num_shards=1, seed=1)
    acts = _train(emb, _batches(4))
    return _state(emb), acts


def test_stored_values_are_16_bit(reference):
    state, _ = reference
    bits = {t: {k: v.view(np.uint32) for k, v in s.items()} for t, s in state.items()}
    for k in ("parameters", "accumulators"):
        assert np.all(bits["bf"][k] & 0xFFFF == 0)
    assert np.array_equal(state["fp"]["parameters"], state["fp"]["parameters"].astype(np.float16).astype(np.float32))
    assert np.all(bits["fp"]["velocities"] & 0xFFFF == 0)
    assert not np.all(bits["fp"]["momenta"] & 0xFFFF == 0)  # a float32 slot


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_same_bits_on_every_backend_and_shard_count(reference, backend, shards):
    if not _usable(backend):
        pytest.skip(f"{backend} not installed")
    state, acts = reference
    emb = me.TPUEmbedding(_config(), backend=backend, num_shards=shards, seed=1)
    got = _train(emb, _batches(4))
    _assert_same_bits(state, _state(emb), (backend, shards))
    for a, b in zip(acts, got):  # float32 activations from the same 16-bit rows
        for x, y in zip(a, b):
            assert y.dtype == np.float32
            np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_non_lazy_adam_and_a_table_smaller_than_the_bucket(backend):
    """Every row updated (non-lazy Adam), and 17 of 20 rows looked up (JAX pads the update
    to the table's 20 rows, not the 32 of the bucket): the NumPy backend's bits."""
    if not _usable(backend):
        pytest.skip(f"{backend} not installed")
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="adam", vocabulary_size=V, dimension=D, combiner="sum",
                               optimizer=me.embedding.Adam(learning_rate=0.01, lazy_adam=False),
                               precision=P(parameters="bfloat16", slots="float16")),
                me.TableConfig(name="small", vocabulary_size=20, dimension=3, combiner="sum",
                               optimizer=me.embedding.Adagrad(0.1), precision=P(parameters="float16"))],
        features=[me.FeatureConfig(table="adam", input_shape=(8,), name="a"),
                  me.FeatureConfig(table="small", input_shape=(17,), name="s")])
    runs = [me.TPUEmbedding(cfg, backend="numpy", seed=2), me.TPUEmbedding(cfg, backend=backend, num_shards=2, seed=2)]
    rng = np.random.default_rng(5)
    for _ in range(3):
        feats = [rng.integers(0, V, 8), rng.permutation(20)[:17]]
        grads = [rng.standard_normal((8, D)).astype(np.float32), rng.standard_normal((17, 3)).astype(np.float32)]
        for emb in runs:
            emb.enqueue(feats)
            emb.dequeue()
            emb.apply_gradients(grads)
    _assert_same_bits(_state(runs[0]), _state(runs[1]), backend)


def test_random_bits_do_not_depend_on_batch_order():
    """Unique ids in another order within the batch: the same stored bits."""
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=V, dimension=D, combiner="sum",
                                                    optimizer=me.embedding.SGD(0.01),
                                                    precision=P(parameters="bfloat16"))],
                             features=[me.FeatureConfig(table="t", input_shape=(40,), name="f")])
    rng = np.random.default_rng(2)
    ids = rng.permutation(V)[:40]
    g = rng.standard_normal((40, D)).astype(np.float32)
    order = rng.permutation(40)
    out = []
    for perm in (np.arange(40), order):
        emb = me.TPUEmbedding(cfg, backend="numpy")
        emb.enqueue([ids[perm]])
        emb.dequeue()
        emb.apply_gradients([g[perm]])
        out.append(emb.retrieve_parameters("t")["parameters"])
    assert np.array_equal(out[0].view(np.uint32), out[1].view(np.uint32))


def test_nearest_is_the_rounded_float32_update():
    """rounding='nearest': the float32 update of the 16-bit rows, then the IEEE cast."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=V, dimension=D, combiner="sum",
                                                    optimizer=me.embedding.SGD(0.01),
                                                    precision=P(parameters="bfloat16", rounding="nearest"))],
                             features=[me.FeatureConfig(table="t", input_shape=(40,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="numpy")
    before = emb.retrieve_parameters("t")["parameters"]
    rng = np.random.default_rng(3)
    ids = rng.permutation(V)[:40]
    g = rng.standard_normal((40, D)).astype(np.float32)
    emb.enqueue([ids])
    emb.dequeue()
    emb.apply_gradients([g])
    want = before.copy()
    want[ids] = (before[ids] - np.float32(0.01) * g).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(emb.retrieve_parameters("t")["parameters"].view(np.uint32), want.view(np.uint32))


def test_sgd_tiny_updates_stall_with_nearest_and_move_with_stochastic():
    """The classic case: lr * g far below half an ulp of the row. Round-to-nearest never moves
    the row; stochastic rounding moves it by the float32 sum on average."""
    def run(rounding):
        cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=1, dimension=512, combiner="sum",
                                                        optimizer=me.embedding.SGD(1.0),
                                                        initializer=me.embedding.Constant(1.0),
                                                        precision=P(parameters="bfloat16", rounding=rounding))],
                                 features=[me.FeatureConfig(table="t", input_shape=(1,), name="f")])
        emb = me.TPUEmbedding(cfg, backend="numpy")
        for _ in range(100):
            emb.enqueue([np.zeros(1, np.int64)])
            emb.dequeue()
            emb.apply_gradients([np.full((1, 512), -1e-4, np.float32)])  # each step +1e-4; ulp(1) = 2**-7
        return emb.retrieve_parameters("t")["parameters"].astype(np.float64)

    assert np.all(run("nearest") == 1.0)
    sr = run("stochastic")
    # each step adds 1e-4 in expectation; the sum over 100 steps is 1e-2 (about 1.3 ulps)
    assert abs(sr.mean() - 1.01) < 0.002, sr.mean()


def test_load_rounds_to_nearest_and_retrieve_is_exact():
    cfg = _config()
    emb = me.TPUEmbedding(cfg, backend="numpy")
    x = np.random.default_rng(4).standard_normal((V, D)).astype(np.float32)
    emb.load_parameters("fp", x)
    assert np.array_equal(emb.retrieve_parameters("fp")["parameters"], x.astype(np.float16).astype(np.float32))
    assert np.array_equal(emb.embedding_tables["fp"], x.astype(np.float16).astype(np.float32))


def test_nonfinite_gradient_is_refused_and_nothing_changes():
    emb = me.TPUEmbedding(_config(), backend="numpy")
    before = _state(emb)
    (feats, grads), = _batches(1)
    grads[0][0, 0] = np.nan
    emb.enqueue(feats)
    emb.dequeue()
    with pytest.raises(me.InputError, match="NaN"):
        emb.apply_gradients(grads)
    _assert_same_bits(before, _state(emb))


# -- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,shards", [("numpy", 2), ("torch", 1), ("jax", 4), ("array_api_strict", 1)])
def test_checkpoint_resume_is_bit_identical(tmp_path, reference, backend, shards):
    if not _usable(backend):
        pytest.skip(f"{backend} not installed")
    state, _ = reference
    batches = _batches(4)
    emb = me.TPUEmbedding(_config(), backend="numpy", num_shards=3, seed=1)
    _train(emb, batches[:2])
    emb.save(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert [t["dtype"] for t in manifest["tables"]] == ["bfloat16", "float16", "float32"]
    assert manifest["tables"][0]["precision"]["seed"] == 5 and "precision" not in manifest["tables"][2]
    with np.load(tmp_path / "ck" / "arrays.npz") as z:  # stored in their dtype, never widened
        assert z["t0.parameters"].dtype == np.uint16 and z["t1.parameters"].dtype == np.float16
        assert z["t1.velocities"].dtype == np.uint16 and z["t1.momenta"].dtype == np.float32
    back = me.TPUEmbedding.restore(tmp_path / "ck", backend=backend, num_shards=shards)
    assert back.layout == emb.layout and back.step == 2
    _train(back, batches[2:])
    _assert_same_bits(state, _state(back), backend)


def test_restoring_into_other_storage_is_explicit(tmp_path):
    emb = me.TPUEmbedding(_config(), backend="numpy", seed=1)
    _train(emb, _batches(2))
    saved = _state(emb)
    emb.save(tmp_path / "ck")
    wide = me.TPUEmbedding.restore(tmp_path / "ck", precision={"bf": None, "fp": None})
    assert all(t.precision is None for t in wide.layout.tables)
    _assert_same_bits(saved, _state(wide))  # 16-bit values are exact in float32
    wide.save(tmp_path / "wide")
    narrow = me.TPUEmbedding.restore(tmp_path / "wide", precision={"f32": P(parameters="bfloat16")})
    assert narrow.layout.tables[2].precision == P(parameters="bfloat16")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    want = saved["f32"]["parameters"].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(narrow.retrieve_parameters("f32")["parameters"].view(np.uint32), want.view(np.uint32))
    with pytest.raises(me.InputError, match="no tables"):
        me.TPUEmbedding.restore(tmp_path / "ck", precision={"nope": None})
    with pytest.raises(me.InputError, match="precision"):
        me.TPUEmbedding.restore(tmp_path / "ck", precision="float32")


def test_damaged_precision_entry_is_refused(tmp_path):
    import hashlib

    from meshembed.embedding import checkpoint

    emb = me.TPUEmbedding(_config(), backend="numpy")
    emb.save(tmp_path / "ck")
    path = tmp_path / "ck" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tables"][0]["precision"]["parameters"] = "float16"  # arrays.npz holds bfloat16 patterns
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["manifest_sha256"] = hashlib.sha256(checkpoint._canonical(body)).hexdigest()
    path.write_text(json.dumps(manifest))
    with pytest.raises(me.CheckpointError, match="dtype"):
        me.TPUEmbedding.restore(tmp_path / "ck")


# -- front ends ---------------------------------------------------------------------------------
def test_torch_module_gives_the_engines_bits(reference):
    torch = pytest.importorskip("torch")
    state, _ = reference
    ec = me.torch.EmbeddingCollection(_config())
    base = me.TPUEmbedding(_config(), backend="numpy", seed=1)
    ec.engine.load_tables({t: base.retrieve_parameters(t) for t in base.table_names})
    for feats, grads in _batches(4):
        out = ec(dict(zip(ec.engine.feature_names, [torch.from_numpy(np.asarray(f)) if isinstance(f, np.ndarray)
                                                      else f for f in feats])))
        assert all(v.dtype == torch.float32 for v in out.values())
        loss = sum((out[n] * torch.from_numpy(g)).sum() for n, g in zip(ec.engine.feature_names, grads))
        loss.backward()
    _assert_same_bits(state, _state(ec.engine), "me.torch")


def test_tpu_front_end_takes_a_precision():
    E = me.tpu
    table = E.TableConfig(vocabulary_size=20, dim=4, name="user", precision=P(parameters="bfloat16"))
    emb = E.TPUEmbedding(feature_config={"user": E.FeatureConfig(table)}, optimizer=E.Adagrad(learning_rate=0.1))
    emb.enqueue({"user": np.array([1, 2, 3])}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()})
    values = np.asarray(emb.embedding_tables[table])
    assert values.dtype == np.float32 and np.all(values.view(np.uint32) & 0xFFFF == 0)


def test_jax_front_end_gives_the_engines_bits(reference):
    """jitted me.jax (tests/test_jax_low_precision.py has more: eager, 8 devices, checkpoints)."""
    if not _usable("jax"):
        pytest.skip("jax not installed")
    import jax

    state = me.jax.init(_config(), num_shards=2, seed=1)
    lookup, apply = jax.jit(me.jax.lookup), jax.jit(me.jax.apply_gradients)
    names = ("bag", "seq", "fp_ids", "plain")
    for (feats, grads), want in zip(_batches(4), reference[1]):
        batch = me.jax.prepare(state, feats)
        acts = lookup(state, batch)
        for n, w in zip(names, want):
            assert np.array_equal(np.asarray(acts[n]).view(np.uint32), w.view(np.uint32)), n
        state = apply(state, batch, dict(zip(names, grads)))
    _assert_same_bits(reference[0], {t: state.parameters(t) for t in reference[0]}, "me.jax")


def test_jax_engine_compiles_one_program_and_falls_back_where_inexact():
    """The JAX engine's update of a 16-bit table is one compiled program per table and shape
    (meshembed_jax.kernels.low_precision, via ``update_low_precision``); a dynamic rate meeting another
    scalar in the rule (lr x weight decay: the engine holds it as a Python float, double
    arithmetic) takes the generic path instead: NumPy's bits either way."""
    if not _usable("jax"):
        pytest.skip("jax not installed")
    from meshembed_jax.kernels import low_precision

    E = me.embedding

    def cfg(opt):
        return me.EmbeddingConfig(tables=[me.TableConfig("t", 29, 5, optimizer=opt, combiner="sum",
                                                         precision=P(parameters="bfloat16", seed=1))],
                                  features=[me.FeatureConfig("t", (8,), name="f")])

    for opt, inexact in ((E.FTRL(E.DynamicLearningRate(0)), None),
                         (E.Adagrad(E.DynamicLearningRate(0), weight_decay_factor=0.01,
                                    multiply_weight_decay_factor_by_learning_rate=True), True)):
        rng = np.random.default_rng(0)
        runs = [me.TPUEmbedding(cfg(opt), backend=b, num_shards=1, seed=2) for b in ("numpy", "jax")]
        for s in range(3):
            ids, g = rng.integers(0, 29, 8), (rng.standard_normal((8, 5)) * 0.3).astype(np.float32)
            for e in runs:
                e.enqueue([ids])
                e.dequeue()
                e.apply_gradients([g], learning_rates=[0.1 / (1 + s)])
        want, got = (e.retrieve_parameters("t") for e in runs)
        for k in want:
            assert np.array_equal(got[k].view(np.uint32), want[k].view(np.uint32)), (type(opt).__name__, k)
        programs = low_precision._PROGRAMS[runs[1].state.tables[0][0]]
        assert programs.get("inexact") is inexact
        if not inexact:  # one program for the table (a dynamic rate is an input, not a constant)
            assert len(programs) == 1, list(programs)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "fused_off"])
@pytest.mark.parametrize("optimizer", ["adagrad_momentum", "ftrl", "rms_prop", "sgd"])
def test_torch_gives_numpys_bits_with_fused_kernels_on_and_off(optimizer, fused):
    """bf16 parameters with SR and float32 slots on torch, the generated kernels on or off
    (off: NumPy's own rule math on the same rows, not torch operations): NumPy's bits."""
    pytest.importorskip("torch")
    from meshembed_torch import TorchBackend

    opt = {"adagrad_momentum": me.embedding.AdagradMomentum(learning_rate=0.1, momentum=0.9),
           "ftrl": me.embedding.FTRL(learning_rate=0.2), "rms_prop": me.embedding.RMSProp(learning_rate=0.05),
           "sgd": me.embedding.SGD(0.3)}[optimizer]
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=V, dimension=D, optimizer=opt, combiner="sum",
                               precision=P(parameters="bfloat16", slots="float32", seed=3))],
        features=[me.FeatureConfig(table="t", input_shape=(12,), name="f")])
    rng = np.random.default_rng(4)
    batches = [([rng.integers(0, V, 12)], [rng.standard_normal((12, D)).astype(np.float32)]) for _ in range(3)]
    runs = [me.TPUEmbedding(cfg, backend="numpy", seed=1), me.TPUEmbedding(cfg, backend=TorchBackend(fused=fused), seed=1)]
    for emb in runs:
        _train(emb, batches)
    _assert_same_bits(*(_state(e) for e in runs), optimizer)


# -- 8 JAX devices --------------------------------------------------------------------------------
def _jax8(out: str) -> None:
    """8 shards on 8 devices (fewer shards on 8 devices: conformance's test_engine_low_precision)."""
    emb = me.TPUEmbedding(_config(), backend="jax", num_shards=8, seed=1)
    _train(emb, _batches(4))
    results = {f"8.{t}.{k}": v for t, arrays in _state(emb).items() for k, v in arrays.items()}
    np.savez(out, **results)


@pytest.mark.slow
def test_same_bits_on_eight_jax_devices(tmp_path, reference):
    if not _usable("jax"):
        pytest.skip("jax not installed")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = tmp_path / "jax8.npz"
    run = subprocess.run([sys.executable, __file__, "jax8", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    state, _ = reference
    with np.load(out) as z:
        _assert_same_bits(state, {t: {k: z[f"8.{t}.{k}"] for k in state[t]} for t in state}, 8)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "jax8":
    import jax

    assert len(jax.devices()) == 8, jax.devices()
    _jax8(sys.argv[2])


def test_compiled_integer_programs_give_the_eager_bits():
    """The widening, the Philox words and the rounding run through ``Backend.compile`` (torch:
    inductor fuses their ~1000 integer operations where the arrays are large; W1's bf16 step
    went from over a second to ~60 ms). Integer arithmetic is exact: compiled, they give the
    eager bits (the words of two streams in one program, a float16 widening with subnormals,
    float16 to nearest and bfloat16 stochastic rounding with a dimension that cuts a group)."""
    pytest.importorskip("torch")
    from meshembed.embedding import precision
    from meshembed.math.rounding import counters
    from meshembed_torch.backend import TorchBackend

    compiled, eager = TorchBackend(compile="always"), TorchBackend(compile="never")
    rng = np.random.default_rng(3)
    n, dim = 300, 7
    ids = np.unique(rng.integers(0, 2**40, n))  # row ids past 2**32: both counter words
    rows = (rng.standard_normal((len(ids), dim)) * np.float32(10.0) ** rng.integers(-8, 6, (len(ids), dim)))
    rows = rows.astype(np.float32)
    halves = rng.integers(-2**15, 2**15, (len(ids), dim)).astype(np.int16)  # every kind of float16 pattern

    def run(be):
        xp = be.xp
        limbs = [limb for word in counters(xp, ids, 11, dim) for limb in word]
        words = precision._philox(be, 5, (3, 259))(*limbs)
        x = be.asarray(rows)
        return ([be.to_numpy(w) for ws in words for w in ws],
                be.to_numpy(precision._widener(be, "float16")(be.asarray(halves))).view(np.uint32),
                be.to_numpy(precision._rounder(be, "bfloat16", "stochastic", dim)(x, *words[1])),
                be.to_numpy(precision._rounder(be, "float16", "nearest", dim)(x)))

    want, got = run(eager), run(compiled)
    assert compiled._compiler.broken is False  # compiled, not the eager fallback after a failure
    for a, b in zip(want[0] + list(want[1:]), got[0] + list(got[1:])):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_a_compiled_module_over_a_large_bf16_table_gives_the_eager_engines_bits():
    """A ``torch.compile``'d ``me.torch`` module whose bfloat16 update arrays are large enough
    for the backend to compile its integer programs (a million elements or more) runs them from
    inside the module's update op — a compilation while the user's compiled graph runs — and
    gives the bits of the engine on an eager backend (``compile="never"``)."""
    torch = pytest.importorskip("torch")
    from meshembed_torch.backend import TorchBackend

    vocab, dim, bags, per_bag = 65536, 64, 8192, 4  # 32,768 ids: per-id rows of 2M elements
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=vocab, dimension=dim, combiner="sum",
                               optimizer=me.embedding.Adagrad(learning_rate=0.1),
                               precision=P(parameters="bfloat16", rounding="stochastic", seed=3))],
        features=[me.FeatureConfig(table="t", input_shape=(bags,), name="f")])
    ec = me.torch.EmbeddingCollection(cfg)
    module = torch.compile(ec, fullgraph=True, dynamic=False)
    engine = me.TPUEmbedding(cfg, backend=TorchBackend(compile="never"))
    rng = np.random.default_rng(0)
    splits = np.arange(0, bags * per_bag + 1, per_bag)
    for _ in range(2):
        ids = rng.integers(0, vocab, bags * per_bag)
        out = module([me.RaggedIds(torch.from_numpy(splits), torch.from_numpy(ids))])["f"]
        out.square().sum().backward()
        engine.enqueue([me.RaggedIds(splits, ids)])
        act = engine.dequeue()[0]
        assert torch.equal(out.detach(), act)
        engine.apply_gradients([2 * act])
    stats = ec.engine.backend.stats()
    assert stats.get("compiled_calls", 0) >= 2, stats  # the integer programs ran compiled, not eagerly
    assert engine.backend.stats().get("compiled_calls", 0) == 0
    for name in ("parameters", "accumulators"):
        got, want = ec.engine.retrieve_parameters("t")[name], engine.retrieve_parameters("t")[name]
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), name


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_an_update_in_chunks_gives_the_same_bits(reference, backend, monkeypatch):
    """The eager update of a 16-bit table runs its unique rows in chunks of a fixed size (the last
    one padded with rows it does not write): with chunks of 3 rows every table's update is
    chunked, and the bits are the reference's (one chunk each)."""
    if not _usable(backend):
        pytest.skip(f"{backend} not installed")
    from meshembed.embedding import precision

    monkeypatch.setattr(precision, "_UPDATE_ELEMENTS", 3 * D)
    before = precision._UPDATE_STATS["chunked"]
    state, _ = reference
    emb = me.TPUEmbedding(_config(), backend=backend, num_shards=1, seed=1)
    _train(emb, _batches(4))
    _assert_same_bits(state, _state(emb), backend)
    assert precision._UPDATE_STATS["chunked"] - before == 8  # 2 low-precision tables x 4 steps


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_chunked_update_that_fails_writes_nothing(backend, monkeypatch):
    """The chunks' new rows are all made before any is written: a failure in a later chunk (here
    the second chunk's rows) leaves every table and slot bit-identical."""
    if not _usable(backend):
        pytest.skip(f"{backend} not installed")
    from meshembed.embedding import precision

    monkeypatch.setattr(precision, "_UPDATE_ELEMENTS", 3 * D)
    emb = me.TPUEmbedding(_config(), backend=backend, num_shards=1, seed=1)
    _train(emb, _batches(1))
    before = _state(emb)
    real, calls = precision._new_rows, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("the second chunk")
        return real(*args, **kwargs)

    monkeypatch.setattr(precision, "_new_rows", failing)
    feats, grads = _batches(1, seed=1)[0]
    emb.enqueue(feats)
    emb.dequeue()
    with pytest.raises(Exception):
        emb.apply_gradients(grads)
    assert len(calls) == 2
    _assert_same_bits(before, _state(emb))
