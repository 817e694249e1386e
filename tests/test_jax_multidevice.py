"""JAX backend on 8 CPU devices and across 2 processes (``jax.distributed`` on loopback).

Each scenario runs in fresh interpreters: the device count (``XLA_FLAGS``) and the
distributed runtime must be fixed before jax is imported. This file is also the worker
script (``python tests/test_jax_multidevice.py process RANK PORT``).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytest.importorskip("jax")


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["MESHEMBED_JAX_EXPECT_DEVICES"] = str(devices)
    env.pop("MESHEMBED_JAX_CAPACITY", None)
    return env


@pytest.mark.slow
def test_backend_suite_on_eight_devices():
    """The whole single-process JAX test module, with tables spread over 8 devices, on the
    pure-XLA kernels (the conformance suite runs the FFI CPU kernels on 8 devices)."""
    env = _env(8)
    env["MESHEMBED_JAX_CPU_KERNELS"] = "0"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_jax_backend.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_kernels_route_ids_not_tables_on_eight_devices():
    """Compiled HLO: lookup combines rows with an all-reduce of [batch, D]; the update has
    no collective but the scalar capacity check; neither gathers a table."""
    out = subprocess.run(
        [sys.executable, __file__, "hlo"], cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "HLO OK" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_numpy(tmp_path):
    """2 processes x 2 CPU devices: each passes its part of the global batch; tables and
    activations equal the single-process NumPy result on the whole batch."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "process", str(rank), str(port), str(tmp_path)],
            cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["checks"] >= 15, result


