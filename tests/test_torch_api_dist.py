"""me.torch.EmbeddingCollection over real gloo ranks; the DLRM example in one process.

The 2-rank run trains the module and ``TPUEmbedding(backend="torch")`` side by side on each
rank (bit-identical tables), then the module's state dict — whole logical tables — is saved
and loaded again with 4 ranks and with 1 process: every load gives back the same state dict.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Multi-process runs must pass on a loaded 2-core machine: every rank runs one thread, the
# ranks meet through a fresh file (no TCP port to race for), collectives wait at most
# PG_TIMEOUT_S, the whole run at most RUN_TIMEOUT_S (then every process of it is killed and the
# test fails with its output), and each rank destroys its process group before it exits (a
# rank leaving gloo's threads running aborts with "terminate called without an active exception").
PG_TIMEOUT_S, RUN_TIMEOUT_S = 300, 900

WORKER = textwrap.dedent('''
    import os, sys, pathlib, traceback
    from datetime import timedelta
    import numpy as np, torch, torch.distributed as dist
    import meshembed as me

    VOCAB, DIM, B = 41, 4, 5

    def cfg():
        return me.EmbeddingConfig(
            tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.Adadelta(learning_rate=1.0, rho=0.9,
                                   epsilon=1e-6), combiner="mean")],
            features=[me.FeatureConfig("t", (B,), name="bag"), me.FeatureConfig("t", (B, 2), name="seq")])

    def work(rank, world, mode, tmp):
        ec = me.torch.EmbeddingCollection(cfg(), seed=2)
        assert ec.engine.num_shards == world
        if mode == "train":
            emb = me.TPUEmbedding(cfg(), backend="torch", seed=2)
            rng = np.random.default_rng(10 + rank)
            for _ in range(3):
                lengths = rng.integers(0, 4, B)
                values = rng.integers(0, VOCAB, int(lengths.sum()))
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                seq = rng.integers(0, VOCAB, (B, 2))
                out = ec({"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.from_numpy(seq)})
                sum(((a - 0.5) ** 2).sum() for a in out.values()).backward()
                emb.enqueue([me.RaggedIds(offsets, values), seq])
                acts = [a.requires_grad_() for a in emb.dequeue()]
                sum(((a - 0.5) ** 2).sum() for a in acts).backward()
                emb.apply_gradients([a.grad for a in acts])
            for k, v in emb.retrieve_parameters("t").items():
                np.testing.assert_array_equal(ec.engine.retrieve_parameters("t")[k], v)
        else:
            ec.load_state_dict(torch.load(tmp / "sd2.pt", weights_only=True))
        sd = ec.state_dict()
        if rank == 0:
            torch.save(sd, tmp / f"sd{world}.pt")

    def run(rank, world, mode, tmp, timeout_s):
        torch.set_num_threads(1)  # spawned ranks do not inherit the parent's setting
        tmp = pathlib.Path(tmp)
        try:
            dist.init_process_group("gloo", init_method=(tmp / f"rendezvous-{mode}-{world}").as_uri(), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
            work(rank, world, mode, tmp)
            dist.barrier()
        except BaseException:
            print(f"rank {rank} of {world} ({mode}) failed:\\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    if __name__ == "__main__":
        world, mode, tmp, timeout_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
        torch.multiprocessing.spawn(run, args=(world, mode, tmp, timeout_s), nprocs=world)
        print("OK")
''')


def _run_bounded(args: list[str], what: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run a multi-process job in its own session; past RUN_TIMEOUT_S every process of it is
    killed and the test fails with what it printed (never a hang, never an orphaned rank)."""
    env = {**os.environ, "MESHEMBED_TORCH_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish within {RUN_TIMEOUT_S} s; killed.\nstdout:\n{out[-3000:]}\n"
                    f"stderr:\n{err[-5000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _spawn(tmp: pathlib.Path, world: int, mode: str) -> None:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    out = _run_bounded([sys.executable, str(script), str(world), mode, str(tmp), str(PG_TIMEOUT_S)],
                       f"{world} ranks ({mode})", ROOT)
    assert out.returncode == 0 and "OK" in out.stdout, (
        f"{world} ranks ({mode}) exited with {out.returncode}:\n{out.stderr[-5000:]}")


