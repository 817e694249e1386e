"""Dynamic vocabularies: lookups + updates per second for a Zipf stream of 64-bit keys.

A stream of batches of 64-bit keys — ranks drawn from a Zipf(s) law bounded to a vocabulary
``ratio`` times the capacity, each rank hashed to a 64-bit key — goes through:

* **the host mapping alone** (``embedding.dynamic.assign``: admission Always, eviction LRU):
  the hash index and the sorted-key index, each pure (a new state per batch, what the engine
  runs) and in place; against a **Python dict baseline** (an ``OrderedDict`` key -> row with
  LRU per occurrence, ``move_to_end``/``popitem``: the usual pure-Python cache), and — where torchrec
  imports (the interop venv of ``make test-interop``) — **torchrec's MCH**
  (``MCHManagedCollisionModule``, LRU, eviction every batch, ``zch_size`` = capacity + 1) in
  training mode: its ``forward`` (profile: history, ranking, eviction; then remap). Every key
  of a batch is one lookup and one update (its counter and last-seen step, or its admission).
* **the engine step** (``enqueue`` -> ``dequeue`` -> ``apply_gradients``, SGD, sum combiner)
  of a dynamic table against the same table fed ``key % capacity`` as plain row ids, per
  backend: what the mapping costs inside a training step.
* **the jitted me.jax step** (``--jax-jit``: host ``prepare``, then one ``jax.jit`` program of
  ``map_keys`` -> ``lookup`` -> ``apply_gradients``) of the same two tables: the mapping as jnp
  ops inside the compiled step instead of on the host.

Each configuration first runs until the table is full (the steady state, with evictions), then
times ``--steps`` batches: median, min and max per batch, keys per second from the median, the
hit rate of the timed batches and the host memory per key (the vocabulary state and its index
over the capacity; the dict's from tracemalloc over its keys). The 2-core machine is shared,
so the rows are interleaved batch by batch (``--rounds``) and medians reported.

    python -m benchmarks.dynamic_vocab                      # capacity 2**20, 10x vocabulary, 131072 keys/batch
    python -m benchmarks.dynamic_vocab --quick              # CI sizes
    python -m benchmarks.dynamic_vocab --engine numpy,torch --json out.json
    python -m benchmarks.dynamic_vocab --engine jax --jax-jit   # the engine on JAX and jitted me.jax
    .venv/interop/bin/python -m benchmarks.dynamic_vocab --torchrec on    # with torchrec's MCH row
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
import tracemalloc
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from meshembed.embedding import dynamic as dv


def zipf_keys(rng: np.random.Generator, n: int, vocab: int, s: float) -> np.ndarray:
    """``n`` 64-bit keys: Zipf(s) ranks in [0, vocab) (inverse CDF of the bounded power law),
    each hashed to an int64 key (so keys are spread over the whole 64-bit space)."""
    u = rng.random(n)
    if abs(s - 1.0) < 1e-9:
        ranks = np.floor(np.exp(u * np.log(vocab + 1.0)))
    else:
        ranks = np.floor(((float(vocab + 1) ** (1 - s) - 1) * u + 1) ** (1 / (1 - s)))
    ranks = np.clip(ranks.astype(np.int64) - 1, 0, vocab - 1)
    return dv.hash_keys(ranks, 0xBEEF).view(np.int64)


class DictLRU:
    """The pure-Python baseline: key -> row in an OrderedDict, LRU per occurrence."""

    def __init__(self, capacity: int) -> None:
        self.rows: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))
        self.lookups = self.hits = 0

    def assign(self, keys: np.ndarray) -> list[int]:
        out = []
        rows, free = self.rows, self.free
        for k in keys.tolist():
            r = rows.get(k)
            if r is None:
                r = free.pop() if free else rows.popitem(last=False)[1]
                rows[k] = r
            else:
                rows.move_to_end(k)
                self.hits += 1
            out.append(r)
        self.lookups += len(out)
        return out


class TorchrecMCH:
    """torchrec's ``MCHManagedCollisionModule`` (LRU, ``eviction_interval=1``) in training mode,
    fed one jagged feature per batch; hits are counted before each (untimed) forward. Its ops
    run on ``threads`` torch threads (set around each forward and restored): the NumPy mapping
    runs on one, and on a shared 2-core machine torch's default 2 OpenMP threads made this
    forward 15x slower (157 against 10 ms a batch at capacity 4096)."""

    EMPTY = np.iinfo(np.int64).max

    def __init__(self, capacity: int, threads: int = 1) -> None:
        import torch
        from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule
        from torchrec.sparse.jagged_tensor import JaggedTensor

        self.torch, self.jagged = torch, JaggedTensor
        self.module = MCHManagedCollisionModule(zch_size=capacity + 1, device=torch.device("cpu"),
                                                eviction_policy=LRU_EvictionPolicy(), eviction_interval=1, name="t")
        self.module.train()
        self.lookups = self.hits = 0
        self.threads = threads

    @property
    def size(self) -> int:
        return int((self.module._mch_sorted_raw_ids != self.EMPTY).sum())

    def count_hits(self, keys: np.ndarray) -> None:
        ids = self.module._mch_sorted_raw_ids.numpy()
        at = np.minimum(np.searchsorted(ids, keys), ids.shape[0] - 1)
        self.hits += int(np.count_nonzero(ids[at] == keys))
        self.lookups += keys.shape[0]

    def assign(self, keys: np.ndarray) -> Any:
        t = self.torch.from_numpy(keys)
        feature = self.jagged(values=t, lengths=self.torch.tensor([t.shape[0]], dtype=self.torch.int64))
        before = self.torch.get_num_threads()
        self.torch.set_num_threads(self.threads)
        try:
            return self.module({"t": feature})["t"].values()
        finally:
            self.torch.set_num_threads(before)

    @property
    def nbytes(self) -> int:
        """Every buffer of the module and its history accumulator (sized by the batch)."""
        m = self.module
        return int(sum(b.nbytes for b in m.buffers()) + m._history_accumulator.nbytes)


class Mapper:
    """One host-mapping implementation fed the stream batch by batch."""

    def __init__(self, name: str, capacity: int, make: Callable[[], Any]) -> None:
        self.name, self.capacity = name, capacity
        self.obj = make()
        self.step = 0
        self.times: list[float] = []

    @property
    def full(self) -> bool:
        o = self.obj
        return (len(o.rows) if isinstance(o, DictLRU) else o.size) >= self.capacity

    def run(self, keys: np.ndarray, timed: bool) -> None:
        if isinstance(self.obj, TorchrecMCH):
            self.obj.count_hits(keys)
        t = time.perf_counter()
        if isinstance(self.obj, (DictLRU, TorchrecMCH)):
            self.obj.assign(keys)
        else:
            _, self.obj, _ = dv.assign(self.obj, keys, self.step, inplace=self.name.endswith("in place"))
        if timed:
            self.times.append(time.perf_counter() - t)
        self.step += 1

    def counters(self) -> tuple[int, int]:
        o = self.obj
        return (o.lookups, o.hits) if isinstance(o, (DictLRU, TorchrecMCH)) else (o.stats["lookups"], o.stats["hits"])


def dict_bytes_per_key(capacity: int, keys_stream: list[np.ndarray]) -> float:
    """tracemalloc's growth while the dict baseline fills, over its keys."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    d = DictLRU(capacity)
    for keys in keys_stream:
        d.assign(keys)
        if len(d.rows) >= capacity:
            break
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / max(1, len(d.rows))


