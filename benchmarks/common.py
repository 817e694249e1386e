"""Shared benchmark plumbing: workloads, timing, memory, bandwidth, tables.

Timings are medians of several runs after warm-up, with min–max beside them. Peak memory
is the growth of the process's peak RSS over its baseline after imports, so each row runs
in a fresh subprocess (see ``runner.py``). The memory-traffic lower bound of a row is the
bytes it must touch divided by the machine's measured copy bandwidth.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

# W1: a sparse embedding step (design §5).
W1 = dict(vocab=1_000_000, dim=64, batch=16_384, ids_per_sample=8, zipf=1.1)
# W2: one dense Adadelta step on 16,777,216 float32 parameters, as 1 or 64 tensors.
W2 = dict(params=16_777_216)
# The CI-sized versions of both.
TINY_W1 = dict(vocab=10_000, dim=16, batch=256, ids_per_sample=8, zipf=1.1)
TINY_W2 = dict(params=65_536)


def zipf_ids(n: int, vocab: int, a: float, seed: int = 0) -> np.ndarray:
    """``n`` ids from a Zipf(a) law truncated to ``[0, vocab)`` by rejection.

    For W1 this gives about 29,800 unique rows out of 131,072 ids, as design §5 states.
    """
    rng = np.random.default_rng(seed)
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        z = rng.zipf(a, size=2 * n)
        out = np.concatenate([out, z[z <= vocab] - 1])
    return out[:n]


#: Untimed steps before the timed ones. The first steps of an implementation carry one-off
#: costs (allocator warm-up, first-touch page faults, thread pools waking): measured per step
#: on W1, the JAX engine took 7-9 ms for its first ~5 steps and 4-5 ms after, torch's engine
#: 2-4 steps, fbgemm none; with 2 warm-ups, 3 of the 7 timed steps were still warming up.
WARMUP = 8


def timeit(step: Callable[[], object], *, warmup: int = WARMUP, repeats: int = 7,
           sync: Callable[[object], None] | None = None) -> tuple[float, float, float]:
    """(median, min, max) milliseconds of ``step()``; ``sync`` waits for async results.

    A step may leave work running that the next step waits for (the JAX engine's update
    overlaps the next step's host work); ``step.finish()``, if present, waits for it after
    the last repeat and counts toward that repeat, so every step's work is timed."""
    finish = getattr(step, "finish", None)
    for _ in range(warmup):
        out = step()
        if sync:
            sync(out)
    if finish:
        finish()
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = step()
        if sync:
            sync(out)
        if finish and i == repeats - 1:
            finish()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times)


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def start_peak_rss() -> float:
    """Start measuring peak memory: resets the kernel's high-water mark where Linux allows
    (so a transient peak of the framework imports does not hide the job's own) and returns
    the baseline — the current RSS, or the peak so far where the reset is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        current = _status_mb("VmRSS")
        if current is not None:
            return current
    except OSError:
        pass
    return peak_rss_mb()


_baseline: list[float] = []


def start_frameworks(names: list[str], torch_compiler: bool = False) -> None:
    """Import (and start) the frameworks a job uses before its memory baseline is taken, so
    that a row's peak is the job's, not the framework's fixed cost: torch with the compiler
    stack ``torch.compile`` loads on first use (~100 MB of Python modules), jax with its CPU
    runtime and compiler started by one tiny compiled call (~40 MB of code and buffers).
    Both are the same for any table size. ``torch_compiler``: torch's compiler started too by
    one tiny ``torch.compile`` call, as jax's is (inductor's first compilation in a process
    keeps ~28 MB and peaks ~68 MB higher, whatever it compiles; ~4 s, so only the memory rows
    ask for it). A framework that is not installed is skipped."""
    import importlib

    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if name == "torch":
            importlib.import_module("torch._inductor.compile_fx")
            if torch_compiler:
                module.compile(lambda x: x * 3 + 1)(module.ones(4))
        elif name == "jax":
            module.jit(lambda x: x + 1)(1.0).block_until_ready()


def inputs_ready() -> None:
    """A job calls this once its inputs exist (ids, gradients, host values it hands to the
    implementation): the job's peak memory counts from here, so it is the implementation's
    (state, temporaries, compiled code), not the harness's data."""
    _baseline[:] = [start_peak_rss()]


def job_peak_mb() -> float:
    """Peak RSS growth since :func:`inputs_ready` (MB)."""
    return peak_rss_mb() - _baseline[0]


