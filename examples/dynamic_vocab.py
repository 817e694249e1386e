"""Train on a stream whose vocabulary grows: raw 64-bit item keys, a dynamic vocabulary.

Every step draws a batch of item keys: most from a Zipf law over the catalogue released so
far (an item keeps its popularity rank), the rest from the newest releases; new items are
released every step, so the set of keys in use grows without bound. The table has a fixed capacity: keys are admitted
after 2 occurrences, the least recently used make room when it is full, and keys unseen for
``--ttl`` steps expire. Each key has a hidden click-through logit; the model is a logistic
regression on the key's embedding. The loss falls while the hit rate (lookups whose key had
a row) settles, although far more keys pass than the table holds.

    python examples/dynamic_vocab.py                       # NumPy
    python examples/dynamic_vocab.py --backend torch --steps 400 --capacity 4096
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

import meshembed as me
from meshembed.embedding import dynamic as dv


def item_key(item: np.ndarray) -> np.ndarray:
    """The raw id of an item: a 64-bit value with no structure (like a real id)."""
    return dv.hash_keys(item, 2024).view(np.int64)


def batch(rng: np.random.Generator, step: int, size: int, released_per_step: int) -> np.ndarray:
    """``size`` item keys: 70% Zipf(1.3) over the catalogue released so far by popularity
    rank (items keep their rank), 30% Zipf(1.5) over the newest releases (the newest first)."""
    released = 1000 + released_per_step * step
    rank = np.minimum(rng.zipf(1.3, size) - 1, released - 1)
    recent = released - 1 - np.minimum(rng.zipf(1.5, size) - 1, released - 1)
    return item_key(np.where(rng.random(size) < 0.7, rank, recent))


def clicks(keys: np.ndarray, step: int) -> np.ndarray:
    """A click per key drawn from its hidden logit (a counter-based hash: reproducible)."""
    logit = 4.0 * (dv.uniform(keys, 7) - 0.5)
    return (dv.uniform(keys, 11, step) < 1 / (1 + np.exp(-logit))).astype(np.float32)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="numpy")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--released-per-step", type=int, default=20)
    p.add_argument("--ttl", type=int, default=100)
    p.add_argument("--every", type=int, default=50, help="print every this many steps")
    args = p.parse_args(argv)

    vocab = me.embedding.DynamicVocabulary(
        admission=me.embedding.AfterOccurrences(2),
        eviction=(me.embedding.LRU(), me.embedding.TTL(args.ttl)))
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("item", args.capacity, args.dim, combiner="sum", dynamic=vocab,
                               optimizer=me.embedding.Adagrad(learning_rate=0.5))],
        features=[me.FeatureConfig("item", (args.batch,), name="item")])
    emb = me.TPUEmbedding(cfg, backend=args.backend, seed=0)
    head = np.full(args.dim, 1 / np.sqrt(args.dim), np.float32)  # logit = <embedding, head>
    rng = np.random.default_rng(0)
    seen: set[int] = set()
    losses, stats0 = [], dict(emb.vocabulary("item").stats)
    print(f"capacity {args.capacity} rows, {args.released_per_step} new items per step, TTL {args.ttl} steps")
    print(f"{'step':>5} {'loss':>7} {'hit rate':>8} {'resident':>8} {'keys seen':>9} {'admitted':>8} {'evicted':>7}")
    for step in range(args.steps):
        keys = batch(rng, step, args.batch, args.released_per_step)
        seen.update(keys.tolist())
        y = clicks(keys, step)
        emb.enqueue([keys])
        act = np.asarray(emb.backend.to_numpy(emb.dequeue()[0]))
        prob = 1 / (1 + np.exp(-(act @ head)))
        losses.append(float(-np.mean(y * np.log(prob + 1e-7) + (1 - y) * np.log(1 - prob + 1e-7))))
        emb.apply_gradients([((prob - y)[:, None] * head[None, :]).astype(np.float32)])
        if (step + 1) % args.every == 0:
            st = emb.vocabulary("item").stats
            hits = (st["hits"] - stats0["hits"]) / max(1, st["lookups"] - stats0["lookups"])
            print(f"{step + 1:>5} {np.mean(losses[-args.every:]):7.4f} {hits:8.3f} {emb.vocabulary('item').size:>8} "
                  f"{len(seen):>9} {st['admitted']:>8} {st['evicted']:>7}")
            stats0 = dict(st)
    keys, values = emb.export_dynamic("item")  # for serving: (keys, rows)
    with tempfile.TemporaryDirectory() as d:  # the vocabulary travels with the checkpoint
        restored = me.TPUEmbedding.restore(emb.save(f"{d}/ckpt"))
        assert restored.vocabulary("item").equal(emb.vocabulary("item"))
    print(f"exported {keys.shape[0]} keys x {values.shape[1]} values; checkpoint restored with the same vocabulary")
    return {"first_loss": float(np.mean(losses[:args.every])), "last_loss": float(np.mean(losses[-args.every:])),
            "keys_seen": len(seen), "resident": int(keys.shape[0])}


if __name__ == "__main__":
    main()
