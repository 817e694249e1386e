"""Peak memory of each W1 row of ``benchmarks.w1_all``, each row in a fresh process (#36 item 6).

A row's figure is the growth of its process's peak RSS (``VmHWM``, reset where Linux allows)
over the baseline taken once the frameworks are imported and started, before any input
exists: the row's inputs (ids, splits, gradients), tables, slots, temporaries and compiled
code all count. It is set beside the bytes the row cannot do without — its tables and
slots (read from the engine's own arrays, so a 16-bit table or a ``[vocab, 1]`` row-wise slot
counts as what it is; a peer's as the same optimizer's dense slots) plus the batch — and
judged against ``peak ≤ 1.2 × (tables + slots + batch)``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np

TARGET = 1.2
#: Timed-steps stand-in: enough steps that every lazily made buffer and compiled program exists.
STEPS = 4
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_FRAMEWORKS = {"torch": ["torch"], "jax": ["jax"], "numpy": []}
_PEER_FRAMEWORKS = {"fbgemm": ["torch"], "sparseadam": ["torch"], "tf": ["tensorflow"]}
_CHILD = r"""
import json, sys
from benchmarks import w1_memory
print("MEM" + json.dumps(w1_memory.measure(**json.loads(sys.argv[1]))), flush=True)
"""


def nbytes(x: Any) -> int:
    """Bytes of a NumPy / torch / JAX array."""
    n = getattr(x, "nbytes", None)
    return int(n) if n is not None else int(x.element_size() * x.numel())


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    return int(size) if size is not None else int(np.dtype(dtype).itemsize)


def engine_state_bytes(emb: Any) -> int:
    """Bytes of every table and slot an engine holds, as stored (16-bit arrays at 2 bytes)."""
    return sum(int(np.prod(t.shape)) * _itemsize(t.dtype) for arrays in emb.state.tables.values() for t in arrays)


def measure(backend: str, algorithm: str, row: str, sizes: dict, steps: int = STEPS) -> dict:
    """In this (fresh) process: start the frameworks, take the baseline, make the row's inputs
    and implementation, run ``steps`` steps; the peak growth and the bytes it is judged by."""
    from benchmarks import common, w1_all

    frameworks = _PEER_FRAMEWORKS.get(row, _FRAMEWORKS.get(backend, [backend]))
    common.start_frameworks(frameworks, torch_compiler=True)
    if row not in _PEER_FRAMEWORKS:
        import meshembed as me

        me.get_backend(backend)  # the backend's modules: code, not the row's memory
    base = common.start_peak_rss()
    d = w1_all._Data(sizes)
    batch = nbytes(d.ids) + nbytes(d.splits) + nbytes(d.segments) + nbytes(d.grad)
    s = sizes
    table_bytes = s["vocab"] * s["dim"] * 4
    if row in _PEER_FRAMEWORKS:
        step = w1_all._peer_step(row, d, algorithm)
        n_slots = 2 if row == "sparseadam" else w1_all.n_slots(algorithm)  # SparseAdam: Adam's m, v
        state = table_bytes * (1 + n_slots)
    else:
        emb, feat, grad = w1_all.engine(backend, d, algorithm, per_id=row == "per_id",
                                        precision="bfloat16" if row == "bf16" else None)
        if row == "per_id":
            batch += nbytes(grad)  # the [B*K, 1, D] gradient is the per-id batch's own
        lrs = w1_all._learning_rates(algorithm, False)
        sync = w1_all._syncer(backend)

        def step() -> Any:
            emb.enqueue([feat])
            acts = emb.dequeue()
            emb.apply_gradients([grad], learning_rates=lrs(0))
            sync(acts)
            return acts

        state = engine_state_bytes(emb)
    for _ in range(steps):
        step()
    if row not in _PEER_FRAMEWORKS:
        sync(w1_all.table_array(emb))
    return {"peak_mb": common.peak_rss_mb() - base, "state_bytes": state, "batch_bytes": batch}


def run_row(backend: str, algorithm: str, row: str, sizes: dict, timeout: float = 900) -> dict:
    """:func:`measure` in a fresh interpreter; ``{"error": ...}`` when it fails."""
    spec = json.dumps(dict(backend=backend, algorithm=algorithm, row=row, sizes=sizes))
    env = dict(os.environ, KMP_BLOCKTIME=os.environ.get("KMP_BLOCKTIME", "0"))
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True,
                              timeout=timeout, cwd=_ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("MEM"):
            return json.loads(line[3:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return {"error": tail[-1][:160] if tail else f"exit {proc.returncode}"}


def ratio(m: dict) -> float:
    """Peak ÷ (tables + slots + batch); NaN for a failed row."""
    if "peak_mb" not in m:
        return float("nan")
    return m["peak_mb"] * 2**20 / (m["state_bytes"] + m["batch_bytes"])


def table(memory: dict[tuple[str, str], dict], label: Any = str) -> str:
    """Markdown: one line per (optimizer, row)."""
    lines = ["| optimizer | row | peak MB (growth) | tables + slots MB | batch MB | peak ÷ (tables+slots+batch) (≤ 1.2) |",
             "|---|---|---|---|---|---|"]
    for (algorithm, row), m in memory.items():
        if "error" in m:
            lines.append(f"| {label(algorithm)} | {row} | — | — | — | failed: {m['error']} |")
            continue
        r = ratio(m)
        lines.append(f"| {label(algorithm)} | {row} | {m['peak_mb']:.0f} | {m['state_bytes'] / 2**20:.0f} "
                     f"| {m['batch_bytes'] / 2**20:.1f} | {r:.2f}× {'✓' if r <= TARGET else '✗'} |")
    return "\n".join(lines)
