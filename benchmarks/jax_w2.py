"""W2: one dense Adadelta step on 16,777,216 float32 parameters (1 tensor, or 64 tensors), JAX.

Rows:
* ``me.optimizers.Adadelta.apply_gradients`` — the public dense optimizer on JAX variables: the
  NaN check, then the rule's generated row kernel over all tensors in one FFI call.
* ``meshembed core adadelta, jit+donate`` — ``meshembed.math.adadelta`` over ``jax.numpy``
  compiled by ``JaxBackend.compile`` (``jax.jit``) with params and both slots donated: XLA
  fuses the element-wise ops into one loop per tensor and writes in place.
* ``optax.adadelta, jit+donate`` — ``tx.update`` + ``optax.apply_updates`` in one ``jax.jit``
  with params and optimizer state donated (63.5 ms on this machine per design §5).
* ``W2's in-place stream, no math (the bound)`` — ``benchmarks/w2_stream.cc``: the step's bytes
  and nothing else, on host arrays of the same sizes; the #36 item 3 line divides the
  optimizer's median by it (≤ 1.2×).

The bound is ``w2_bytes`` (read g, read+write p and both slots) ÷ measured copy bandwidth.
Run: ``python -m benchmarks.jax_w2 [--tiny] [--repeats N]``.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import W2_STREAM_NAME, WARMUP, Row, timeit, w2_bytes, w2_main, w2_stream_fn

LR, RHO, EPS = 1.0, 0.95, 1e-6
IMPLS = ("optimizer", "core", "optax", "bound")
_NAME = {"optimizer": "me.optimizers.Adadelta.apply_gradients", "core": "meshembed core adadelta, jit+donate",
         "optax": "optax.adadelta, jit+donate", "bound": W2_STREAM_NAME}


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


def _optimizer_step(params: int, n: int) -> Callable[[], Any]:
    """The public dense optimizer on JAX variables: its rule runs as the generated kernel in
    one FFI call over the n tensors (the core function jitted where that is unavailable)."""
    import meshembed as me

    variables = [me.Variable(x, name=f"w{i}", backend="jax") for i, x in enumerate(_tensors(params, n, 0))]
    opt = me.optimizers.Adadelta(learning_rate=LR, rho=RHO, epsilon=EPS)
    opt.build(variables)
    pairs = list(zip(_tensors(params, n, 1), variables))

    def step() -> Any:
        opt.apply_gradients(pairs)
        return [v.value for v in variables]

    return step


def _bound_step(params: int, n: int) -> Callable[[], Any]:
    """The bytes of the step with no math (``benchmarks/w2_stream.cc``) over ``n`` host arrays of
    the same sizes, on as many threads as XLA's CPU pool (the cores): the #36 item 3 bound."""
    import os

    fn = w2_stream_fn()
    if fn is None:
        raise NotImplementedError("benchmarks/w2_stream.cc could not be built (no compiler)")
    arrays = [[np.full(params // n, 0.5, np.float32) for _ in range(n)] for _ in range(4)]
    ptrs = [[x.ctypes.data for x in xs] for xs in arrays]
    sizes = [params // n] * n
    threads = os.cpu_count() or 1

    def step() -> Any:
        fn(*ptrs, sizes, threads)
        return arrays  # keeps the arrays alive as long as the step

    return step


_MAKERS = {"optimizer": _optimizer_step, "core": _core_step, "optax": _optax_step, "bound": _bound_step}


def _sync(x: Any) -> None:
    import jax

    jax.block_until_ready(x)


def w2(sizes: dict, repeats: int = 7, impls: tuple[str, ...] = IMPLS, warmup: int = WARMUP,
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


def main(argv: list[str] | None = None) -> None:
    w2_main(__doc__, w2, IMPLS, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
