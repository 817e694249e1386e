"""W1 for every trainable optimizer on one backend, side by side with its peers (issue #18).

W1: table 1,000,000 × 64 float32, 16,384 samples × 8 Zipf(1.1) ids, sum combiner; a step is
enqueue → dequeue → apply_gradients of ``me.TPUEmbedding`` with a fixed upstream gradient.
For each optimizer one engine (its learning rate a dynamic tag) is timed, in interleaved
rounds with its peers (``benchmarks.torch_w1._timed_rounds``: a noisy neighbour slows all
alike), with a constant learning rate and with one that changes every step (the two
alternating step by step, so their ratio sees the same noise). Medians over
every timed step; the ratios the issue asks for, each next to its target:

* each optimizer ÷ SGD on the same backend (≤ 1.5×), SGD's step timed in the same rounds;
* learning rate changing every step ÷ constant (≤ 1.05×);
* fbgemm's CPU TBE ÷ engine for SGD (≥ 2.75×, #36 item 1) and Adagrad (≥ 1.25×); fbgemm_gpu
  is only in the interop venv: ``.venv/interop/bin/python -m benchmarks.w1_all``, skipped with
  the reason elsewhere;
* SGD's step itself (#36 item 1): ≤ 3.0 ms on torch; on JAX ≤ 1.2× the torch engine's SGD step,
  timed in the same rounds (the ``torch`` peer of a JAX run);
* the pooled lookup (#36 item 2, ``--lookup``, default on): the engine's forward
  (``enqueue(training=False)`` + ``dequeue``) ÷ the best of plain ``F.embedding_bag`` and
  fbgemm's TBE forward (``torch.no_grad``) on the same ids, timed in interleaved rounds (≤ 1.1×);
* TensorFlow (``ResourceSparseApplyFtrl``, LazyAdam-style scatter Adam, ``tf_peers``) and
  ``nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam`` ÷ engine for Adam and FTRL
  (≥ 3×; torch has no FTRL, so SparseAdam is FTRL's torch peer as well);
* the per-id step (a sequence feature of 131,072 × 1 ids, activations and gradients
  ``[131072, 1, 64]``) ÷ the pooled step, same optimizer (≤ 1.5×);
* the bf16 row (#32): the same optimizer with a bfloat16 table and stochastic rounding
  (``me.embedding.Precision(parameters="bfloat16")``, slots float32), timed in the same
  rounds: its median ÷ the float32 engine's, and the table's bytes (half);
* peak memory (#36 item 6, ``benchmarks.w1_memory``): every row again, each in a fresh
  process, its peak RSS growth over the baseline after imports ÷ the bytes of its tables,
  slots and batch (≤ 1.2×).

A new optimizer (e.g. the row-wise ones) gets its rows by being trainable in
``meshembed.math.OPTIMIZERS`` and having a spec in ``_spec`` (and, for a peer, in ``PEERS``).

Run: ``python -m benchmarks.w1_all --backend torch|jax|numpy [--optimizers all|sgd,adam,...]
[--repeats 7] [--rounds 3] [--per-id sgd,...] [--bf16 sgd,adagrad|none] [--[no-]memory]
[--peers fbgemm,tf,sparseadam,torch|none] [--[no-]lookup] [--quick]``.
Prints markdown tables ready for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from benchmarks.common import TINY_W1, W1, WARMUP, W1Inputs, bandwidth_gbs

LR = 0.01
#: The issue's targets.
TARGET_VS_SGD, TARGET_LR, TARGET_PER_ID = 1.5, 1.05, 1.5
#: The bf16 row's storage (#32): parameters in bfloat16 with stochastic rounding, slots float32.
BF16 = "bfloat16"
TARGET_PEER = {"fbgemm": 1.25, "tf": 3.0, "sparseadam": 3.0, "torch": 1 / 1.2}
#: #36 item 1: SGD's fbgemm ratio (fbgemm ÷ engine) and its step time on torch; item 2: the pooled
#: lookup ÷ the best of plain embedding_bag and fbgemm's forward.
TARGET_SGD_FBGEMM, TARGET_SGD_MS, TARGET_LOOKUP = 2.75, 3.0, 1.1
ALIASES = {"sgd": "stochastic_gradient_descent"}
SGD = ALIASES["sgd"]
#: Which peer runs for which optimizer.
PEERS = {SGD: ("fbgemm", "torch"), "adagrad": ("fbgemm",),
         "adam": ("tf", "sparseadam"), "ftrl": ("tf", "sparseadam")}
PEER_NAME = {"fbgemm": "fbgemm TBE CPU", "tf": "TensorFlow sparse apply",
             "sparseadam": "nn.EmbeddingBag + SparseAdam", "torch": "meshembed[torch] engine"}


def peer_target(peer: str, algorithm: str) -> float:
    """peer ÷ engine must be at least this (the torch peer of a JAX run: engine ≤ 1.2× it)."""
    return TARGET_SGD_FBGEMM if (peer, algorithm) == ("fbgemm", SGD) else TARGET_PEER[peer]
#: Registry names that are not trainable optimizers here: no public formula, an HLO program,
#: or a plain assignment of the gradient.
NOT_TRAINABLE = ("mdl_adagrad_light", "user_defined_program", "assign")


def trainable() -> tuple[str, ...]:
    """Every trainable algorithm of ``meshembed.math.OPTIMIZERS``, in registry order."""
    from meshembed.math import OPTIMIZERS

    return tuple(n for n, m in OPTIMIZERS.items() if m.supported and n not in NOT_TRAINABLE)


def short(algorithm: str) -> str:
    return {v: k for k, v in ALIASES.items()}.get(algorithm, algorithm)


def _spec(algorithm: str) -> Any:
    """The optimizer with its learning rate as dynamic tag 0 (FrequencyAwareAdagrad's step
    counter is tag 1), with typical hyper-parameters."""
    import meshembed as me

    E, lr = me.embedding, me.embedding.DynamicLearningRate(0)
    return {
        "adagrad": lambda: E.Adagrad(lr, initial_accumulator_value=0.1),
        "adagrad_momentum": lambda: E.AdagradMomentum(lr, momentum=0.9, exponent=2.0, beta2=0.999, epsilon=1e-8),
        "bounded_adagrad": lambda: E.BoundedAdagrad(lr, max_var_update=0.1, max_accumulator=10.0),
        "frequency_aware_adagrad": lambda: E.FrequencyAwareAdagrad(
            lr, step_counter=E.DynamicLearningRate(1), l1_regularization_strength=0.01,
            l2_regularization_strength=0.01, max_lr_multiplier=3.0, probability_exponent=0.5,
            accumulator_decay=0.99),
        "stochastic_gradient_descent": lambda: E.SGD(lr),
        "ftrl": lambda: E.FTRL(lr, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
        "adam": lambda: E.Adam(lr),
        "momentum": lambda: E.Momentum(lr, momentum=0.9),
        "lion": lambda: E.Lion(lr, beta1=0.9, beta2=0.99),
        "rms_prop": lambda: E.RMSProp(lr, rho=0.9, momentum=0.9, epsilon=1e-7),
        "centered_rms_prop": lambda: E.CenteredRMSProp(lr, rho=0.9, momentum=0.9, epsilon=1e-7),
        "adadelta": lambda: E.Adadelta(lr, rho=0.95, epsilon=1e-6),
        "proximal_adagrad": lambda: E.ProximalAdagrad(lr, l1=0.01, l2=0.01),
        "online_yogi": lambda: E.OnlineYogi(lr, l1=0.01, l2=0.01, beta2=0.99),
        "proximal_yogi": lambda: E.ProximalYogi(lr, l1=0.01, l2=0.01, beta1=0.9, beta2=0.99, epsilon=1e-3),
        "frequency_estimator": lambda: E.FrequencyEstimator(lr, tau=0.25, max_delta=6.0, outlier_threshold=2.0),
        # Row-wise optimizers (#36 item 5): a row each once trainable() lists them; their
        # [vocab, 1] slots count as such in the memory table (read from the engine's arrays).
        "row_wise_adagrad": lambda: E.RowWiseAdagrad(lr),
        "row_wise_adam": lambda: E.RowWiseAdam(lr),
    }[algorithm]()


def n_slots(algorithm: str) -> int:
    """How many slots the algorithm keeps (the registry's slot names)."""
    from meshembed.math import OPTIMIZERS

    return len(OPTIMIZERS[algorithm].slot_names)


def _learning_rates(algorithm: str, changing: bool) -> Callable[[int], list[float]]:
    """``learning_rates`` of step k. FrequencyEstimator's "learning rate" is the global step
    (constant: the same step every time); FrequencyAwareAdagrad's step counter always counts."""
    if algorithm == "frequency_estimator":
        return (lambda k: [float(k + 1)]) if changing else (lambda k: [1.0])
    base = (lambda k: LR / (1 + k)) if changing else (lambda k: LR)
    if algorithm == "frequency_aware_adagrad":
        return lambda k: [base(k), float(k + 1)]
    return lambda k: [base(k)]


_Data = W1Inputs  # the shared W1 inputs (benchmarks.common)


def engine(backend: str, d: _Data, algorithm: str, per_id: bool = False,
           precision: str | None = None) -> tuple[Any, Any, Any]:
    """``(emb, ids, gradient)``: one W1 engine of ``algorithm`` and its fixed step inputs, on the
    pooled feature ``[B]`` or, with ``per_id``, the sequence feature ``[B*K, 1]``; with
    ``precision`` (e.g. ``"bfloat16"``) the table is stored so, with stochastic rounding."""
    import meshembed as me

    s = d.sizes
    b, k, dim = s["batch"], s["ids_per_sample"], s["dim"]
    shape = (b * k, 1) if per_id else (b,)
    extra = {} if precision is None else {
        "precision": me.embedding.Precision(parameters=precision, rounding="stochastic", seed=0)}
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=s["vocab"], dimension=dim,
                               optimizer=_spec(algorithm), combiner="sum", **extra)],
        features=[me.FeatureConfig(table="t", input_shape=shape, name="f")],
    )
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=1)
    if per_id:
        feat = d.ids.reshape(b * k, 1)
        grad = emb.backend.asarray(np.repeat(d.grad, k, axis=0).reshape(b * k, 1, dim))
    else:
        feat, grad = me.RaggedIds(d.splits, d.ids), emb.backend.asarray(d.grad)
    return emb, feat, grad


