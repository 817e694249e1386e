"""W1 through ``me.torch.EmbeddingCollection``, side by side in one run: the module (eager and
``torch.compile(fullgraph=True)``), ``me.TPUEmbedding(backend="torch")`` and fbgemm's CPU TBE
with its fused optimizer, for SGD and Adagrad.

W1: table 1,000,000 × 64 float32, 16,384 samples × 8 Zipf(1.1) ids, sum combiner, one full
training step each (lookup, backward with one fixed upstream gradient, optimizer). The steps
are ``benchmarks.torch_api_w1``'s, timed in interleaved rounds so a noisy machine slows every
row alike. Printed: one table of medians (ms) per optimizer, module ÷ engine (target ≤ 1.15)
and fbgemm ÷ module (target ≥ 1.25), the load average before and after, and the settings.

fbgemm_gpu lives in the interop venv (``make test-interop`` builds it, layered on ``.venv``):

    .venv/interop/bin/python -m benchmarks.torch_module_w1 [--tiny] [--repeats N] [--rounds R]

Without fbgemm_gpu its row is skipped with the import error printed.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import torch_api_w1
from benchmarks.common import TINY_W1, W1

OPTIMIZERS = ("sgd", "adagrad")


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def table(rows: list, optimizers: tuple[str, ...] = OPTIMIZERS) -> str:
    """The side-by-side table: medians (min-max) per implementation, then the ratios."""
    med = {(r.case, r.name): r for r in rows}
    name = torch_api_w1._NAME
    lines = [f"{'optimizer':10s}" + "".join(f"{impl:>22s}" for impl in torch_api_w1.IMPLS)]
    for opt in optimizers:
        cells = []
        for impl in torch_api_w1.IMPLS:
            r = med[(opt, name[impl])]
            cells.append(f"{'skipped':>22s}" if r.median_ms != r.median_ms else
                         f"{r.median_ms:9.2f} ({r.min_ms:.1f}-{r.max_ms:.1f})".rjust(22))
        lines.append(f"{opt:10s}" + "".join(cells))
    lines.append("")
    for opt in optimizers:
        m = {impl: med[(opt, name[impl])].median_ms for impl in torch_api_w1.IMPLS}
        for impl in ("module", "module+compile"):
            vs_engine = m[impl] / m["engine"]
            text = (f"{opt:8s} {impl:15s} / engine {vs_engine:5.2f}x "
                    f"({'met' if vs_engine <= torch_api_w1.TARGET_VS_ENGINE else 'NOT met'}: "
                    f"<= {torch_api_w1.TARGET_VS_ENGINE})")
            if m["fbgemm"] == m["fbgemm"]:
                ahead = m["fbgemm"] / m[impl]
                target = torch_api_w1.TARGET_VS_FBGEMM[opt]
                text += f"   fbgemm / {impl} {ahead:5.2f}x ({'met' if ahead >= target else 'NOT met'}: >= {target})"
            lines.append(text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    skip = torch_api_w1.torch_w1._unsupported("fbgemm", "sgd")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, KMP_BLOCKTIME="
          f"{os.environ.get('KMP_BLOCKTIME', 'unset')}, MESHEMBED_TORCH_MALLOC_TUNING="
          f"{os.environ.get('MESHEMBED_TORCH_MALLOC_TUNING', 'unset (off)')}; interpreter {sys.executable}", flush=True)
    if skip:
        print(f"fbgemm row skipped: {skip}", flush=True)
    print(f"load average before: {_load()}", flush=True)
    rows = torch_api_w1.w1(TINY_W1 if args.tiny else W1, args.repeats, OPTIMIZERS, args.rounds)
    print(f"load average after:  {_load()}")
    print(f"W1 full step, medians in ms of {args.repeats} x {args.rounds} interleaved rounds")
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
