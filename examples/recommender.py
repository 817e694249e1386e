"""A small recommender trained with meshembed's TPU-embedding engine.

    python examples/recommender.py --backend numpy   # or torch, jax
    python -m meshembed demo --backend torch         # the same program

The model and data live in ``meshembed.demo`` (read it top to bottom: config with three
tables and five features incl. a shared-table sequence feature and a weighted multi-hot
feature, an enqueue → dequeue → apply_gradients loop, held-out AUC, checkpoint save and
restore on another shard count).
"""

from __future__ import annotations

import argparse

from meshembed import demo

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--num-shards", type=int, default=2)
    args = parser.parse_args()
    raise SystemExit(demo.main(backend=args.backend, steps=args.steps, num_shards=args.num_shards))