def _engine_steps(backend: str, d: _Data, algorithm: str, per_id: bool = False,
                  precision: str | None = None) -> dict[str, Callable[[], Any]]:
    """``{"constant": step, "changing": step}`` on one engine; with ``per_id`` one step on a
    sequence feature ``[B*K, 1]`` instead of the pooled ``[B]`` (constant learning rate); with
    ``precision``, ``{"bf16": step}`` on a table stored in that dtype (constant learning rate)."""
    emb, feat, grad = engine(backend, d, algorithm, per_id, precision)
    sync = _syncer(backend)

    def make(changing: bool) -> Callable[[], Any]:
        lrs, count = _learning_rates(algorithm, changing), [0]

        def step() -> Any:
            emb.enqueue([feat])
            acts = emb.dequeue()
            emb.apply_gradients([grad], learning_rates=lrs(count[0]))
            count[0] += 1
            sync(acts)  # the update may still run (JAX): the next lookup waits for it
            return acts

        step.finish = lambda: sync(table_array(emb))  # type: ignore[attr-defined]
        return step

    if precision is not None:
        return {"bf16": make(False)}
    return {"per_id": make(False)} if per_id else {"constant": make(False), "changing": make(True)}


def table_array(emb: Any) -> Any:
    """The first table's storage (a JAX / torch array; the NumPy backend's shard list)."""
    table = emb.state.tables[0][0]
    return getattr(table, "data", table)


