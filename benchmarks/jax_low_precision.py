"""me.jax jitted step with low-precision tables vs float32 (docs/low_precision.md, #32).

    python -m benchmarks.jax_low_precision [--vocab 100000] [--dim 32] [--ids 4096] [--steps 10] [--eager]

One Adagrad table (parameters and accumulators in the same format), one feature; each step is
``lookup`` + ``apply_gradients`` under ``jax.jit`` with the state donated (``--eager``: the
me.jax calls without jit). Prints the first call (compile + run) and the mean of the next steps.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--ids", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args(argv)

    import jax

    import meshembed as me
    from meshembed_jax import frontend as api

    P = me.embedding.Precision

    def step(state, batch, g):
        acts = api.lookup(state, batch)
        return api.apply_gradients(state, batch, {"f": g + 0 * acts["f"]})

    run = step if args.eager else jax.jit(step, donate_argnums=0)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, args.vocab, args.ids) for _ in range(args.steps + 2)]
    g = rng.standard_normal((args.ids, args.dim)).astype(np.float32)
    for name, prec in [("float32", None),
                       ("bf16 SR", P(parameters="bfloat16", slots="bfloat16", rounding="stochastic")),
                       ("bf16 RNE", P(parameters="bfloat16", slots="bfloat16", rounding="nearest")),
                       ("fp16 SR", P(parameters="float16", slots="float16", rounding="stochastic"))]:
        cfg = me.EmbeddingConfig(
            tables=[me.TableConfig("t", args.vocab, args.dim, optimizer=me.embedding.Adagrad(0.1), combiner="sum",
                                   precision=prec)],
            features=[me.FeatureConfig("t", (args.ids,), name="f")])
        state = api.init(cfg, num_shards=1)
        batches = [api.prepare(state, [i], capacity=args.ids) for i in ids]
        t = time.perf_counter()
        state = run(state, batches[0], g)
        jax.block_until_ready(state.tables)
        first = time.perf_counter() - t
        state = run(state, batches[1], g)
        jax.block_until_ready(state.tables)
        t = time.perf_counter()
        for b in batches[2:]:
            state = run(state, b, g)
        jax.block_until_ready(state.tables)
        per = (time.perf_counter() - t) / args.steps
        print(f"{'eager' if args.eager else 'jit':5s} {name:9s} V={args.vocab} D={args.dim} ids={args.ids}: "
              f"first call {first:.2f} s, {1e3 * per:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
