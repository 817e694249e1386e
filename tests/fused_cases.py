"""The training run both backends' fused-kernel tests compare (test_torch_fused.py,
test_jax_fused.py): every registered algorithm on ragged Zipf batches."""

from __future__ import annotations

import numpy as np

import meshembed as me

OPTIMIZERS = {
    "stochastic_gradient_descent": lambda: me.embedding.SGD(learning_rate=0.05),
    "adagrad": lambda: me.embedding.Adagrad(learning_rate=0.05),
    "adadelta": lambda: me.embedding.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6),
}


def train(backend: str, algorithm: str, combiner: str, shards: int, dim: int, strategy: str = "mod",
          steps: int = 3) -> dict:
    """The table and slots after ``steps`` steps of a 1000-row table, 64 samples of 0-8 ids."""
    rng = np.random.default_rng(5)
    vocab, batch = 1000, 64
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", vocab, dim, optimizer=OPTIMIZERS[algorithm](), combiner=combiner)],
        features=[me.FeatureConfig("t", (batch,), name="f")],
        sharding_strategy=strategy,
    )
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=shards, seed=3)
    for _ in range(steps):
        lengths = rng.integers(0, 9, size=batch)
        ids = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % vocab  # hot ids repeat
        splits = np.concatenate([[0], np.cumsum(lengths)])
        emb.enqueue([me.RaggedIds(splits, ids)])
        emb.dequeue()
        emb.apply_gradients([emb.backend.asarray(rng.standard_normal((batch, dim)).astype(np.float32))])
    return {name: np.asarray(v) for name, v in emb.retrieve_parameters("t").items()}
