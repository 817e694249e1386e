"""A small recommender trained with meshembed's torch backend on several ranks.

Embedding tables (users, items) are sharded row-wise over the ranks of a ``torch.distributed``
process group (MOD placement): each rank holds only its own rows, looks up its own part of
the batch through all-to-all, and the owner of a row sums the gradients of every rank before
one optimizer step. The dense tower is ordinary torch under ``DistributedDataParallel``.

Launch it either way (gloo on CPU; NCCL when ``--device cuda``):

    torchrun --nproc-per-node 2 examples/torch_distributed.py
    python examples/torch_distributed.py --world-size 2        # torch.multiprocessing.spawn
    python examples/torch_distributed.py --world-size 1        # one process, no process group
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

USERS, ITEMS, DIM = 200, 100, 16
# Hidden per-id preferences the model has to recover from clicks.
_TASTE = np.random.default_rng(7)
USER_TASTE, ITEM_APPEAL = _TASTE.standard_normal(USERS), _TASTE.standard_normal(ITEMS)


def config(batch_per_rank: int) -> me.EmbeddingConfig:
    """Per-rank batch geometry: every rank enqueues ``batch_per_rank`` samples."""
    return me.EmbeddingConfig(
        tables=[
            me.TableConfig(name="user", vocabulary_size=USERS, dimension=DIM, combiner="mean",
                           optimizer=me.embedding.Adagrad(learning_rate=0.2)),
            me.TableConfig(name="item", vocabulary_size=ITEMS, dimension=DIM, combiner="sum",
                           optimizer=me.embedding.Adagrad(learning_rate=0.2)),
        ],
        features=[
            me.FeatureConfig(table="user", input_shape=(batch_per_rank,), name="user_id"),
            me.FeatureConfig(table="item", input_shape=(batch_per_rank,), name="item_id"),
            me.FeatureConfig(table="item", input_shape=(batch_per_rank,), name="recent_items"),
        ],
        sharding_strategy="mod",
    )


def synthetic_batch(rng: np.random.Generator, batch: int):
    """A click when the user's taste plus the item's appeal is positive."""
    users = rng.integers(0, USERS, batch)
    items = rng.integers(0, ITEMS, batch)
    recent = me.RaggedIds.from_lists([list(rng.integers(0, ITEMS, rng.integers(0, 5))) for _ in range(batch)])
    labels = (USER_TASTE[users] + ITEM_APPEAL[items] > 0).astype(np.float32)
    return [users, items, recent], torch.from_numpy(labels)


def train(rank: int, world: int, steps: int, batch: int, device: str, ckpt: pathlib.Path | None) -> float:
    torch.manual_seed(0)
    emb = me.TPUEmbedding(config(batch), backend="torch", seed=0)  # num_shards = world size
    tower = torch.nn.Sequential(torch.nn.Linear(3 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    if world > 1:
        tower = torch.nn.parallel.DistributedDataParallel(tower)
    opt = torch.optim.Adam(tower.parameters(), lr=0.01)
    rng = np.random.default_rng(1000 + rank)  # each rank reads its own part of the data
    loss_value = float("nan")
    for step in range(steps):
        features, labels = synthetic_batch(rng, batch)
        emb.enqueue(features)
        acts = [a.requires_grad_(True) for a in emb.dequeue()]  # plain tensors from the backend
        logits = tower(torch.cat(acts, dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.device))
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the tower's gradients
        opt.step()
        # Each rank's loss is its mean; the engine sums row gradients over ranks, so divide
        # by the world size to train on the global mean (spec: the engine never averages).
        emb.apply_gradients([a.grad / world for a in acts])
        loss_value = float(loss.detach())
        if rank == 0 and (step % 20 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss_value:.4f}", flush=True)
    if ckpt is not None:
        # save() gathers every table (a collective), so every rank calls it; rank 0 writes the
        # one checkpoint and every rank returns once it is complete. Restore reads it anywhere.
        emb.save(ckpt / "embedding")
    return loss_value


def _init(rank: int, world: int, device: str, timeout_s: float) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _init(rank, world, args.device, args.timeout)
    try:
        train(rank, world, args.steps, args.batch, args.device, args.checkpoint)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    ap.add_argument("--checkpoint", type=pathlib.Path, default=None,
                    help="directory for the final checkpoint (default: a temporary one)")
    args = ap.parse_args()
    if args.checkpoint is None:
        args.checkpoint = pathlib.Path(tempfile.mkdtemp(prefix="meshembed_torch_"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.world_size)))

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        if args.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        try:
            train(rank, world, args.steps, args.batch, args.device, args.checkpoint)
        finally:
            dist.destroy_process_group()
    elif args.world_size > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(args.world_size, port, args), nprocs=args.world_size)
    else:
        train(0, 1, args.steps, args.batch, args.device, args.checkpoint)
    print(f"checkpoint(s) under {args.checkpoint}")


if __name__ == "__main__":
    main()
