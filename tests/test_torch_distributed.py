"""Torch backend over real ``gloo`` ranks on loopback (torchrec-style multi-process tests).

Each test spawns 2 or 4 processes (free port, short process-group timeout). A global batch
is split across ranks; the result must equal the NumPy backend run on the whole batch in one
process (gradients are *summed* across ranks, spec §3.1). Workers write their results to
``.npz`` files that the parent compares, so assertion messages come from the parent.
"""

from __future__ import annotations

import os
import pathlib
import socket
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch (pip install 'meshembed[torch]')")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

PG_TIMEOUT_S = 8.0  # the process group's timeout: how long a survivor may wait on a dead peer
VOCAB, DIM = 37, 4
SHARD_CASES = [("mod", 1), ("div", 1), ("mod", 2), ("div", 2), ("mod", 3)]  # num_shards = world * k, or 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _values(dtype: str = "float32") -> np.ndarray:
    return (np.arange(VOCAB)[:, None] + np.arange(DIM)[None, :] / 1000.0).astype(dtype)


def _batches(steps: int = 2, size: int = 48):
    """A global batch per step: ids with many duplicates, one gradient row per id."""
    rng = np.random.default_rng(5)
    return [(rng.integers(0, VOCAB, size=size), rng.standard_normal((size, DIM)).astype(np.float32))
            for _ in range(steps)]


def _split(x: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Contiguous, uneven slices (rank 0 gets the remainder) so ranks send different counts."""
    bounds = np.linspace(0, len(x), world + 1).astype(int)
    return x[bounds[rank]:bounds[rank + 1]]


def _opt_rule(name: str):
    """(UpdateRule, values, slot initial values) of the core's Adagrad or Adadelta."""
    from meshembed.math import UpdateRule, get_math

    if name == "adagrad":
        return UpdateRule(get_math("adagrad"), ("accumulators",)), (0.1,), (0.1,)
    rule = UpdateRule(get_math("adadelta"), ("accumulators", "updates"), static=(("epsilon", 1e-6), ("rho", 0.9)))
    return rule, (0.5,), (0.0, 0.0)


def _num_shards(k: int, world: int) -> int:
    return 3 if k == 3 else world * k


# -- scenarios, run inside each rank -------------------------------------------------------------
def _scenario_protocol(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """gather / scatter / update_rows / unshard over ranks for several placements."""
    from meshembed.sharding import Placement
    from meshembed_torch import TorchBackend

    b = TorchBackend()
    out: dict[str, np.ndarray] = {}
    values = _values()
    rng = np.random.default_rng(1)
    gather_ids = rng.integers(0, VOCAB, size=23)
    for strategy, k in SHARD_CASES:
        n = _num_shards(k, world)
        key = f"{strategy}{n}"
        p = Placement(VOCAB, n, strategy)
        t = b.create_table(values, p)
        assert t.group is not None and t.group.world == world
        assert set(t.held_shards) == {s for s in range(n) if s % world == rank}
        out[f"unshard_{key}"] = b.unshard(t)
        out[f"gather_{key}"] = b.to_numpy(b.gather(t, b.asarray(_split(gather_ids, rank, world))))
        # scatter: every rank writes a disjoint set of unique ids
        uids = _split(np.arange(0, VOCAB, 2), rank, world)
        b.scatter(t, b.asarray(uids), b.asarray(-np.outer(uids, np.ones(DIM)).astype(np.float32)))
        out[f"scatter_{key}"] = b.unshard(t)
        for opt in ("adagrad", "adadelta"):
            fn, hv, inits = _opt_rule(opt)
            tables = [b.create_table(values, p)] + [b.create_table(np.full_like(values, v), p) for v in inits]
            for ids, grads in _batches():
                tables = b.update_rows(tables, b.asarray(_split(ids, rank, world)),
                                       b.asarray(_split(grads, rank, world)), fn, values=hv)
            for i, t2 in enumerate(tables):
                out[f"{opt}_{key}_{i}"] = b.unshard(t2)
        # ranks with nothing to look up or update still take part in the collectives
        lone = np.array([5, 5, VOCAB - 1]) if rank == 0 else np.zeros(0, np.int64)
        out[f"lone_gather_{key}"] = b.to_numpy(b.gather(t, b.asarray(lone)))
        fn, hv, inits = _opt_rule("adagrad")
        tables = [b.create_table(values, p), b.create_table(np.full_like(values, inits[0]), p)]
        b.update_rows(tables, b.asarray(lone), b.asarray(np.ones((lone.size, DIM), np.float32)), fn, values=hv)
        out[f"lone_update_{key}"] = b.unshard(tables[0])
    return out


def _engine_config(batch: int, optimizer):
    import meshembed as me

    return me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=VOCAB, dimension=DIM, optimizer=optimizer, combiner="sum"),
                me.TableConfig(name="u", vocabulary_size=11, dimension=3, optimizer=optimizer, combiner="mean")],
        features=[me.FeatureConfig(table="t", input_shape=(batch,), name="a"),
                  me.FeatureConfig(table="t", input_shape=(batch,), name="b"),
                  me.FeatureConfig(table="u", input_shape=(batch,), name="c")],
        sharding_strategy="mod",
    )


