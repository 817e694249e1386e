"""W2: one dense Adadelta step on 16,777,216 float32 parameters (1 tensor, or 64 tensors), torch.

Rows:
* ``me.optimizers.Adadelta.apply_gradients`` — the public dense optimizer on torch variables
  (``me.Variable``), as a user calls it: validation, staging, the per-variable step through
  ``backend.compile`` (compiled in place at these sizes) and the commit.
* ``meshembed core adadelta, eager`` — ``meshembed.math.adadelta`` over ``array_api_compat.torch``
  (pure: new arrays), results copied back into the variables, as the dense optimizer does.
* ``meshembed core adadelta, torch.compile`` — the same pure function and the write-back in one
  function compiled by ``TorchBackend.compile(..., force=True)``: inductor fuses the ~15
  element-wise ops and the three stores into one pass over memory.
* ``torch.optim.Adadelta(foreach=True)`` and ``(foreach=False)``.

The bound is ``w2_bytes`` (read g, read+write p and both slots) ÷ measured copy bandwidth.
Run: ``python -m benchmarks.torch_w2 [--tiny] [--repeats N]``.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import WARMUP, Row, timeit, w2_bytes, w2_main

LR, RHO, EPS = 1.0, 0.95, 1e-6
IMPLS = ("optimizer", "eager", "compile", "torch-foreach", "torch-loop")
_NAME = {
    "optimizer": "me.optimizers.Adadelta.apply_gradients",
    "eager": "meshembed core adadelta, eager",
    "compile": "meshembed core adadelta, torch.compile",
    "torch-foreach": "torch.optim.Adadelta(foreach=True)",
    "torch-loop": "torch.optim.Adadelta(foreach=False)",
}


def _tensors(params: int, count: int) -> tuple[list, list]:
    import torch

    gen = torch.Generator().manual_seed(0)
    size = params // count
    ps = [torch.randn(size, generator=gen) for _ in range(count)]
    gs = [torch.randn(size, generator=gen) * 0.01 for _ in range(count)]
    return ps, gs


def _make_step(impl: str, params: int, count: int) -> Callable[[], Any]:
    import torch

    import meshembed as me
    from meshembed.math import AdadeltaSlots, adadelta

    ps, gs = _tensors(params, count)
    if impl.startswith("torch"):
        leaves = [torch.nn.Parameter(p) for p in ps]
        opt = torch.optim.Adadelta(leaves, lr=LR, rho=RHO, eps=EPS, foreach=impl == "torch-foreach")

        def step() -> Any:
            for leaf, g in zip(leaves, gs):
                leaf.grad = g
            opt.step()

        return step
    if impl == "optimizer":
        variables = [me.Variable(p, name=f"w{i}", backend="torch") for i, p in enumerate(ps)]
        opt = me.optimizers.Adadelta(learning_rate=LR, rho=RHO, epsilon=EPS)
        opt.build(variables)
        pairs = list(zip(gs, variables))
        return lambda: opt.apply_gradients(pairs)
    backend = me.get_backend("torch")
    xp = backend.xp
    accs = [torch.zeros_like(p) for p in ps]
    upds = [torch.zeros_like(p) for p in ps]

    def update(p, g, a, u):
        new_p, slots = adadelta(xp, p, g, AdadeltaSlots(a, u), lr=LR, rho=RHO, epsilon=EPS)
        p.copy_(new_p)
        a.copy_(slots.accumulators)
        u.copy_(slots.updates)

    fn = backend.compile(update, force=True) if impl == "compile" else update

    def step() -> Any:
        for p, g, a, u in zip(ps, gs, accs, upds):
            fn(p, g, a, u)

    return step


def w2(sizes: dict, repeats: int = 7, impls: tuple[str, ...] = IMPLS, counts: tuple[int, ...] = (1, 64),
       warmup: int = WARMUP, verbose: bool = False) -> list[Row]:
    params = sizes["params"]
    rows = []
    for count in counts:
        for impl in impls:
            note = ""
            med = lo = hi = float("nan")
            try:
                step = _make_step(impl, params, count)
                med, lo, hi = timeit(step, warmup=warmup + (1 if impl in ("compile", "optimizer") else 0), repeats=repeats)
            except Exception as exc:  # noqa: BLE001 - a failing row is reported, not fatal
                note = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                step = None
                gc.collect()
            case = f"adadelta {count} tensor{'s' if count > 1 else ''}"
            row = Row(workload="W2", name=_NAME[impl], case=case, median_ms=med, min_ms=lo, max_ms=hi,
                      bytes_touched=w2_bytes(params), state_bytes=params * 4 * 3, note=note)
            rows.append(row)
            if verbose:
                print(f"{case:20s} {row.name:42s} {med:9.2f} ms  ({lo:.2f}-{hi:.2f}) {note}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    w2_main(__doc__, w2, IMPLS, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
