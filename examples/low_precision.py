"""Low-precision embedding tables: the demo recommender trained with float32 tables, with
bfloat16 tables rounded stochastically (SR), and with bfloat16 tables rounded to nearest (RNE).

    python examples/low_precision.py [--backend numpy] [--steps 1000] [--seeds 3]

Every table (``user`` Adadelta, ``item`` and ``category`` Adagrad) stores its parameters in
bfloat16 (half the bytes); the optimizer slots stay float32 unless ``--slots bfloat16``. The
updates run in float32 and round back to bfloat16 (docs/low_precision.md). The data, the
initial values and the dense head are the same for every run; SR runs with ``--seeds``
different generator seeds, so the spread of its AUC is visible next to the gaps.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import meshembed as me
from meshembed import demo


def with_precision(config: "me.EmbeddingConfig", precision: "me.embedding.Precision | None",
                   lr_scale: float = 1.0) -> "me.EmbeddingConfig":
    """Every table stored as ``precision`` says, its learning rate times ``lr_scale``."""
    return config.replace(tables=tuple(
        t.replace(precision=precision,
                  optimizer=t.optimizer.replace(learning_rate=t.optimizer.learning_rate * lr_scale))
        for t in config.tables))


def train(config, train_data, test_data, steps: int, backend: str | None) -> tuple[float, float, float]:
    """(held-out AUC, mean loss of the last 10% of steps, seconds) of one run."""
    emb = me.TPUEmbedding(config, backend=backend, num_shards=2, seed=0)
    head = demo.Head(np.random.default_rng(0))
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        losses.append(demo.train_step(emb, head, train_data, step))
    seconds = time.perf_counter() - t0
    score = demo.auc(test_data.click, demo.predict(emb, head, test_data))
    return score, float(np.mean(losses[-max(1, steps // 10):])), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="numpy, torch, jax, array_api_strict (default: the current)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3, help="SR generator seeds to run")
    parser.add_argument("--slots", default="float32", help="storage of the optimizer slots (float32 or bfloat16)")
    parser.add_argument("--lr-scale", type=float, default=1.0,
                        help="multiply every table's learning rate (small updates are where rounding matters)")
    args = parser.parse_args(argv)

    train_data = demo.synthesize(args.steps * demo.BATCH, seed=1)
    test_data = demo.synthesize(64 * demo.BATCH, seed=2)
    config = demo.build_config()
    P = me.embedding.Precision
    runs = [("float32", None)]
    runs += [(f"bfloat16 SR (seed {s})", P(parameters="bfloat16", slots=args.slots, rounding="stochastic", seed=s))
             for s in range(args.seeds)]
    runs += [("bfloat16 RNE", P(parameters="bfloat16", slots=args.slots, rounding="nearest"))]
    print(f"demo recommender, {args.steps} steps of {demo.BATCH}, slots {args.slots}, lr x{args.lr_scale:g}, "
          f"held-out set of {len(test_data.click)} samples")
    print(f"{'tables':<24} {'AUC':>7} {'vs f32':>8} {'loss':>7} {'time':>7}")
    results = {}
    for name, precision in runs:
        score, loss, seconds = train(with_precision(config, precision, args.lr_scale), train_data, test_data,
                                     args.steps, args.backend)
        results[name] = score
        gap = score - results["float32"]
        print(f"{name:<24} {score:7.4f} {gap:+8.4f} {loss:7.4f} {seconds:6.1f}s")
    sr = [v for k, v in results.items() if "SR" in k]
    if sr:
        print(f"SR: mean AUC {np.mean(sr):.4f} (min {min(sr):.4f}, max {max(sr):.4f}), "
              f"mean gap to float32 {np.mean(sr) - results['float32']:+.4f}; "
              f"RNE gap {results['bfloat16 RNE'] - results['float32']:+.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
