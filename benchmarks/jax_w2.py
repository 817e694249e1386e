"""W2: one dense Adadelta step on 16,777,216 float32 parameters (1 tensor, or 64 tensors), JAX.

Rows:
* ``meshembed core adadelta, jit+donate`` — ``meshembed.math.adadelta`` over ``jax.numpy``
  compiled by ``JaxBackend.compile`` (``jax.jit``) with params and both slots donated: XLA
  fuses the element-wise ops into one loop per tensor and writes in place.
* ``optax.adadelta, jit+donate`` — ``tx.update`` + ``optax.apply_updates`` in one ``jax.jit``
  with params and optimizer state donated (63.5 ms on this machine per design §5).

The bound is ``w2_bytes`` (read g, read+write p and both slots) ÷ measured copy bandwidth.
Run: ``python -m benchmarks.jax_w2 [--tiny] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import TINY_W2, W2, Row, bandwidth_gbs, table, timeit, w2_bytes

LR, RHO, EPS = 1.0, 0.95, 1e-6
IMPLS = ("core", "optax")
_NAME = {"core": "meshembed core adadelta, jit+donate", "optax": "optax.adadelta, jit+donate"}


def _tensors(params: int, n: int, seed: int) -> list[Any]:
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(params // n).astype(np.float32)) for _ in range(n)]


def _core_step(params: int, n: int) -> Callable[[], Any]:
    import jax.numpy as jnp

    import meshembed as me
    from meshembed import math as me_math

    be = me.get_backend("jax")
    xp = be.xp

    def update(ps: list, gs: list, accs: list, upds: list, lr: Any) -> tuple:
        out = [me_math.adadelta(xp, p, g, me_math.AdadeltaSlots(a, u), lr=lr, rho=RHO, epsilon=EPS)
               for p, g, a, u in zip(ps, gs, accs, upds)]
        return [o[0] for o in out], [o[1].accumulators for o in out], [o[1].updates for o in out]

    step_jit = be.compile(update, donate_argnums=(0, 2, 3))
    st = {"p": _tensors(params, n, 0), "a": [jnp.zeros_like(x) for x in _tensors(params, n, 0)],
          "u": [jnp.zeros_like(x) for x in _tensors(params, n, 0)]}
    grads = _tensors(params, n, 1)
    lr = jnp.asarray(LR, jnp.float32)

    def step() -> Any:
        st["p"], st["a"], st["u"] = step_jit(st["p"], grads, st["a"], st["u"], lr)
        return st["p"]

    return step


def _optax_step(params: int, n: int) -> Callable[[], Any]:
    import jax
    import optax

    tx = optax.adadelta(LR, rho=RHO, eps=EPS)

    def update(ps: list, gs: list, state: Any) -> tuple:
        upd, state = tx.update(gs, state, ps)
        return optax.apply_updates(ps, upd), state

    step_jit = jax.jit(update, donate_argnums=(0, 2))
    st = {"p": _tensors(params, n, 0)}
    st["s"] = tx.init(st["p"])
    grads = _tensors(params, n, 1)

    def step() -> Any:
        st["p"], st["s"] = step_jit(st["p"], grads, st["s"])
        return st["p"]

    return step


_MAKERS = {"core": _core_step, "optax": _optax_step}


def _sync(x: Any) -> None:
    import jax

    jax.block_until_ready(x)


def w2(sizes: dict, repeats: int = 7, impls: tuple[str, ...] = IMPLS, warmup: int = 2,
       verbose: bool = False) -> list[Row]:
    params = sizes["params"]
    rows = []
    for n in (1, 64):
        for impl in impls:
            med = lo = hi = float("nan")
            note = ""
            try:
                step = _MAKERS[impl](params, n)
                med, lo, hi = timeit(step, warmup=warmup, repeats=repeats, sync=_sync)
            except Exception as exc:  # noqa: BLE001 - reported as a row
                note = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                step = None
                gc.collect()
            case = "adadelta 1 tensor" if n == 1 else f"adadelta {n} tensors"
            row = Row("W2", _NAME[impl], case, med, lo, hi, w2_bytes(params), params * 4 * 3, note=note)
            rows.append(row)
            if verbose:
                print(f"{case:20s} {row.name:40s} {med:9.2f} ms  ({lo:.2f}-{hi:.2f})  {note}", flush=True)
    return rows


def run(workload: str = "w2", sizes: str | dict = "full", repeats: int = 7, **kw: Any) -> list[dict]:
    """Entry point for a common runner: rows as dicts (``Row.as_dict``)."""
    if workload.lower() != "w2":
        raise ValueError(f"Invalid `workload`. Expected 'w2'. Received: workload={workload!r}")
    if isinstance(sizes, str):
        sizes = {"full": W2, "tiny": TINY_W2}[sizes]
    return [r.as_dict() for r in w2(sizes, repeats, **kw)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    args = ap.parse_args(argv)
    rows = w2(TINY_W2 if args.tiny else W2, args.repeats, tuple(args.only.split(",")), verbose=True)
    gbs = bandwidth_gbs()
    print(f"\ncopy bandwidth {gbs:.1f} GB/s")
    print(table(rows, gbs))


if __name__ == "__main__":
    main(sys.argv[1:])
