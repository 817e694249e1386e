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
    real = jax_backend.aligned_empty

    def recording(shape, dtype):
        out = real(shape, dtype)
        made.append(out.ctypes.data)
        return out

    monkeypatch.setattr(jax_backend, "aligned_empty", recording)
    from meshembed_jax import native

    native.load()  # the one-pass narrowing where it builds, and NumPy's passes
    for be in (JaxBackend(), JaxBackend(cpu_kernels=False)):
        for n in (5, 1000, 131_072):
            made.clear()
            arr = be.asarray(np.arange(n, dtype=np.int64), dtype="int64")
            assert arr.dtype == np.int32 and made
            if arr.devices().pop().platform == "cpu":  # the narrowed copy itself, not a second one
                assert arr.unsafe_buffer_pointer() == made[-1]
    be = JaxBackend()
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


def test_the_one_pass_narrowing_gives_numpys_values_and_range_errors(monkeypatch):
    """int64 ids and slots are narrowed by one C pass that also finds their range (NumPy's min,
    max and copy: three): the same int32 values, the same refusal of values outside int32
    (either side) with nothing sent to a device, and NumPy's passes where the library is not
    loaded or the kernels are switched off."""
    from meshembed_jax import native

    if not native.load():
        pytest.skip("the JAX CPU kernels could not be built here")
    calls = []
    real = native.narrow_int64
    monkeypatch.setattr(native, "narrow_int64", lambda *a: calls.append(1) or real(*a))
    be = JaxBackend()
    rng = np.random.default_rng(3)
    for host in (rng.integers(-2**31, 2**31, 100_003), np.array([5], np.int64), np.arange(10)[::2].copy()):
        out = be.asarray(host, dtype="int64")
        np.testing.assert_array_equal(np.asarray(out), host)
    assert len(calls) == 3
    for bad in ([0, 2**31], [-2**31 - 1, 0], [2**40, -2**40]):
        with pytest.raises(InputError, match=f"min={min(bad)}, max={max(bad)}"):
            be.asarray(np.array(bad, np.int64), dtype="int64")
    off = JaxBackend(cpu_kernels=False)
    calls.clear()
    np.testing.assert_array_equal(np.asarray(off.asarray(np.arange(7), dtype="int64")), np.arange(7))
    with pytest.raises(InputError, match="must fit"):
        off.asarray(np.array([2**31], np.int64), dtype="int64")
    assert not calls
