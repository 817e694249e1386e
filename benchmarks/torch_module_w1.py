"""W1 through ``me.torch.EmbeddingCollection``, side by side in one run: the module (eager and
``torch.compile(fullgraph=True)``), ``me.TPUEmbedding(backend="torch")`` and fbgemm's CPU TBE
with its fused optimizer, for SGD and Adagrad.

W1: table 1,000,000 × 64 float32, 16,384 samples × 8 Zipf(1.1) ids, sum combiner, one full
training step each (lookup, backward with one fixed upstream gradient, optimizer). The steps
are ``benchmarks.torch_api_w1``'s, timed in interleaved rounds so a noisy machine slows every
row alike. Printed: one table of medians (ms) per optimizer, module ÷ engine (target ≤ 1.15)
and fbgemm ÷ module (target ≥ 1.25), the load average before and after, and the settings.
Each step is timed on two clocks: wall time (the figure that counts) and the process's CPU
time, which a machine shared with other jobs inflates much less (on a loaded 2-core VM the
wall medians moved 3x while CPU medians stayed within 10%); the ratios are given for both.

fbgemm_gpu lives in the interop venv (``make test-interop`` builds it, layered on ``.venv``):

    .venv/interop/bin/python -m benchmarks.torch_module_w1 [--tiny] [--repeats N] [--rounds R]

Without fbgemm_gpu its row is skipped with the import error printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable

from benchmarks import torch_api_w1, torch_w1
from benchmarks.common import TINY_W1, W1, WARMUP, inputs_ready

OPTIMIZERS = ("sgd", "adagrad")
IMPLS = torch_api_w1.IMPLS


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _timed(steps: dict[str, Callable[[], Any]], repeats: int, rounds: int, warmup: int) -> dict[str, tuple]:
    """``{impl: (wall median, wall min, wall max, cpu median)}`` ms, in interleaved rounds."""
    for impl, step in steps.items():
        for _ in range(warmup + (2 if "compile" in impl else 0)):
            step()
    wall: dict[str, list[float]] = {impl: [] for impl in steps}
    cpu: dict[str, list[float]] = {impl: [] for impl in steps}
    for _ in range(rounds):
        for impl, step in steps.items():
            for _ in range(repeats):
                w, c = time.perf_counter(), time.process_time()
                step()
                cpu[impl].append((time.process_time() - c) * 1e3)
                wall[impl].append((time.perf_counter() - w) * 1e3)
    return {impl: (statistics.median(wall[impl]), min(wall[impl]), max(wall[impl]), statistics.median(cpu[impl]))
            for impl in steps}


def measure(sizes: dict, repeats: int = 7, rounds: int = 3, warmup: int = WARMUP,
            optimizers: tuple[str, ...] = OPTIMIZERS) -> tuple[dict, dict]:
    """``(results, skipped)``: ``results[(optimizer, impl)]`` as ``_timed`` gives it;
    ``skipped[(optimizer, impl)]`` the reason a row was not run."""
    d = torch_w1._Data(sizes)
    inputs_ready()
    results, skipped = {}, {}
    for opt in optimizers:
        steps = {}
        for impl in IMPLS:
            reason = torch_w1._unsupported(impl, opt)
            if reason:
                skipped[(opt, impl)] = reason
            else:
                steps[impl] = torch_api_w1._make(impl, d, opt)
        for impl, r in _timed(steps, repeats, rounds, warmup).items():
            results[(opt, impl)] = r
        steps.clear()
        gc.collect()
    return results, skipped


def table(results: dict, optimizers: tuple[str, ...] = OPTIMIZERS) -> str:
    """The side-by-side table (wall median (min-max) / CPU median, ms), then the ratios."""
    lines = [f"{'optimizer':10s}" + "".join(f" {impl:>29s}" for impl in IMPLS)]
    for opt in optimizers:
        cells = []
        for impl in IMPLS:
            r = results.get((opt, impl))
            cells.append(" " + (f"{'skipped':>29s}" if r is None else f"{r[0]:.2f} ({r[1]:.1f}-{r[2]:.1f}) / {r[3]:.2f}".rjust(29)))
        lines.append(f"{opt:10s}" + "".join(cells))
    lines.append("")
    for opt in optimizers:
        for impl in ("module", "module+compile"):
            m, e, f = (results.get((opt, k)) for k in (impl, "engine", "fbgemm"))
            if m is None or e is None:
                continue
            vs = m[0] / e[0]
            text = (f"{opt:8s} {impl:15s} / engine {vs:5.2f}x wall, {m[3] / e[3]:5.2f}x cpu "
                    f"({'met' if vs <= torch_api_w1.TARGET_VS_ENGINE else 'NOT met'}: <= {torch_api_w1.TARGET_VS_ENGINE})")
            if f is not None:
                ahead, target = f[0] / m[0], torch_api_w1.TARGET_VS_FBGEMM[opt]
                text += (f"   fbgemm / {impl} {ahead:5.2f}x wall, {f[3] / m[3]:5.2f}x cpu "
                         f"({'met' if ahead >= target else 'NOT met'}: >= {target})")
            lines.append(text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, KMP_BLOCKTIME="
          f"{os.environ.get('KMP_BLOCKTIME', 'unset')}, MESHEMBED_TORCH_MALLOC_TUNING="
          f"{os.environ.get('MESHEMBED_TORCH_MALLOC_TUNING', 'unset (off)')}; interpreter {sys.executable}", flush=True)
    print(f"load average before: {_load()}", flush=True)
    results, skipped = measure(TINY_W1 if args.tiny else W1, args.repeats, args.rounds)
    print(f"load average after:  {_load()}")
    for reason in dict.fromkeys(skipped.values()):
        print(f"skipped: {reason}")
    print(f"W1 full step, ms: wall median (min-max) / CPU median, {args.repeats} x {args.rounds} interleaved rounds")
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
