"""``me.Mesh`` / ``me.Layout`` / ``me.UNSHARDED``: validation, helpers, backend mapping in one
process (multi-device meshes: ``test_mesh_multidevice.py``)."""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from meshembed.errors import BackendUnavailableError, ConfigError


def _require(name: str):
    try:
        return me.get_backend(name)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


def test_mesh_basics():
    mesh = me.Mesh(["batch", "model"], (1, 1), backend="numpy")
    assert mesh.dim_names == ("batch", "model") and mesh.shape == (1, 1) and mesh.size == 1
    assert mesh.native is None  # NumPy: logical shards only
    assert mesh == me.Mesh(("batch", "model"), [1, 1], backend="numpy")
    assert mesh != me.Mesh(["batch", "data"], (1, 1), backend="numpy")
    assert mesh.dim_size("model") == 1
    assert "batch=1" in repr(mesh)


@pytest.mark.parametrize("names,shape,match", [
    (["x", "x"], (1, 1), "Invalid `dim_names`"),
    ([me.UNSHARDED], (1,), "Invalid `dim_names`"),
    ("xy", (1, 1), "Invalid `dim_names`"),
    (["x"], (1, 2), "Invalid `shape`"),
    (["x"], (0,), "Invalid `shape`"),
    (["x"], 3, "Invalid `shape`"),
])
def test_mesh_validation(names, shape, match):
    with pytest.raises(ConfigError, match=match):
        me.Mesh(names, shape, backend="numpy")


def test_layout_helpers():
    mesh = me.Mesh(["batch", "model"], (2, 4), backend="numpy")
    layout = me.Layout(["model", me.UNSHARDED], mesh)
    assert layout.rank == 2 and not layout.is_fully_replicated
    assert layout.shard_shape((8, 3)) == (2, 3)
    assert layout.num_shards(0) == 4 and layout.num_shards(1) == 1
    assert me.Layout.replicated(mesh, 3).sharding_specs == (me.UNSHARDED,) * 3
    assert me.Layout.replicated(mesh, 0).is_fully_replicated
    assert me.Layout.batch_sharded(mesh, "batch", 2).sharding_specs == ("batch", me.UNSHARDED)
    assert me.Layout.batch_sharded(mesh, "batch", 3, axis=1).sharding_specs == (me.UNSHARDED, "batch", me.UNSHARDED)
    assert layout == me.Layout(("model", "unsharded"), mesh) and hash(layout) == hash(me.Layout(["model", me.UNSHARDED], mesh))
    with pytest.raises(ConfigError, match="divide evenly"):
        layout.check_shape((6, 3))
    with pytest.raises(ConfigError, match="rank"):
        layout.check_shape((8,))


@pytest.mark.parametrize("specs,match", [
    (["model", "model"], "at most once"),
    (["data"], "Expected each entry"),
    ("model", "one entry per tensor axis"),
])
def test_layout_validation(specs, match):
    mesh = me.Mesh(["batch", "model"], (2, 4), backend="numpy")
    with pytest.raises(ConfigError, match=match):
        me.Layout(specs, mesh)
    with pytest.raises(ConfigError, match="Invalid `mesh`"):
        me.Layout([me.UNSHARDED], "mesh")
    with pytest.raises(ConfigError, match="Invalid `axis`"):
        me.Layout.batch_sharded(mesh, "batch", 2, axis=2)


def test_torch_single_process_mesh_is_logical():
    _require("torch")
    import torch

    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with pytest.raises(ConfigError, match="needs 4 torch.distributed ranks"):
        me.Mesh(["batch", "model"], (2, 2), backend="torch")  # would be silently unsharded
    mesh = me.Mesh(["batch", "model"], (1, 1), backend="torch")
    assert mesh.native is None  # no process group: no DeviceMesh, plain tensors
    v = me.Variable(np.ones((4, 2), np.float32), layout=me.Layout(["model", me.UNSHARDED], mesh))
    assert type(v.value) is torch.Tensor and v.sharding is None


def test_jax_mesh_maps_to_named_sharding():
    backend = _require("jax")
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = me.Mesh(["batch", "model"], (1, 1), backend="jax")
    assert isinstance(mesh.native, Mesh) and mesh.native.axis_names == ("batch", "model")
    v = me.Variable(np.ones((4, 2), np.float32), layout=me.Layout(["model", me.UNSHARDED], mesh))
    assert v.sharding == NamedSharding(mesh.native, PartitionSpec("model", None))
    assert backend.sharding_of(v.value) == v.value.sharding
    n = len(jax.devices())
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        me.Mesh(["x"], (n + 1,), backend="jax")


@pytest.mark.parametrize("specs", [["model", me.UNSHARDED], [me.UNSHARDED, "batch"], ["batch", "model"],
                                   [me.UNSHARDED, me.UNSHARDED]])
def test_logical_shards_round_trip(specs):
    """NumPy's logical shards: row i holds i, so a misplaced row shows in the failure."""
    mesh = me.Mesh(["batch", "model"], (2, 4), backend="numpy")
    layout = me.Layout(specs, mesh)
    value = np.arange(8)[:, None] + np.arange(4)[None, :] / 1000.0
    pieces = layout.shard(value)
    assert len(pieces) == 8 and all(p.shape == layout.shard_shape(value.shape) for p in pieces)
    np.testing.assert_array_equal(layout.unshard(pieces), value)
    if specs[0] == "model":  # device (b, m) holds rows 2m, 2m+1 whatever b is
        np.testing.assert_array_equal(pieces[1 * 4 + 3][:, 0], [6, 7])
        np.testing.assert_array_equal(pieces[0 * 4 + 3], pieces[1 * 4 + 3])
