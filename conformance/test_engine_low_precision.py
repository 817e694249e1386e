"""Low-precision tables (docs/low_precision.md) through ``TPUEmbedding`` on every backend.

An SGD table stored in bfloat16 or float16, rounded to nearest or stochastically, is checked
bit for bit against a plain-NumPy reference of the documented definition (uint64 arithmetic,
Philox-4x32-10 with Python-sized words: no code shared with ``meshembed.math.rounding``), on
1, 2 and 4 shards; an Adagrad table with 16-bit parameters and slots gives the NumPy
backend's bits. On ``jax-functional`` every step runs through jitted me.jax and is checked
against the engine's step bit for bit (``functional_jax.py``), so the definition holds for
me.jax too; several processes refuse such tables.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me

E = me.embedding
P = me.embedding.Precision
V, D, B = 13, 6, 9
LR = 0.05
SEED = 77


def _philox(ctr: list[np.ndarray], key: tuple[int, int]) -> list[np.ndarray]:
    c = [np.asarray(x, np.uint64) for x in ctr]
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & np.uint64(0xFFFFFFFF),
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & np.uint64(0xFFFFFFFF)]
    return c


def _random(rows: np.ndarray, step: int, stream: int) -> np.ndarray:
    """[rows, D] random integers of the documented key and counter."""
    rows = rows.astype(np.uint64)[:, None]
    cols = np.arange(D, dtype=np.uint64)[None, :]
    ctr = [cols // np.uint64(4) + 0 * rows, (rows & np.uint64(0xFFFFFFFF)) + 0 * cols,
           (rows >> np.uint64(32)) + 0 * cols, np.full((len(rows), D), step, np.uint64)]
    words = _philox(ctr, (SEED, stream))
    pick = np.stack(words, -1)[np.arange(len(rows))[:, None], np.arange(D)[None, :], (cols % np.uint64(4)).astype(int)]
    return pick & np.uint64(0x7FFFFFFF)


def _round(x: np.ndarray, dtype: str, r: np.ndarray | None) -> np.ndarray:
    """float32 -> the 16-bit patterns (uint16) of the documented rule (finite values)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    s, a = b >> np.uint64(31), b & np.uint64(0x7FFFFFFF)
    one = np.uint64(1)
    if dtype == "bfloat16":
        add = (r & np.uint64(0xFFFF)) if r is not None else np.uint64(0x7FFF) + ((a >> np.uint64(16)) & one)
        h = (a + add) >> np.uint64(16)
    else:
        e = a >> np.uint64(23)
        c = a - np.minimum(a, np.uint64(112 << 23))
        add = (r & np.uint64(0x1FFF)) if r is not None else np.uint64(0xFFF) + ((c >> np.uint64(13)) & one)
        normal = np.minimum((c + add) >> np.uint64(13), np.uint64(0x7C00))
        g = (a & np.uint64(0x7FFFFF)) | np.where(e > 0, np.uint64(0x800000), np.uint64(0))
        t = np.uint64(126) - np.maximum(e, one).astype(np.int64).clip(None, 126).astype(np.uint64)
        if r is not None:
            k = np.minimum(t, np.uint64(30))
            sub = ((g >> (t - k)) + (r & ((one << k) - one))) >> k
        else:
            u = np.minimum(t, np.uint64(25))
            sub = (g + (one << (u - one)) - one + ((g >> u) & one)) >> u
        h = np.where(e >= 113, normal, sub)
    return (h | (s << np.uint64(15))).astype(np.uint16)


def _widen(h: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (h.astype(np.uint32) << 16).view(np.float32)
    return h.view(np.float16).astype(np.float32)


def _config(dtype: str, rounding: str, opt=None, slots="float32") -> me.EmbeddingConfig:
    tables = [me.TableConfig("t", V, D, optimizer=opt or E.SGD(LR), combiner="sum",
                             precision=P(parameters=dtype, slots=slots, rounding=rounding, seed=SEED))]
    return me.EmbeddingConfig(tables=tables, features=[me.FeatureConfig("t", (B,), name="f")])


def _batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(0, V, B), (rng.standard_normal((B, D)) * 10.0 ** rng.integers(-5, 1, (B, 1)))
             .astype(np.float32)) for _ in range(steps)]


def _check_refused(cfg: me.EmbeddingConfig, backend, shards: int) -> None:
    """Several processes refuse at construction."""
    with pytest.raises(me.ConfigError, match="process"):
        me.TPUEmbedding(cfg, backend=backend, num_shards=shards)


def _refused(backend_name: str, backend) -> bool:
    return backend.processes > 1  # `backend`: the one under a front end


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_sgd_bits_match_the_numpy_definition(backend, backend_name, dtype, rounding, shards):
    if _refused(backend_name, backend):
        return _check_refused(_config(dtype, rounding), backend, shards)
    init = np.random.default_rng(1).standard_normal((V, D)).astype(np.float32) * np.float32(0.01)
    emb = me.TPUEmbedding(_config(dtype, rounding), backend=backend, num_shards=shards, initializers={"t": init})
    rows = _round(init, dtype, None)  # creation rounds to nearest
    for step, (ids, g) in enumerate(_batches(5)):
        emb.enqueue([ids])
        emb.dequeue()
        emb.apply_gradients([g])
        summed = np.zeros((V, D), np.float32)
        np.add.at(summed, ids, g)
        uids = np.unique(ids)
        new = _widen(rows[uids], dtype) - np.float32(LR) * summed[uids]
        rows[uids] = _round(new, dtype, _random(uids, step, 0) if rounding == "stochastic" else None)
    got = emb.retrieve_parameters("t")["parameters"]
    np.testing.assert_array_equal(got.view(np.uint32), _widen(rows, dtype).view(np.uint32))