def peak_rss_mb() -> float:
    """Peak RSS of this process in MB (since the last :func:`start_peak_rss` on Linux)."""
    hwm = _status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def bandwidth_gbs(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Measured copy bandwidth (read + write bytes per second) of this machine, GB/s.

    One thread per core copies its own slice (NumPy releases the GIL while copying), so
    the figure is the machine's, not one core's."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, os.cpu_count() or 1)
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if p.size]
    with ThreadPoolExecutor(threads) as pool:
        def once() -> float:
            t0 = time.perf_counter()
            list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
            return time.perf_counter() - t0

        once()
        best = min(once() for _ in range(repeats))
    return 2 * nbytes / best / 1e9


@dataclass
class Row:
    workload: str
    name: str           # e.g. "meshembed[torch]", "fbgemm TBE", "torch.optim.Adadelta(foreach)"
    case: str           # optimizer / layout, e.g. "sgd", "adadelta 64 tensors"
    median_ms: float
    min_ms: float
    max_ms: float
    bytes_touched: int  # memory traffic a perfect implementation needs
    state_bytes: int    # table + slots (W1) or params + slots (W2)
    peak_mb: float = float("nan")
    note: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def w1_bytes(unique_rows: int, n_ids: int, dim: int, n_slots: int, itemsize: int = 4) -> int:
    """Lower-bound traffic of a W1 step: read the looked-up rows for the forward pass,
    read+write each unique row of table and slots once, read the activation gradients."""
    forward = n_ids * dim * itemsize
    update = 2 * unique_rows * dim * itemsize * (1 + n_slots)
    return forward + update


def w2_bytes(params: int, n_slots: int = 2, itemsize: int = 4) -> int:
    """Read grad, read+write params and each slot once."""
    return params * itemsize * (1 + 2 * (1 + n_slots))


def table(rows: list[Row], gbs: float) -> str:
    head = ("| workload | case | implementation | median ms | min–max ms | lower bound ms | × bound "
            "| peak MB | state MB | note |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        bound = r.bytes_touched / (gbs * 1e9) * 1e3
        lines.append(
            f"| {r.workload} | {r.case} | {r.name} | {r.median_ms:.2f} | {r.min_ms:.2f}–{r.max_ms:.2f} "
            f"| {bound:.2f} | {r.median_ms / bound:.1f} | {r.peak_mb:.0f} | {r.state_bytes / 2**20:.0f} | {r.note} |"
        )
    return "\n".join(lines)


#: Issue #36 item 3: a dense W2 step (1 tensor and 64) within this many times its memory floor.
TARGET_W2_BOUND = 1.2
#: The meshembed rows judged against it, and the peers they must stay ahead of (the rows of
#: ``tf_peers.w2``; no Keras 3 W2 row exists yet: tf_keras is Keras 2's optimizer on TF).
W2_JUDGED = ("me.optimizers.Adadelta.apply_gradients", "meshembed[torch]", "meshembed[jax]")
W2_PEERS = ("TensorFlow ResourceApplyAdadelta (C++)", "tf_keras Adadelta (XLA)")


#: The row of the bound where a W2 module times it beside the others (same process, same load).
W2_STREAM_NAME = "W2's in-place stream, no math (the bound)"
_stream_lib: list = []


def w2_stream_fn() -> Callable[..., None] | None:
    """``fn(p, a, u, g, n, threads)``, each of p, a, u, g a list of float32 addresses (one per
    tensor) and n their sizes: ``benchmarks/w2_stream.cc``, W2's access pattern with no math
    (read g, read and write p, a and u in place) over every tensor in one OpenMP region, as
    the dense drivers run; None where it cannot be built (no compiler)."""
    if not _stream_lib:
        import ctypes
        from pathlib import Path

        try:
            from meshembed_native import build as native

            lib = ctypes.CDLL(str(native.build_library(Path(__file__).with_name("w2_stream.cc"), "bench_w2_stream",
                                                       flags=(*native.FLAGS, "-fopenmp"))))
            raw = lib.w2_stream
            raw.restype = None
            raw.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int]

            def fn(p: list, a: list, u: list, g: list, n: list, threads: int) -> None:
                count = len(n)
                threads = max(1, min(int(threads), sum(n) >> 18))  # the dense drivers' rule: a thread per 256K elements
                raw(*((ctypes.c_void_p * count)(*x) for x in (p, a, u, g)), (ctypes.c_int64 * count)(*n), count,
                    threads)
        except Exception:  # noqa: BLE001 - no compiler: the copy-bandwidth bound alone is printed
            fn = None
        _stream_lib.append(fn)
    return _stream_lib[0]


