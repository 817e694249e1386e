"""Convergence with the TPU's pipelined embedding schedule, on CPU, against the plain one.

    python examples/pipelined_training.py                  # numpy, 400 steps
    python examples/pipelined_training.py --backend torch --steps 1000

On a TPU, ``pipeline_execution_with_tensor_core`` (TF) or jax-tpu-embedding's pipelining
overlap the SparseCore with the TensorCore: the embedding gradients of step t are applied
after the lookup of step t+1, so every step trains on activations one step stale. Whether
that costs accuracy "often requires empirical validation" (OpenXLA's SparseCore guide).
``me.TPUEmbedding(pipelined=True)`` runs exactly that schedule, so this trains the demo's
recommender (``meshembed.demo``: three tables, five features) both ways on the same clicks
and prints both loss curves and the held-out AUC.
"""

from __future__ import annotations

import argparse

import numpy as np

import meshembed as me
from meshembed import demo


def train(pipelined: bool, steps: int, backend: str | None, train_data: demo.Data, test_data: demo.Data
          ) -> tuple[list[float], float]:
    emb = me.TPUEmbedding(demo.build_config(), backend=backend, num_shards=2, seed=0, pipelined=pipelined)
    head = demo.Head(np.random.default_rng(0))
    losses = []
    for step in range(steps):
        feats, weights, y = train_data.batch(np.arange(step * demo.BATCH, (step + 1) * demo.BATCH))
        emb.enqueue(feats, weights)
        acts = [emb.backend.to_numpy(a) for a in emb.dequeue()]  # pipelined: step-1's update lands after this
        logit, cache = head.forward(acts)
        p = 1 / (1 + np.exp(-logit))
        losses.append(float(np.mean(-y * np.log(p + 1e-7) - (1 - y) * np.log(1 - p + 1e-7))))
        emb.apply_gradients(head.backward(p - y, cache))
    emb.flush()  # the last step's gradients (a no-op when not pipelined)
    return losses, demo.auc(test_data.click, demo.predict(emb, head, test_data))


def main(steps: int = 400, backend: str | None = None, points: int = 10) -> int:
    train_data, test_data = demo.synthesize(steps * demo.BATCH, seed=1), demo.synthesize(16 * demo.BATCH, seed=2)
    plain, plain_auc = train(False, steps, backend, train_data, test_data)
    piped, piped_auc = train(True, steps, backend, train_data, test_data)
    window = max(1, steps // points)
    print(f"training loss (mean over {window} steps), batch {demo.BATCH}, backend {backend or me.get_backend().name}")
    print(f"{'step':>6}  {'plain':>8}  {'pipelined':>9}  {'difference':>10}")
    for end in range(window, steps + 1, window):
        a, b = np.mean(plain[end - window:end]), np.mean(piped[end - window:end])
        print(f"{end:6d}  {a:8.4f}  {b:9.4f}  {b - a:+10.4f}")
    print(f"held-out AUC: plain {plain_auc:.4f}, pipelined {piped_auc:.4f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    raise SystemExit(main(args.steps, args.backend))
