"""``python -m meshembed demo --backend numpy|torch|jax``: a small recommender end to end.

Synthetic click logs with a planted signal (each user and item has a hidden taste vector;
clicks follow their agreement plus item popularity). The model is TPU-embedding-shaped:

* tables ``user`` (Adadelta), ``item`` (Adagrad, shared by two features) and ``category``
  (Adagrad, shared by two features);
* features ``user_id``, ``item_id``, ``recent_items`` (a sequence feature of the user's last
  clicks, output ``[B, 5, dim]``), ``user_categories`` (weighted multi-hot, ragged, mean
  combiner) and ``item_category``;
* a tiny dense head in plain NumPy: dot-product interactions plus a linear layer.

It trains with a progress bar, prints the falling loss and the held-out AUC, saves a
checkpoint, restores it on another shard count and checks the predictions are unchanged.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

import numpy as np

import meshembed as me

USERS, ITEMS, CATEGORIES, DIM, SEQ, BATCH = 3000, 1200, 24, 8, 5, 256


@dataclass
class Data:
    user: np.ndarray
    item: np.ndarray
    recent: list[list[int]]
    cats: list[list[int]]
    cat_weights: list[list[float]]
    item_cat: np.ndarray
    click: np.ndarray

    def batch(self, rows: np.ndarray):
        recent = me.RaggedIds.from_lists([self.recent[r] for r in rows])
        cats = me.RaggedIds.from_lists([self.cats[r] for r in rows])
        weights = me.RaggedIds(cats.row_splits, np.asarray([w for r in rows for w in self.cat_weights[r]], np.float32))
        features = [self.user[rows], self.item[rows], recent, cats, self.item_cat[rows]]
        return features, [None, None, None, weights, None], self.click[rows]


def synthesize(n: int, seed: int = 0) -> Data:
    """Clicks from hidden tastes: p = sigmoid(2.5·<u, v> + popularity − 1)."""
    rng = np.random.default_rng(1234)  # the world is fixed; `seed` only draws the log
    taste_u = rng.normal(size=(USERS, 4)) / 2
    taste_v = rng.normal(size=(ITEMS, 4)) / 2
    popularity = rng.normal(scale=0.8, size=ITEMS)
    item_category = rng.integers(0, CATEGORIES, ITEMS)
    cat_taste = np.stack([taste_v[item_category == c].mean(0) for c in range(CATEGORIES)])
    liked = [np.argsort(-(taste_u[u] @ taste_v.T))[:40] for u in range(USERS)]
    draw = np.random.default_rng(seed)
    user = draw.integers(0, USERS, n)
    item = draw.integers(0, ITEMS, n)
    logit = 2.5 * np.sum(taste_u[user] * taste_v[item], 1) + popularity[item] - 1.0
    click = (draw.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    recent = [draw.choice(liked[u], draw.integers(0, SEQ + 3), replace=False).tolist() for u in user]
    cats, weights = [], []
    for u in user:
        score = cat_taste @ taste_u[u]
        top = np.argsort(-score)[: draw.integers(1, 4)]
        cats.append(top.tolist())
        weights.append(draw.uniform(0.5, 2.0, len(top)).round(2).tolist())
    return Data(user, item, recent, cats, weights, item_category[item], click)


def build_config() -> "me.EmbeddingConfig":
    emb = me.embedding
    tables = [
        me.TableConfig("user", USERS, DIM, optimizer=emb.Adadelta(learning_rate=1.0, rho=0.95, epsilon=1e-3)),
        me.TableConfig("item", ITEMS, DIM, optimizer=emb.Adagrad(0.3)),
        me.TableConfig("category", CATEGORIES, DIM, optimizer=emb.Adagrad(0.05), combiner="mean"),
    ]
    features = [
        me.FeatureConfig("user", (BATCH,), name="user_id"),
        me.FeatureConfig("item", (BATCH,), name="item_id"),
        me.FeatureConfig("item", (BATCH, SEQ), name="recent_items"),
        me.FeatureConfig("category", (BATCH,), name="user_categories"),
        me.FeatureConfig("category", (BATCH,), name="item_category"),
    ]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy="mod")


class Head:
    """logit = <user, item> + <Σ recent, item> + <categories, item_category> + w·h + b."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.w = rng.normal(scale=0.01, size=5 * DIM).astype(np.float32)
        self.b = np.float32(0.0)

    def forward(self, acts):
        user, item, recent, cats, icat = acts
        rsum = recent.sum(axis=1)
        h = np.concatenate([user, item, rsum, cats, icat], axis=1)
        logit = np.sum(user * item, 1) + np.sum(rsum * item, 1) + np.sum(cats * icat, 1) + h @ self.w + self.b
        return logit, (user, item, rsum, cats, icat, h)

    def backward(self, dlogit, cache, lr=0.05):
        """Gradients w.r.t. every activation (summed loss), and an SGD step on the head."""
        user, item, rsum, cats, icat, h = cache
        d = dlogit[:, None]
        w = self.w.reshape(5, DIM)
        grads = [d * (item + w[0]), d * (user + rsum + w[1]),
                 np.repeat((d * (item + w[2]))[:, None, :], SEQ, axis=1), d * (icat + w[3]), d * (cats + w[4])]
        self.w -= lr * (h.T @ dlogit) / len(dlogit)
        self.b -= lr * float(dlogit.mean())
        return [g.astype(np.float32) for g in grads]


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann–Whitney U with average ranks)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def predict(emb, head, data: Data) -> np.ndarray:
    scores = []
    for start in range(0, len(data.click) - BATCH + 1, BATCH):
        feats, weights, _ = data.batch(np.arange(start, start + BATCH))
        emb.enqueue(feats, weights, training=False)
        acts = [emb.backend.to_numpy(a) for a in emb.dequeue()]
        scores.append(head.forward(acts)[0])
    return np.concatenate(scores)


