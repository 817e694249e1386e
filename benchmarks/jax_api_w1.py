"""W1 through me.jax: a jitted functional step next to ``TPUEmbedding(backend="jax")``.

Table 1,000,000 × 64 float32; batch 16,384 samples × 8 Zipf(1.1) ids (ragged input, sum
combiner); the activation gradient ``G + 0.001·activations`` (a fixed ``[16384, 64]`` G; it
depends on the lookup, as a loss's gradient does, and on both paths). Every row times a
full step with its host work: the engine's enqueue + dequeue + apply_gradients, against
``me.jax.prepare`` (a unique capacity 1.25x the distinct rows) + one ``jax.jit`` (donated state) of ``lookup`` + ``apply_gradients``, with
a constant learning rate and with a learning rate (dynamic tag) changing every step.
fbgemm's CPU TBE row (SGD, Adagrad) appears when ``fbgemm_gpu`` imports: run it with
``.venv/interop/bin/python`` (``make test-interop`` installs it there, layered on ``.venv``).
The meshembed rows of one optimizer are timed interleaved, one step each in turn; fbgemm's
after them.

Run: ``python -m benchmarks.jax_api_w1 [--tiny] [--repeats N] [--optimizers sgd,adam]``.
Prints medians, the ratios me.jax / engine, changing / constant lr and fbgemm / me.jax, and
the load average. ``--profile``
interleaves the two steps and splits each into its host part and the whole (waited) step.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import TINY_W1, W1, zipf_ids

OPTIMIZERS = ("sgd", "adagrad", "adam", "adadelta")
LR = 0.05


def _config(sizes: dict, optimizer: str, dynamic: bool) -> Any:
    import meshembed as me

    E = me.embedding
    lr = E.DynamicLearningRate(0) if dynamic else LR
    spec = {"sgd": lambda: E.SGD(learning_rate=lr), "adagrad": lambda: E.Adagrad(learning_rate=lr),
            "adam": lambda: E.Adam(learning_rate=lr),
            "adadelta": lambda: E.Adadelta(learning_rate=lr, rho=0.95, epsilon=1e-6)}[optimizer]()
    return me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=sizes["vocab"], dimension=sizes["dim"], optimizer=spec)],
        features=[me.FeatureConfig(table="t", input_shape=(sizes["batch"],), name="f")])


def _inputs(sizes: dict) -> tuple[Any, np.ndarray]:
    import meshembed as me

    b, k = sizes["batch"], sizes["ids_per_sample"]
    ids = zipf_ids(b * k, sizes["vocab"], sizes["zipf"], 0)
    grad = np.random.default_rng(1).standard_normal((b, sizes["dim"])).astype(np.float32) * 0.01
    return me.RaggedIds(np.arange(0, b * k + 1, k, dtype=np.int64), ids), grad


def engine_step(sizes: dict, optimizer: str) -> Callable[[], Any]:
    import jax

    import meshembed as me

    emb = me.TPUEmbedding(_config(sizes, optimizer, False), backend="jax", num_shards=1)
    ragged, grad = _inputs(sizes)
    grad = emb.backend.asarray(grad)

    def step() -> Any:
        emb.enqueue([ragged])
        acts = emb.dequeue()
        emb.apply_gradients([grad + 1e-3 * acts[0]])
        return acts, emb.state.tables[0][0].data  # reading .data waits for a deferred capacity check

    return step


def api_step(sizes: dict, optimizer: str, dynamic: bool) -> Callable[[], Any]:
    import jax

    import meshembed as me

    cfg = _config(sizes, optimizer, dynamic)
    holder = {"state": me.jax.init(cfg), "i": 0}
    ragged, grad = _inputs(sizes)
    grad = jax.device_put(grad)
    capacity = sizes["batch"] * sizes["ids_per_sample"]
    unique = int(np.unique(ragged.values).size)
    unique = -(-(unique + unique // 4) // 1024) * 1024  # ~1.25x the distinct rows, as the engine's automatic one

    def train(state, batch, g, lr):
        acts = me.jax.lookup(state, batch)
        g = g + 1e-3 * acts["f"]  # a gradient that depends on the activations, as in training
        return me.jax.apply_gradients(state, batch, {"f": g}, [lr] if dynamic else ()), acts["f"]

    jitted = jax.jit(train, donate_argnums=0)

    def step() -> Any:
        holder["i"] += 1
        lr = LR * (1 + 0.01 * (holder["i"] % 7)) if dynamic else LR
        batch = me.jax.prepare(cfg, {"f": ragged}, capacity=capacity, unique_capacity=unique)
        holder["state"], acts = jitted(holder["state"], batch, grad, lr)
        return acts, holder["state"].tables

    step.traces = jitted._cache_size  # type: ignore[attr-defined]
    return step


def fbgemm_step(sizes: dict, optimizer: str) -> Callable[[], Any] | None:
    """fbgemm's CPU TBE on the same sizes (``benchmarks.torch_w1``), or None when fbgemm_gpu
    does not import or has no such optimizer (it lives in ``.venv/interop``: make test-interop)."""
    from benchmarks import torch_w1

    if optimizer not in ("sgd", "adagrad") or torch_w1._unsupported("fbgemm", optimizer):
        return None
    return torch_w1._make_step("fbgemm", torch_w1._Data(sizes), optimizer)


def run(sizes: dict, repeats: int, optimizers: tuple[str, ...], verbose: bool = False, warmup: int = 3) -> dict:
    """{optimizer: {row: (median, min, max) ms}} plus the ratios. The meshembed rows of one
    optimizer are built together and timed interleaved (engine step, me.jax step, ...,
    ``repeats`` rounds), so a change of load hits them alike; every step is waited for
    (activations and the updated table), so no row hides work in the next step."""
    import os
    import statistics
    import time

    import jax

    out: dict = {}
    for optimizer in optimizers:
        steps = {"TPUEmbedding[jax]": engine_step(sizes, optimizer),
                 "me.jax jit, constant lr": api_step(sizes, optimizer, False),
                 "me.jax jit, lr every step": api_step(sizes, optimizer, True)}
        for step in steps.values():
            for _ in range(warmup):
                jax.block_until_ready(step())
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                t0 = time.perf_counter()
                jax.block_until_ready(step())
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, step in steps.items():
            traces = getattr(step, "traces", None)
            if traces is not None and traces() != 1:
                raise AssertionError(f"{name} ({optimizer}) traced {traces()} times")
        del steps
        gc.collect()
        # fbgemm after, not interleaved: torch's OpenMP workers spin on after each call and
        # would slow the XLA step that follows on a small machine
        fbgemm = fbgemm_step(sizes, optimizer)
        if fbgemm is not None:
            for _ in range(warmup):
                fbgemm()
            times["fbgemm TBE CPU"] = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fbgemm()
                times["fbgemm TBE CPU"].append((time.perf_counter() - t0) * 1e3)
            del fbgemm
            gc.collect()
        rows = {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}
        eng, const, dyn = (rows[k][0] for k in list(rows)[:3])
        rows["ratio me.jax / engine"] = const / eng
        rows["ratio changing / constant lr"] = dyn / const
        if "fbgemm TBE CPU" in rows:
            rows["ratio fbgemm / me.jax"] = rows["fbgemm TBE CPU"][0] / const
        if verbose:
            for name, (med, lo, hi) in ((k, v) for k, v in rows.items() if not k.startswith("ratio")):
                print(f"{optimizer:9s} {name:28s} {med:8.2f} ms ({lo:.2f}-{hi:.2f})", flush=True)
            print(f"{optimizer:9s} " + "   ".join(f"{k[6:]} {v:.2f}x" for k, v in rows.items() if k.startswith("ratio"))
                  + "   load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        out[optimizer] = rows
    return out


def profile(sizes: dict, repeats: int, optimizers: tuple[str, ...]) -> dict:
    """Interleaved (engine step, me.jax step, engine step, ...), so load drifts hit both
    alike; each step split into its host part (``enqueue`` / ``prepare``) and the whole step
    waited for with ``jax.block_until_ready``. {optimizer: {part: median ms}}."""
    import statistics
    import time

    import jax

    import meshembed as me

    out = {}
    for optimizer in optimizers:
        cfg = _config(sizes, optimizer, False)
        emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
        ragged, grad = _inputs(sizes)
        grad = jax.device_put(grad)
        capacity = sizes["batch"] * sizes["ids_per_sample"]
        unique = int(np.unique(ragged.values).size)
        unique = -(-(unique + unique // 4) // 1024) * 1024
        holder = {"state": me.jax.init(cfg)}

        def train(state, batch, g):
            acts = me.jax.lookup(state, batch)
            return me.jax.apply_gradients(state, batch, {"f": g + 1e-3 * acts["f"]}), acts["f"]

        jitted = jax.jit(train, donate_argnums=0)
        times: dict[str, list[float]] = {k: [] for k in ("enqueue", "engine step", "prepare", "me.jax step")}

        def engine() -> None:
            t0 = time.perf_counter()
            emb.enqueue([ragged])
            t1 = time.perf_counter()
            acts = emb.dequeue()
            emb.apply_gradients([grad + 1e-3 * acts[0]])
            jax.block_until_ready((acts, emb.state.tables[0][0].data))
            times["enqueue"].append((t1 - t0) * 1e3)
            times["engine step"].append((time.perf_counter() - t0) * 1e3)

        def functional() -> None:
            t0 = time.perf_counter()
            batch = me.jax.prepare(cfg, {"f": ragged}, capacity=capacity, unique_capacity=unique)
            t1 = time.perf_counter()
            holder["state"], acts = jitted(holder["state"], batch, grad)
            jax.block_until_ready((acts, holder["state"].tables))
            times["prepare"].append((t1 - t0) * 1e3)
            times["me.jax step"].append((time.perf_counter() - t0) * 1e3)

        for i in range(2 + repeats):
            if i == 2:
                for v in times.values():
                    v.clear()
            engine()
            functional()
        med = {k: statistics.median(v) for k, v in times.items()}
        med["ratio me.jax / engine"] = med["me.jax step"] / med["engine step"]
        print(f"{optimizer:9s} " + "  ".join(f"{k} {v:.2f}" + ("x" if k.startswith("ratio") else " ms")
                                             for k, v in med.items()), flush=True)
        out[optimizer] = med
        del emb, holder
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--profile", action="store_true",
                    help="interleaved engine / me.jax steps: host part (enqueue / prepare) and whole step")
    args = ap.parse_args(argv)
    if args.profile:
        profile(TINY_W1 if args.tiny else W1, args.repeats, tuple(args.optimizers.split(",")))
        return
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        print("fbgemm_gpu not installed: no fbgemm TBE row (run with .venv/interop/bin/python, see make test-interop)")
    print("load average at start: %.2f %.2f %.2f" % __import__("os").getloadavg(), flush=True)
    run(TINY_W1 if args.tiny else W1, args.repeats, tuple(args.optimizers.split(",")), verbose=True)


if __name__ == "__main__":
    main(sys.argv[1:])
