"""Row-wise model parallelism over ``torch.distributed`` ranks (torchrec's scheme).

Each rank holds the rows of its own shard(s). Ids travel to the rank that owns them and
rows travel back with ``all_to_all_single`` in three exchanges: the per-destination counts
first (so every rank can size its receive buffers), then the ids, then the rows. Whole
tables are only ever gathered by :meth:`RankGroup.all_gather_rows` (checkpoints/retrieve).

Every collective is wrapped so that a peer that died or stopped answering surfaces as a
:class:`RankFailureError` naming the operation, not a bare gloo/NCCL message or a hang:
the process group's own timeout (``init_process_group(timeout=...)``) bounds the wait.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshembed.backend.env import env_int
from meshembed.errors import ConfigError, MeshembedError


class RankFailureError(MeshembedError, RuntimeError):
    """A collective failed: another rank died, crashed or did not answer in time."""


def agree_timeout() -> float:
    """Seconds a rank waits for the others to agree on a call (``MESHEMBED_AGREE_TIMEOUT``,
    read once; default 60)."""
    global _AGREE_TIMEOUT
    if _AGREE_TIMEOUT is None:
        _AGREE_TIMEOUT = float(env_int("MESHEMBED_AGREE_TIMEOUT", 60))
        if _AGREE_TIMEOUT <= 0:
            raise ConfigError(f"Invalid MESHEMBED_AGREE_TIMEOUT={_AGREE_TIMEOUT:g}. Expected seconds > 0.")
    return _AGREE_TIMEOUT


_AGREE_TIMEOUT: float | None = None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class RankGroup:
    """The ranks a table is sharded over, with error-wrapped collectives.

    Holds no reference to the default process group (collectives pass ``group=None``), so
    ``dist.destroy_process_group()`` really ends it: a group kept alive by a library object
    is torn down at interpreter exit, where gloo's worker threads abort the process
    ("terminate called without an active exception"), and a re-initialised world would
    be served by the dead group."""

    def __init__(self, device_type: str, pg: Any = None):
        """``pg``: the user's process group (theirs to keep), or None for the default group."""
        self.device_type = device_type
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)

    @property
    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` ("shard",) the rows are sharded over, built on request."""
        if self.pg is not None:
            from torch.distributed.device_mesh import DeviceMesh

            return DeviceMesh.from_group(self.pg, self.device_type, mesh_dim_names=("shard",))
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world,), mesh_dim_names=("shard",))

    def _run(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (RuntimeError, dist.DistError) as exc:  # DistBackendError, gloo/NCCL errors
            raise RankFailureError(
                f"torch.distributed {what} failed on rank {self.rank} of {self.world}: another "
                "rank probably died or did not reach this step within the process group's "
                "timeout. The tables on this rank are unchanged by the failed step only if the "
                "error came before the owner applied it, so restart every rank from the last "
                f"checkpoint (emb.save / TPUEmbedding.restore). Cause: {exc}"
            ) from exc

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """How many items every rank sends to this one (first all-to-all): row r of
        ``send_counts`` goes to rank r."""
        recv = torch.empty_like(send_counts)
        self._run("all_to_all (counts)", lambda: dist.all_to_all_single(recv, send_counts, group=self.pg))
        return recv

    def all_to_all(self, what: str, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send ``tensor``'s consecutive blocks of ``send[r]`` rows to rank r."""
        out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        self._run(
            f"all_to_all ({what})",
            lambda: dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.pg),
        )
        return out

    def all_ok(self, ok: bool, device: Any) -> bool:
        """Barrier and vote: True when every rank passed ``ok=True``."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        self._run("all_reduce (barrier)", lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg))
        return bool(int(flag.item()))

    def statuses(self, status: int, device: Any) -> tuple[int, ...]:
        """Every rank's ``status``, in rank order (one all-reduce of a ``[world]`` vector in
        which each rank fills its own entry). Waits at most ``agree_timeout()`` seconds: a rank
        that skipped a step (or died) fails every other rank within it, not after the process
        group's timeout (30 minutes by default)."""
        flags = torch.zeros(self.world, dtype=torch.int64, device=device)
        flags[self.rank] = status
        seconds = agree_timeout()
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)
            work.wait(timeout=timedelta(seconds=seconds))
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailureError(
                f"torch.distributed ranks did not all reach the same meshembed call within {seconds:g} s "
                f"(rank {self.rank} of {self.world} waited): another rank probably died, skipped a step or "
                "called something else. Nothing of this call was applied on this rank. Fix: call the same engine "
                "methods in the same order on every rank; restart every rank from the last checkpoint. "
                f"The wait is MESHEMBED_AGREE_TIMEOUT seconds (default 60). Cause: {exc}") from exc
        return tuple(int(v) for v in flags.tolist())

    def all_gather_rows(self, what: str, local: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """Every rank's ``local`` (padded to ``rows`` rows so sizes match)."""
        if local.shape[0] < rows:
            pad = local.new_zeros((rows - local.shape[0],) + tuple(local.shape[1:]))
            local = torch.cat([local, pad])
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self._run(f"all_gather ({what})", lambda: dist.all_gather(parts, local.contiguous(), group=self.pg))
        return parts


class Route:
    """A plan that sends items to their destination ranks and brings answers back.

    ``dest[i]`` is the rank item i goes to. Building the plan costs one all-to-all of
    counts; each :meth:`send` of a payload then costs one all-to-all, and :meth:`reply`
    returns one answer row per received item to where it came from, in input order.
    """

    def __init__(self, group: RankGroup, dest: torch.Tensor, what: str = "route", status: int = 0):
        """``status`` travels with the counts (no extra collective): when any rank's is not 0
        (its input was invalid: ``meshembed.backend.status`` codes) every rank raises
        here, before any payload moves — the failing rank's caller then raises its own error."""
        self.group = group
        n = dest.numel()
        if n > 1 and not bool((dest[1:] >= dest[:-1]).all()):
            self.order: torch.Tensor | None = torch.sort(dest, stable=True)[1]
        else:  # already grouped by rank (DIV placement of sorted ids): no permutation
            self.order = None
        counts = torch.bincount(dest, minlength=group.world).to(torch.int64)
        recv = group.exchange_counts(torch.stack([counts, torch.full_like(counts, int(status))], dim=1))
        if bool(recv[:, 1].any()):
            from meshembed.backend.status import peer_error

            raise peer_error(what, tuple(int(v) for v in recv[:, 1].tolist()))
        self.send_counts: list[int] = counts.tolist()
        self.recv_counts: list[int] = recv[:, 0].tolist()
        self.n = n

    def send(self, what: str, payload: torch.Tensor) -> torch.Tensor:
        """The items other ranks sent here, grouped by source rank."""
        if self.order is not None:
            payload = payload.index_select(0, self.order)
        return self.group.all_to_all(what, payload, self.send_counts, self.recv_counts)

    def reply(self, what: str, answers: torch.Tensor) -> torch.Tensor:
        """Send one answer per received item back; returns answers in input order."""
        back = self.group.all_to_all(what, answers, self.recv_counts, self.send_counts)
        if self.order is None:
            return back
        out = torch.empty_like(back)
        out.index_copy_(0, self.order, back)
        return out

