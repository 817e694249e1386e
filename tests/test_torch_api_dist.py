"""me.torch.EmbeddingCollection over real gloo ranks; the DLRM example in one process.

The 2-rank run trains the module and ``TPUEmbedding(backend="torch")`` side by side on each
rank (bit-identical tables), then the module's state dict — whole logical tables — is saved
and loaded again with 4 ranks and with 1 process: every load gives back the same state dict.
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

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent('''
    import os, sys, pathlib
    from datetime import timedelta
    import numpy as np, torch, torch.distributed as dist
    import meshembed as me

    VOCAB, DIM, B = 41, 4, 5

    def cfg():
        return me.EmbeddingConfig(
            tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.Adadelta(learning_rate=1.0, rho=0.9,
                                   epsilon=1e-6), combiner="mean")],
            features=[me.FeatureConfig("t", (B,), name="bag"), me.FeatureConfig("t", (B, 2), name="seq")])

    def run(rank, world, port, mode, tmp):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        try:
            tmp = pathlib.Path(tmp)
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
            dist.barrier()
        finally:
            dist.destroy_process_group()

    if __name__ == "__main__":
        world, port, mode, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
        torch.set_num_threads(1)
        torch.multiprocessing.spawn(run, args=(world, port, mode, tmp), nprocs=world)
        print("OK")
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp: pathlib.Path, world: int, mode: str) -> None:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MESHEMBED_TORCH_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(script), str(world), str(_free_port()), mode, str(tmp)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


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
    env = {**os.environ, "MESHEMBED_TORCH_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_dlrm.py"), "--world-size", "2", "--steps",
                          "60", "--eager", "--checkpoint", str(ckpt)], capture_output=True, text=True, timeout=600,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0] - 0.05, out.stdout
    assert "restored in one process" in out.stdout and ckpt.exists()