MCH_NAME = "torchrec MCH (LRU, evict every batch, {} torch thread(s))"


def _with_torchrec(choice: str) -> bool:
    """``on``: torchrec must import; ``auto``: when it does (a note otherwise); ``off``: never."""
    if choice == "off":
        return False
    try:
        importlib.import_module("torchrec.modules.mc_modules")
    except ImportError as exc:
        if choice == "on":
            raise SystemExit(f"--torchrec on: torchrec does not import here ({exc}); run it with the interop "
                             "venv: .venv/interop/bin/python -m benchmarks.dynamic_vocab (make test-interop builds it)")
        print(f"note: no torchrec MCH row ({exc}); run with .venv/interop/bin/python for it")
        return False
    return True


def mapping_rows(args: argparse.Namespace) -> list[dict]:
    C, n = args.capacity, args.batch
    rng = np.random.default_rng(args.seed)
    vocab = args.ratio * C
    names = ["meshembed hash index (pure)", "meshembed hash index (in place)",
             "meshembed sorted index (pure)", "meshembed sorted index (in place)", "Python dict + OrderedDict LRU"]
    if _with_torchrec(args.torchrec):
        names.append(MCH_NAME.format(args.torch_threads))
    mappers = []
    for name in names:
        if name.startswith("Python"):
            mappers.append(Mapper(name, C, lambda: DictLRU(C)))
        elif name.startswith("torchrec MCH"):
            mappers.append(Mapper(name, C, lambda: TorchrecMCH(C, args.torch_threads)))
        else:
            kind = "hash" if "hash" in name else "sorted"
            mappers.append(Mapper(name, C, lambda kind=kind: dv.new_state(dv.DynamicVocabulary(capacity=C, index=kind))))
    warm = 0
    warm_batches = []
    while not all(m.full for m in mappers) and warm < args.max_warmup:
        keys = zipf_keys(rng, n, vocab, args.zipf)
        warm_batches.append(keys)
        for m in mappers:
            m.run(keys, timed=False)
        warm += 1
    before = [m.counters() for m in mappers]
    for _ in range(args.steps):
        keys = zipf_keys(rng, n, vocab, args.zipf)
        for m in mappers[::1 if _ % 2 == 0 else -1]:  # alternate the order: a shared machine's noise
            m.run(keys, timed=True)
    rows = []
    dict_mem = dict_bytes_per_key(C, warm_batches) if warm_batches else float("nan")
    for m, (l0, h0) in zip(mappers, before):
        l1, h1 = m.counters()
        med = statistics.median(m.times)
        mem = dict_mem if isinstance(m.obj, DictLRU) else m.obj.nbytes / C
        rows.append({"case": "host mapping", "implementation": m.name, "capacity": C, "vocabulary": vocab,
                     "batch": n, "warmup_batches": warm, "full": m.full,
                     "median_ms": 1e3 * med, "min_ms": 1e3 * min(m.times), "max_ms": 1e3 * max(m.times),
                     "keys_per_s": n / med, "hit_rate": (h1 - h0) / max(1, l1 - l0), "bytes_per_key": mem})
    return rows


