"""A two-tower recommender trained with me.jax: the whole step is one ``jax.jit``.

lookup (user and item embeddings, sharded over every device of a Mesh) -> two plain-JAX MLP
towers -> dot-product logits -> logistic loss -> ``jax.value_and_grad`` (dense params and the
activations) -> ``me.jax.apply_gradients`` (a learning-rate schedule on dynamic tag 0,
computed from the step counter inside the jit) + the dense Adadelta (``me.jax.adadelta``).
Then the tables are saved as a portable checkpoint and restored on torch.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax_two_tower.py``
(8 CPU devices; any device count works). Prints the loss and ``TWO TOWER OK``.
"""

from __future__ import annotations

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import meshembed as me

USERS, ITEMS, DIM, BATCH, STEPS = 300, 100, 16, 256, 80


def config() -> me.EmbeddingConfig:
    lr = me.embedding.DynamicLearningRate(0)
    return me.EmbeddingConfig(
        tables=[me.TableConfig(name="user", vocabulary_size=USERS, dimension=DIM, optimizer=me.embedding.Adagrad(lr)),
                me.TableConfig(name="item", vocabulary_size=ITEMS, dimension=DIM, optimizer=me.embedding.Adagrad(lr),
                               combiner="mean")],
        features=[me.FeatureConfig(table="user", input_shape=(BATCH,), name="user_id"),
                  me.FeatureConfig(table="item", input_shape=(BATCH,), name="item_ids")])


def tower_params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (DIM, 32)) / np.sqrt(DIM), "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 16)) / np.sqrt(32), "b2": jnp.zeros(16)}


def tower(p: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(dense: dict, acts: dict, labels: jax.Array) -> jax.Array:
    logits = jnp.sum(tower(dense["user"], acts["user_id"]) * tower(dense["item"], acts["item_ids"]), axis=-1)
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, labels))  # a sum: per-sample gradients


def schedule(step: jax.Array) -> jax.Array:
    """The embedding learning rate: warm-up then decay, a traced value every step."""
    s = step.astype(jnp.float32)
    return 0.3 * jnp.minimum(1.0, (s + 1) / 10) * 0.99 ** s


tx = me.jax.adadelta(learning_rate=1.0, rho=0.95, epsilon=1e-6)


@jax.jit
def train_step(state, dense, opt_state, batch, labels):
    """One step: embeddings, towers, loss, gradients, both optimizers."""
    acts = me.jax.lookup(state, batch)
    loss, (g_dense, g_acts) = jax.value_and_grad(loss_fn, argnums=(0, 1))(dense, acts, labels)
    state = me.jax.apply_gradients(state, batch, g_acts, [schedule(state.step)])
    updates, opt_state = tx.update(g_dense, opt_state, dense)
    return state, optax.apply_updates(dense, updates), opt_state, loss


def data(rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """Users like items of their own parity class; each sample has 1-3 items (ragged, mean)."""
    users = rng.integers(0, USERS, BATCH)
    lengths = rng.integers(1, 4, BATCH)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    labels = rng.integers(0, 2, BATCH)
    items = rng.integers(0, ITEMS // 2, splits[-1]) * 2 + np.repeat((users + 1 - labels) % 2, lengths)
    return {"user_id": users, "item_ids": me.RaggedIds(splits, items)}, labels.astype(np.float32)


def main() -> int:
    cfg = config()
    mesh = Mesh(np.asarray(jax.devices(), dtype=object), ("model",))
    state = me.jax.init(cfg, mesh=mesh, seed=0)
    keys = jax.random.split(jax.random.PRNGKey(0))
    dense = {"user": tower_params(keys[0]), "item": tower_params(keys[1])}
    dense = jax.device_put(dense, NamedSharding(mesh, PartitionSpec()))  # replicated on the mesh
    opt_state = tx.init(dense)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        feats, labels = data(rng)
        batch = me.jax.prepare(cfg, feats, capacity={"user_id": BATCH, "item_ids": 3 * BATCH})
        state, dense, opt_state, loss = train_step(state, dense, opt_state, batch, labels)
        losses.append(float(loss) / BATCH)
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    print(f"devices={len(jax.devices())} loss {first:.4f} -> {last:.4f} traces={train_step._cache_size()}")
    if not last < first - 0.05 or train_step._cache_size() != 1:
        print("loss did not fall, or the step retraced", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        path = me.jax.save(state, f"{tmp}/two_tower")
        on_torch = me.TPUEmbedding.restore(path, backend="torch")
        for t in ("user", "item"):
            np.testing.assert_array_equal(on_torch.retrieve_parameters(t)["parameters"], state.parameters(t)["parameters"])
        print(f"restored on torch: step {on_torch.step}, tables {on_torch.table_names}")
    print("TWO TOWER OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
