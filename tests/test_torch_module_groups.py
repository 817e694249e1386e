"""me.torch.EmbeddingCollection over a process *subgroup*: 4 gloo ranks on loopback, two
groups of 2 (ranks [0, 2] and [1, 3]: neither is 0..k-1) each training its own module at the
same time. Each group's tables are row-sharded over its 2 ranks only, and its result equals a
1-process run of the same module on the group's whole batch (the 2 ranks' batches
concatenated in group-rank order; gradients are summed across a group's ranks) within float32
rounding; its checkpoint, written by the group's rank 0, restores over the group and in one
process bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import meshembed as me  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, STEPS = 5, 3
GROUPS = {"a": [0, 2], "b": [1, 3]}


def cfg(group: str, batch: int) -> me.EmbeddingConfig:
    """Group a: Adagrad, mean; group b: SGD, sum, another vocabulary (different modules)."""
    if group == "a":
        table = me.TableConfig("t", 41, 4, optimizer=me.embedding.Adagrad(learning_rate=0.1), combiner="mean")
    else:
        table = me.TableConfig("u", 23, 3, optimizer=me.embedding.SGD(learning_rate=0.5), combiner="sum")
    return me.EmbeddingConfig(tables=[table], features=[me.FeatureConfig(table.name, (batch,), name="bag"),
                                                       me.FeatureConfig(table.name, (batch, 2), name="seq")])


def group_batches(group: str) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Per step, per group rank: (values, offsets, seq) of B samples."""
    vocab = cfg(group, B).tables[0].vocabulary_size
    rng = np.random.default_rng(ord(group))
    out = []
    for _ in range(STEPS):
        per_rank = []
        for _ in range(2):
            lengths = rng.integers(0, 4, B)
            values = rng.integers(0, vocab, int(lengths.sum()))
            per_rank.append((values, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, vocab, (B, 2))))
        out.append(per_rank)
    return out


def loss(out) -> torch.Tensor:
    return sum(((a - 0.5) ** 2).sum() for a in out.values())


def feats(values, offsets, seq) -> dict:
    return {"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.from_numpy(seq)}


WORKER = textwrap.dedent('''
    import os, sys, pathlib, traceback
    from datetime import timedelta
    import numpy as np, torch, torch.distributed as dist
    import meshembed as me
    sys.path.insert(0, os.getcwd())
    from tests.test_torch_module_groups import GROUPS, B, cfg, group_batches, loss, feats

    def run(rank, world, port, tmp):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        tmp = pathlib.Path(tmp)
        try:
            groups = {name: dist.new_group(ranks) for name, ranks in GROUPS.items()}  # every rank, same order
            name = "a" if rank in GROUPS["a"] else "b"
            other = "b" if name == "a" else "a"
            try:
                me.torch.EmbeddingCollection(cfg(other, B), process_group=groups[other])
            except me.ConfigError as exc:
                (tmp / f"refused{rank}.txt").write_text(str(exc))
            ec = me.torch.EmbeddingCollection(cfg(name, B), process_group=groups[name], seed=2)
            grank = dist.get_rank(groups[name])
            assert ec.engine.num_shards == 2 and ec.engine.backend.processes == 2, ec.engine.num_shards
            for step in group_batches(name):
                loss(ec(feats(*step[grank]))).backward()
            sd = ec.state_dict()  # collective over the group: whole logical tables
            ec.save(tmp / f"ckpt_{name}")
            back = me.torch.EmbeddingCollection.restore(tmp / f"ckpt_{name}", process_group=groups[name])
            assert back.engine.num_shards == 2
            for k, v in back.state_dict().items():
                assert torch.equal(v, sd[k]), k
            if grank == 0:
                torch.save(sd, tmp / f"sd_{name}.pt")
            try:  # rank-sharded tables stay where the group's collectives run
                ec._move_tables(torch.device("cpu"))
            except me.ConfigError as exc:
                (tmp / f"move{rank}.txt").write_text(str(exc))
            rows = ec.engine.state.tables[0][0].data.shape[0]  # this rank's rows of the one table
            (tmp / f"rows{rank}.txt").write_text(str(rows))
            dist.barrier()
        except BaseException:
            (tmp / f"error{rank}.txt").write_text(traceback.format_exc())
            raise
        finally:
            dist.destroy_process_group()

    if __name__ == "__main__":
        port, tmp = int(sys.argv[1]), sys.argv[2]
        torch.set_num_threads(1)
        torch.multiprocessing.spawn(run, args=(4, port, tmp), nprocs=4)
        print("OK")
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_subgroups_train_their_own_modules_equal_to_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MESHEMBED_TORCH_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(script), str(_free_port()), str(tmp_path)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=ROOT)
    errors = "".join(p.read_text() for p in tmp_path.glob("error*.txt"))
    assert out.returncode == 0 and "OK" in out.stdout, errors or out.stderr[-3000:]
    for rank in range(4):  # a rank outside a group cannot build a module over it
        assert "is not one of its ranks" in (tmp_path / f"refused{rank}.txt").read_text()
        assert "sharded over torch.distributed ranks stay on their device" in (tmp_path / f"move{rank}.txt").read_text()
    for name, ranks in GROUPS.items():
        # row-sharded over the group's 2 ranks: each holds about half the rows
        vocab = cfg(name, B).tables[0].vocabulary_size
        assert [int((tmp_path / f"rows{r}.txt").read_text()) for r in ranks] == [(vocab + 1) // 2, vocab // 2]
        one = me.torch.EmbeddingCollection(cfg(name, 2 * B), num_shards=2, seed=2)
        for step in group_batches(name):
            (v0, o0, s0), (v1, o1, s1) = step
            whole = (np.concatenate([v0, v1]), np.concatenate([o0, o1[1:] + o0[-1]]), np.concatenate([s0, s1]))
            loss(one(feats(*whole))).backward()
        want = one.state_dict()
        got = torch.load(tmp_path / f"sd_{name}.pt", weights_only=True)
        assert sorted(got) == sorted(want)
        assert not torch.equal(got[f"{cfg(name, B).tables[0].name}.parameters"],
                               me.torch.EmbeddingCollection(cfg(name, B), seed=2).state_dict()[
                                   f"{cfg(name, B).tables[0].name}.parameters"])  # trained
        for k in want:  # float32 rounding: an owner adds each rank's partial sum of a row's
            # gradients, one process sums them in batch order (measured: <= 1 ulp, Adagrad only)
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=f"group {name}: {k}")
        restored = me.torch.EmbeddingCollection.restore(tmp_path / f"ckpt_{name}")
        for k in want:
            torch.testing.assert_close(restored.state_dict()[k], got[k], rtol=0, atol=0, msg=f"checkpoint {k}")
