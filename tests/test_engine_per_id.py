"""Per-id (sequence) features: one id per output slot takes the identity path (issue #18).

A sequence feature whose every position holds one id (dense ids ``[B, M]``, or ragged rows
of exactly ``M`` ids) has ``slots == arange(B * M)``: its lookup is a plain gather and its
activation gradient is already one row per id. The engine then skips the segment sum and
the slot index; the numbers must be the general path's, bit for bit, on every backend.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import combiners

V, D, B, M = 50, 4, 6, 3


def test_is_identity():
    assert combiners.is_identity(np.arange(5), 5)
    assert combiners.is_identity(np.zeros(0, np.int64), 0)
    assert not combiners.is_identity(np.arange(5), 6)  # a missing position
    assert not combiners.is_identity(np.array([0, 2, 1]), 3)  # not in slot order
    assert not combiners.is_identity(np.array([0, 0, 1]), 3)  # two ids share a slot


def _backends() -> list[str]:
    return [b for b in ("numpy", "torch", "jax") if b in me.available_backends()]


def _run(backend: str, combiner: str, optimizer, weighted: bool) -> dict:
    """Table, slots and activations after three steps of a sequence feature."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", V, D, optimizer=optimizer, combiner=combiner)],
        features=[me.FeatureConfig("t", (B, M), name="seq")],
    )
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=2, seed=1)
    rng = np.random.default_rng(3)
    acts = []
    for _ in range(3):
        ids = rng.integers(0, V, size=(B, M))
        ids[0, :] = 7  # duplicates within and across samples
        if weighted:
            feat = me.RaggedIds(np.arange(0, B * M + 1, M), ids.reshape(-1))
            w = me.RaggedIds(np.arange(0, B * M + 1, M), rng.uniform(0.5, 2.0, B * M).astype(np.float32))
            emb.enqueue([feat], [w])
        else:
            emb.enqueue([ids])
        acts.append(np.asarray(emb.backend.to_numpy(emb.dequeue()[0])))
        g = rng.standard_normal((B, M, D)).astype(np.float32)
        emb.apply_gradients([g])
    out = emb.retrieve_parameters("t")
    out["acts"] = np.stack(acts)
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("combiner,weighted", [("sum", False), ("sum", True), ("mean", True)])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_identity_path_equals_general_path(backend, combiner, weighted, opt, monkeypatch):
    optimizer = {"sgd": me.embedding.SGD(learning_rate=0.1),
                 "adagrad": me.embedding.Adagrad(learning_rate=0.1),
                 "adam": me.embedding.Adam(learning_rate=0.01)}[opt]
    seen = []
    real = combiners.is_identity
    with monkeypatch.context() as m:
        m.setattr(combiners, "is_identity", lambda s, n: seen.append(real(s, n)) or seen[-1])
        fast = _run(backend, combiner, optimizer, weighted)
    assert seen and all(seen), "the identity path was not taken"
    with monkeypatch.context() as m:
        m.setattr(combiners, "is_identity", lambda s, n: False)
        general = _run(backend, combiner, optimizer, weighted)
    assert fast.keys() == general.keys()
    for key in fast:
        np.testing.assert_array_equal(fast[key], general[key], err_msg=key)


def test_identity_update_sends_no_slot_index(monkeypatch):
    """The update of an identity feature is one row per id: no ``grad_index`` travels."""
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", V, D, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (B, M), name="seq")])
    emb = me.TPUEmbedding(cfg, backend="numpy")
    calls = []
    real = emb.backend.update_rows

    def spy(tables, ids, grads, fn, **kw):
        calls.append((tuple(np.shape(grads)), kw.get("grad_index")))
        return real(tables, ids, grads, fn, **kw)

    monkeypatch.setattr(emb.backend, "update_rows", spy)
    emb.enqueue([np.arange(B * M).reshape(B, M)])
    emb.dequeue()
    emb.apply_gradients([np.ones((B, M, D), np.float32)])
    assert calls == [((B * M, D), None)]
