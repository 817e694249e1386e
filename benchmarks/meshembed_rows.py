"""meshembed's own rows, through the public API only, on any backend.

W1: one full step ``enqueue → dequeue → apply_gradients`` of ``me.TPUEmbedding`` (sum
combiner, ragged multi-hot ids); W2: one ``me.optimizers.Adadelta.apply_gradients`` step.
"""

from __future__ import annotations

import numpy as np

import meshembed as me
from benchmarks.common import Row, inputs_ready, timeit, w1_bytes, w2_bytes, zipf_ids

W1_OPTIMIZERS = {
    "sgd": lambda: me.embedding.SGD(learning_rate=0.01),
    "adagrad": lambda: me.embedding.Adagrad(learning_rate=0.01),
    "adadelta": lambda: me.embedding.Adadelta(learning_rate=1.0, rho=0.95, epsilon=1e-6),
}


def _sync(backend):
    def sync(x):
        if x is not None:
            backend.to_numpy(x[0] if isinstance(x, (list, tuple)) else x)
    return sync


def w1(sizes: dict, repeats: int = 7, backend: str = "numpy", case: str = "sgd", num_shards: int = 1) -> list[Row]:
    v, d, b, k = sizes["vocab"], sizes["dim"], sizes["batch"], sizes["ids_per_sample"]
    ids = zipf_ids(b * k, v, sizes["zipf"])
    splits = np.arange(0, b * k + 1, k, dtype=np.int64)
    grad_host = np.random.default_rng(1).standard_normal((b, d)).astype(np.float32) * 0.01
    optimizer = W1_OPTIMIZERS[case]()
    inputs_ready()
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=v, dimension=d, optimizer=optimizer, combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(b,), name="f")],
        sharding_strategy="mod",
    )
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=num_shards)
    be = emb.backend
    grad = be.asarray(grad_host)
    ragged = me.RaggedIds(splits, ids)

    def step():
        emb.enqueue([ragged])
        acts = emb.dequeue()
        emb.apply_gradients([grad])
        return acts

    # the step's update may still run (JAX): reading a row of the table waits for it
    step.finish = lambda: be.to_numpy(emb.backend.gather(emb.state.tables[0][0], be.asarray(np.zeros(1, np.int64))))

    med, lo, hi = timeit(step, repeats=repeats, sync=_sync(be))
    n_slots = len(optimizer.slot_names)
    return [Row("W1", f"meshembed[{backend}]", case, med, lo, hi,
                w1_bytes(len(np.unique(ids)), b * k, d, n_slots), v * d * 4 * (1 + n_slots),
                note=f"{num_shards} shard(s)")]


def w2(sizes: dict, repeats: int = 7, backend: str = "numpy", tensors: int = 1) -> list[Row]:
    n = sizes["params"]
    m = n // tensors
    rng = np.random.default_rng(0)
    be = me.get_backend(backend)
    values = [rng.standard_normal(m, dtype=np.float32) for _ in range(tensors)]
    grads = [be.asarray(rng.standard_normal(m, dtype=np.float32)) for _ in range(tensors)]
    inputs_ready()
    variables = [me.Variable(v, name=f"w{i}", backend=backend) for i, v in enumerate(values)]
    opt = me.optimizers.Adadelta(learning_rate=1e-3, rho=0.95, epsilon=1e-7)
    opt.build(variables)
    pairs = list(zip(grads, variables))

    def step():
        opt.apply_gradients(pairs)
        return variables[-1].value

    med, lo, hi = timeit(step, repeats=repeats, sync=_sync(be))
    case = f"adadelta {tensors} tensor{'s' if tensors > 1 else ''}"
    return [Row("W2", f"meshembed[{backend}]", case, med, lo, hi, w2_bytes(n), 3 * n * 4)]
