"""W1: sparse embedding training step on JAX, next to a hand-written optax + ``jax.jit`` step.

Table 1,000,000 × 64 float32; batch 16,384 samples × 8 ids from Zipf(1.1); sum combiner;
the same fixed ``[16384, 64]`` upstream gradient for every row.

Rows (``impl``):
* ``engine`` — ``me.TPUEmbedding(cfg, backend="jax")``: enqueue + dequeue + apply_gradients.
* ``update_rows`` — the backend's fused, donated update alone (dedup + segment-sum + the core's
  optimizer function), on precomputed per-id gradients.
* ``optax+jit`` — a hand-written full step in one ``jax.jit`` with donation: gather + segment
  sum forward, combiner backward, ``jnp.unique(size=capacity)`` + segment sum, the optax
  transform (``optax.sgd/adagrad/adadelta``) applied to the gathered rows, scatter back.

Run: ``python -m benchmarks.jax_w1 [--tiny] [--repeats N] [--only engine,update_rows,optax]``;
``--against-fbgemm R`` times the engine and fbgemm's CPU TBE in R interleaved rounds instead.
A common runner imports :func:`run`.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import TINY_W1, W1, WARMUP, Row, W1Inputs, bandwidth_gbs, inputs_ready, table, timeit, w1_bytes

OPTIMIZERS = ("sgd", "adagrad", "adadelta")
IMPLS = ("engine", "update_rows", "optax")
LR = 0.05
_NAME = {
    "engine": "meshembed[jax] engine",
    "update_rows": "meshembed[jax] update_rows only",
    "optax": "hand-written optax + jax.jit (donated)",
}
_SLOTS = {"sgd": 0, "adagrad": 1, "adadelta": 2}


def _spec(name: str) -> Any:
    import meshembed as me

    return {
        "sgd": lambda: me.embedding.SGD(learning_rate=LR),
        "adagrad": lambda: me.embedding.Adagrad(learning_rate=LR),
        "adadelta": lambda: me.embedding.Adadelta(learning_rate=LR, rho=0.95, epsilon=1e-6),
    }[name]()


_Data = W1Inputs  # the shared W1 inputs (benchmarks.common)


def _sync(x: Any) -> None:
    import jax

    jax.block_until_ready(x)


def _engine_step(d: _Data, optimizer: str) -> Callable[[], Any]:
    import meshembed as me

    s = d.sizes
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=s["vocab"], dimension=s["dim"],
                               optimizer=_spec(optimizer), combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(s["batch"],), name="f")],
        sharding_strategy="mod",
    )
    emb = me.TPUEmbedding(cfg, backend="jax", num_shards=1)
    grad = emb.backend.asarray(d.grad)
    ragged = me.RaggedIds(d.splits, d.ids)

    def step() -> Any:
        emb.enqueue([ragged])
        acts = emb.dequeue()
        emb.apply_gradients([grad])
        return acts  # this step's update finishes before the next step's lookup reads the table

    step.finish = lambda: _sync(emb.state.tables[0][0].data)  # type: ignore[attr-defined]
    return step


def _update_rows_step(d: _Data, optimizer: str) -> Callable[[], Any]:
    import meshembed as me
    from meshembed.embedding.layout import build_layout
    from meshembed.embedding.updates import make_rule, rule_values
    from meshembed.sharding import Placement

    s = d.sizes
    be = me.get_backend("jax")
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=s["vocab"], dimension=s["dim"],
                               optimizer=_spec(optimizer), combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(s["batch"],), name="f")],
    )
    spec = build_layout(cfg).tables[0]
    placement = Placement(s["vocab"], 1, "mod")
    rng = np.random.default_rng(2)
    values = (rng.standard_normal((s["vocab"], s["dim"])) * 0.01).astype(np.float32)
    state = [be.create_table(values, placement)]
    state += [be.create_table(np.full_like(values, 0.1), placement) for _ in range(_SLOTS[optimizer])]
    ids = be.asarray(d.ids)
    grads = be.asarray(d.grad[d.segments])
    holder = {"state": state}

    rule = make_rule(spec, "jax")  # the update as data, its values passed per call (as the engine)

    def step() -> Any:
        holder["state"] = be.update_rows(holder["state"], ids, grads, rule, values=rule_values(spec, rule, ()))
        return holder["state"][0].data

    return step


def _optax_step(d: _Data, optimizer: str) -> Callable[[], Any]:
    """Hand-written sparse step: one jit, table and optimizer-state leaves donated."""
    import jax
    import jax.numpy as jnp
    import optax

    s = d.sizes
    v, dim, b = s["vocab"], s["dim"], s["batch"]
    tx = {
        "sgd": lambda: optax.sgd(LR),
        "adagrad": lambda: optax.adagrad(LR, initial_accumulator_value=0.1),
        "adadelta": lambda: optax.adadelta(LR, rho=0.95, eps=1e-6),
    }[optimizer]()
    n = d.ids.size
    capacity = 1 << max(int(np.ceil(np.log2(max(d.unique, 1) * 1.1))), 3)
    rng = np.random.default_rng(2)
    table_ = jnp.asarray((rng.standard_normal((v, dim)) * 0.01).astype(np.float32))
    state_ = tx.init(jnp.zeros((v, dim), jnp.float32))

    def row_leaf(x: Any) -> bool:
        return getattr(x, "shape", ()) == (v, dim)

    def _step(table: Any, state: Any, ids: Any, segments: Any, grad_out: Any) -> Any:
        acts = jax.ops.segment_sum(table[ids], segments, num_segments=b)  # forward
        g_ids = grad_out[segments]  # sum-combiner backward
        uniq, inv = jnp.unique(ids, size=capacity, fill_value=v, return_inverse=True)
        g = jax.ops.segment_sum(g_ids, inv.reshape(-1), num_segments=capacity)
        rows = table.at[uniq].get(mode="fill", fill_value=0)
        srows = jax.tree.map(lambda x: x.at[uniq].get(mode="fill", fill_value=0) if row_leaf(x) else x, state)
        upd, new_srows = tx.update(g, srows, rows)
        table = table.at[uniq].set(rows + upd, mode="drop")
        state = jax.tree.map(
            lambda full, part: full.at[uniq].set(part, mode="drop") if row_leaf(full) else part, state, new_srows
        )
        return acts, table, state

    step_jit = jax.jit(_step, donate_argnums=(0, 1))
    ids = jnp.asarray(d.ids.astype(np.int32))
    segments = jnp.asarray(d.segments.astype(np.int32))
    grad = jnp.asarray(d.grad)
    holder = {"table": table_, "state": state_}

    def step() -> Any:
        acts, holder["table"], holder["state"] = step_jit(holder["table"], holder["state"], ids, segments, grad)
        return acts, holder["table"]

    return step


_MAKERS = {"engine": _engine_step, "update_rows": _update_rows_step, "optax": _optax_step}


def w1(sizes: dict, repeats: int = 7, impls: tuple[str, ...] = IMPLS,
       optimizers: tuple[str, ...] = OPTIMIZERS, warmup: int = WARMUP, verbose: bool = False) -> list[Row]:
    """One Row per (implementation, optimizer); a failure becomes a NaN row with a note."""
    d = _Data(sizes)
    inputs_ready()
    s = sizes
    rows = []
    for optimizer in optimizers:
        for impl in impls:
            med = lo = hi = float("nan")
            note = ""
            try:
                step = _MAKERS[impl](d, optimizer)
                med, lo, hi = timeit(step, warmup=warmup, repeats=repeats, sync=_sync)
            except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, not hidden
                note = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                step = None
                gc.collect()
            n_slots = _SLOTS[optimizer]
            row = Row(
                workload="W1", name=_NAME[impl], case=optimizer, median_ms=med, min_ms=lo, max_ms=hi,
                bytes_touched=w1_bytes(d.unique, s["batch"] * s["ids_per_sample"], s["dim"], n_slots),
                state_bytes=s["vocab"] * s["dim"] * 4 * (1 + n_slots), note=note,
                extra={"unique_rows": d.unique},
            )
            rows.append(row)
            if verbose:
                print(f"{optimizer:9s} {row.name:42s} {med:9.2f} ms  ({lo:.2f}-{hi:.2f})  {note}", flush=True)
    return rows


def against_fbgemm(sizes: dict, optimizer: str, repeats: int = 7, rounds: int = 6) -> dict[str, tuple]:
    """The engine step and fbgemm's CPU TBE step (``benchmarks.torch_w1``) timed in
    interleaved rounds in one process: a noisy neighbour slows both alike, so their ratio
    is steadier than two separate runs'. Returns ``{name: (median, min, max) ms}``."""
    from benchmarks import torch_w1

    engine = _engine_step(_Data(sizes), optimizer)
    synced = lambda: _sync(engine())  # noqa: E731
    synced.finish = engine.finish  # type: ignore[attr-defined]
    steps = {"meshembed[jax] engine": synced,
             "fbgemm TBE CPU": torch_w1._make_step("fbgemm", torch_w1._Data(sizes), optimizer)}
    return torch_w1._timed_rounds(steps, repeats, rounds, warmup=3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--against-fbgemm", type=int, default=0, metavar="ROUNDS",
                    help="instead: the engine and fbgemm's TBE in ROUNDS interleaved rounds (sgd, adagrad)")
    args = ap.parse_args(argv)
    if args.against_fbgemm:
        for optimizer in [o for o in args.optimizers.split(",") if o != "adadelta"]:
            timed = against_fbgemm(TINY_W1 if args.tiny else W1, optimizer, args.repeats, args.against_fbgemm)
            for name, (med, lo, hi) in timed.items():
                print(f"{optimizer:9s} {name:24s} {med:8.2f} ms ({lo:.2f}-{hi:.2f})")
            ratio = timed["fbgemm TBE CPU"][0] / timed["meshembed[jax] engine"][0]
            print(f"{optimizer:9s} fbgemm / meshembed[jax] = {ratio:.2f}x", flush=True)
        return
    rows = w1(TINY_W1 if args.tiny else W1, args.repeats, tuple(args.only.split(",")),
              tuple(args.optimizers.split(",")), verbose=True)
    gbs = bandwidth_gbs()
    print(f"\n{rows[0].extra['unique_rows']} unique rows/step; copy bandwidth {gbs:.1f} GB/s")
    print(table(rows, gbs))


if __name__ == "__main__":
    main(sys.argv[1:])
