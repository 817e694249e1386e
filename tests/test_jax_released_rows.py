"""The JAX backend writes a per-id lookup of >= 32 MiB over an earlier result nobody holds
(``meshembed_jax.table.ReleasedRows``, the FFI gather into a donated buffer): the values are
the table's rows every step, and a result the user still holds, or viewed through NumPy,
is never written over."""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'meshembed[jax]'")

import jax  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed_jax import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.usable("cpu", np.float32),
                                reason="the JAX CPU FFI kernels did not build here")

VOCAB, DIM, N = 1000, 64, 131072  # [131072, 1, 64] float32: 32 MiB, the size that is recycled


def _engine() -> me.TPUEmbedding:
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=VOCAB, dimension=DIM,
                               optimizer=me.embedding.SGD(0.5), combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(N, 1), name="f")],
    )
    return me.TPUEmbedding(cfg, backend="jax", num_shards=1)


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(N, 1))


def _table(emb: me.TPUEmbedding) -> np.ndarray:
    return np.asarray(emb.backend.to_numpy(emb.state.tables[0][0]))


def _step(emb: me.TPUEmbedding, seed: int, grad: np.ndarray) -> jax.Array:
    """One training step; returns the activations and checks them against the table."""
    ids = _ids(seed)
    want = _table(emb)[ids[:, 0]].reshape(N, 1, DIM)
    emb.enqueue([ids])
    acts = emb.dequeue()[0]
    np.testing.assert_array_equal(np.asarray(acts), want)
    emb.apply_gradients([grad])
    return acts


def test_released_results_are_written_over_and_every_lookup_is_exact():
    emb = _engine()
    grad = np.full((N, 1, DIM), 1e-3, np.float32)
    taken = []
    take = emb.backend._released.take
    emb.backend._released.take = lambda key: taken.append(take(key)) or taken[-1]
    for seed in range(6):
        acts = _step(emb, seed, grad)
        del acts
        gc.collect()
    # after the first results are released, the lookups write over them: no fresh 32 MiB
    reused = [t for t in taken if t is not None]
    assert len(reused) >= 4 and all(t.is_deleted() for t in reused), taken  # donated


@pytest.mark.parametrize("keep", ["array", "numpy_view"])
def test_what_the_user_keeps_is_never_written_over(keep):
    """The activations themselves, or a zero-copy NumPy view of them (XLA then declines to
    donate the buffer), stay as they were while later lookups run."""
    emb = _engine()
    grad = np.full((N, 1, DIM), 1e-3, np.float32)
    kept, copies = [], []
    for seed in range(5):
        acts = _step(emb, seed, grad)
        kept.append(acts if keep == "array" else np.asarray(acts))
        copies.append(np.array(acts))  # a copy, not a view
        del acts
        gc.collect()
    for k, copy in zip(kept, copies):
        np.testing.assert_array_equal(np.asarray(k), copy)


def test_the_loop_idiom_keeps_the_previous_step_valid():
    """``acts = emb.dequeue()`` rebinds only after the next lookup: that one must survive it."""
    emb = _engine()
    grad = np.full((N, 1, DIM), 1e-3, np.float32)
    previous = None
    for seed in range(5):
        ids = _ids(seed)
        want = _table(emb)[ids[:, 0]].reshape(N, 1, DIM)
        emb.enqueue([ids])
        before = None if previous is None else np.array(previous)
        acts = emb.dequeue()[0]
        if before is not None:
            np.testing.assert_array_equal(np.asarray(previous), before)
        np.testing.assert_array_equal(np.asarray(acts), want)
        emb.apply_gradients([grad])
        previous = acts


@pytest.mark.parametrize("n,dim", [(65600, 64), (88000, 48), (210000, 20)])
def test_large_lookups_of_any_width_are_exact(n, dim):
    """Outputs of >= 16 MiB are written with streaming stores where rows are whole cache
    lines (64, 48 floats), with plain copies otherwise (20): the table's rows either way,
    with a padded batch (n is no bucket size) too."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=VOCAB, dimension=dim, optimizer=me.embedding.SGD(0.5))],
        features=[me.FeatureConfig(table="t", input_shape=(n, 1), name="f")],
    )
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    ids = np.random.default_rng(n).integers(0, VOCAB, size=(n, 1))
    emb.enqueue([ids], training=False)
    acts = np.asarray(emb.dequeue()[0])
    np.testing.assert_array_equal(acts, _table(emb)[ids[:, 0]].reshape(n, 1, dim))


def test_a_padded_per_id_lookup_is_not_written_over_a_smaller_buffer():
    """A per-id batch that is no bucket size (padded ids) takes the plain lookup even at
    >= 32 MiB: the released buffer holds n rows, the padded lookup would write more."""
    n = 140000  # bucket(140000) = 147456: padded; 140000 x 64 float32 = 34 MiB
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=VOCAB, dimension=DIM, optimizer=me.embedding.SGD(0.5))],
        features=[me.FeatureConfig(table="t", input_shape=(n, 1), name="f")],
    )
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    for seed in range(3):
        ids = np.random.default_rng(seed).integers(0, VOCAB, size=(n, 1))
        emb.enqueue([ids], training=False)
        acts = emb.dequeue()[0]
        np.testing.assert_array_equal(np.asarray(acts), _table(emb)[ids[:, 0]].reshape(n, 1, DIM))
        del acts
        gc.collect()
