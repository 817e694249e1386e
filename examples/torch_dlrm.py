"""A small DLRM trained with ``me.torch``: the embedding tables' optimizer runs in backward.

* bottom MLP over 8 dense features; ``me.torch.EmbeddingCollection`` with a table shared by three
  features — an item id (dense ``LongTensor``), a weighted multi-hot history (``(values,
  offsets)`` + per-id weights) and a sequence of the last 4 items (``input_shape=(B, 4)``) — and
  a user table; pairwise dot-product interaction; top MLP; BCE loss.
* ``torch.compile(fullgraph=True)`` over the module, the dense model and the loss;
  ``loss.backward()`` runs the compiled backward, whose last op applies Adagrad to the looked-up
  rows; ``me.torch.Adadelta`` steps the dense part (``DistributedDataParallel`` on several ranks).
* At the end every rank saves: ``state_dict()`` holds the whole logical tables, so rank 0 writes
  one ``torch.save`` file that any number of ranks (or one process) loads.

    python examples/torch_dlrm.py                      # one process
    python examples/torch_dlrm.py --world-size 2       # 2 gloo ranks (torch.multiprocessing)
    torchrun --nproc-per-node 2 examples/torch_dlrm.py # the same under torchrun
    python examples/torch_dlrm.py --eager              # no torch.compile

With several ranks each one reads its own samples; the engine *sums* a row's gradients over the
ranks (TPU and torchrec row-wise semantics) while DDP averages the dense ones.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import tempfile
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import meshembed as me

ITEMS, USERS, DIM, DENSE, SEQ = 500, 100, 8, 8, 4
_TRUTH = np.random.default_rng(11)
ITEM_APPEAL, USER_TASTE = _TRUTH.standard_normal(ITEMS), _TRUTH.standard_normal(USERS)
DENSE_W = _TRUTH.standard_normal(DENSE) / np.sqrt(DENSE)


def config(batch: int) -> me.EmbeddingConfig:
    """``batch`` is the per-rank batch (every rank looks up its own samples)."""
    return me.EmbeddingConfig(
        tables=[
            me.TableConfig("items", ITEMS, DIM, optimizer=me.embedding.Adagrad(learning_rate=0.1), combiner="sum"),
            me.TableConfig("users", USERS, DIM, optimizer=me.embedding.Adagrad(learning_rate=0.1), combiner="mean"),
        ],
        features=[
            me.FeatureConfig("items", (batch,), name="item"),
            me.FeatureConfig("items", (batch,), name="history"),
            me.FeatureConfig("items", (batch, SEQ), name="recent"),
            me.FeatureConfig("users", (batch,), name="user"),
        ],
    )


def synthetic_batch(rng: np.random.Generator, batch: int):
    """Click when the item's appeal + the user's taste + a dense signal + the history's mean appeal > 0."""
    item = rng.integers(0, ITEMS, batch)
    user = rng.integers(0, USERS, batch)
    lengths = rng.integers(1, 6, batch)
    hist = rng.integers(0, ITEMS, int(lengths.sum()))
    hist_w = rng.uniform(0.5, 1.5, hist.shape[0]).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    recent = rng.integers(0, ITEMS, (batch, SEQ))
    dense = rng.standard_normal((batch, DENSE)).astype(np.float32)
    hist_mean = np.add.reduceat(ITEM_APPEAL[hist], offsets[:-1]) / lengths
    score = ITEM_APPEAL[item] + USER_TASTE[user] + dense @ DENSE_W + 0.5 * hist_mean
    labels = (score > 0).astype(np.float32)
    feats = {
        "item": torch.from_numpy(item),
        "history": (torch.from_numpy(hist), torch.from_numpy(offsets)),
        "recent": torch.from_numpy(recent),
        "user": torch.from_numpy(user).int(),  # int32 ids are fine too
    }
    return torch.from_numpy(dense), feats, {"history": torch.from_numpy(hist_w)}, torch.from_numpy(labels)