def test_state_dict_round_trips_over_2_4_and_1_ranks(tmp_path):
    import meshembed as me

    _spawn(tmp_path, 2, "train")  # also: module == engine on every rank
    _spawn(tmp_path, 4, "load")
    sd2 = torch.load(tmp_path / "sd2.pt", weights_only=True)
    sd4 = torch.load(tmp_path / "sd4.pt", weights_only=True)
    assert sorted(sd2) == ["t.accumulators", "t.parameters", "t.updates"]
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 41, 4, optimizer=me.embedding.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6),
                               combiner="mean")],
        features=[me.FeatureConfig("t", (5,), name="bag"), me.FeatureConfig("t", (5, 2), name="seq")])
    one = me.torch.EmbeddingCollection(cfg)
    one.load_state_dict(sd4)
    fresh = me.torch.EmbeddingCollection(cfg, seed=2).state_dict()
    assert not torch.equal(sd2["t.parameters"], fresh["t.parameters"])  # training changed it
    for k in sd2:
        torch.testing.assert_close(sd4[k], sd2[k], rtol=0, atol=0)
        torch.testing.assert_close(one.state_dict()[k], sd2[k], rtol=0, atol=0)


def test_dlrm_example_compiled_loss_falls(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import torch_dlrm
    finally:
        sys.path.pop(0)
    torch._dynamo.reset()
    ckpt = tmp_path / "dlrm.pt"
    losses = torch_dlrm.train(steps=60, batch=64, compile=True, checkpoint=ckpt, log=False)
    assert np.mean(losses[-15:]) < np.mean(losses[:15]) - 0.05, losses
    held_out = torch_dlrm.evaluate(ckpt)
    assert held_out < 0.66, held_out


def test_dlrm_example_on_two_gloo_ranks(tmp_path):
    """The example as a user launches it: 2 ranks (DDP dense part, sharded tables), the state
    dicts saved by the ranks and restored in one process. Eager here (the compiled run is the
    1-process test above; both were run compiled on 2 ranks by hand)."""
    ckpt = tmp_path / "dlrm.pt"
    out = _run_bounded([sys.executable, str(ROOT / "examples" / "torch_dlrm.py"), "--world-size", "2", "--steps",
                        "60", "--eager", "--checkpoint", str(ckpt)], "the DLRM example on 2 ranks", ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0] - 0.05, out.stdout
    assert "restored in one process" in out.stdout and ckpt.exists()


def test_tables_do_not_keep_the_process_group_alive(tmp_path):
    """``dist.destroy_process_group()`` ends the group even while meshembed tables live: a
    group a library object kept was torn down at interpreter exit, where gloo's worker
    threads aborted the rank ("terminate called without an active exception") about one
    run in six; and after a re-init the tables use the new group."""
    import gc
    import weakref

    import meshembed as me

    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 10, 4, optimizer=me.embedding.SGD(learning_rate=0.5))],
                             features=[me.FeatureConfig("t", (3,), name="f")])
    ids, grad = np.array([1, 2, 3]), np.ones((3, 4), np.float32)
    dist = torch.distributed
    assert not dist.is_initialized()
    try:
        dist.init_process_group("gloo", init_method=(tmp_path / "first").as_uri(), rank=0, world_size=1)
        world = weakref.ref(dist.group.WORLD)
        emb = me.TPUEmbedding(cfg, backend="torch", seed=0)
        ec = me.torch.EmbeddingCollection(cfg, seed=0)
        before = emb.retrieve_parameters("t")["parameters"].copy()
        emb.enqueue([ids])
        emb.dequeue()
        emb.apply_gradients([grad])
        ec.state_dict()
        assert ec.engine.state.tables[0][0].mesh.get_group() is dist.group.WORLD  # table.mesh, built on request
        dist.destroy_process_group()
        gc.collect()
        assert world() is None, "a meshembed object kept the destroyed process group alive"
        dist.init_process_group("gloo", init_method=(tmp_path / "second").as_uri(), rank=0, world_size=1)
        emb.enqueue([ids])
        emb.dequeue()
        emb.apply_gradients([grad])
        np.testing.assert_allclose(emb.retrieve_parameters("t")["parameters"][1:4], before[1:4] - 1.0, rtol=1e-6)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
