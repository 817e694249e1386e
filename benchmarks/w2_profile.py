"""W2 profile (#36 item 3): the pieces of one dense Adadelta step, timed interleaved in one process.

For 1 tensor and 64 tensors (16,777,216 float32 in all), each piece alone, in turn, ``repeats``
rounds (a machine whose load changes weighs on every piece alike), median and min in ms:

* ``apply_gradients`` — the public dense optimizer (NaN check, then the fused update);
* ``apply_gradients(allow_nonfinite=True)`` — the same without the check;
* ``the update call`` — the backend's generated-kernel call alone (torch: ``native.dense_update``,
  one C call; JAX: ``compile_update``'s FFI call) on its own tensors;
* ``the NaN check`` — the backend's all-finite pass alone (``finite_guard``);
* ``the bound`` — ``benchmarks/w2_stream.cc``: the step's bytes with no math (on NumPy arrays:
  2 MiB pages where THP is ``madvise``; torch's tensors here are on 4 KiB pages, as a model's).

``apply_gradients`` − ``allow_nonfinite`` ≈ the check; ``allow_nonfinite`` − the update call ≈
the Python of a step; the update call ÷ the bound = what the kernel's math and chunking cost
over the memory floor. Run: ``python -m benchmarks.w2_profile [--backend torch|jax] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from benchmarks.common import W2, w2_stream_fn

LR, RHO, EPS = 1.0, 0.95, 1e-6


def _pieces(backend: str, params: int, count: int) -> dict[str, Callable[[], Any]]:
    import meshembed as me

    m = params // count
    rng = np.random.default_rng(0)
    be = me.get_backend(backend)
    if backend == "jax":
        import jax

        def block(x: Any) -> Any:
            return jax.block_until_ready(x)
    else:
        def block(x: Any) -> Any:
            return x

    def new(scale: float = 1.0) -> list:
        xs = [be.asarray(rng.standard_normal(m, dtype=np.float32) * np.float32(scale)) for _ in range(count)]
        # torch: memory of torch's own allocator, as a model's (as_tensor would keep NumPy's, on 2 MiB pages)
        return [x.clone() for x in xs] if backend == "torch" else xs

    grads = new(0.01)
    out: dict[str, Callable[[], Any]] = {}
    for name, nonfinite in (("apply_gradients", False), ("apply_gradients(allow_nonfinite=True)", True)):
        variables = [me.Variable(v, name=f"w{i}", backend=backend) for i, v in enumerate(new())]
        opt = me.optimizers.Adadelta(learning_rate=LR, rho=RHO, epsilon=EPS, allow_nonfinite=nonfinite)
        opt.build(variables)
        pairs = list(zip(grads, variables))
        out[name] = (lambda o, p, v: lambda: block([o.apply_gradients(p), v[-1].value]))(opt, pairs, variables)
    run = be.compile_update(opt._rule(variables[0], True), count)
    state = {"t": [new(), [be.asarray(np.zeros(m, np.float32)) for _ in range(count)],
                   [be.asarray(np.zeros(m, np.float32)) for _ in range(count)]]}
    values = [(LR,)] * count

    def update() -> Any:
        new_targets = run(grads, values, *state["t"])
        if new_targets is not None:  # JAX: the donated buffers' successors
            state["t"] = new_targets
        return block(state["t"])

    out["the update call"] = update
    out["the NaN check"] = lambda: bool(be.finite_guard(grads))
    fn = w2_stream_fn()
    if fn is not None:
        import os

        arrays = [[np.full(m, 0.5, np.float32) for _ in range(count)] for _ in range(4)]
        ptrs = [[x.ctypes.data for x in xs] for xs in arrays]
        out["the bound (W2's in-place stream, no math)"] = lambda: (fn(*ptrs, [m] * count, os.cpu_count() or 1), arrays)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch", choices=("torch", "jax"))
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--params", type=int, default=W2["params"])
    args = ap.parse_args(argv)
    load = open("/proc/loadavg").read().split()[:3] if __import__("os").path.exists("/proc/loadavg") else "?"
    print(f"W2 profile, {args.backend}, {args.params:,} float32, {args.repeats} interleaved rounds, load {load}")
    print("| tensors | piece | median ms | min ms |\n|---|---|---|---|")
    for count in (1, 64):
        pieces = _pieces(args.backend, args.params, count)
        for f in pieces.values():
            for _ in range(3):
                f()
        times: dict[str, list[float]] = {n: [] for n in pieces}
        for _ in range(args.repeats):
            for n, f in pieces.items():
                t0 = time.perf_counter()
                f()
                times[n].append((time.perf_counter() - t0) * 1e3)
        for n, v in times.items():
            print(f"| {count} | {n} | {float(np.median(v)):.2f} | {min(v):.2f} |", flush=True)
        pieces.clear()


if __name__ == "__main__":
    main()
