"""The conformance suite over real ``torch.distributed`` ranks (data-parallel harness).

Three pieces, all used by ``conformance/conftest.py`` when the process was started as one
rank of a group (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set — the
``torchrun`` contract, which :func:`launch` follows too):

* :func:`from_env` initialises the ``gloo`` process group once per rank (loopback, short
  timeout) and registers the ``torch-ranks`` backend.
* :class:`RanksBackend` (``torch-ranks``) is the real distributed ``TorchBackend`` — tables
  stay sharded over the ranks and rows are routed by the backend's own all-to-all — behind a
  thin wrapper that does what data-parallel training does with a batch: every rank holds the
  whole (identical) test input, keeps only its part of every *batch-shaped* argument
  (``ids[r::world]`` and the rows that go with them) and lets collectives put the result
  back together, so a backend that summed over ranks wrongly, or double-counted, fails.
* :class:`Lockstep` (a pytest plugin) keeps the ranks on the same test: it checks that every
  rank collected the same tests, exchanges each test's outcome through the process group's
  ``TCPStore`` (independent of the gloo collectives, so it still works when they broke), fails
  a test on every rank when it failed on any, stops the session when the ranks diverged (their
  collectives no longer pair up), and makes rank 0 print every rank's result and fail when
  any rank failed.

Run it::

    python -m conformance.distributed -n 2                    # the whole suite, 2 ranks
    python -m conformance.distributed -n 4 -- -k engine -x    # extra pytest arguments after --
    torchrun --nproc-per-node 2 -m pytest conformance -p no:cacheprovider   # the same, via torchrun

See ``conformance/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import pytest

from meshembed.backend.protocol import Backend, Capabilities, ShardedTable
from meshembed.errors import InputError

BACKEND_NAME = "torch-ranks"
#: The process group's timeout: how long a collective waits for a peer before failing.
PG_TIMEOUT_ENV = "MESHEMBED_TEST_RANKS_PG_TIMEOUT"
DEFAULT_PG_TIMEOUT_S = 60.0
#: How long a rank waits at a test boundary for the others' outcome (> the PG timeout, so a
#: rank stuck in a collective times out there and still reports).
SYNC_SLACK_S = 60.0
#: How a batch is split over the ranks: ``strided`` (rank r takes items r, r + world, ...;
#: the default), ``blocks`` (contiguous, uneven blocks) or ``none`` — every rank feeds the
#: whole batch, the mistake this harness exists to catch (gradients come out ``world`` times
#: too large); the suite must fail with it (tests/test_torch_conformance_ranks.py checks).
SPLIT_ENV = "MESHEMBED_TEST_RANKS_SPLIT"
SPLITS = ("strided", "blocks", "none")
_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_KEY = "meshembed-conformance/"


# -- the backend ---------------------------------------------------------------------------------
#: Calls into the wrapped backend that may run collectives, counted so the ranks can check at
#: every test boundary that they issued the same number (a mismatch means they diverged).
COLLECTIVE_CALLS = [0]


class RanksBackend(Backend):
    """``torch-ranks``: the distributed :class:`meshembed_torch.TorchBackend`, fed the way
    data-parallel training feeds it.

    Every rank runs the same test with the same arguments. Per call:

    * ``update_rows(tables, ids, grads, fn, grad_index=, grad_weights=)`` — rank ``r`` passes
      ``ids[r::world]`` with the gradient rows that go with them (``grads[r::world]``, or with
      ``grad_index``: ``grad_index[r::world]``/``grad_weights[r::world]`` and the whole
      per-sample ``grads``, which every data-parallel rank has for its own samples). The
      backend routes each (id, row) to the owning rank, which sums every rank's contribution
      before running ``fn`` once per unique row — so ``fn`` must see the same sums as in one
      process.
    * ``gather_combine(table, ids, segment_ids, n, weights)`` — each rank combines its part of
      the ids into a partial ``[n, D]``; an all-reduce sum gives the full activations.
    * ``gather(table, ids)`` — each rank gathers its part; an all-gather reassembles the rows in
      the original order.
    * ``scatter(table, ids, rows)`` — each rank writes its part of the (unique) ids.
    * everything else (``create_table``, ``unshard``, the segment sums, ``asarray``, the dense
      side, ...) goes to the wrapped backend unchanged; tables stay sharded over the ranks.

    The split is ``$MESHEMBED_TEST_RANKS_SPLIT``: ``strided`` (default; ``[r::world]``),
    ``blocks`` (contiguous ``[n·r//world : n·(r+1)//world]``) or ``none`` (every rank passes
    everything — the bug this harness catches; the suite must fail with it).

    Ids (and segment ids) are validated on the whole input before it is split, so a bad input
    raises the same error on every rank instead of on the one rank that holds the bad id (which
    would leave the others waiting in a collective).
    """

    name = BACKEND_NAME

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            from meshembed_torch import TorchBackend
        except ImportError as exc:  # pragma: no cover - depends on the install
            return f"meshembed_torch cannot be imported ({exc})"
        reason = TorchBackend.unavailable_reason()
        if reason:
            return reason
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return ("torch.distributed is not initialised in this process: the 'torch-ranks' backend runs "
                    "only under `python -m conformance.distributed -n N` or `torchrun ... -m pytest conformance`")
        return None

    def __init__(self, inner: Any = None, split: str | None = None):
        import torch
        import torch.distributed as dist

        from meshembed_torch import TorchBackend

        self.inner = inner if inner is not None else TorchBackend()
        self._torch = torch
        self._dist = dist
        self.split = split or os.environ.get(SPLIT_ENV, "strided")
        if self.split not in SPLITS:
            raise ValueError(f"Invalid {SPLIT_ENV}. Expected one of {list(SPLITS)}. Received: {self.split!r}")

    # -- ranks ----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._dist.get_rank()

    @property
    def world(self) -> int:
        return self._dist.get_world_size()

    def _slice(self, r: int, n: int) -> slice:
        """Which of ``n`` batch items rank ``r`` contributes."""
        if self.split == "blocks":
            return slice(n * r // self.world, n * (r + 1) // self.world)
        if self.split == "none":
            return slice(0, n)
        return slice(r, None, self.world)

    def _part(self, x: Any) -> Any:
        """This rank's share of a batch-shaped array (its own, contiguous copy)."""
        return x[self._slice(self.rank, int(x.shape[0]))].contiguous()

    def _collective(self, what: str, call: Callable[[], Any]) -> Any:
        from meshembed_torch.distributed import RankFailureError

        try:
            return call()
        except (RuntimeError, self._dist.DistError) as exc:
            raise RankFailureError(f"torch.distributed {what} (conformance harness) failed on rank "
                                   f"{self.rank} of {self.world}: {exc}") from exc

    def _ids(self, ids: Any, table: ShardedTable) -> Any:
        """Whole-input validation (the wrapped backend's own), as a flat int64 tensor."""
        check = getattr(self.inner, "_ids", None)
        if check is not None:
            return check(ids, table)
        return self.inner.asarray(ids).reshape(-1).to(self._torch.int64)  # pragma: no cover

    # -- discovery ------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def xp(self) -> Any:
        return self.inner.xp

    def __getattr__(self, name: str) -> Any:
        # Backend-specific extras of the wrapped backend (``device``, ``torch_dtype``, ...).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- dense arrays ---------------------------------------------------------------------------
    def asarray(self, x: Any, dtype: Any = None) -> Any:
        return self.inner.asarray(x, dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.inner.to_numpy(x)

    def is_native(self, x: Any) -> bool:
        return self.inner.is_native(x)

    # -- tables: passed through -----------------------------------------------------------------
    def create_table(self, values: np.ndarray, placement: Any) -> ShardedTable:
        COLLECTIVE_CALLS[0] += 1
        return self.inner.create_table(values, placement)

    def unshard(self, table: ShardedTable) -> np.ndarray:
        COLLECTIVE_CALLS[0] += 1
        return self.inner.unshard(table)

    def segment_sum(self, ids: Any, values: Any) -> tuple[Any, Any]:
        return self.inner.segment_sum(ids, values)

    def segment_sum_to(self, values: Any, segment_ids: Any, num_segments: int) -> Any:
        return self.inner.segment_sum_to(values, segment_ids, num_segments)

    # -- tables: batch split over the ranks ----------------------------------------------------
    def gather(self, table: ShardedTable, ids: Any) -> Any:
        COLLECTIVE_CALLS[0] += 1
        torch = self._torch
        ids = self._ids(ids, table)
        n = int(ids.shape[0])
        part = self.inner.gather(table, self._part(ids))
        if n == 0:  # the same on every rank: nothing to reassemble
            return part
        if self.split == "none":
            return part
        sizes = [len(range(n)[self._slice(r, n)]) for r in range(self.world)]
        width = max(sizes)
        if part.shape[0] < width:
            part = torch.cat([part, part.new_zeros((width - part.shape[0],) + tuple(part.shape[1:]))])
        parts = [torch.empty_like(part) for _ in range(self.world)]
        self._collective("all_gather (gather)", lambda: self._dist.all_gather(parts, part.contiguous()))
        out = part.new_empty((n,) + tuple(part.shape[1:]))
        for r, (p, size) in enumerate(zip(parts, sizes)):
            out[self._slice(r, n)] = p[:size]
        return out

    def scatter(self, table: ShardedTable, ids: Any, rows: Any) -> ShardedTable:
        COLLECTIVE_CALLS[0] += 1
        ids = self._ids(ids, table)
        rows = self.inner.asarray(rows)
        if rows.ndim >= 1 and rows.shape[0] == ids.shape[0]:
            rows = self._part(rows)
        else:  # let the wrapped backend raise its own error, on every rank alike
            return self.inner.scatter(table, ids, rows)
        return self.inner.scatter(table, self._part(ids), rows)

    def gather_combine(self, table: ShardedTable, ids: Any, segment_ids: Any, num_segments: int,
                       weights: Any = None, *, offsets: Any = None) -> Any:
        """Each rank's part of the ids (``offsets`` describe the whole: not passed on)."""
        COLLECTIVE_CALLS[0] += 1
        torch = self._torch
        ids = self._ids(ids, table)
        seg = self.inner.asarray(segment_ids).reshape(-1).to(torch.int64)
        if seg.numel():
            lo, hi = (int(v) for v in torch.aminmax(seg))
            if lo < 0 or hi >= num_segments:
                raise InputError(f"Invalid `segment_ids`. Expected values in [0, {num_segments}).")
        w = None if weights is None else self._part(self.inner.asarray(weights).reshape(-1))
        partial = self.inner.gather_combine(table, self._part(ids), self._part(seg), num_segments, w)
        partial = partial.contiguous()
        self._collective("all_reduce (gather_combine)",
                         lambda: self._dist.all_reduce(partial, op=self._dist.ReduceOp.SUM))
        return partial

    def update_rows(
        self,
        tables: Sequence[ShardedTable],
        ids: Any,
        grads: Any,
        fn: Callable[..., tuple[Any, ...]],
        *,
        grad_index: Any = None,
        grad_weights: Any = None,
        values: Sequence[Any] = (),
    ) -> list[ShardedTable]:
        COLLECTIVE_CALLS[0] += 1
        if not tables:
            return []
        ids = self._ids(ids, tables[0])
        grads = self.inner.asarray(grads)
        if grad_index is None:
            if grads.ndim >= 1 and grads.shape[0] == ids.shape[0]:
                grads = self._part(grads)
            else:  # the wrapped backend's shape error, on every rank alike
                return self.inner.update_rows(tables, ids, grads, fn, values=values)
            return self.inner.update_rows(tables, self._part(ids), grads, fn, values=values)
        index = self._part(self.inner.asarray(grad_index).reshape(-1))
        w = None if grad_weights is None else self._part(self.inner.asarray(grad_weights).reshape(-1))
        return self.inner.update_rows(tables, self._part(ids), grads, fn, grad_index=index, grad_weights=w,
                                      values=values)

    # ``update_rows_in_order`` is the protocol's own (occurrence rounds through the split
    # ``update_rows`` above): every rank computes the same rounds from the same whole input.

    # -- processes: the wrapped backend's collectives --------------------------------------------
    @property
    def processes(self) -> int:
        return self.inner.processes

    def agree(self, status: int = 0) -> tuple[int, ...]:
        COLLECTIVE_CALLS[0] += 1
        return self.inner.agree(status)

    # -- compilation and the dense side: passed through ----------------------------------------
    def compile(self, fn: Callable, **options: Any) -> Callable:
        return self.inner.compile(fn, **options)

    def make_mesh(self, dim_names: Sequence[str], shape: Sequence[int], devices: Any = None) -> Any:
        return self.inner.make_mesh(dim_names, shape, devices)

    def place(self, value: Any, layout: Any) -> Any:
        return self.inner.place(value, layout)

    def sharding_of(self, value: Any) -> Any:
        return self.inner.sharding_of(value)

    def value_and_grad(self, fn: Callable[..., Any], values: Sequence[Any]) -> tuple[Any, list[Any]]:
        return self.inner.value_and_grad(fn, values)


def register() -> None:
    """Make ``torch-ranks`` selectable (``me.get_backend("torch-ranks")``)."""
    from meshembed.backend import registry

    if BACKEND_NAME not in registry._extra:
        registry.register_backend(BACKEND_NAME, RanksBackend)


# -- one rank's process group --------------------------------------------------------------------
@dataclasses.dataclass
class RankContext:
    rank: int
    world: int
    store: Any
    pg_timeout_s: float

    @property
    def sync_timeout_s(self) -> float:
        return self.pg_timeout_s + SYNC_SLACK_S


_CONTEXT: RankContext | None = None


def in_rank() -> bool:
    """Whether this process was started as one rank of a group (the torchrun variables)."""
    return all(os.environ.get(k) for k in _ENV_KEYS)


def from_env() -> RankContext | None:
    """Initialise the gloo process group from the torchrun variables, once per process, and
    register ``torch-ranks``; None when this process is not a rank."""
    global _CONTEXT
    if _CONTEXT is not None or not in_rank():
        return _CONTEXT
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pg_timeout = float(os.environ.get(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S))
    sync = timedelta(seconds=pg_timeout + SYNC_SLACK_S)
    # torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT; otherwise rank 0 does.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent), timeout=sync)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
    register()
    _CONTEXT = RankContext(rank, world, dist.PrefixStore(_KEY, store), pg_timeout)
    return _CONTEXT


# -- lockstep: the pytest plugin every rank loads ------------------------------------------------
def _short(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)[:600]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:  # a skip
        return str(report.longrepr[2])[:600]
    return str(report.longrepr or "")[-600:]


def _outcome(report: Any) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    return report.outcome


class Lockstep:
    """pytest plugin: the ranks run the same tests and agree on every outcome."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.seq = 0
        self.broken: str | None = None  # why the ranks can no longer be trusted to pair up
        self.peer_lost = False  # a rank stopped answering through the store (died or hung)
        self.counts: dict[str, int] = {}
        self.others: dict[int, dict] = {}

    # store helpers -------------------------------------------------------------------------
    def _exchange(self, key: str, payload: dict) -> list[dict | None]:
        """Everyone's payload for ``key`` (None for a rank that did not answer in time)."""
        store, me_ = self.ctx.store, self.ctx.rank
        store.set(f"{key}/{me_}", json.dumps(payload))
        out: list[dict | None] = []
        for r in range(self.ctx.world):
            if r == me_:
                out.append(payload)
                continue
            try:
                out.append(json.loads(store.get(f"{key}/{r}")))
            except Exception as exc:  # noqa: BLE001 - a dead peer or store: reported below
                out.append(None)
                self.peer_lost = True
                self.broken = self.broken or f"rank {r} did not report {key!r} within {self.ctx.sync_timeout_s:.0f}s ({exc})"
        return out

    # hooks ---------------------------------------------------------------------------------
    def pytest_report_header(self, config) -> str:
        return (f"meshembed conformance over torch.distributed: rank {self.ctx.rank} of {self.ctx.world} (gloo, "
                f"process-group timeout {self.ctx.pg_timeout_s:.0f}s); rank 0 reports for all")

    def pytest_collection_finish(self, session) -> None:
        ids = [item.nodeid for item in session.items]
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
        got = self._exchange("collected", {"digest": digest, "n": len(ids)})
        if any(g is None or g["digest"] != digest for g in got):
            counts = ", ".join(f"rank {r}: {'?' if g is None else g['n']}" for r, g in enumerate(got))
            _abort(f"the ranks collected different tests ({counts}); every rank must run the same "
                        "tests in the same order (same arguments, no -p cacheprovider/--lf on some ranks)")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        # One exchange per test: at "call", or at "setup" when the call will not run.
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self._agree(item, call, report)
        return report

    def _agree(self, item, call, report) -> None:
        import torch.distributed as dist

        from meshembed_torch.distributed import RankFailureError

        self.seq += 1
        if self.broken:
            return
        exc = None if call.excinfo is None else call.excinfo.value
        dist_error = isinstance(exc, (RankFailureError, dist.DistError)) or (
            isinstance(exc, RuntimeError)  # gloo's own timeouts/errors, raised inside torch.distributed
            and any("torch/distributed/" in str(entry.path).replace(os.sep, "/") for entry in call.excinfo.traceback))
        mine = {"nodeid": item.nodeid, "outcome": _outcome(report), "collectives": COLLECTIVE_CALLS[0],
                "dist_error": dist_error, "message": _short(report) if not report.passed else ""}
        got = self._exchange(f"test/{self.seq}", mine)
        lines = []
        for r, g in enumerate(got):
            if g is None:
                lines.append(f"rank {r}: no answer")
            elif g["nodeid"] != item.nodeid:
                lines.append(f"rank {r}: was at another test, {g['nodeid']}")
            elif g["outcome"] != mine["outcome"] or g["outcome"] == "failed":
                lines.append(f"rank {r}: {g['outcome']}" + (f" — {g['message']}" if g["message"] else ""))
        outcomes = {None if g is None else (g["nodeid"], g["outcome"]) for g in got}
        # A test that failed on some ranks only is failed everywhere, and the run goes on as long
        # as every rank made the same number of backend calls (the ranks are still paired up);
        # otherwise — or after a failed collective — later collectives would pair wrongly.
        diverged = (
            any(g is None or g["nodeid"] != item.nodeid for g in got)
            or len({g["collectives"] for g in got}) > 1
            or any(g["dist_error"] for g in got)
        )
        if diverged:
            self.broken = self.broken or (
                f"the ranks diverged at {item.nodeid} (a rank did not answer, the ranks made different "
                "numbers of backend calls, or a collective failed), so later collectives would not pair up")
            item.session.shouldstop = f"stopped: {self.broken}"
        if len(outcomes) > 1:  # fail the test on every rank, so rank 0 reports the others' failures
            text = "outcome on each rank differs:\n  " + "\n  ".join(lines)
            if report.failed:
                report.sections.append(("ranks", text))
            else:
                report.outcome = "failed"
                report.longrepr = text
                if hasattr(report, "wasxfail"):
                    del report.wasxfail
        elif report.failed and len(lines) > 1:
            report.sections.append(("ranks", "failed on every rank:\n  " + "\n  ".join(lines)))

    def pytest_runtest_logreport(self, report) -> None:
        outcome = _outcome(report)
        if report.when == "call" or not report.passed:
            key = "error" if report.failed and report.when != "call" else outcome
            self.counts[key] = self.counts.get(key, 0) + 1

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        mine = {"counts": self.counts, "exitstatus": int(exitstatus), "broken": self.broken}
        if self.peer_lost:
            got: list[dict | None] = [mine if r == self.ctx.rank else None for r in range(self.ctx.world)]
        else:
            got = self._exchange("final", mine)
        self.others = {r: g for r, g in enumerate(got)}
        bad = [r for r, g in enumerate(got) if g is None or g["exitstatus"] not in (0, 5)
               or g["counts"].get("failed") or g["counts"].get("error")]
        if bad and session.exitstatus == 0:
            session.exitstatus = 1  # another rank's failure fails this rank too
        # rank 0 hosts the store: it leaves last, once every rank has written its result
        self.ctx.store.set(f"done/{self.ctx.rank}", "1")
        if self.ctx.rank == 0 and not self.peer_lost:
            try:
                self.ctx.store.wait([f"done/{r}" for r in range(self.ctx.world)],
                                    timedelta(seconds=self.ctx.sync_timeout_s))
            except Exception:  # noqa: BLE001 - a rank died at the very end; already reported
                pass

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.ctx.rank != 0:
            return
        tr = terminalreporter
        tr.section(f"meshembed conformance: {self.ctx.world} ranks")
        for r in range(self.ctx.world):
            g = self.others.get(r)
            if g is None:
                tr.write_line(f"rank {r}: no result (died or hung)")
                continue
            counts = ", ".join(f"{v} {k}" for k, v in sorted(g["counts"].items())) or "no tests"
            tr.write_line(f"rank {r}: {counts}; pytest exit status {g['exitstatus']}")
        if self.broken:
            tr.write_line(f"ranks stopped early: {self.broken}")

    def pytest_unconfigure(self, config) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and not self.broken:
            dist.destroy_process_group()


def _abort(msg: str) -> None:
    pytest.exit(msg, returncode=pytest.ExitCode.USAGE_ERROR)


# -- the launcher --------------------------------------------------------------------------------
@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed after the deadline (hung)
    log: pathlib.Path | None  # None for rank 0 when it writes to this process's output
    junit: pathlib.Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    world: int,
    pytest_args: Sequence[str] = (),
    *,
    workdir: str | os.PathLike | None = None,
    deadline_s: float = 1800.0,
    pg_timeout_s: float | None = None,
    rank0_to_stdout: bool = True,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run the conformance suite as ``world`` gloo ranks on loopback; one result per rank.

    Every rank runs ``python -m pytest <suite> <pytest_args>`` with the torchrun variables
    set, ``OMP_NUM_THREADS=1``, its own ``--basetemp`` and ``--junitxml`` under ``workdir``;
    ranks other than 0 (and rank 0 too unless ``rank0_to_stdout``) write their output to
    ``workdir/rank<r>.log``. A rank still running ``deadline_s`` after the start, or 60 s
    past the process-group timeout after another rank exited, is killed (returncode None).
    """
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="meshembed-ranks-"))
    work.mkdir(parents=True, exist_ok=True)
    suite = pathlib.Path(__file__).parent
    args = list(pytest_args)
    if not any(not a.startswith("-") and (os.path.exists(a.split("::")[0])) for a in args):
        args = [str(suite)] + args
    port = free_port()
    base_env = dict(os.environ if env is None else env)
    base_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world))
    base_env.setdefault("OMP_NUM_THREADS", "1")
    base_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if pg_timeout_s is not None:
        base_env[PG_TIMEOUT_ENV] = str(pg_timeout_s)
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    pg_timeout = float(base_env.get(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S))
    procs, results, files = [], [], []
    for r in range(world):
        rank_env = dict(base_env, RANK=str(r), LOCAL_RANK=str(r))
        junit = work / f"rank{r}.xml"
        cmd = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider",
               f"--basetemp={work / f'tmp{r}'}", f"--junitxml={junit}"]
        if r == 0 and rank0_to_stdout:
            out, log = None, None
        else:
            log = work / f"rank{r}.log"
            out = open(log, "w")  # noqa: SIM115 - closed below
            files.append(out)
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=subprocess.STDOUT if out else None))
        results.append(RankResult(r, None, log, junit))
    start = time.monotonic()
    first_exit: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_exit is None and any(p.poll() is not None for p in procs):
                first_exit = now
            late = first_exit is not None and now - first_exit > pg_timeout + SYNC_SLACK_S + 60
            if now - start > deadline_s or late:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in files:
            f.close()
    for res, p in zip(results, procs):
        res.returncode = p.returncode if p.returncode is not None and p.returncode >= 0 else None
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.distributed",
        description="Run the conformance suite on the torch backend over N gloo ranks on loopback "
                    "(backend 'torch-ranks'). Arguments after -- go to pytest on every rank.")
    parser.add_argument("-n", "--nproc", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--workdir", default=None, help="logs, junit XML and temp dirs per rank (default: a new temp dir)")
    parser.add_argument("--deadline", type=float, default=1800.0, help="kill every rank after this many seconds")
    parser.add_argument("--pg-timeout", type=float, default=None,
                        help=f"process-group timeout in seconds (default ${PG_TIMEOUT_ENV} or {DEFAULT_PG_TIMEOUT_S:.0f})")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args, unknown = parser.parse_known_args(argv)
    extra = unknown + extra
    if not any(a in ("-q", "-v", "-qq", "-vv") for a in extra):
        extra = ["-q"] + extra
    start = time.monotonic()
    results = launch(args.nproc, extra, workdir=args.workdir, deadline_s=args.deadline, pg_timeout_s=args.pg_timeout)
    elapsed = time.monotonic() - start
    ok = True
    print(f"\n== {args.nproc} ranks, {elapsed:.1f}s ==")
    for res in results:
        status = "hung (killed)" if res.returncode is None else f"exit {res.returncode}"
        where = f" — log {res.log}" if res.log else ""
        print(f"rank {res.rank}: {status}{where}")
        if res.returncode != 0:
            ok = False
            if res.log and res.log.exists():
                tail = res.log.read_text(errors="replace").splitlines()[-40:]
                print("  | " + "\n  | ".join(tail))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