def engine_rows(args: argparse.Namespace, backend: str) -> list[dict]:
    import meshembed as me

    C, n, dim = args.capacity, args.batch, args.dim
    per = args.ids_per_sample
    samples = n // per
    rng = np.random.default_rng(args.seed + 1)
    vocab = args.ratio * C

    def config(dynamic: bool) -> Any:
        spec = dv.DynamicVocabulary() if dynamic else None
        return me.EmbeddingConfig(
            tables=[me.TableConfig("t", C, dim, optimizer=me.embedding.SGD(learning_rate=0.01), combiner="sum",
                                   dynamic=spec)],
            features=[me.FeatureConfig("t", (samples,), name="f")], sharding_strategy="mod")

    zeros = {"initializers": {"t": "zeros"}}
    engines = {"dynamic table (keys)": me.TPUEmbedding(config(True), backend=backend, num_shards=1, **zeros),
               "plain table (key % capacity)": me.TPUEmbedding(config(False), backend=backend, num_shards=1, **zeros)}
    splits = np.arange(0, samples * per + 1, per, dtype=np.int64)
    grad = np.full((samples, dim), 1e-3, np.float32)

    def step(emb: Any, keys: np.ndarray) -> None:
        ids = keys if emb.vocabularies else (keys.view(np.uint64) % np.uint64(C)).astype(np.int64)
        emb.enqueue([me.RaggedIds(splits, ids)])
        emb.dequeue()
        emb.apply_gradients([grad])

    dyn = engines["dynamic table (keys)"]
    warm = 0
    while dyn.vocabulary("t").size < C and warm < args.max_warmup:
        keys = zipf_keys(rng, samples * per, vocab, args.zipf)
        for emb in engines.values():
            step(emb, keys)
        warm += 1
    times: dict[str, list[float]] = {k: [] for k in engines}
    st0 = dict(dyn.vocabulary("t").stats)
    for i in range(args.steps):
        keys = zipf_keys(rng, samples * per, vocab, args.zipf)
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            t = time.perf_counter()
            step(engines[name], keys)
            times[name].append(time.perf_counter() - t)
    st1 = dyn.vocabulary("t").stats
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {"case": f"engine step [{backend}]", "implementation": name, "capacity": C, "vocabulary": vocab,
               "batch": samples * per, "warmup_batches": warm, "full": dyn.vocabulary("t").size >= C,
               "median_ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
               "keys_per_s": samples * per / med, "hit_rate": float("nan"), "bytes_per_key": float("nan")}
        if name.startswith("dynamic"):
            row["hit_rate"] = (st1["hits"] - st0["hits"]) / max(1, st1["lookups"] - st0["lookups"])
            row["bytes_per_key"] = dyn.vocabulary("t").nbytes / C
        rows.append(row)
    return rows


