"""W1 on the NumPy backend beside plain NumPy programs for the same step (issue #36, item 4).

The NumPy backend is the readable reference (vectorised NumPy, no C); the target is its
update within 1.5× of the best plain NumPy program that does the same SGD / Adagrad update.
Each program does what the engine's step does on W1 (``benchmarks.common.W1``: 1,000,000 ×
64 float32, 16,384 bags × 8 Zipf(1.1) ids, sum combiner, a fixed upstream gradient):

* forward: gather the 131,072 rows and sum each bag;
* update: one gradient row per id (``grad[bag]``), summed per unique id, then the optimizer
  on the unique rows (SGD ``p -= lr·g``; Adagrad ``a += g²; p -= lr·g/√a``).

The plain programs read rows with ``np.take`` (several times faster than fancy indexing
``a[idx]`` on 2-D arrays here) and differ only in how they sum per unique id:

* ``add.at``: ``np.unique(return_inverse=True)`` + ``np.add.at`` on ``[n, 64]`` rows — the
  straightforward program (sequential per id: the reference's bits);
* ``flat add.at``: the same sum on a flattened array with one index per element (NumPy 2's
  one-dimensional ``ufunc.at`` fast path), same order, same bits;
* ``sort + reduceat``: a stable argsort and ``np.add.reduceat`` — NumPy's pairwise order, so
  other bits than the reference's;
* ``bincount``: ``np.bincount(inverse, weights=column)`` per column, in float64, rounded to
  float32 — other bits again.

The last two are not open to the engine: every fast path reproduces the sequential order.

The engine row is ``me.TPUEmbedding(backend="numpy")``: enqueue → dequeue → apply_gradients,
its update timed as ``apply_gradients`` alone. Every row is timed in interleaved rounds (a
noisy neighbour slows all alike); medians over every timed step; the ratio engine ÷ best
plain program is judged against the target for the update and shown for the whole step.

Run: ``python -m benchmarks.numpy_w1 [--optimizers sgd,adagrad] [--repeats 5] [--rounds 3] [--quick]``;
``--profile`` instead prints where the engine's step spends its time (cProfile, own time
per function over ``--repeats`` steps after warm-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from benchmarks.common import TINY_W1, W1, W1Inputs

LR = 0.01
INITIAL_ACCUMULATOR = 0.1
#: Issue #36 item 4: the backend's update ÷ the best plain NumPy program's.
TARGET = 1.5
SUMS = ("add.at", "flat add.at", "sort + reduceat", "bincount")

#: A step returns (forward ms, update ms) of its own work.
Step = Callable[[], tuple[float, float]]


def _sum_per_id(how: str, ids: np.ndarray, rows_of: Callable[[np.ndarray], np.ndarray],
                dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids, per-id sums of the gradient rows) the plain way ``how``."""
    if how == "sort + reduceat":
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        return ordered[starts], np.add.reduceat(rows_of(order), starts, axis=0)
    uids, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((uids.size, dim), np.float32)
    if how == "add.at":
        np.add.at(sums, inverse, rows_of(np.arange(ids.size)))
    elif how == "bincount":
        rows = rows_of(np.arange(ids.size))
        for c in range(dim):
            sums[:, c] = np.bincount(inverse, weights=rows[:, c], minlength=uids.size)
    else:  # flat add.at, 4,096 rows at a time
        flat, cols = sums.reshape(-1), np.arange(dim)
        for s in range(0, ids.size, 4096):
            part = np.arange(s, min(s + 4096, ids.size))
            np.add.at(flat, (inverse[part][:, None] * dim + cols).reshape(-1), rows_of(part).reshape(-1))
    return uids, sums


def plain_step(d: W1Inputs, optimizer: str, how: str) -> Step:
    """A plain NumPy program of the W1 step with its own table (and accumulator)."""
    s = d.sizes
    v, dim, b, k = s["vocab"], s["dim"], s["batch"], s["ids_per_sample"]
    table = np.random.default_rng(2).uniform(-0.05, 0.05, (v, dim)).astype(np.float32)
    acc = np.full((v, dim), INITIAL_ACCUMULATOR, np.float32) if optimizer == "adagrad" else None
    ids, bags, grad, lr = d.ids, d.segments, d.grad, np.float32(LR)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        np.take(table, ids, axis=0).reshape(b, k, dim).sum(axis=1)  # the activations (k ids a bag)
        t1 = time.perf_counter()
        uids, g = _sum_per_id(how, ids, lambda pos: np.take(grad, bags[pos], axis=0), dim)
        if acc is None:
            table[uids] = np.take(table, uids, axis=0) - lr * g
        else:
            a = np.take(acc, uids, axis=0) + g * g
            acc[uids] = a
            table[uids] = np.take(table, uids, axis=0) - lr * g / np.sqrt(a)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    return step