def _engine_batches(global_batch: int, steps: int = 2):
    """Per step: ragged multi-hot ids for a, b (same table) and c, as per-sample lists."""
    rng = np.random.default_rng(9)
    out = []
    for _ in range(steps):
        feats = []
        for vocab in (VOCAB, VOCAB, 11):
            feats.append([list(rng.integers(0, vocab, size=rng.integers(1, 4))) for _ in range(global_batch)])
        out.append(feats)
    return out


def _engine_step(emb, feats, lr_tag_values=()):
    """One full step; the loss is Σ 0.5·act², so d loss/d act = act (a torch model would
    produce the same tensors with ``loss.backward()``)."""
    import meshembed as me

    emb.enqueue([me.RaggedIds.from_lists(f) for f in feats])
    acts = emb.dequeue()
    grads = []
    for a in acts:
        leaf = a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a
        if isinstance(leaf, torch.Tensor):
            (0.5 * (leaf * leaf).sum()).backward()
            grads.append(leaf.grad)
        else:
            grads.append(np.asarray(leaf))
    emb.apply_gradients(grads, lr_tag_values)
    return acts


def _optimizers():
    import meshembed as me

    return {
        "sgd": me.embedding.SGD(learning_rate=0.1),
        "adagrad": me.embedding.Adagrad(learning_rate=0.1, initial_accumulator_value=0.1),
        "adadelta": me.embedding.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6),
    }