def train_step(emb, head: Head, data: Data, step: int) -> float:
    """One training step on batch ``step`` of ``data``: lookup, the head's forward and
    backward, the embedding update; returns the batch's log loss."""
    rows = np.arange(step * BATCH, (step + 1) * BATCH)
    feats, weights, y = data.batch(rows)
    emb.enqueue(feats, weights)
    acts = [emb.backend.to_numpy(a) for a in emb.dequeue()]
    logit, cache = head.forward(acts)
    p = 1 / (1 + np.exp(-logit))
    emb.apply_gradients(head.backward(p - y, cache))
    return float(np.mean(-y * np.log(p + 1e-7) - (1 - y) * np.log(1 - p + 1e-7)))


def main(backend: str | None = None, steps: int | None = None, num_shards: int = 2, quiet: bool = False) -> int:
    from tqdm import tqdm

    say = (lambda *a: None) if quiet else print
    steps = steps or 1000
    t0 = time.perf_counter()
    train, test = synthesize(steps * BATCH, seed=1), synthesize(16 * BATCH, seed=2)
    emb = me.TPUEmbedding(build_config(), backend=backend, num_shards=num_shards, seed=0)
    head = Head(np.random.default_rng(0))
    say(f"meshembed demo: {emb!r}")
    base_auc = auc(test.click, predict(emb, head, test))
    say(f"held-out AUC before training: {base_auc:.3f}")
    losses = []
    bar = tqdm(range(steps), desc="training", unit="step", disable=quiet, mininterval=0.5)
    for step in bar:
        losses.append(train_step(emb, head, train, step))
        if (step + 1) % max(1, steps // 8) == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-steps // 8:]):.4f}")
            if not quiet:
                bar.write(f"  step {step + 1:5d}  loss {np.mean(losses[-max(1, steps // 8):]):.4f}")
    scores = predict(emb, head, test)
    final_auc = auc(test.click, scores)
    say(f"loss {np.mean(losses[:20]):.4f} -> {np.mean(losses[-20:]):.4f}; "
        f"held-out AUC {base_auc:.3f} -> {final_auc:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = emb.save(f"{tmp}/recommender")
        other = me.TPUEmbedding.restore(path, backend=backend, num_shards=num_shards + 1)
        same = np.allclose(predict(other, head, test), scores, rtol=1e-5, atol=1e-6)
        say(f"checkpoint saved at step {emb.step}, restored on {other.num_shards} shards: "
            f"predictions {'identical' if same else 'DIFFER'}")
    say(f"done in {time.perf_counter() - t0:.1f} s on backend {emb.backend.name!r}")
    return 0 if same and final_auc > base_auc else 1


if __name__ == "__main__":
    raise SystemExit(main())