class DenseArch(torch.nn.Module):
    """Bottom MLP, dot-product interaction of every pair of vectors, top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE, 16), torch.nn.ReLU(), torch.nn.Linear(16, DIM))
        n = 1 + 3 + SEQ  # bottom output, item, history, user, each recent position
        self.pairs = torch.triu_indices(n, n, offset=1)
        self.top = torch.nn.Sequential(torch.nn.Linear(DIM + self.pairs.shape[1], 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, item: torch.Tensor, history: torch.Tensor, recent: torch.Tensor,
                user: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.cat([torch.stack([x, item, history, user], dim=1), recent], dim=1)  # [B, n, D]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


class DLRM(torch.nn.Module):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.embedding = me.torch.EmbeddingCollection(config(batch), seed=0)  # sharded over the ranks
        self.dense = DenseArch()

    def forward(self, dense, feats, weights, labels):
        e = self.embedding(feats, weights)
        logits = self.dense(dense, e["item"], e["history"], e["recent"], e["user"])
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def train(rank: int = 0, world: int = 1, steps: int = 60, batch: int = 64, compile: bool = True,
          checkpoint: pathlib.Path | None = None, log: bool = True) -> list[float]:
    torch.manual_seed(0)
    model = DLRM(batch)
    opt = me.torch.Adadelta(model.dense.parameters(), lr=1.0, rho=0.9, eps=1e-6)  # torch.optim's values
    # DDP all-reduces the dense part's gradients (the embedding module has no parameters: its
    # rows are sharded, not replicated). DDP wraps the compiled model: DDP's own forward is
    # host bookkeeping that dynamo cannot trace whole, so it stays outside the graph.
    step_fn = torch.compile(model, fullgraph=True) if compile else model
    if world > 1:
        step_fn = torch.nn.parallel.DistributedDataParallel(step_fn)
    rng = np.random.default_rng(100 + rank)
    losses = []
    for step in range(steps):
        loss = step_fn(*synthetic_batch(rng, batch))
        opt.zero_grad()
        loss.backward()  # dense gradients (DDP all-reduces them) + the embedding update
        opt.step()
        losses.append(float(loss.detach()))
        if log and rank == 0 and (step % 20 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {np.mean(losses[-20:]):.4f}", flush=True)
    if checkpoint is not None:
        # state_dict() gathers whole tables (collective: every rank calls it); rank 0 writes.
        embedding = model.embedding.state_dict()
        dense = model.dense.state_dict()
        if rank == 0:
            torch.save({"embedding": embedding, "dense": dense}, checkpoint)
        if world > 1:
            dist.barrier()
    return losses


def evaluate(checkpoint: pathlib.Path, batch: int = 64, seed: int = 999) -> float:
    """Load a checkpoint (written by any number of ranks) in this process; the loss on new data."""
    saved = torch.load(checkpoint, weights_only=True)
    model = DLRM(batch).eval()
    model.embedding.load_state_dict(saved["embedding"])
    model.dense.load_state_dict(saved["dense"])
    with torch.no_grad():
        return float(model(*synthetic_batch(np.random.default_rng(seed), batch)))


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    try:
        train(rank, world, args.steps, args.batch, not args.eager, args.checkpoint)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=1, help="gloo ranks to spawn (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    ap.add_argument("--checkpoint", type=pathlib.Path, default=None, help="file for the final state dicts")
    args = ap.parse_args()
    if args.checkpoint is None:
        args.checkpoint = pathlib.Path(tempfile.mkdtemp(prefix="meshembed_dlrm_")) / "dlrm.pt"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        try:
            train(rank, world, args.steps, args.batch, not args.eager, args.checkpoint)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return
    elif args.world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(args.world_size, port, args), nprocs=args.world_size)
    else:
        train(0, 1, args.steps, args.batch, not args.eager, args.checkpoint)
    print(f"restored in one process from {args.checkpoint}: held-out loss {evaluate(args.checkpoint, args.batch):.4f}")


if __name__ == "__main__":
    main()