def _syncer(backend: str) -> Callable[[Any], None]:
    if backend == "jax":
        import jax

        return jax.block_until_ready
    return lambda x: None  # torch on CPU and NumPy: done when the call returns


def _sparseadam_step(d: _Data) -> Callable[[], Any]:
    """``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SparseAdam``: forward, backward of the
    fixed upstream gradient, the lazy Adam step."""
    import torch

    s = d.sizes
    bag = torch.nn.EmbeddingBag(s["vocab"], s["dim"], mode="sum", sparse=True)
    opt = torch.optim.SparseAdam(bag.parameters(), lr=LR)
    ids, offsets = torch.from_numpy(d.ids), torch.from_numpy(d.splits[:-1])
    grad = torch.from_numpy(d.grad)

    def step() -> Any:
        out = bag(ids, offsets)
        out.backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    return step


def _fbgemm_step(d: _Data, algorithm: str) -> Callable[[], Any]:
    from benchmarks import torch_w1

    return torch_w1._make_step("fbgemm", torch_w1._Data(d.sizes), short(algorithm))


def _peer_step(peer: str, d: _Data, algorithm: str) -> Callable[[], Any]:
    if peer == "torch":  # the torch engine beside a JAX (or NumPy) run's
        return _engine_steps("torch", d, algorithm)["constant"]
    if peer == "fbgemm":
        return _fbgemm_step(d, algorithm)
    if peer == "sparseadam":
        return _sparseadam_step(d)
    from benchmarks import tf_peers

    step = tf_peers.w1_step(d.sizes, algorithm)
    return lambda: step().numpy()


