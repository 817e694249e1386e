"""The JAX backend's host-to-device path for a batch's integer arrays (without x64): ids and
slots are narrowed to int32 into 64-byte-aligned memory that XLA's CPU client keeps instead of
copying, and a one-device kernel takes the resulting array as it is (no second device_put)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from meshembed.errors import InputError  # noqa: E402
from meshembed.sharding import Placement  # noqa: E402
from meshembed_jax.backend import HOST_ALIGNMENT, JaxBackend, cast_aligned  # noqa: E402

pytestmark = pytest.mark.skipif(jax.config.jax_enable_x64, reason="ids are narrowed only without x64")


def test_cast_aligned_is_an_aligned_copy_the_cpu_device_keeps():
    host = np.arange(-5, 1000, dtype=np.int64)[3:]  # an odd offset into its buffer
    out = cast_aligned(host, np.int32)
    assert out.dtype == np.int32 and out.ctypes.data % HOST_ALIGNMENT == 0
    np.testing.assert_array_equal(out, host)
    assert not np.shares_memory(out, host)
    # the premise of the alignment: the CPU client takes this memory as the array's buffer
    if jax.devices()[0].platform == "cpu":
        assert jax.device_put(out).unsafe_buffer_pointer() == out.ctypes.data
    assert cast_aligned(np.zeros((0, 3), np.int64), np.int32).shape == (0, 3)


def test_narrowed_ids_are_kept_by_the_device_and_never_the_callers_memory(monkeypatch):
    from meshembed_jax import backend as jax_backend

    made = []

    def recording(host, dtype):
        out = cast_aligned(host, dtype)
        made.append(out.ctypes.data)
        return out

    monkeypatch.setattr(jax_backend, "cast_aligned", recording)
    be = JaxBackend()
    for n in (5, 1000, 131_072):
        arr = be.asarray(np.arange(n, dtype=np.int64), dtype="int64")
        assert arr.dtype == np.int32 and made
        if arr.devices().pop().platform == "cpu":  # the narrowed copy itself, not a second one
            assert arr.unsafe_buffer_pointer() == made[-1]
    host = np.array([0, 7, 2**31 - 1, -2**31, 5], np.int64)
    arr = be.asarray(host, dtype="int64")
    host[:] = 1  # the caller's array changes: the device array does not
    np.testing.assert_array_equal(np.asarray(arr), [0, 7, 2**31 - 1, -2**31, 5])
    with pytest.raises(InputError, match="must fit"):
        be.asarray(np.array([0, 2**31], np.int64), dtype="int64")


def test_one_device_kernels_take_a_ready_array_without_a_device_put():
    be = JaxBackend()
    layout = be.layout(Placement(100, 1, "mod"))
    assert layout.n_dev == 1
    ids = be.asarray(np.arange(8, dtype=np.int64), dtype="int64")
    assert be._replicated_1d(layout, ids, 8, -1, np.int32) is ids
    assert be._replicated_1d(layout, ids, 8, -1, np.int32) is ids  # remembered
    padded = be._replicated_1d(layout, ids, 16, -1, np.int32)  # padding still makes a new array
    np.testing.assert_array_equal(np.asarray(padded), list(range(8)) + [-1] * 8)


def test_the_updates_gradient_rows_reach_a_one_device_kernel_as_they_are(monkeypatch):
    """The combiner's backward update takes the activation gradient without a device_put on a
    one-device layout (the bits: every fused-update test; here, that no copy is made)."""
    be = JaxBackend()
    layout = be.layout(Placement(100, 1, "mod"))
    g = jax.numpy.ones((4, 3), np.float32)
    assert be._replicated(layout, g) is g
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real(*a, **k))
    import meshembed as me

    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 100, 3, optimizer=me.embedding.SGD(0.1), combiner="sum")],
                             features=[me.FeatureConfig("t", (4,), name="f")])
    emb = me.TPUEmbedding(cfg, backend=be)
    emb.enqueue([me.RaggedIds(np.array([0, 2, 3, 5, 6]), np.array([1, 2, 3, 4, 5, 6]))])
    emb.dequeue()
    puts.clear()
    emb.apply_gradients([g])
    assert not any(a and a[0] is g for a in puts)
