"""W1: sparse embedding training step on torch, side by side with its peers.

Table 1,000,000 × 64 float32; batch 16,384 samples × 8 ids from Zipf(1.1); sum combiner.
A *full step* is enqueue + lookup/combine (dequeue) + backward/optimizer (apply_gradients),
with the same fixed ``[16384, 64]`` upstream gradient for every implementation.

Rows (``impl``):
* ``meshembed engine`` — ``me.TPUEmbedding(cfg, backend="torch")`` as a user calls it (default
  ``compile="auto"``: the optimizer step is compiled at W1 sizes, eager at --tiny). The engine
  calls the backend's fused hooks itself — ``gather_combine`` for the forward combiner and
  ``update_rows(grad_index=, grad_weights=)`` for the backward — so no ``[131072, 64]``
  intermediate is materialised, and with the sum combiner and no weights it passes no
  weights at all.
* ``meshembed backend fast path`` — the same two backend calls made directly (the engine's
  host-side enqueue, then no engine bookkeeping), with the optimizer step eager
  (``compile="never"``) or as one ``torch.compile``d gather → core fn → scatter: what the
  engine's own overhead is measured against.
* ``meshembed update_rows only`` — dedup + optimizer of precomputed per-id gradients.
* ``nn.EmbeddingBag(sparse=True) + torch.optim`` and fbgemm's CPU TBE (fused backward +
  optimizer), where they support the optimizer.

Every implementation of one optimizer is built first, then timed in interleaved rounds
(``--rounds``; ``--repeats`` steps per implementation per round), so a noisy neighbour on a
shared machine slows all of them alike; the median, min and max are over every timed step.
After each optimizer the engine's speed-up over fbgemm (fbgemm median ÷ engine median) is
printed against the issue's target (≥ 1.25× for SGD and Adagrad).

``bound ms`` = bytes that must move (ids, unique rows of params and slots read+written,
activations and gradients) ÷ the measured copy bandwidth of this machine.

Run: ``python -m benchmarks.torch_w1 [--tiny] [--repeats N] [--rounds R] [--only engine,fbgemm,...]``.
A common runner imports :func:`run`.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.common import TINY_W1, W1, WARMUP, Row, bandwidth_gbs, inputs_ready, table, w1_bytes, zipf_ids

OPTIMIZERS = ("sgd", "adagrad", "adadelta")
IMPLS = ("engine", "fast", "fast+compile", "update_rows", "embeddingbag", "fbgemm")
LR = 0.05
_NAME = {
    "engine": "meshembed[torch] engine",
    "fast": "meshembed[torch] backend fast path, eager",
    "fast+compile": "meshembed[torch] backend fast path, torch.compile",
    "update_rows": "meshembed[torch] update_rows only (compile=auto)",
    "embeddingbag": "nn.EmbeddingBag(sparse=True) + torch.optim",
    "fbgemm": "fbgemm TBE CPU (fused backward+optimizer)",
}


def _spec(name: str):
    import meshembed as me

    return {
        "sgd": me.embedding.SGD(learning_rate=LR),
        "adagrad": me.embedding.Adagrad(learning_rate=LR, initial_accumulator_value=0.1),
        "adadelta": me.embedding.Adadelta(learning_rate=LR, rho=0.95, epsilon=1e-6),
    }[name]


_SLOTS = {"sgd": 0, "adagrad": 1, "adadelta": 2}


class _Data:
    """Ids, offsets, a fixed upstream gradient and the initial table, shared by every row."""

    def __init__(self, sizes: dict, seed: int = 0):
        import torch

        rng = np.random.default_rng(seed + 1)
        self.sizes = sizes
        v, d, b, k = sizes["vocab"], sizes["dim"], sizes["batch"], sizes["ids_per_sample"]
        self.ids = zipf_ids(b * k, v, sizes["zipf"], seed)
        self.splits = np.arange(0, b * k + 1, k, dtype=np.int64)
        self.unique = int(np.unique(self.ids).size)
        self.grad = torch.from_numpy(rng.standard_normal((b, d)).astype(np.float32) * 0.01)
        self.init = (rng.standard_normal((v, d)) * 0.05).astype(np.float32)


def _engine(d: _Data, optimizer: str) -> tuple[Any, Any]:
    import meshembed as me

    s = d.sizes
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=s["vocab"], dimension=s["dim"],
                               optimizer=_spec(optimizer), combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(s["batch"],), name="f")],
    )
    emb = me.TPUEmbedding(cfg, backend="torch", initializers={"t": d.init})
    return emb, me.RaggedIds(d.splits, d.ids)


def _make_step(impl: str, d: _Data, optimizer: str) -> Callable[[], Any]:
    import torch

    s = d.sizes
    if impl == "engine":
        emb, feat = _engine(d, optimizer)

        def step() -> Any:
            emb.enqueue([feat])
            acts = emb.dequeue()
            emb.apply_gradients([d.grad])
            return acts

        return step
    if impl in ("fast", "fast+compile", "update_rows"):
        from meshembed.embedding.updates import make_rule

        from meshembed_torch import TorchBackend

        emb, feat = _engine(d, optimizer)
        b = {"fast": TorchBackend(compile="never"), "fast+compile": TorchBackend(compile="always")}.get(impl, emb.backend)
        state = emb.state.tables[0]
        fn = make_rule(emb.layout.tables[0])  # the update as data; its learning rate passed per call
        if impl == "update_rows":
            ids_t = b.asarray(d.ids, dtype="int64")
            per_id = d.grad.repeat_interleave(s["ids_per_sample"], dim=0)
            return lambda: b.update_rows(state, ids_t, per_id, fn, values=(LR,))

        def step() -> Any:
            emb.enqueue([feat])  # the engine's host-side input normalisation and transfer
            batch = emb.pending
            emb.discard()
            ids, slots, scale = (batch.device_array(b, 0, name) for name in ("ids", "slots", "scale"))
            acts = b.gather_combine(state[0], ids, slots, batch.features[0].num_slots, weights=scale)
            b.update_rows(state, ids, d.grad, fn, values=(LR,), grad_index=slots, grad_weights=scale)
            return acts

        return step
    ids_t = torch.from_numpy(d.ids)
    if impl == "embeddingbag":
        bag = torch.nn.EmbeddingBag(s["vocab"], s["dim"], mode="sum", sparse=optimizer != "adadelta")
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(d.init))
        offsets = torch.from_numpy(d.splits[:-1])
        opt = {
            "sgd": lambda p: torch.optim.SGD(p, lr=LR),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=LR, initial_accumulator_value=0.1),
            "adadelta": lambda p: torch.optim.Adadelta(p, lr=LR, rho=0.95, eps=1e-6, foreach=True),
        }[optimizer](bag.parameters())

        def step() -> Any:
            out = bag(ids_t, offsets)
            out.backward(d.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out

        return step
    if impl == "fbgemm":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        kind = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD}[optimizer]
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(s["vocab"], s["dim"], EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=kind, learning_rate=LR, eps=1e-10, pooling_mode=PoolingMode.SUM,
        )
        offsets = torch.from_numpy(d.splits)

        def step() -> Any:
            out = tbe(ids_t, offsets)
            out.backward(d.grad)
            return out

        return step
    raise ValueError(f"Invalid `impl`. Expected one of {IMPLS}. Received: impl={impl!r}")


def _unsupported(impl: str, optimizer: str) -> str | None:
    if impl == "fbgemm":
        try:
            import fbgemm_gpu  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - report any import failure verbatim
            return f"fbgemm_gpu does not import: {type(exc).__name__}: {exc}"
        if optimizer == "adadelta":
            return "fbgemm TBE has no Adadelta"
    return None


#: The issue's target: meshembed's engine at least this many times faster than fbgemm's TBE.
TARGET_SPEEDUP = {"sgd": 1.25, "adagrad": 1.25}


def _timed_rounds(steps: dict[str, Callable[[], Any]], repeats: int, rounds: int, warmup: int,
                  alternate: tuple[str, ...] = ()) -> dict[str, tuple[float, float, float]]:
    """(median, min, max) ms of every step, timed in ``rounds`` interleaved rounds. The steps
    named in ``alternate`` (e.g. one engine's constant and changing learning rate) share one
    turn and take it step by step, A B A B …: a ratio of theirs then sees the same noise."""
    import statistics
    import time

    for impl, step in steps.items():
        for _ in range(warmup + (2 if "compile" in impl else 0)):
            step()
        getattr(step, "finish", lambda: None)()
    together = tuple(a for a in alternate if a in steps)
    turns = [(impl,) for impl in steps if impl not in together]
    if together:
        turns.insert(min(list(steps).index(a) for a in together), together)
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    for _ in range(rounds):
        for turn in turns:
            for i in range(repeats):
                for impl in turn:
                    finish = getattr(steps[impl], "finish", None)  # see common.timeit
                    t0 = time.perf_counter()
                    steps[impl]()
                    if finish and i == repeats - 1:
                        finish()
                    times[impl].append((time.perf_counter() - t0) * 1e3)
    return {impl: (statistics.median(t), min(t), max(t)) for impl, t in times.items()}


def speedup(rows: list[Row], optimizer: str, impl: str = "engine") -> float:
    """fbgemm's median ÷ ``impl``'s median for ``optimizer`` (NaN when either is missing)."""
    med = {r.name: r.median_ms for r in rows if r.case == optimizer}
    return med.get(_NAME["fbgemm"], float("nan")) / med.get(_NAME[impl], float("nan"))


def w1(sizes: dict, repeats: int = 7, impls: tuple[str, ...] = IMPLS,
       optimizers: tuple[str, ...] = OPTIMIZERS, warmup: int = WARMUP, verbose: bool = False,
       rounds: int = 3) -> list[Row]:
    """One Row per (implementation, optimizer); unsupported pairs get NaN times and a note."""
    d = _Data(sizes)
    inputs_ready()
    s = sizes
    rows = []
    for optimizer in optimizers:
        n_slots = _SLOTS[optimizer]
        notes: dict[str, str] = {}
        steps: dict[str, Callable[[], Any]] = {}
        for impl in impls:
            notes[impl] = _unsupported(impl, optimizer) or ""
            if not notes[impl]:
                try:
                    steps[impl] = _make_step(impl, d, optimizer)
                except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a table row
                    notes[impl] = f"{type(exc).__name__}: {str(exc)[:160]}"
        try:
            timed = _timed_rounds(steps, repeats, rounds, warmup)
        except Exception:  # noqa: BLE001 - time them one by one to find the failing one
            timed = {}
            for impl, step in steps.items():
                try:
                    timed.update(_timed_rounds({impl: step}, repeats, rounds, warmup))
                except Exception as exc:  # noqa: BLE001
                    notes[impl] = f"{type(exc).__name__}: {str(exc)[:160]}"
        steps.clear()
        gc.collect()
        for impl in impls:
            med, lo, hi = timed.get(impl, (float("nan"),) * 3)
            note = notes[impl]
            if impl == "embeddingbag" and optimizer == "adadelta" and not note:
                note = "dense gradient (torch.optim.Adadelta rejects sparse ones)"
            row = Row(
                workload="W1", name=_NAME[impl], case=optimizer, median_ms=med, min_ms=lo, max_ms=hi,
                bytes_touched=w1_bytes(d.unique, s["batch"] * s["ids_per_sample"], s["dim"], n_slots),
                state_bytes=s["vocab"] * s["dim"] * 4 * (1 + n_slots), note=note,
                extra={"unique_rows": d.unique},
            )
            rows.append(row)
            if verbose:
                print(f"{row.case:9s} {row.name:48s} {med:9.2f} ms  ({lo:.2f}-{hi:.2f})  {note}", flush=True)
        ratio = speedup(rows, optimizer)
        for r in rows:
            if r.case == optimizer and r.name == _NAME["engine"]:
                r.extra["speedup_vs_fbgemm"] = ratio
        if verbose and ratio == ratio:
            target = TARGET_SPEEDUP.get(optimizer)
            verdict = "" if target is None else f" (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"
            print(f"{optimizer:9s} engine vs fbgemm: {ratio:.2f}x faster{verdict}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per implementation per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--only", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = ap.parse_args(argv)
    import torch

    rows = w1(TINY_W1 if args.tiny else W1, args.repeats, tuple(args.only.split(",")),
              tuple(args.optimizers.split(",")), verbose=True, rounds=args.rounds)
    gbs = bandwidth_gbs()
    print(f"\n{rows[0].extra['unique_rows']} unique rows/step; torch threads {torch.get_num_threads()}; "
          f"copy bandwidth {gbs:.1f} GB/s")
    print(table(rows, gbs))
    for optimizer in dict.fromkeys(r.case for r in rows):
        ratio = speedup(rows, optimizer)
        if ratio == ratio:
            print(f"engine vs fbgemm, {optimizer}: {ratio:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