def jax_jit_rows(args: argparse.Namespace) -> list[dict]:
    """The jitted me.jax step of a dynamic table (keys mapped by ``map_keys`` inside the program)
    against the same table fed ``key % capacity``; each timed step includes the host ``prepare``
    and waits for the step counter (as the engine rows include ``enqueue``)."""
    import jax

    import meshembed as me

    C, dim, per = args.capacity, args.dim, args.ids_per_sample
    samples = args.batch // per
    n = samples * per
    rng = np.random.default_rng(args.seed + 1)
    vocab = args.ratio * C
    splits = np.arange(0, n + 1, per, dtype=np.int64)
    grad = jax.numpy.full((samples, dim), 1e-3, jax.numpy.float32)

    def config(dynamic: bool) -> Any:
        return me.EmbeddingConfig(
            tables=[me.TableConfig("t", C, dim, optimizer=me.embedding.SGD(learning_rate=0.01), combiner="sum",
                                   dynamic=dv.DynamicVocabulary() if dynamic else None)],
            features=[me.FeatureConfig("t", (samples,), name="f")], sharding_strategy="mod")

    @jax.jit
    def dyn_step(state: Any, keys: Any) -> Any:
        state, batch = me.jax.map_keys(state, keys)
        me.jax.lookup(state, batch)
        return me.jax.apply_gradients(state, batch, [grad])

    @jax.jit
    def plain_step(state: Any, batch: Any) -> Any:
        me.jax.lookup(state, batch)
        return me.jax.apply_gradients(state, batch, [grad])

    runs = {"dynamic table (keys, map_keys in jit)": [dyn_step, None], "plain table (key % capacity)": [plain_step, None]}
    for name, dynamic in zip(runs, (True, False)):
        runs[name][1] = me.jax.init(config(dynamic), num_shards=1, initializers={"t": "zeros"})

    def step(name: str, keys: np.ndarray) -> None:
        fn, state = runs[name]
        ids = keys if name.startswith("dynamic") else (keys.view(np.uint64) % np.uint64(C)).astype(np.int64)
        state = fn(state, me.jax.prepare(state, [me.RaggedIds(splits, ids)], capacity=n))
        state.step.block_until_ready()
        runs[name][1] = state

    dyn_name = next(iter(runs))
    warm = 0
    while me.jax.vocabulary(runs[dyn_name][1], "t").size < C and warm < args.max_warmup:
        keys = zipf_keys(rng, n, vocab, args.zipf)
        for name in runs:
            step(name, keys)
        warm += 1
    times: dict[str, list[float]] = {k: [] for k in runs}
    st0 = dict(me.jax.vocabulary(runs[dyn_name][1], "t").stats)
    for i in range(args.steps):
        keys = zipf_keys(rng, n, vocab, args.zipf)
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            t = time.perf_counter()
            step(name, keys)
            times[name].append(time.perf_counter() - t)
    voc = me.jax.vocabulary(runs[dyn_name][1], "t")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {"case": "jitted me.jax step [jax]", "implementation": name, "capacity": C, "vocabulary": vocab,
               "batch": n, "warmup_batches": warm, "full": voc.size >= C, "median_ms": 1e3 * med,
               "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts), "keys_per_s": n / med,
               "hit_rate": float("nan"), "bytes_per_key": float("nan")}
        if name.startswith("dynamic"):
            st1 = voc.stats
            row["hit_rate"] = (st1["hits"] - st0["hits"]) / max(1, st1["lookups"] - st0["lookups"])
        rows.append(row)
        assert dyn_step._cache_size() == 1  # one program for every step
    return rows


def table(rows: list[dict]) -> str:
    head = ("| case | implementation | median ms | min–max ms | keys/s (median) | hit rate | host bytes/key |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        hit = "" if r["hit_rate"] != r["hit_rate"] else f"{r['hit_rate']:.3f}"
        mem = "" if r["bytes_per_key"] != r["bytes_per_key"] else f"{r['bytes_per_key']:.1f}"
        lines.append(f"| {r['case']} | {r['implementation']} | {r['median_ms']:.2f} | {r['min_ms']:.2f}–"
                     f"{r['max_ms']:.2f} | {r['keys_per_s'] / 1e6:.2f} M | {hit} | {mem} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--capacity", type=int, default=1 << 20)
    p.add_argument("--ratio", type=int, default=10, help="vocabulary / capacity")
    p.add_argument("--batch", type=int, default=131_072, help="keys per batch")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--steps", type=int, default=15, help="timed batches per row")
    p.add_argument("--max-warmup", type=int, default=400)
    p.add_argument("--engine", default="", help="backends for the engine-step rows, e.g. numpy,torch")
    p.add_argument("--jax-jit", action="store_true", help="the jitted me.jax rows (map_keys inside jax.jit)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ids-per-sample", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torchrec", choices=("auto", "on", "off"), default="auto",
                   help="the torchrec MCH row (needs torchrec: the interop venv)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads of the MCH row's forward")
    p.add_argument("--quick", action="store_true", help="CI sizes")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.capacity, args.batch, args.steps, args.dim = 4096, 4096, 3, 8
        args.engine = args.engine or "numpy"
    rows = mapping_rows(args)
    for backend in [b for b in args.engine.split(",") if b]:
        rows += engine_rows(args, backend)
    if args.jax_jit:
        rows += jax_jit_rows(args)
    print(f"capacity {args.capacity}, vocabulary {args.ratio}x, {args.batch} keys per batch, Zipf({args.zipf})")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
