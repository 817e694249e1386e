"""Dense Adadelta on real meshes: a JAX mesh of 8 CPU devices and a 2-rank torch.distributed
(gloo, loopback) mesh. Every slot must carry its variable's own backend sharding
(``NamedSharding`` / DTensor placements) and the results must equal the single-device run.

JAX fixes its device count at import and torch ranks are separate processes, so each check
runs in a fresh interpreter (this file's ``__main__``: ``python test_mesh_multidevice.py jax``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

DEVICES = 8
STEPS = 4


def _problem(seed: int = 0) -> tuple[dict[str, tuple[np.ndarray, list[str]]], list[dict[str, object]]]:
    """Variables (value, layout specs) and per-step gradients; row i starts at value i."""
    rng = np.random.default_rng(seed)
    variables = {
        "kernel": (np.arange(8, dtype=np.float32)[:, None] + np.zeros((8, 4), np.float32), ["model", "unsharded"]),
        "grid": (rng.normal(size=(4, 8)).astype(np.float32), ["batch", "model"]),
        "bias": (rng.normal(size=(6,)).astype(np.float32), ["unsharded"]),
    }
    steps = []
    for _ in range(STEPS):
        steps.append({
            "kernel": (rng.normal(size=(5, 4)).astype(np.float32), np.array([0, 7, 3, 7, 0])),  # sparse
            "grid": rng.normal(size=(4, 8)).astype(np.float32),
            "bias": rng.normal(size=(6,)).astype(np.float32),
        })
    return variables, steps


def run(backend: str, mesh_shape: tuple[int, int] | None, check=None) -> dict[str, np.ndarray]:
    """Train the problem; return every variable and slot as NumPy (and check co-sharding)."""
    import meshembed as me

    variables, steps = _problem()
    mesh = None if mesh_shape is None else me.Mesh(["batch", "model"], mesh_shape, backend=backend)
    vs = {
        name: me.Variable(value, name=name, backend=backend,
                          layout=None if mesh is None else me.Layout(specs, mesh))
        for name, (value, specs) in variables.items()
    }
    opt = me.optimizers.Adadelta(
        learning_rate=0.5, rho=0.9, epsilon=1e-3, mesh=mesh,
        gradients_clip_option=me.optimizers.GradientsClipOption(global_clipnorm=3.0),
        ema_option=me.optimizers.EMAOption(use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3),
    )
    for grads in steps:
        pairs = []
        for name, g in grads.items():
            if isinstance(g, tuple):
                g = me.IndexedSlices(g[0], g[1], variables[name][0].shape)
            pairs.append((g, vs[name]))
        opt.apply_gradients(pairs)
        if mesh is not None:
            check(opt, vs)
    out = {v.name: v.numpy() for v in opt.variables}
    out.update({name: v.numpy() for name, v in vs.items()})
    return out


def run_minimize(backend: str, mesh_shape: tuple[int, int] | None, check=None) -> dict[str, np.ndarray]:
    """``minimize`` on the mesh: gradients by the backend's autodiff keep the layouts."""
    import meshembed as me

    variables, _ = _problem(1)
    mesh = None if mesh_shape is None else me.Mesh(["batch", "model"], mesh_shape, backend=backend)
    vs = {name: me.Variable(value, name=name, backend=backend,
                            layout=None if mesh is None else me.Layout(specs, mesh))
          for name, (value, specs) in variables.items()}
    xp = me.get_backend(backend).xp

    def loss():
        k, g, b = vs["kernel"].value, vs["grid"].value, vs["bias"].value
        return xp.sum(k * k) + xp.sum(xp.sin(g)) + xp.sum((b - 1.0) ** 2)

    opt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-3, mesh=mesh,
                                 ema_option=me.optimizers.EMAOption(use_ema=True))
    for _ in range(3):
        opt.minimize(loss, list(vs.values()))
        if mesh is not None:
            check(opt, vs)
    return {v.name: v.numpy() for v in [*opt.variables, *vs.values()]}


def check_jax(opt, vs) -> None:
    """Every slot's backend sharding equals its variable's; iterations replicated."""
    from jax.sharding import NamedSharding

    for name, v in vs.items():
        assert isinstance(v.value.sharding, NamedSharding), v.value.sharding
        assert v.value.sharding == v.backend.named_sharding(v.layout), name
        slots = [s for s in opt.variables if s.name.endswith("/" + name)]
        assert len(slots) == 3, [s.name for s in slots]  # accumulated_grad, accumulated_delta_var, average
        for s in slots:
            assert s.value.sharding == v.value.sharding, (s.name, s.value.sharding, v.value.sharding)
            assert s.layout == v.layout
    it = opt.iterations.value
    assert it.sharding.is_fully_replicated and it.sharding.mesh == opt.mesh.native


def check_torch(opt, vs) -> None:
    """DTensor placements (and DeviceMesh) of every slot equal its variable's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, v in vs.items():
        assert isinstance(v.value, DTensor), type(v.value)
        specs = v.layout.sharding_specs
        expected = tuple(Shard(specs.index(d)) if d in specs else Replicate() for d in v.layout.mesh.dim_names)
        assert tuple(v.value.placements) == expected, (name, v.value.placements, expected)
        assert v.sharding == (v.layout.mesh.native, expected)
        slots = [s for s in opt.variables if s.name.endswith("/" + name)]
        assert len(slots) == 3, [s.name for s in slots]
        for s in slots:
            assert isinstance(s.value, DTensor), (s.name, type(s.value))
            assert s.value.device_mesh == v.value.device_mesh
            assert tuple(s.value.placements) == tuple(v.value.placements), (s.name, s.value.placements)
            assert s.sharding == v.sharding
    it = opt.iterations.value
    assert isinstance(it, DTensor) and all(isinstance(p, Replicate) for p in it.placements)


def compare(sharded, single, reference) -> None:
    assert sharded.keys() == single.keys() == reference.keys()
    for key in sharded:
        # Element-wise math is bit-identical; only the global norm's cross-shard sum may
        # round differently (a few ulp), hence rtol 1e-6 rather than exact equality.
        np.testing.assert_allclose(sharded[key], single[key], rtol=1e-6, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(sharded[key], reference[key], rtol=2e-6, atol=1e-7, err_msg=key)


def _main_jax() -> None:
    import jax

    assert len(jax.devices()) == DEVICES, jax.devices()
    compare(run("jax", (2, 4), check_jax), run("jax", None), run("numpy", None))
    sharded, single = run_minimize("jax", (2, 4), check_jax), run_minimize("jax", None)
    compare(sharded, single, single)
    print("OK jax")


def _torch_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        sharded = run("torch", (1, world), check_torch)
        compare(sharded, run("torch", None), run("numpy", None))
        sharded, single = run_minimize("torch", (1, world), check_torch), run_minimize("torch", None)
        compare(sharded, single, single)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _main_torch() -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_torch_rank, args=(2, port), nprocs=2, join=True)
    print("OK torch")


def _run_main(which: str, env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, __file__, which], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert f"OK {which}" in proc.stdout


@pytest.mark.slow
def test_jax_mesh_of_8_cpu_devices_matches_single_device():
    pytest.importorskip("jax")
    _run_main("jax", {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_torch_two_rank_gloo_mesh_matches_single_process():
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    _run_main("torch", {"MESHEMBED_TORCH_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""})


if __name__ == "__main__":
    {"jax": _main_jax, "torch": _main_torch}[sys.argv[1]]()