def _scenario_engine(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """``TPUEmbedding(backend="torch")`` steps on this rank's part of the global batch."""
    import meshembed as me

    out = {}
    global_batch = 4 * world
    for name, opt in _optimizers().items():
        emb = me.TPUEmbedding(_engine_config(global_batch // world, opt), backend="torch")
        assert emb.num_shards == world
        for s, feats in enumerate(_engine_batches(global_batch)):
            local = [f[rank * (global_batch // world):(rank + 1) * (global_batch // world)] for f in feats]
            acts = _engine_step(emb, local)
            assert all(isinstance(a, torch.Tensor) for a in acts)
            out[f"{name}_act{s}_a"] = acts[0].numpy()
        for table in ("t", "u"):
            for slot, arr in emb.retrieve_parameters(table).items():
                out[f"{name}_{table}_{slot}"] = arr
    return out


def _scenario_kill(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """A step, a checkpoint, then the last rank dies; the survivors must fail clearly."""
    import meshembed as me
    from meshembed_torch.distributed import RankFailureError

    emb = me.TPUEmbedding(_engine_config(4, _optimizers()["adagrad"]), backend="torch")
    batches = _engine_batches(4 * world)
    local = [f[rank * 4:(rank + 1) * 4] for f in batches[0]]
    _engine_step(emb, local)
    emb.save(tmp / "ckpt")  # collective unshard; rank 0 writes, every rank waits for it
    dist.barrier()
    if rank == world - 1:
        os._exit(17)  # dies mid-training, without cleanup
    start = time.monotonic()
    try:
        _engine_step(emb, [f[rank * 4:(rank + 1) * 4] for f in batches[1]])
    except RankFailureError as exc:
        return {"elapsed": np.array(time.monotonic() - start), "message": np.array(str(exc))}
    raise AssertionError("the step after a peer died did not raise RankFailureError")


def _scenario_checkpoint(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """save() from every rank: one writer (rank 0), a complete checkpoint on return everywhere,
    restore on every rank; a failing writer makes every rank raise (none waits forever)."""
    import meshembed as me
    from meshembed.embedding import checkpoint
    from meshembed.errors import StateError

    writes = []
    real_write = checkpoint._write_atomically

    def counting_write(engine, path, collected):
        writes.append(str(path))
        if path.name == "broken":
            raise OSError("disk full (simulated)")
        return real_write(engine, path, collected)

    checkpoint._write_atomically = counting_write
    out = {}
    emb = me.TPUEmbedding(_engine_config(4, _optimizers()["adadelta"]), backend="torch")
    assert emb.backend.is_writer == (rank == 0)
    batches = _engine_batches(4 * world, steps=3)
    _engine_step(emb, [f[rank * 4:(rank + 1) * 4] for f in batches[0]])
    saved = {t: emb.retrieve_parameters(t) for t in ("t", "u")}
    returned = emb.save(tmp / "ckpt")
    out["complete_on_return"] = np.array((tmp / "ckpt" / "manifest.json").exists())
    out["returned"] = np.array(str(returned))
    emb.save(tmp / "ckpt")  # overwrite: still one writer, still complete
    out["writes"] = np.array(len(writes))
    restored = me.TPUEmbedding.restore(tmp / "ckpt", backend="torch")
    assert restored.num_shards == world and restored.step == emb.step
    for t in ("t", "u"):
        for slot, arr in restored.retrieve_parameters(t).items():
            out[f"restored_{t}_{slot}"] = arr
            out[f"saved_{t}_{slot}"] = saved[t][slot]
    # both engines take the same next step on every rank
    local = [f[rank * 4:(rank + 1) * 4] for f in batches[1]]
    _engine_step(emb, local)
    _engine_step(restored, local)
    for t in ("t", "u"):
        a, b = emb.retrieve_parameters(t), restored.retrieve_parameters(t)
        for slot in a:
            out[f"next_orig_{t}_{slot}"] = a[slot]
            out[f"next_restored_{t}_{slot}"] = b[slot]
    try:
        emb.save(tmp / "broken")
        out["broken_error"] = np.array("")
    except (OSError, StateError) as exc:
        out["broken_error"] = np.array(type(exc).__name__)
    # the ranks are still in step: one more collective step works after the failed save
    _engine_step(emb, [f[rank * 4:(rank + 1) * 4] for f in batches[2]])
    return out


SCENARIOS = {"protocol": _scenario_protocol, "engine": _scenario_engine, "kill": _scenario_kill,
             "checkpoint": _scenario_checkpoint}


def _scenario(name: str):
    """A scenario of this file by name, or any module's as ``"package.module:function"``."""
    if ":" not in name:
        return SCENARIOS[name]
    import importlib

    module, func = name.split(":")
    return getattr(importlib.import_module(module), func)


def _worker(rank: int, world: int, port: int, scenario: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)  # several ranks share 2 cores
    out_dir = pathlib.Path(tmp)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
        result = _scenario(scenario)(rank, world, out_dir)
        np.savez(out_dir / f"rank{rank}.npz", **result)
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    if scenario != "kill":
        dist.destroy_process_group()
    os._exit(0)  # a survivor of "kill" would otherwise wait on its dead peer at shutdown


def _launch(scenario: str, world: int, tmp_path: pathlib.Path, deadline_s: float = 90.0) -> dict[int, dict]:
    """Spawn ``world`` ranks; return each rank's saved results. Never waits past the deadline."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scenario, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(world) if (tmp_path / f"rank{r}.err").exists()}
    assert not hung, f"ranks {hung} still running after {deadline_s}s (a hang). Errors: {errors}"
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    results = {}
    for r in range(world):
        f = tmp_path / f"rank{r}.npz"
        if f.exists():
            with np.load(f) as z:
                results[r] = {k: z[k] for k in z.files}
    return results, [p.exitcode for p in procs]


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_protocol_over_gloo_ranks_equals_numpy(world, tmp_path):
    from meshembed.sharding import Placement
    from meshembed_numpy import NumpyBackend

    results, codes = _launch("protocol", world, tmp_path)
    assert codes == [0] * world
    nb = NumpyBackend()
    values = _values()
    gather_ids = np.random.default_rng(1).integers(0, VOCAB, size=23)
    for strategy, k in SHARD_CASES:
        n = _num_shards(k, world)
        key = f"{strategy}{n}"
        p = Placement(VOCAB, n, strategy)
        expected_scatter = values.copy()
        expected_scatter[0::2] = -np.outer(np.arange(0, VOCAB, 2), np.ones(DIM))
        for r in range(world):
            np.testing.assert_array_equal(results[r][f"unshard_{key}"], values, err_msg=key)
            np.testing.assert_array_equal(results[r][f"gather_{key}"], values[_split(gather_ids, r, world)], err_msg=key)
            np.testing.assert_array_equal(results[r][f"scatter_{key}"], expected_scatter, err_msg=key)
        np.testing.assert_array_equal(results[0][f"lone_gather_{key}"], expected_scatter[[5, 5, VOCAB - 1]])
        fn, hv, inits = _opt_rule("adagrad")
        lone = [nb.create_table(values, p), nb.create_table(np.full_like(values, inits[0]), p)]
        nb.update_rows(lone, np.array([5, 5, VOCAB - 1]), np.ones((3, DIM), np.float32), fn, values=hv)
        for r in range(world):
            assert results[r][f"lone_gather_{key}"].shape == ((3 if r == 0 else 0), DIM)
            np.testing.assert_allclose(results[r][f"lone_update_{key}"], nb.unshard(lone[0]), rtol=2e-6, atol=2e-6)
        for opt in ("adagrad", "adadelta"):
            fn, hv, inits = _opt_rule(opt)
            tables = [nb.create_table(values, p)] + [nb.create_table(np.full_like(values, v), p) for v in inits]
            for ids, grads in _batches():
                tables = nb.update_rows(tables, ids, grads, fn, values=hv)
            for i, t in enumerate(tables):
                for r in range(world):  # every rank sees the same unsharded result
                    np.testing.assert_allclose(results[r][f"{opt}_{key}_{i}"], nb.unshard(t), rtol=2e-6, atol=2e-6,
                                               err_msg=f"{opt} {key} table {i} rank {r}")


@pytest.mark.parametrize("world", [2, 4])
def test_engine_steps_over_gloo_ranks_equal_numpy_single_process(world, tmp_path):
    import meshembed as me

    results, _ = _launch("engine", world, tmp_path)
    global_batch = 4 * world
    for name, opt in _optimizers().items():
        emb = me.TPUEmbedding(_engine_config(global_batch, opt), backend="numpy", num_shards=world)
        acts = [_engine_step(emb, feats)[0] for feats in _engine_batches(global_batch)]
        for s, act in enumerate(acts):
            got = np.concatenate([results[r][f"{name}_act{s}_a"] for r in range(world)])
            np.testing.assert_allclose(got, act, rtol=2e-6, atol=2e-6, err_msg=f"{name} activations step {s}")
        for table in ("t", "u"):
            for slot, arr in emb.retrieve_parameters(table).items():
                for r in range(world):
                    np.testing.assert_allclose(results[r][f"{name}_{table}_{slot}"], arr, rtol=2e-6, atol=2e-6,
                                               err_msg=f"{name} {table}.{slot} rank {r}")


def test_dead_rank_makes_survivors_fail_clearly_and_checkpoint_loads(tmp_path):
    import meshembed as me

    world = 2
    start = time.monotonic()
    results, codes = _launch("kill", world, tmp_path, deadline_s=60.0)
    assert codes[-1] == 17 and codes[0] == 0
    msg = str(results[0]["message"])
    assert "rank 0 of 2" in msg and "another rank probably died" in msg, msg
    assert float(results[0]["elapsed"]) <= PG_TIMEOUT_S + 5.0, results[0]["elapsed"]
    assert time.monotonic() - start < 60.0
    # the last checkpoint is intact and loads (here into the NumPy backend, one process)
    restored = me.TPUEmbedding.restore(tmp_path / "ckpt", backend="numpy")
    assert restored.retrieve_parameters("t")["parameters"].shape == (VOCAB, DIM)
    assert restored.step == 1


def test_checkpoint_is_written_once_by_rank_zero_and_restores_on_every_rank(tmp_path):
    import meshembed as me

    world = 2
    results, codes = _launch("checkpoint", world, tmp_path)
    assert codes == [0] * world
    # one writer: rank 0 wrote both saves, rank 1 none; no per-rank or temporary leftovers
    assert [int(results[r]["writes"]) for r in range(world)] == [2, 0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ckpt"]
    for r in range(world):
        assert bool(results[r]["complete_on_return"]), f"rank {r} returned before the checkpoint was complete"
        assert str(results[r]["returned"]) == str(tmp_path / "ckpt")
    # restored on both ranks: the saved numbers exactly, and the same next step
    keys = [k[len("saved_"):] for k in results[0] if k.startswith("saved_")]
    assert keys
    for r in range(world):
        for k in keys:
            np.testing.assert_array_equal(results[r][f"restored_{k}"], results[r][f"saved_{k}"], err_msg=f"rank {r} {k}")
            np.testing.assert_array_equal(results[r][f"restored_{k}"], results[0][f"saved_{k}"], err_msg=f"rank {r} {k}")
            np.testing.assert_array_equal(results[r][f"next_restored_{k}"], results[r][f"next_orig_{k}"],
                                          err_msg=f"rank {r} {k}")
    # the single-process reader sees the same checkpoint
    cp = me.TPUEmbedding.restore(tmp_path / "ckpt", backend="numpy")
    for k in keys:
        table, slot = k.split("_", 1)
        np.testing.assert_array_equal(cp.retrieve_parameters(table)[slot], results[0][f"saved_{k}"])
    # a failing writer: rank 0 raises its own error, rank 1 a StateError; neither hangs
    assert [str(results[r]["broken_error"]) for r in range(world)] == ["OSError", "StateError"]