def _peer_unavailable(peer: str, backend: str = "") -> str | None:
    if peer == "torch" and backend == "torch":
        return "the engine itself"
    module = {"fbgemm": "fbgemm_gpu", "tf": "tensorflow", "sparseadam": "torch", "torch": "torch"}[peer]
    try:
        if peer == "tf":
            from benchmarks import tf_peers

            tf_peers._tf()
        else:
            __import__(module)
    except Exception as exc:  # noqa: BLE001 - report any import failure verbatim
        return f"{module} does not import here ({type(exc).__name__}: {str(exc)[:120]})"
    return None


@dataclass
class Result:
    """One optimizer's medians (ms) and min–max, by row: constant, changing, per_id, peers."""

    algorithm: str
    n_slots: int
    times: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    #: row (constant, per_id, bf16, a peer) -> benchmarks.w1_memory.measure's figures
    memory: dict[str, dict] = field(default_factory=dict)
    table_bytes: dict[str, int] = field(default_factory=dict)  # "float32" / "bf16": the parameters

    def med(self, key: str) -> float:
        return self.times.get(key, (float("nan"),) * 3)[0]


def run(backend: str, sizes: dict, algorithms: tuple[str, ...], *, repeats: int = 7, rounds: int = 3,
        warmup: int = WARMUP, per_id: tuple[str, ...] = (SGD,), bf16: tuple[str, ...] = (SGD, "adagrad"),
        peers: tuple[str, ...] = ("fbgemm", "tf", "sparseadam"), memory: bool = True,
        verbose: bool = False) -> list[Result]:
    """Time every optimizer of ``algorithms`` (engine constant / changing lr, its per-id step
    when listed in ``per_id``, its bf16 step when listed in ``bf16``, and its peers), all rows
    of one optimizer interleaved; with ``memory``, then each row's peak memory in a process
    of its own (``benchmarks.w1_memory``)."""
    from benchmarks.torch_w1 import _timed_rounds
    from meshembed.math import OPTIMIZERS

    d = _Data(sizes)
    results = []
    # SGD's step runs in every optimizer's interleaved rounds: each ÷ SGD ratio is of two
    # medians taken side by side, not of runs minutes apart on a shared machine
    reference = _engine_steps(backend, d, SGD)["constant"]
    for algorithm in algorithms:
        res = Result(algorithm, len(OPTIMIZERS[algorithm].slot_names))
        steps: dict[str, Callable[[], Any]] = {} if algorithm == SGD else {"sgd": reference}
        try:
            steps.update(_engine_steps(backend, d, algorithm))
            if algorithm in per_id:
                steps.update(_engine_steps(backend, d, algorithm, per_id=True))
        except Exception as exc:  # noqa: BLE001 - an optimizer that cannot run is a table row
            res.notes["engine"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        if algorithm in bf16:
            try:
                steps.update(_engine_steps(backend, d, algorithm, precision=BF16))
                res.table_bytes = {"float32": sizes["vocab"] * sizes["dim"] * 4,
                                   "bf16": sizes["vocab"] * sizes["dim"] * 2}
            except Exception as exc:  # noqa: BLE001
                res.notes["bf16"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        for peer in PEERS.get(algorithm, ()):
            if peer not in peers:
                continue
            why = _peer_unavailable(peer, backend)
            if why == "the engine itself":
                continue
            if why is None:
                try:
                    steps[peer] = _peer_step(peer, d, algorithm)
                except Exception as exc:  # noqa: BLE001
                    why = f"{type(exc).__name__}: {str(exc)[:160]}"
            if why:
                res.notes[peer] = why
                if verbose:
                    print(f"{short(algorithm)}: {PEER_NAME[peer]} skipped: {why}", flush=True)
        try:
            # constant and changing learning rate: one engine, alternating step by step
            res.times = _timed_rounds(steps, repeats, rounds, warmup, alternate=("constant", "changing"))
        except Exception:  # noqa: BLE001 - time them one by one to find the failing one
            for key, step in steps.items():
                try:
                    res.times.update(_timed_rounds({key: step}, repeats, rounds, warmup))
                except Exception as exc:  # noqa: BLE001
                    res.notes[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
        steps.clear()
        gc.collect()
        if algorithm == SGD:
            res.times["sgd"] = res.times.get("constant", (float("nan"),) * 3)
        results.append(res)
        if verbose:
            cells = "  ".join(f"{k} {m:.2f} ({lo:.2f}-{hi:.2f})" for k, (m, lo, hi) in res.times.items())
            print(f"{short(algorithm):24s} {cells}", flush=True)
    if memory:
        from benchmarks import w1_memory

        for res in results:
            rows = [k for k in ("constant", "per_id", "bf16") if k in res.times]
            rows += [p for p in PEERS.get(res.algorithm, ()) if p in res.times and p != "torch"]
            for row in rows:
                res.memory[row] = w1_memory.run_row(backend, res.algorithm, row, sizes)
                if verbose:
                    m = res.memory[row]
                    print(f"{short(res.algorithm):24s} {row:10s} memory "
                          + (f"peak {m['peak_mb']:.0f} MB ÷ bytes {w1_memory.ratio(m):.2f}" if "peak_mb" in m
                             else m["error"]), flush=True)
    return results


def _ratio(a: float, b: float) -> float:
    return a / b if b == b and b > 0 else float("nan")


def _vs_sgd(r: Result) -> float:
    """The constant-lr median ÷ SGD's, timed in the same interleaved rounds."""
    return _ratio(r.med("constant"), r.med("sgd"))


def _verdict(value: float, target: float, at_most: bool) -> str:
    if value != value:
        return "—"
    ok = value <= target if at_most else value >= target
    return f"{value:.2f}× {'✓' if ok else '✗'}"


def table(results: list[Result]) -> str:
    """The markdown table of one backend's run: one row per optimizer."""
    head = ("| optimizer | slots | constant lr ms (min–max) | changing lr ms | changing ÷ constant (≤ 1.05) "
            "| ÷ SGD beside it (≤ 1.5), SGD ms | peer ÷ engine (target) | per-id ms, ÷ pooled (≤ 1.5) "
            "| bf16 SR ms, ÷ float32; table MB | note |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        const = r.times.get("constant", (float("nan"),) * 3)
        peer_cells = []
        for peer in PEERS.get(r.algorithm, ()):
            if peer in r.times:
                ratio = _ratio(r.med(peer), const[0])
                target = peer_target(peer, r.algorithm)
                peer_cells.append(f"{PEER_NAME[peer]} {r.med(peer):.2f} ms: "
                                  f"{_verdict(ratio, target, at_most=False)} (≥ {round(target, 3)})")
        per_id = ""
        if "per_id" in r.times:
            per_id = f"{r.med('per_id'):.2f}, {_verdict(_ratio(r.med('per_id'), const[0]), TARGET_PER_ID, True)}"
        bf16 = ""
        if "bf16" in r.times:
            bf16 = (f"{r.med('bf16'):.2f}, {_ratio(r.med('bf16'), const[0]):.2f}×; "
                    f"{r.table_bytes['bf16'] / 2**20:.0f} vs {r.table_bytes['float32'] / 2**20:.0f}")
        note = "; ".join(f"{k}: {v}" for k, v in r.notes.items())
        lines.append(
            f"| {short(r.algorithm)} | {r.n_slots} | {const[0]:.2f} ({const[1]:.2f}–{const[2]:.2f}) "
            f"| {r.med('changing'):.2f} | {_verdict(_ratio(r.med('changing'), const[0]), TARGET_LR, True)} "
            f"| {_verdict(_vs_sgd(r), TARGET_VS_SGD, True)}, {r.med('sgd'):.2f} | {'; '.join(peer_cells)} | {per_id} "
            f"| {bf16} | {note} |"
        )
    return "\n".join(lines)


def lookup_steps(backend: str, d: _Data, peers: tuple[str, ...] = ("fbgemm",)) -> dict[str, Callable[[], Any]]:
    """The pooled lookup (#36 item 2): ``engine`` (``enqueue(training=False)`` + ``dequeue`` of
    the W1 batch, SGD table), ``embedding_bag`` (``F.embedding_bag(ids, table, offsets,
    mode="sum")`` on the int64 tensors of the same ids, a torch table of the same rows) and, with
    fbgemm_gpu, ``fbgemm`` (the TBE's forward under ``torch.no_grad``). Peers that cannot run
    are left out."""
    emb, feat, _ = engine(backend, d, SGD)
    sync = _syncer(backend)

    def forward() -> Any:
        emb.enqueue([feat], training=False)
        acts = emb.dequeue()
        sync(acts)
        return acts

    steps: dict[str, Callable[[], Any]] = {"engine": forward}
    if _peer_unavailable("sparseadam") is None:  # torch imports
        import torch

        ids, offsets = torch.from_numpy(d.ids), torch.from_numpy(d.splits[:-1])
        weight = torch.from_numpy(np.ascontiguousarray(emb.retrieve_parameters("t")["parameters"]))
        steps["embedding_bag"] = lambda: torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum")
    if "fbgemm" in peers and _peer_unavailable("fbgemm") is None:
        import torch

        tbe_step = _fbgemm_step(d, SGD)
        fb = getattr(tbe_step, "__closure__", None)
        tbe = next((c.cell_contents for c in fb or () if type(c.cell_contents).__name__.startswith("SplitTable")),
                   None)
        if tbe is not None:
            ids_t, offs_t = torch.from_numpy(d.ids), torch.from_numpy(d.splits)

            def fbgemm_forward() -> Any:
                with torch.no_grad():
                    return tbe(ids_t, offs_t)

            steps["fbgemm"] = fbgemm_forward
    return steps


def lookup_times(backend: str, sizes: dict, repeats: int, rounds: int, warmup: int,
                 peers: tuple[str, ...] = ("fbgemm",)) -> dict[str, tuple[float, float, float]]:
    """(median, min, max) ms of every :func:`lookup_steps` row, in interleaved rounds."""
    from benchmarks.torch_w1 import _timed_rounds

    steps = lookup_steps(backend, _Data(sizes), peers)
    try:
        return _timed_rounds(steps, repeats, rounds, warmup)
    finally:
        steps.clear()
        gc.collect()


def issue36(backend: str, results: list[Result], lookup: dict[str, tuple[float, float, float]] | None) -> list[str]:
    """#36 items 1 and 2, one ✓/✗ line each: SGD's step (≤ 3.0 ms on torch; on JAX ≤ 1.2× the
    torch engine beside it), fbgemm ÷ SGD (≥ 2.75×), every optimizer ÷ SGD (≤ 1.5×), the pooled
    lookup ÷ the best of embedding_bag and fbgemm (≤ 1.1×). A target not measured says so."""
    def mark(ok: bool) -> str:
        return "✓" if ok else "✗"

    out = []
    sgd = next((r for r in results if r.algorithm == SGD), None)
    if sgd is None or sgd.med("constant") != sgd.med("constant"):
        out.append("#36.1 SGD step: not measured (run with --optimizers including sgd)")
    else:
        ms = sgd.med("constant")
        if backend == "torch":
            out.append(f"#36.1 torch SGD step {ms:.2f} ms ≤ {TARGET_SGD_MS} ms: {mark(ms <= TARGET_SGD_MS)}")
        elif "torch" in sgd.times:
            ratio = _ratio(ms, sgd.med("torch"))
            out.append(f"#36.1 {backend} SGD step {ms:.2f} ms ÷ torch engine {sgd.med('torch'):.2f} ms = "
                       f"{ratio:.2f}× ≤ 1.2×: {mark(ratio <= 1.2)}")
        else:
            out.append(f"#36.1 {backend} SGD step {ms:.2f} ms; ÷ torch: not measured (torch peer absent)")
        if "fbgemm" in sgd.times:
            ratio = _ratio(sgd.med("fbgemm"), ms)
            out.append(f"#36.1 fbgemm TBE {sgd.med('fbgemm'):.2f} ms ÷ {backend} SGD {ms:.2f} ms = {ratio:.2f}× "
                       f"≥ {TARGET_SGD_FBGEMM}×: {mark(ratio >= TARGET_SGD_FBGEMM)}")
        else:
            out.append(f"#36.1 fbgemm ÷ SGD: not measured ({sgd.notes.get('fbgemm', 'peer not run')})")
    worst = max(((_vs_sgd(r), r.algorithm) for r in results if r.algorithm != SGD and _vs_sgd(r) == _vs_sgd(r)),
                default=None)
    if worst is not None:
        out.append(f"#36.1 every optimizer ÷ SGD ≤ {TARGET_VS_SGD}× (worst {short(worst[1])} {worst[0]:.2f}×): "
                   f"{mark(worst[0] <= TARGET_VS_SGD)}")
    if lookup:
        eng = lookup.get("engine", (float("nan"),) * 3)[0]
        best = min(((lookup[p][0], p) for p in ("embedding_bag", "fbgemm") if p in lookup), default=None)
        if best is None:
            out.append(f"#36.2 lookup {eng:.2f} ms: no peer measured")
        else:
            ratio = _ratio(eng, best[0])
            peers_ms = ", ".join(f"{p} {lookup[p][0]:.2f}" for p in ("embedding_bag", "fbgemm") if p in lookup)
            out.append(f"#36.2 {backend} pooled lookup {eng:.2f} ms ÷ best peer ({best[1]}) {best[0]:.2f} ms = "
                       f"{ratio:.2f}× ≤ {TARGET_LOOKUP}× [{peers_ms} ms]: {mark(ratio <= TARGET_LOOKUP)}")
    return out


def misses(results: list[Result]) -> list[str]:
    """One line per missed target (empty: every measured target met)."""
    out = []
    for r in results:
        c = r.med("constant")
        checks = [("÷ SGD", _vs_sgd(r), TARGET_VS_SGD, True),
                  ("changing ÷ constant lr", _ratio(r.med("changing"), c), TARGET_LR, True),
                  ("per-id ÷ pooled", _ratio(r.med("per_id"), c), TARGET_PER_ID, True)]
        checks += [(f"{PEER_NAME[p]} ÷ engine", _ratio(r.med(p), c), peer_target(p, r.algorithm), False)
                   for p in PEERS.get(r.algorithm, ())]
        from benchmarks import w1_memory

        checks += [(f"{row} peak memory ÷ (tables+slots+batch)", w1_memory.ratio(m), w1_memory.TARGET, True)
                   for row, m in r.memory.items()]
        for what, value, target, at_most in checks:
            if value == value and not (value <= target if at_most else value >= target):
                out.append(f"{short(r.algorithm)}: {what} = {value:.2f} (target {'≤' if at_most else '≥'} {target})")
    return out


def _names(arg: str, every: tuple[str, ...]) -> tuple[str, ...]:
    if arg in ("all", ""):
        return every
    if arg == "none":
        return ()
    names = tuple(ALIASES.get(n.strip(), n.strip()) for n in arg.split(",") if n.strip())
    bad = [n for n in names if n not in every]
    if bad:
        raise SystemExit(f"Invalid optimizer(s) {bad}. Expected 'all' or some of {[short(n) for n in every]}.")
    return names


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("torch", "jax", "numpy"), default="torch")
    ap.add_argument("--optimizers", default="all", help="'all' or a comma list (sgd, adagrad, adam, ...)")
    ap.add_argument("--per-id", default="sgd", help="optimizers that also get the per-id step ('all', 'none')")
    ap.add_argument("--bf16", default="sgd,adagrad", help="optimizers that also get the bf16 + SR row ('all', 'none')")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                    help="the per-row peak memory pass (default: on, off with --quick)")
    ap.add_argument("--peers", default="fbgemm,tf,sparseadam,torch",
                    help="comma list of fbgemm, tf, sparseadam, torch (the torch engine beside a JAX run), or none")
    ap.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                    help="the pooled lookup beside embedding_bag and fbgemm's forward (#36 item 2)")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per row per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--quick", action="store_true", help="CI sizes, 1 warm-up, 1 round (a smoke test)")
    args = ap.parse_args(argv)
    every = trainable()
    algorithms = _names(args.optimizers, every)
    per_id = _names(args.per_id, every)
    bf16 = _names(args.bf16, every)
    memory = not args.quick if args.memory is None else args.memory
    peers = () if args.peers == "none" else tuple(p.strip() for p in args.peers.split(",") if p.strip())
    if args.quick:
        sizes, warmup, rounds = TINY_W1, 1, 1
    else:
        sizes, warmup, rounds = W1, WARMUP, args.rounds
    results = run(args.backend, sizes, algorithms, repeats=args.repeats, rounds=rounds, warmup=warmup,
                  per_id=per_id, bf16=bf16, peers=peers, memory=memory, verbose=True)
    lookup = None
    if args.lookup:
        lookup = lookup_times(args.backend, sizes, args.repeats, rounds, warmup, peers)
        print("lookup  " + "  ".join(f"{k} {m:.3f} ({lo:.3f}-{hi:.3f})" for k, (m, lo, hi) in lookup.items()),
              flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gbs = bandwidth_gbs(1 << 24 if args.quick else 1 << 28)
    print(f"\nW1 on {args.backend}: {sizes}; {_Data(sizes).unique} unique rows/step; {args.repeats} steps × "
          f"{rounds} rounds per row; load average {load:.1f} on {os.cpu_count()} cores; "
          f"copy bandwidth {gbs:.1f} GB/s\n")
    print(table(results))
    if memory:
        from benchmarks import w1_memory

        print(f"\nPeak memory per row (each in a fresh process; growth of peak RSS over the baseline after "
              f"imports; target ≤ {w1_memory.TARGET}×):\n")
        print(w1_memory.table({(r.algorithm, row): m for r in results for row, m in r.memory.items()}, short))
    print("\nIssue #36 items 1-2:\n" + "\n".join(issue36(args.backend, results, lookup)))
    missed = misses(results)
    print("\nevery measured target met" if not missed else "\ntargets missed:\n" + "\n".join(missed))


if __name__ == "__main__":
    main(sys.argv[1:])
