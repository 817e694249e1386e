"""The runner behind ``meshembed bench``: every benchmark of ``benchmarks/`` in one table.

Lives in the source checkout with the benchmarks it runs (the installed package does not
carry them); ``meshembed bench`` finds the checkout and runs ``python -m benchmarks.runner``
in it. Each job runs in a fresh subprocess so its peak memory (growth of peak RSS over the
baseline taken once the framework has started and the job has made its inputs) is its own.
Prints one table with medians, min–max, the memory-traffic lower bound from the measured
bandwidth, and peak memory; writes JSON and a PNG bar chart when asked.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass, field

from benchmarks import common

_ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import importlib, json, sys
spec = json.loads(sys.argv[1])
from benchmarks import common
common.start_frameworks(spec["preload"])
common.inputs_ready()  # jobs call it again once they have made their inputs
mod = importlib.import_module("benchmarks." + spec["module"])
rows = getattr(mod, spec["function"])(**spec["kwargs"])
peak = common.job_peak_mb()
out = []
for r in rows:
    r.peak_mb = peak
    out.append(r.as_dict())
print("ROWS" + json.dumps(out))
"""


@dataclass
class Job:
    label: str
    module: str
    function: str
    kwargs: dict
    preload: list[str] = field(default_factory=list)


_FRAMEWORK = {"torch": ["torch"], "jax": ["jax"], "numpy": []}


def jobs(backends: list[str], workload: str, peers: bool, repeats: int) -> list[Job]:
    tiny = workload == "tiny"
    w1, w2 = (common.TINY_W1, common.TINY_W2) if tiny else (common.W1, common.W2)
    out: list[Job] = []
    if workload in ("W1", "all", "tiny"):
        for b in backends:
            for case in ("sgd", "adagrad", "adadelta"):
                out.append(Job(f"W1 meshembed[{b}] {case}", "meshembed_rows", "w1",
                               dict(sizes=w1, repeats=repeats, backend=b, case=case), _FRAMEWORK.get(b, [b])))
        if peers:
            out.append(Job("W1 TensorFlow", "tf_peers", "w1", dict(sizes=w1, repeats=repeats), ["tensorflow"]))
            out += _peer_jobs("w1", w1, repeats)
    if workload in ("W2", "all", "tiny"):
        for b in backends:
            for tensors in (1, 64):
                out.append(Job(f"W2 meshembed[{b}] {tensors}", "meshembed_rows", "w2",
                               dict(sizes=w2, repeats=repeats, backend=b, tensors=tensors), _FRAMEWORK.get(b, [b])))
        if peers:
            out.append(Job("W2 TensorFlow/Keras", "tf_peers", "w2", dict(sizes=w2, repeats=repeats), ["tensorflow"]))
            out += _peer_jobs("w2", w2, repeats)
    return out


# Peers kept by the backends' benchmark modules: (module, function, impls, frameworks).
_PEERS = {
    "w1": [("torch_w1", "w1", ("embeddingbag",), ["torch"]),
           ("torch_w1", "w1", ("fbgemm",), ["torch"]),
           ("jax_w1", "w1", ("optax",), ["jax"])],
    "w2": [("torch_w2", "w2", ("torch-foreach",), ["torch"]),
           ("jax_w2", "w2", ("optax",), ["jax"])],
}


def _peer_jobs(kind: str, sizes: dict, repeats: int) -> list[Job]:
    """One job per peer implementation, where its framework is installed."""
    import importlib.util

    found = []
    for module, function, impls, frameworks in _PEERS[kind]:
        if all(importlib.util.find_spec(f) for f in frameworks):
            found.append(Job(f"{kind.upper()} {impls[0]}", module, function,
                             dict(sizes=sizes, repeats=repeats, impls=impls), frameworks))
    return found


def run_job(job: Job, timeout: float = 1800) -> tuple[list[dict], str]:
    spec = json.dumps(dict(module=job.module, function=job.function, kwargs=job.kwargs, preload=job.preload))
    env = dict(os.environ)
    env.setdefault("KMP_BLOCKTIME", "0")  # every row alike: no 200 ms OpenMP spin-waits (torch README)
    env.setdefault("MESHEMBED_TORCH_MALLOC_TUNING", "1")  # the opt-in glibc thresholds the figures used
    proc = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True,
                          timeout=timeout, cwd=_ROOT, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS"):
            return json.loads(line[4:]), ""
    return [], (proc.stderr or proc.stdout).strip().splitlines()[-1:] and (proc.stderr or proc.stdout).strip().splitlines()[-1]


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']} {r['case']}\n{r['name']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r["median_ms"] for r in rows],
            xerr=[[r["median_ms"] - r["min_ms"] for r in rows], [r["max_ms"] - r["median_ms"] for r in rows]])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median ms per step (log scale; bars show min–max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """``argv``: one JSON object of ``meshembed bench``'s options (what ``meshembed.bench`` passes)."""
    import meshembed as me

    args = argparse.Namespace(**json.loads((sys.argv[1:] if argv is None else argv)[0]))
    backends = [b.strip() for b in args.backends.split(",")] if args.backends else list(me.available_backends())
    todo = jobs(backends, args.workload, args.peers, args.repeats)
    gbs = common.bandwidth_gbs(1 << 24 if args.workload == "tiny" else 1 << 28)
    print(f"measured copy bandwidth: {gbs:.1f} GB/s (lower bound = bytes touched / bandwidth)")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **_: x  # noqa: E731
    rows, failures = [], []
    for job in tqdm(todo, desc="bench", unit="job"):
        got, err = run_job(job)
        rows += got
        if err:
            failures.append(f"{job.label}: {err}")
    objs = [common.Row(**r) for r in rows]
    print(common.table(objs, gbs))
    if any(r.workload == "W2" for r in objs):
        w2 = (common.TINY_W2 if args.workload == "tiny" else common.W2)["params"]
        for line in common.issue36_w2(objs, common.w2_stream_ms(w2), gbs):
            print(line)
    for f in failures:
        print("failed:", f)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"bandwidth_gbs": gbs, "rows": rows, "failures": failures}, indent=1))
    if args.png and rows:
        chart(rows, args.png)
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
