"""Dynamic vocabularies through the front ends: me.torch.EmbeddingCollection, me.tpu and
me.ops map raw int64 keys to rows exactly as the engine does (the same rows, the same bits)."""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from meshembed import ops

B, CAP = 6, 8
KEYS = np.array([10**12 + 7, 5, 2**40, 99, 10**12 + 7, 123456789012], np.int64)


def config():
    spec = me.embedding.DynamicVocabulary(capacity=CAP, eviction=me.embedding.LRU())
    return me.EmbeddingConfig(tables=[me.TableConfig("t", CAP, 4, optimizer=me.embedding.SGD(0.5), combiner="sum",
                                                     dynamic=spec)],
                              features=[me.FeatureConfig("t", (B,), name="a")])


def keys(step):
    return (KEYS + step * 3) % (2**50)


def engine_run(backend="numpy", steps=4):
    emb = me.TPUEmbedding(config(), backend=backend, seed=1)
    acts = []
    for s in range(steps):
        emb.enqueue([keys(s)])
        a = np.asarray(emb.backend.to_numpy(emb.dequeue()[0]))
        acts.append(a)
        emb.apply_gradients([np.full_like(a, 0.25) + a * 0.1])
    return emb, acts


def test_me_torch_module_maps_keys_as_the_engine():
    torch = pytest.importorskip("torch")
    ref, ref_acts = engine_run("torch")
    ec = me.torch.EmbeddingCollection(config(), seed=1)
    for s in range(4):
        out = ec({"a": torch.as_tensor(keys(s))})["a"]
        np.testing.assert_array_equal(out.detach().numpy(), ref_acts[s])
        out.backward(0.25 + out.detach() * 0.1)
    k, v = ec.engine.export_dynamic("t")
    rk, rv = ref.export_dynamic("t")
    np.testing.assert_array_equal(k, rk)
    np.testing.assert_array_equal(v, rv)


def test_me_tpu_table_takes_a_dynamic_vocabulary():
    E = me.tpu
    spec = me.embedding.DynamicVocabulary(capacity=CAP)
    table = E.TableConfig(vocabulary_size=CAP, dim=4, name="t", combiner="sum", dynamic=spec)
    emb = E.TPUEmbedding({"a": E.FeatureConfig(table)}, optimizer=E.SGD(learning_rate=0.5), seed=1)
    ref, ref_acts = engine_run()
    for s in range(4):
        emb.enqueue({"a": keys(s)})
        a = np.asarray(emb.dequeue()["a"])
        np.testing.assert_array_equal(a[:, :], ref_acts[s])
        emb.apply_gradients({"a": np.full_like(a, 0.25) + a * 0.1})
    np.testing.assert_array_equal(emb.engine.export_dynamic("t")[0], ref.export_dynamic("t")[0])


def test_me_ops_enqueue_takes_keys():
    ref, ref_acts = engine_run(steps=1)
    ops.configure_tpu_embedding(config(), seed=1)
    try:
        ops.enqueue_tpu_embedding_arbitrary_tensor_batch([np.zeros(0, np.int64)], [keys(0)], [np.zeros(0)])
        (act,) = ops.recv_tpu_embedding_activations(1)
        np.testing.assert_array_equal(np.asarray(act), ref_acts[0])
    finally:
        ops.shutdown_tpu_embedding()
