"""The W1 step in two phases, pooled and per-id side by side (issue #18's per-id target).

For each optimizer: one engine on the pooled feature (``[16384]`` × 8 ids) and one on the
per-id feature (``[131072, 1]``), timed step by step in interleaved rounds, each step split
into forward (enqueue + dequeue, waited for) and apply (``apply_gradients``, waited for), so
the per-id cost shows where it is. Medians; ``per-id ÷ pooled`` of the whole step.

Run: ``python -m benchmarks.w1_phases --backend torch|jax [--optimizers sgd,adam] [--rounds 5]
[--quick]`` (``--quick``: CI sizes, one round: a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import w1_all
from benchmarks.common import TINY_W1, W1, W1Inputs


def run(backend: str, algorithm: str, rounds: int = 5, steps: int = 8, sizes: dict = W1
        ) -> dict[str, tuple[float, float]]:
    """``{"pooled": (forward ms, apply ms), "per-id": ...}``: medians (the first round warms up)."""
    d = W1Inputs(sizes)
    engines = {"pooled": w1_all.engine(backend, d, algorithm), "per-id": w1_all.engine(backend, d, algorithm, True)}
    sync = w1_all._syncer(backend)
    lrs = w1_all._learning_rates(algorithm, False)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for r in range(rounds + 1):
        for name, (emb, feat, grad) in engines.items():
            for j in range(steps):
                t0 = time.perf_counter()
                emb.enqueue([feat])
                acts = emb.dequeue()
                sync(acts)
                t1 = time.perf_counter()
                emb.apply_gradients([grad], learning_rates=lrs(j))
                sync(emb.state.tables[0][0].data)
                t2 = time.perf_counter()
                del acts
                if r:
                    times[name].append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
    return {name: (statistics.median(f for f, _ in t), statistics.median(a for _, a in t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("torch", "jax"), default="torch")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CI sizes, one round (a smoke test)")
    args = ap.parse_args(argv)
    sizes, rounds, steps = (TINY_W1, 1, 2) if args.quick else (W1, args.rounds, 8)
    print("| optimizer | pooled forward + apply ms | per-id forward + apply ms | per-id ÷ pooled |")
    print("|---|---|---|---|")
    for algorithm in w1_all._names(args.optimizers, w1_all.trainable()):  # an unknown name: SystemExit
        res = run(args.backend, algorithm, rounds, steps, sizes)
        (pf, pa), (qf, qa) = res["pooled"], res["per-id"]
        print(f"| {w1_all.short(algorithm)} | {pf:.2f} + {pa:.2f} | {qf:.2f} + {qa:.2f} | {(qf + qa) / (pf + pa):.2f}× |",
              flush=True)


if __name__ == "__main__":
    main()
