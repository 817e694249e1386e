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
* ``me.optimizers.Adadelta ... allow_nonfinite=True`` — the same without the NaN/Inf check of
  the gradients (the default, ``allow_nonfinite=False``, refuses a non-finite step and changes
  nothing: one extra read of every gradient).
* ``me.torch.Adadelta.step`` — the ``torch.optim.Optimizer`` over ``nn.Parameter``\ s (``p.grad``),
  on the same path (the generated row kernel of the rule, all tensors in one C call).
* ``torch.optim.Adadelta(foreach=True)``, ``(foreach=False)`` and ``(fused=True)`` where this
  torch has it (torch 2.13's Adadelta has no ``fused``: the row says so).
* ``W2's in-place stream, no math (the bound)`` — ``benchmarks/w2_stream.cc`` over the same
  tensors on torch's threads: the bytes of the step and nothing else, timed interleaved with
  the rows, so the #36 item 3 line (median ÷ this bound ≤ 1.2×) compares them under the same
  load.

``main`` prints the side-by-side table and each row's speed-up over ``foreach=True``.

The bound is ``w2_bytes`` (read g, read+write p and both slots) ÷ measured copy bandwidth.
Run: ``python -m benchmarks.torch_w2 [--tiny] [--repeats N] [--only impl,...]``.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import W2_STREAM_NAME, WARMUP, Row, w2_bytes, w2_main, w2_stream_fn

LR, RHO, EPS = 1.0, 0.95, 1e-6
IMPLS = ("optimizer", "optimizer-nonfinite", "me-torch", "eager", "compile", "torch-foreach", "torch-fused",
         "torch-loop", "bound")
BASELINE = "torch-foreach"
_NAME = {
    "optimizer": "me.optimizers.Adadelta.apply_gradients",
    "optimizer-nonfinite": "me.optimizers.Adadelta(allow_nonfinite=True)",
    "me-torch": "me.torch.Adadelta.step",
    "torch-fused": "torch.optim.Adadelta(fused=True)",
    "eager": "meshembed core adadelta, eager",
    "compile": "meshembed core adadelta, torch.compile",
    "torch-foreach": "torch.optim.Adadelta(foreach=True)",
    "torch-loop": "torch.optim.Adadelta(foreach=False)",
    "bound": W2_STREAM_NAME,
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
    if impl == "bound":  # the same bytes with no math: read g, read and write p and two slots in place
        fn = w2_stream_fn()
        if fn is None:
            raise NotImplementedError("benchmarks/w2_stream.cc could not be built (no compiler)")
        arrays = [ps, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], gs]
        ptrs = [[x.data_ptr() for x in xs] for xs in arrays]
        sizes = [p.numel() for p in ps]
        threads = torch.get_num_threads()

        def stream() -> list:
            fn(*ptrs, sizes, threads)
            return arrays  # keeps the tensors (and so the addresses) alive as long as the step

        return stream
    if impl.startswith("torch") or impl == "me-torch":
        leaves = [torch.nn.Parameter(p) for p in ps]
        if impl == "me-torch":
            opt = me.torch.Adadelta(leaves, lr=LR, rho=RHO, eps=EPS)
        elif impl == "torch-fused":
            import inspect

            if "fused" not in inspect.signature(torch.optim.Adadelta.__init__).parameters:
                raise NotImplementedError(f"torch {torch.__version__}'s Adadelta has no fused=True")
            opt = torch.optim.Adadelta(leaves, lr=LR, rho=RHO, eps=EPS, fused=True)
        else:
            opt = torch.optim.Adadelta(leaves, lr=LR, rho=RHO, eps=EPS, foreach=impl == "torch-foreach")

        def step() -> Any:
            for leaf, g in zip(leaves, gs):
                leaf.grad = g
            opt.step()

        return step
    if impl.startswith("optimizer"):
        variables = [me.Variable(p, name=f"w{i}", backend="torch") for i, p in enumerate(ps)]
        opt = me.optimizers.Adadelta(learning_rate=LR, rho=RHO, epsilon=EPS, allow_nonfinite=impl != "optimizer")
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
    """Every implementation of a case built side by side, then timed *interleaved* (repeat r
    times each one once, in turn), so a machine whose load changes during the run (other
    processes on the same cores) weighs on every row alike; medians of ``repeats``."""
    import time

    params = sizes["params"]
    rows = []
    for count in counts:
        steps: dict[str, Any] = {}
        notes = {impl: "" for impl in impls}
        for impl in impls:
            try:
                steps[impl] = _make_step(impl, params, count)
                for _ in range(warmup + (1 if impl in ("compile", "optimizer", "optimizer-nonfinite", "me-torch") else 0)):
                    steps[impl]()
            except Exception as exc:  # noqa: BLE001 - a failing row is reported, not fatal
                steps.pop(impl, None)
                notes[impl] = f"{type(exc).__name__}: {str(exc)[:160]}"
        times: dict[str, list[float]] = {impl: [] for impl in steps}
        for _ in range(repeats):
            for impl, step in steps.items():
                t0 = time.perf_counter()
                step()
                times[impl].append((time.perf_counter() - t0) * 1e3)
        steps.clear()
        gc.collect()
        case = f"adadelta {count} tensor{'s' if count > 1 else ''}"
        for impl in impls:
            got = times.get(impl)
            med, lo, hi = (float(np.median(got)), min(got), max(got)) if got else (float("nan"),) * 3
            row = Row(workload="W2", name=_NAME[impl], case=case, median_ms=med, min_ms=lo, max_ms=hi,
                      bytes_touched=w2_bytes(params), state_bytes=params * 4 * 3, note=notes[impl])
            rows.append(row)
            if verbose:
                print(f"{case:20s} {row.name:46s} {med:9.2f} ms  ({lo:.2f}-{hi:.2f}) {row.note}", flush=True)
    return rows


def speedups(rows: list[Row]) -> str:
    """Side by side: each row's median and its speed-up over ``torch.optim.Adadelta(foreach=True)``
    of the same case (> 1: faster)."""
    base = {r.case: r.median_ms for r in rows if r.name == _NAME[BASELINE]}
    lines = ["| case | implementation | median ms | min–max ms | × faster than foreach=True |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = base.get(r.case, float("nan")) / r.median_ms if r.median_ms == r.median_ms else float("nan")
        shown = f"{ratio:.2f}" if ratio == ratio else (r.note or "n/a")
        lines.append(f"| {r.case} | {r.name} | {r.median_ms:.2f} | {r.min_ms:.2f}–{r.max_ms:.2f} | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    captured: list[Row] = []

    def w2_kept(*args: Any, **kwargs: Any) -> list[Row]:
        captured[:] = w2(*args, **kwargs)
        return captured

    w2_main(__doc__, w2_kept, IMPLS, argv)
    print()
    print(speedups(captured))


if __name__ == "__main__":
    main(sys.argv[1:])