def engine_step(d: W1Inputs, optimizer: str, backend: str = "numpy") -> Step:
    """``me.TPUEmbedding`` on ``backend``: enqueue + dequeue (forward), apply_gradients (update)."""
    import meshembed as me

    s = d.sizes
    opt = (me.embedding.SGD(LR) if optimizer == "sgd"
           else me.embedding.Adagrad(LR, initial_accumulator_value=INITIAL_ACCUMULATOR))
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=s["vocab"], dimension=s["dim"], optimizer=opt,
                               combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(s["batch"],), name="f")])
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=1)
    feat, grad = me.RaggedIds(d.splits, d.ids), emb.backend.asarray(d.grad)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        emb.enqueue([feat])
        emb.dequeue()
        t1 = time.perf_counter()
        emb.apply_gradients([grad])
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    return step


def timed(steps: dict[str, Step], repeats: int, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """Per row: median forward, update and step ms over every timed step, interleaved rounds."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            got[name] += [step() for _ in range(repeats)]
    return {name: {"forward": statistics.median(f for f, _ in t), "update": statistics.median(u for _, u in t),
                   "step": statistics.median(f + u for f, u in t)} for name, t in got.items()}


def run(sizes: dict, optimizers: tuple[str, ...], repeats: int, rounds: int, warmup: int,
        verbose: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """``{optimizer: {row: medians}}``; the rows of one optimizer are timed together."""
    d, out = W1Inputs(sizes), {}
    for optimizer in optimizers:
        steps = {"meshembed[numpy]": engine_step(d, optimizer)}
        steps.update({f"plain NumPy, {how}": plain_step(d, optimizer, how) for how in SUMS})
        out[optimizer] = timed(steps, repeats, rounds, warmup)
        if verbose:
            for name, m in out[optimizer].items():
                print(f"{optimizer:8s} {name:30s} fwd {m['forward']:8.2f}  update {m['update']:8.2f}  "
                      f"step {m['step']:8.2f} ms", flush=True)
        steps.clear()
    return out


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one row per (optimizer, program); the engine's row carries the verdict."""
    lines = ["| optimizer | program | forward ms | update ms | step ms | engine ÷ best plain: update (≤ 1.5), step |",
             "|---|---|---|---|---|---|"]
    for optimizer, rows in results.items():
        plain = {n: m for n, m in rows.items() if n.startswith("plain")}
        best_u = min(plain, key=lambda n: plain[n]["update"])
        best_s = min(plain, key=lambda n: plain[n]["step"])
        for name, m in rows.items():
            verdict = ""
            if not name.startswith("plain"):
                ru, rs = m["update"] / plain[best_u]["update"], m["step"] / plain[best_s]["step"]
                verdict = (f"{ru:.2f}× {'✓' if ru <= TARGET else '✗'} (vs {best_u.split(', ')[1]}), "
                           f"{rs:.2f}× (vs {best_s.split(', ')[1]})")
            lines.append(f"| {optimizer} | {name} | {m['forward']:.2f} | {m['update']:.2f} | {m['step']:.2f} "
                         f"| {verdict} |")
    return "\n".join(lines)


def profile(sizes: dict, optimizer: str, steps: int, top: int = 14) -> str:
    """cProfile of ``steps`` engine steps (after 3 warm-ups): the functions with the most own time."""
    import cProfile
    import io
    import pstats

    step = engine_step(W1Inputs(sizes), optimizer)
    for _ in range(3):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="sgd,adagrad", help="comma list of sgd, adagrad")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per row per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--quick", action="store_true", help="CI sizes, 1 warm-up, 1 round (a smoke test)")
    ap.add_argument("--profile", action="store_true", help="profile the engine's step instead (first optimizer)")
    args = ap.parse_args(argv)
    optimizers = tuple(o.strip() for o in args.optimizers.split(",") if o.strip())
    bad = [o for o in optimizers if o not in ("sgd", "adagrad")]
    if bad:
        raise SystemExit(f"Invalid optimizer(s) {bad}. Expected some of ['sgd', 'adagrad'].")
    sizes, warmup, rounds = (TINY_W1, 1, 1) if args.quick else (W1, 3, args.rounds)
    if args.profile:
        print(profile(sizes, optimizers[0], args.repeats))
        return
    results = run(sizes, optimizers, args.repeats, rounds, warmup, verbose=True)
    load = os.getloadavg()
    print(f"\nW1 on NumPy {np.__version__}: {sizes}; {args.repeats} steps × {rounds} rounds per row; "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) on {os.cpu_count()} cores\n")
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