def w2_stream_ms(params: int, repeats: int = 9, threads: int | None = None) -> float | None:
    """Best ms of :func:`w2_stream_fn` over ``params`` float32 on every core: the least any
    implementation of the W2 step can take here, so the bound of #36 item 3 is this time
    (= ``w2_bytes`` ÷ this in-place bandwidth). None where it cannot be built."""
    import os

    fn = w2_stream_fn()
    if fn is None:
        return None
    arrays = [np.full(params, 0.5, np.float32) for _ in range(4)]
    ptrs = [[a.ctypes.data] for a in arrays]
    threads = threads or os.cpu_count() or 1
    fn(*ptrs, [params], threads)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*ptrs, [params], threads)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def issue36_w2(rows: list[Row], stream_ms: float | None, gbs: float) -> list[str]:
    """#36 item 3, one ✓/✗ line per judged row and case: its median ÷ the bound ≤
    :data:`TARGET_W2_BOUND`, and ahead of every TF / Keras row of the case present in ``rows``
    (a peer not run is said so). The bound: the median of the :data:`W2_STREAM_NAME` row of
    the case, timed beside it; else ``stream_ms`` (:func:`w2_stream_ms`); else ``w2_bytes`` ÷
    the copy bandwidth ``gbs``, a looser figure."""
    out = []
    beside = {r.case: r.median_ms for r in rows if r.name == W2_STREAM_NAME and r.median_ms == r.median_ms}
    for r in rows:
        if r.name not in W2_JUDGED or r.workload != "W2" or r.median_ms != r.median_ms:
            continue
        if r.case in beside:
            bound = beside[r.case]
            how = f"in-place stream timed beside it, median, {r.bytes_touched / bound / 1e6:.1f} GB/s"
        elif stream_ms is not None:
            bound, how = stream_ms, f"in-place stream {r.bytes_touched / stream_ms / 1e6:.1f} GB/s"
        else:
            bound, how = r.bytes_touched / (gbs * 1e9) * 1e3, f"copy bandwidth {gbs:.1f} GB/s"
        ratio = r.median_ms / bound
        line = (f"#36.3 {r.name} {r.case}: {r.median_ms:.2f} ms ÷ bound {bound:.2f} ms ({how}) = {ratio:.2f}× "
                f"≤ {TARGET_W2_BOUND}×: {'✓' if ratio <= TARGET_W2_BOUND else '✗'}")
        peers = [p for p in rows if p.name in W2_PEERS and p.case == r.case and p.median_ms == p.median_ms]
        if peers:
            line += "; " + ", ".join(f"ahead of {p.name} {p.median_ms:.2f} ms: {'✓' if r.median_ms < p.median_ms else '✗'}"
                                     for p in peers)
        else:
            line += "; TF / Keras peers not run here (meshembed bench --workload W2 --peers runs them)"
        out.append(line)
    return out


def w2_main(doc: str, w2: Callable[..., list[Row]], impls: tuple[str, ...], argv: list[str] | None) -> None:
    """The command line of a backend's W2 module (``python -m benchmarks.<backend>_w2``)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=",".join(impls), help=f"comma list of {impls}")
    args = ap.parse_args(argv)
    rows = w2(TINY_W2 if args.tiny else W2, args.repeats, tuple(args.only.split(",")), verbose=True)
    gbs = bandwidth_gbs()
    stream = w2_stream_ms((TINY_W2 if args.tiny else W2)["params"])
    print(f"\ncopy bandwidth {gbs:.1f} GB/s" + ("" if stream is None else
          f"; W2's in-place stream (no math) {stream:.2f} ms = {w2_bytes((TINY_W2 if args.tiny else W2)['params']) / stream / 1e6:.1f} GB/s"))
    print(table(rows, gbs))
    for line in issue36_w2(rows, stream, gbs):
        print(line)


class W1Inputs:
    """A W1-shaped workload's host inputs, made once: Zipf ids, the pooled splits (``k`` ids
    a sample), a small gradient per sample, and how many unique rows a step touches."""

    def __init__(self, sizes: dict, seed: int = 0):
        self.sizes = sizes
        v, d, b, k = sizes["vocab"], sizes["dim"], sizes["batch"], sizes["ids_per_sample"]
        self.ids = zipf_ids(b * k, v, sizes["zipf"], seed)
        self.splits = np.arange(0, b * k + 1, k, dtype=np.int64)
        self.segments = np.repeat(np.arange(b), k)
        self.grad = np.random.default_rng(seed + 1).standard_normal((b, d)).astype(np.float32) * 0.01
        self.unique = int(np.unique(self.ids).size)