def test_adagrad_with_16_bit_slots_gives_the_numpy_backends_bits(backend, backend_name):
    cfg = _config("bfloat16", "stochastic", E.Adagrad(0.2), slots="float16")
    if _refused(backend_name, backend):
        return _check_refused(cfg, backend, 2)
    runs = [me.TPUEmbedding(cfg, backend="numpy", num_shards=1, seed=3),
            me.TPUEmbedding(cfg, backend=backend, num_shards=2, seed=3)]
    for ids, g in _batches(4):
        for emb in runs:
            emb.enqueue([ids])
            emb.dequeue()
            emb.apply_gradients([g])
    want, got = (e.retrieve_parameters("t") for e in runs)
    for k in want:
        np.testing.assert_array_equal(got[k].view(np.uint32), want[k].view(np.uint32), err_msg=k)


def _optimizers() -> dict:
    return {
        "SGD": E.SGD(0.1), "Adagrad": E.Adagrad(0.2),
        "AdagradMomentum": E.AdagradMomentum(0.1, momentum=0.9),
        "AdagradMomentumNesterov": E.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True),
        "BoundedAdagrad": E.BoundedAdagrad(0.1), "FrequencyAwareAdagrad": E.FrequencyAwareAdagrad(0.1, step_counter=lambda: 7),
        "FTRL": E.FTRL(0.15), "FTRLMultiplyLinearByLr": E.FTRL(0.15, multiply_linear_by_learning_rate=True),
        "Adam": E.Adam(0.05), "AdamNonLazy": E.Adam(0.05, lazy_adam=False),
        "Momentum": E.Momentum(0.1, momentum=0.9), "MomentumNesterov": E.Momentum(0.1, momentum=0.9, use_nesterov=True),
        "Lion": E.Lion(0.01), "LionNonLazy": E.Lion(0.01, use_non_lazy_lion=True),
        "RMSProp": E.RMSProp(0.05), "CenteredRMSProp": E.CenteredRMSProp(0.05), "Adadelta": E.Adadelta(0.5),
        "ProximalAdagrad": E.ProximalAdagrad(0.1), "OnlineYogi": E.OnlineYogi(0.15),
        "ProximalYogi": E.ProximalYogi(0.05), "Assign": E.Assign(),
    }


#: On jax-functional (jitted me.jax: a full step compiled per optimizer, ~20 s of CPU each) and
#: over 4 ranks (conformance/device_repeats.py) only the rules with a division by a scalar, a pow
#: or every row updated run (on 8 JAX devices none: one shard is on one device); the update itself
#: is the program the 1-device ``jax`` entry checks for every optimizer
#: (meshembed_jax.kernels.low_precision).
SUBSET = {"AdagradMomentum", "FTRL", "OnlineYogi", "AdamNonLazy"}


@pytest.mark.parametrize("optimizer", sorted(_optimizers()))
def test_every_optimizer_gives_the_numpy_backends_bits(backend, backend_name, optimizer):
    """Every optimizer the engine stores in 16 bits, bfloat16 parameters with SR and float32
    slots (table ``a``) or bfloat16 slots (table ``b``), 3 steps on 1 shard: the NumPy
    backend's bits, slots included (on JAX: the compiled update, exact.py's sealed math; on
    torch: the generated row kernel, or NumPy's own math where the rule calls pow/exp/log)."""
    def config() -> me.EmbeddingConfig:
        tables = [me.TableConfig(name, V, D, optimizer=_optimizers()[optimizer], combiner="sum",
                                 precision=P(parameters="bfloat16", slots=slots, rounding="stochastic", seed=SEED))
                  for name, slots in (("a", "float32"), ("b", "bfloat16"))]
        return me.EmbeddingConfig(tables=tables, features=[me.FeatureConfig("a", (B,), name="fa"),
                                                           me.FeatureConfig("b", (B,), name="fb")])

    if _refused(backend_name, backend):
        return _check_refused(config(), backend, 1)
    if backend_name == "jax-functional" and optimizer not in SUBSET:
        pytest.skip("jax-functional runs a subset (CI time); the jax entry checks this optimizer's program")
    runs = [me.TPUEmbedding(config(), backend="numpy", num_shards=1, seed=3),
            me.TPUEmbedding(config(), backend=backend, num_shards=1, seed=3)]
    for ids, g in _batches(3):
        for emb in runs:
            emb.enqueue([ids, ids[::-1].copy()])
            emb.dequeue()
            emb.apply_gradients([g, g[::-1].copy()])
    for t in ("a", "b"):
        want, got = (e.retrieve_parameters(t) for e in runs)
        for k in want:
            differ = int(np.sum(got[k].view(np.uint32) != want[k].view(np.uint32)))
            assert differ == 0, f"{optimizer}: table {t} ({'float32 slots' if t == 'a' else 'bfloat16 slots'}) {k}: " \
                f"{differ} values differ"
