"""me.torch on W1 and W2, side by side: the nn.Module against the engine and its peers.

W1 (``benchmarks.torch_w1``'s data: table 1,000,000 × 64, 16,384 samples × 8 Zipf(1.1) ids,
sum combiner, one fixed upstream gradient), a full training step each:

* ``module, eager`` — ``out = ec({"f": (values, offsets)})["f"]; out.backward(grad)``: the
  lookup custom op, then the optimizer applied in backward;
* ``module, torch.compile`` — the same forward under ``torch.compile(fullgraph=True)``;
* ``engine`` — ``me.TPUEmbedding(backend="torch")`` enqueue / dequeue / apply_gradients;
* ``fbgemm`` — fbgemm's CPU TBE with its fused optimizer (when ``fbgemm_gpu`` imports).

Timed in interleaved rounds (``torch_w1._timed_rounds``). Printed per optimizer: module ÷ engine
(the target is ≤ 1.15) and fbgemm ÷ module (≥ 1.25 for SGD and Adagrad).

W2 (16,777,216 float32 parameters, as 1 and 64 tensors): ``me.torch.Adadelta.step()`` against
``torch.optim.Adadelta(foreach=True)`` (target: ≥ 5× faster).

The process settings are printed with the figures: torch threads, ``KMP_BLOCKTIME`` and
``MESHEMBED_TORCH_MALLOC_TUNING`` (both opt-in; ``meshembed bench`` opts its children in).

Run: ``python -m benchmarks.torch_api_w1 [--tiny] [--repeats N] [--rounds R] [--optimizers sgd,adagrad]
[--skip-w1] [--skip-w2]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Callable

from benchmarks import torch_w1
from benchmarks.common import TINY_W1, TINY_W2, W1, W2, WARMUP, Row, inputs_ready, timeit, w1_bytes, w2_bytes

IMPLS = ("module", "module+compile", "engine", "fbgemm")
_NAME = {
    "module": "me.torch.EmbeddingCollection, eager",
    "module+compile": "me.torch.EmbeddingCollection, torch.compile",
    "engine": torch_w1._NAME["engine"],
    "fbgemm": torch_w1._NAME["fbgemm"],
}
TARGET_VS_ENGINE = 1.15
TARGET_VS_FBGEMM = {"sgd": 1.25, "adagrad": 1.25}
TARGET_W2 = 5.0


def _module_step(d: Any, optimizer: str, compiled: bool) -> Callable[[], Any]:
    import torch

    import meshembed as me

    emb, _ = torch_w1._engine(d, optimizer)
    ec = me.torch.EmbeddingCollection._from_engine(emb)
    feats = {"f": (torch.from_numpy(d.ids), torch.from_numpy(d.splits))}

    def forward(feats: Any) -> Any:
        return ec(feats)["f"]

    fwd = torch.compile(forward, fullgraph=True) if compiled else forward

    def step() -> Any:
        out = fwd(feats)
        out.backward(d.grad)
        return out

    return step


def _make(impl: str, d: Any, optimizer: str) -> Callable[[], Any]:
    if impl.startswith("module"):
        return _module_step(d, optimizer, impl == "module+compile")
    return torch_w1._make_step(impl, d, optimizer)


def w1(sizes: dict, repeats: int = 7, optimizers: tuple[str, ...] = ("sgd", "adagrad", "adadelta"),
       rounds: int = 3, warmup: int = WARMUP, verbose: bool = False) -> list[Row]:
    d = torch_w1._Data(sizes)
    inputs_ready()
    rows = []
    for optimizer in optimizers:
        notes, steps = {}, {}
        for impl in IMPLS:
            notes[impl] = torch_w1._unsupported(impl, optimizer) or ""
            if not notes[impl]:
                steps[impl] = _make(impl, d, optimizer)
        timed = torch_w1._timed_rounds(steps, repeats, rounds, warmup)
        steps.clear()
        gc.collect()
        med = {}
        for impl in IMPLS:
            m, lo, hi = timed.get(impl, (float("nan"),) * 3)
            med[impl] = m
            n_slots = torch_w1._SLOTS[optimizer]
            rows.append(Row(workload="W1", name=_NAME[impl], case=optimizer, median_ms=m, min_ms=lo, max_ms=hi,
                            bytes_touched=w1_bytes(d.unique, sizes["batch"] * sizes["ids_per_sample"], sizes["dim"],
                                                   n_slots),
                            state_bytes=sizes["vocab"] * sizes["dim"] * 4 * (1 + n_slots), note=notes[impl]))
            if verbose:
                print(f"{optimizer:9s} {_NAME[impl]:48s} {m:9.2f} ms  ({lo:.2f}-{hi:.2f})  {notes[impl]}", flush=True)
        if verbose:
            for impl in ("module", "module+compile"):
                ratio = med[impl] / med["engine"]
                print(f"{optimizer:9s} {impl} / engine: {ratio:.2f}x (target <= {TARGET_VS_ENGINE}: "
                      f"{'met' if ratio <= TARGET_VS_ENGINE else 'NOT met'})", flush=True)
                if optimizer in TARGET_VS_FBGEMM and med["fbgemm"] == med["fbgemm"]:
                    ahead = med["fbgemm"] / med[impl]
                    print(f"{optimizer:9s} fbgemm / {impl}: {ahead:.2f}x (target >= {TARGET_VS_FBGEMM[optimizer]})",
                          flush=True)
    return rows


def _w2_step(impl: str, params: int, count: int) -> Callable[[], Any]:
    import torch

    import meshembed as me

    gen = torch.Generator().manual_seed(0)
    leaves = [torch.nn.Parameter(torch.randn(params // count, generator=gen)) for _ in range(count)]
    grads = [torch.randn(params // count, generator=gen) * 0.01 for _ in range(count)]
    hyper = dict(lr=1.0, rho=0.95, eps=1e-6)
    opt = me.torch.Adadelta(leaves, **hyper) if impl == "me" else torch.optim.Adadelta(leaves, foreach=True, **hyper)

    def step() -> None:
        for p, g in zip(leaves, grads):
            p.grad = g
        opt.step()

    return step


def w2(sizes: dict, repeats: int = 7, counts: tuple[int, ...] = (1, 64), warmup: int = WARMUP,
       verbose: bool = False) -> list[Row]:
    names = {"me": "me.torch.Adadelta", "torch": "torch.optim.Adadelta(foreach=True)"}
    rows = []
    for count in counts:
        med = {}
        for impl in names:
            step = _w2_step(impl, sizes["params"], count)
            m, lo, hi = timeit(step, warmup=warmup + 1, repeats=repeats)
            step = None
            gc.collect()
            med[impl] = m
            case = f"adadelta {count} tensor{'s' if count > 1 else ''}"
            rows.append(Row(workload="W2", name=names[impl], case=case, median_ms=m, min_ms=lo, max_ms=hi,
                            bytes_touched=w2_bytes(sizes["params"]), state_bytes=sizes["params"] * 12))
            if verbose:
                print(f"{case:20s} {names[impl]:40s} {m:9.2f} ms  ({lo:.2f}-{hi:.2f})", flush=True)
        if verbose:
            ratio = med["torch"] / med["me"]
            print(f"W2 {count:2d} tensors: me.torch.Adadelta {ratio:.1f}x faster than foreach "
                  f"(target >= {TARGET_W2}: {'met' if ratio >= TARGET_W2 else 'NOT met'})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--optimizers", default="sgd,adagrad,adadelta")
    ap.add_argument("--skip-w1", action="store_true")
    ap.add_argument("--skip-w2", action="store_true")
    args = ap.parse_args(argv)
    import torch

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, KMP_BLOCKTIME="
          f"{os.environ.get('KMP_BLOCKTIME', 'unset')}, MESHEMBED_TORCH_MALLOC_TUNING="
          f"{os.environ.get('MESHEMBED_TORCH_MALLOC_TUNING', 'unset (off)')}", flush=True)
    if not args.skip_w1:
        w1(TINY_W1 if args.tiny else W1, args.repeats, tuple(args.optimizers.split(",")), args.rounds, verbose=True)
    if not args.skip_w2:
        w2(TINY_W2 if args.tiny else W2, args.repeats, verbose=True)


if __name__ == "__main__":
    main(sys.argv[1:])