# --------------------------------------------------------------------------- workers
def _hlo_worker() -> None:
    import jax

    import meshembed as me
    from meshembed.sharding import Placement

    assert len(jax.devices()) == 8
    be = me.get_backend("jax")
    placement = Placement(1000, 8, "mod")
    tables = [be.create_table(np.zeros((1000, 16), np.float32), placement) for _ in range(2)]
    ids = be.asarray(np.arange(0, 1000, 7))
    grads = be.asarray(np.ones((ids.shape[0], 16), np.float32))

    from meshembed.math.registry import OptimizerMath
    from meshembed.math.rule import UpdateRule

    def update(xp, p, g, slots, *, lr):
        s2 = slots[0] + g * g
        return p - lr * g / xp.sqrt(s2 + 1.0), (s2,)

    rule = UpdateRule(math=OptimizerMath("custom", update, None, ()), slot_names=("s",))
    be.gather(tables[0], ids)
    be.fused = False  # the XLA step first
    be.update_rows(tables, ids, grads, rule, values=(1.0,))
    be.fused = True
    texts = {}
    gids, ggrads, _, _ = be._global_batch(tables[0].layout, ids, grads)
    for key, kernel in be._kernels.items():
        if key[0] == "lookup":
            texts["lookup"] = kernel.lower(tables[0].data, gids).compile().as_text()
        elif key[0] == "update":
            guard = be._guard(tables[0].layout, None)
            texts["update"] = kernel.lower(tuple(t.data for t in tables), gids, ggrads, guard, (1.0,)).compile().as_text()
    for name, text in texts.items():
        assert "all-gather" not in text and "all-to-all" not in text, f"{name} gathers: {text[:2000]}"
    reduces = [line for line in texts["lookup"].splitlines() if "all-reduce(" in line or "all-reduce-start(" in line]
    assert reduces and any(f"[{gids.shape[0]},16]" in line for line in reduces), reduces
    upd = [line for line in texts["update"].splitlines() if "all-reduce(" in line or "all-reduce-start(" in line]
    assert all("[]" in line.split("=")[1].split("all-reduce")[0] for line in upd), upd
    from meshembed_jax import native

    if native.usable("cpu", np.float32):  # the FFI row kernels run on every device
        assert "meshembed_dedup_sum" in texts["update"] and "meshembed_scatter_rows" in texts["update"]
        # the generated fused update: one in-place call per device, no collective, no copy
        from meshembed.embedding.updates import make_rule

        cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 1000, 16, optimizer=me.embedding.Adagrad(0.1))],
                                 features=[me.FeatureConfig("t", (4,), name="f")])
        spec = me.TPUEmbedding(cfg, backend="numpy").layout.tables[0]
        be.update_rows(tables, ids, grads, make_rule(spec), values=(0.1,))
        key = next(k for k in be._kernels if k[0] == "fused_update")
        hp = native.hp_block((0.1,))  # Adagrad's parameter block: the learning rate
        guard = be._guard(tables[0].layout, None)
        text = be._kernels[key].lower(tuple(t.data for t in tables), gids, ggrads, be._no_weights(tables[0].layout, np.int32),
                                      be._no_weights(tables[0].layout, np.float32), guard, hp).compile().as_text()
        assert "meshembed_fused_update" in text
        assert not any(op in text for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute")), text[:3000]
        assert not [line for line in text.splitlines() if " copy(" in line and "f32[" in line.split("=")[1].split("copy(")[0]]
    print("HLO OK")


def _process_worker(rank: int, port: int, out_dir: str) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import meshembed as me
    from meshembed import math as me_math
    from meshembed.sharding import Placement
    from meshembed_numpy import NumpyBackend

    assert jax.process_count() == 2 and len(jax.devices()) == 4
    be, ref = me.get_backend("jax"), NumpyBackend()
    assert be.capabilities.distributed
    checks = 0

    from meshembed.math.rule import UpdateRule

    def make_fn(xp, lr):  # update_rows' rule arguments: the core's Adagrad, lr as a value
        return {"fn": UpdateRule(math=me_math.get_math("adagrad"), slot_names=("accumulators",)), "values": (lr,)}

    rng = np.random.default_rng(0)  # identical on both processes: each takes its part
    for vocab, shards, strategy in [(37, 4, "mod"), (37, 2, "div"), (64, 8, "div")]:
        placement = Placement(vocab, shards, strategy)
        values = (np.arange(vocab)[:, None] + np.arange(4)[None] / 1000).astype(np.float32)
        acc = np.full_like(values, 0.1)
        tj = [be.create_table(values, placement), be.create_table(acc, placement)]
        tr = [ref.create_table(values, placement), ref.create_table(acc, placement)]
        assert len(tj[0].data.sharding.device_set) == min(shards, 4)
        for step in range(2):
            ids = rng.integers(0, vocab, size=23)
            grads = rng.standard_normal((23, 4)).astype(np.float32)
            mine = slice(0, 9) if rank == 0 else slice(9, 23)  # uneven parts
            rows = be.to_numpy(be.gather(tj[0], be.asarray(ids[mine])))
            np.testing.assert_allclose(rows, ref.gather(tr[0], ids)[mine], rtol=2e-6, atol=2e-6 * vocab)
            tj = be.update_rows(tj, be.asarray(ids[mine]), be.asarray(grads[mine]), **make_fn(be.xp, 0.1 * (step + 1)))
            tr = ref.update_rows(tr, ids, grads, **make_fn(ref.xp, 0.1 * (step + 1)))
            checks += 1
        for a, b in zip(tj, tr):
            np.testing.assert_allclose(be.unshard(a), ref.unshard(b), rtol=2e-6, atol=2e-6 * vocab)
            checks += 1
    # tables made block by block on the devices (forced for small tables: 3-row windows)
    from meshembed_jax import table as jax_table

    saved = jax_table.BLOCKWISE_MIN_BYTES, jax_table.WINDOW_BYTES
    jax_table.BLOCKWISE_MIN_BYTES, jax_table.WINDOW_BYTES = 0, 4 * 4 * 4 * 3
    try:
        for vocab, shards, strategy in [(37, 4, "mod"), (37, 2, "div")]:
            values = (np.arange(vocab)[:, None] + np.arange(4)[None] / 1000).astype(np.float32)
            blocks = (values[a : a + 5] for a in range(0, vocab, 5))
            table = be.create_table_from_blocks((vocab, 4), blocks, Placement(vocab, shards, strategy))
            np.testing.assert_array_equal(be.unshard(table), values)
            checks += 1
    finally:
        jax_table.BLOCKWISE_MIN_BYTES, jax_table.WINDOW_BYTES = saved
    try:
        be.create_table(np.zeros((10, 2), np.float32), Placement(10, 3, "mod"))
    except ValueError as exc:
        assert "multiple of the process count" in str(exc)
        checks += 1

    # the engine: each process enqueues its half of the global batch
    opt = me.embedding.Adadelta(learning_rate=0.1, rho=0.95, epsilon=1e-6)

    def engine(backend: str, batch: int, shards: int):
        cfg = me.EmbeddingConfig(
            tables=[me.TableConfig(name="t", vocabulary_size=200, dimension=8, optimizer=opt, combiner="mean")],
            features=[me.FeatureConfig(table="t", input_shape=(batch, 3), name="f")],
        )
        return me.TPUEmbedding(cfg, backend=backend, num_shards=shards)

    ej, er = engine("jax", 8, 4), engine("numpy", 16, 4)
    for _ in range(2):
        feats = rng.integers(0, 200, size=(16, 3))
        grads = rng.standard_normal((16, 3, 8)).astype(np.float32)
        mine = slice(0, 8) if rank == 0 else slice(8, 16)
        ej.enqueue([feats[mine]])
        er.enqueue([feats])
        aj = be.to_numpy(ej.dequeue()[0])
        ar = er.dequeue()[0]
        np.testing.assert_allclose(aj, np.asarray(ar)[mine], rtol=2e-6, atol=1e-5)
        ej.apply_gradients([grads[mine]])
        er.apply_gradients([grads])
        checks += 1
    got, want = ej.retrieve_parameters("t"), er.retrieve_parameters("t")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=1e-5)
        checks += 1
    # a fixed capacity that table "b" exceeds only with both processes' ids (6 unique ids of
    # device 0 here, 12 in all): refused on every process before table "a" is written
    sgd = me.embedding.SGD(learning_rate=0.5)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name=t, vocabulary_size=64, dimension=4, optimizer=sgd, combiner="sum") for t in "ab"],
        features=[me.FeatureConfig(table="a", input_shape=(4,), name="fa"),
                  me.FeatureConfig(table="b", input_shape=(6,), name="fb")],
        sharding_strategy="mod",
    )
    e = me.TPUEmbedding(cfg, backend="jax", num_shards=4)
    before = {t: e.retrieve_parameters(t)["parameters"] for t in "ab"}
    ids_a = np.array([1, 2, 3, 5]) + 5 * rank
    ids_b = np.arange(6) * 4 + 24 * rank  # all owned by device 0 (MOD 4)
    be.capacity = 8
    try:
        e.enqueue([ids_a, ids_b])
        e.dequeue()
        try:
            e.apply_gradients([np.ones((4, 4), np.float32), np.ones((6, 4), np.float32)])
            raise AssertionError("a capacity exceeded across processes was not refused")
        except me.errors.CapacityError as exc:
            assert "'b'" in str(exc) and "12 unique ids" in str(exc), str(exc)
        for t in "ab":
            np.testing.assert_array_equal(e.retrieve_parameters(t)["parameters"], before[t])
            checks += 1
        be.capacity = 12  # enough: the same step goes through
        e.apply_gradients([np.ones((4, 4), np.float32), np.ones((6, 4), np.float32)])
        got = e.retrieve_parameters("b")["parameters"]
        np.testing.assert_array_equal(got[np.arange(12) * 4], before["b"][np.arange(12) * 4] - 0.5)
        checks += 1
    finally:
        be.capacity = None
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"checks": checks}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "hlo":
        _hlo_worker()
    elif sys.argv[1] == "process":
        _process_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
