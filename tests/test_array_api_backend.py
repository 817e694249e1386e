"""The generic Array API backend: standard-only kernels equal the NumPy backend's bit for bit,
array_api_strict is registered (its arrays on a non-host device, as a GPU library's), and a
checkpoint written on it continues with the same numbers on numpy, torch and jax."""

from __future__ import annotations

import os
import subprocess
import sys

import array_api_compat.numpy as compat_numpy
import numpy as np
import pytest

import meshembed as me
from conformance.test_engine import assert_same_state, config, run, snapshot
from meshembed.errors import BackendUnavailableError, ConfigError
from meshembed.sharding.placement import Placement
from meshembed_array_api import ArrayAPIBackend, ArrayAPIStrictBackend, CupyBackend

pytest.importorskip("array_api_strict")
NP = me.get_backend("numpy")


@pytest.fixture(scope="module")
def strict():
    return me.get_backend("array_api_strict")


def test_registered_and_listed(strict):
    assert isinstance(strict, ArrayAPIStrictBackend) and strict.name == "array_api_strict"
    assert "array_api_strict" in me.available_backends()
    if CupyBackend.unavailable_reason():  # no cupy or no CUDA device here (the GPU run covers it)
        with pytest.raises(BackendUnavailableError, match="cupy|CUDA"):
            me.get_backend("cupy")


def test_arrays_live_off_the_host(strict):
    """An implicit host conversion of a backend array must fail, as it does for GPU arrays."""
    x = strict.asarray(np.arange(3.0), dtype="float32")
    with pytest.raises(RuntimeError):
        np.asarray(x)
    np.testing.assert_array_equal(strict.to_numpy(x), np.arange(3.0, dtype=np.float32))


def test_not_a_namespace_is_a_config_error():
    with pytest.raises(ConfigError, match="Invalid `xp`"):
        ArrayAPIBackend(object())


def _in_strict_mode(version: str, code: str) -> list[str]:
    """Run ``code`` under array-api-strict's ``version`` mode (an environment variable of a
    child process, so this process's flags stay as they are); its printed lines."""
    env = {**os.environ, "ARRAY_API_STRICT_API_VERSION": version}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_a_standard_older_than_2023_12_is_refused_by_name():
    code = ("import array_api_strict, meshembed as me\n"
            "from meshembed_array_api import ArrayAPIBackend\n"
            "assert 'array_api_strict' not in me.available_backends()\n"
            "for make in (lambda: me.get_backend('array_api_strict'), lambda: ArrayAPIBackend(array_api_strict)):\n"
            "    try:\n        make()\n"
            "    except (me.BackendUnavailableError, me.ConfigError) as exc:\n        print(type(exc).__name__, exc)\n")
    lines = _in_strict_mode("2022.12", code)
    assert len(lines) == 2, lines
    assert lines[0].startswith("BackendUnavailableError") and "ARRAY_API_STRICT_API_VERSION" in lines[0]
    assert lines[1].startswith("ConfigError") and "implements Array API 2022.12" in lines[1]


def test_the_2023_12_standard_trains_every_clamping_optimizer_like_numpy():
    """2023.12's maximum/minimum/pow take arrays only: the math passes static numbers as 0-d
    arrays (math.common.maximum/minimum/power), so the oldest supported standard runs the
    optimizers that clamp or raise to a power, bit for bit with NumPy."""
    code = """
import numpy as np, meshembed as me
opts = [me.embedding.FTRL(learning_rate=0.1, l1_regularization_strength=0.01, multiply_linear_by_learning_rate=True),
        me.embedding.AdagradMomentum(learning_rate=0.1, momentum=0.9, exponent=3.0, beta2=0.5),
        me.embedding.BoundedAdagrad(learning_rate=0.1, max_var_update=0.01, max_accumulator=1.0),
        me.embedding.SGD(learning_rate=0.1, clip_weight_min=-0.05, clip_weight_max=0.05)]
for opt in opts:
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=16, dimension=3, optimizer=opt)],
                             features=[me.FeatureConfig(table="t", input_shape=(6,), name="f")])
    out = []
    for backend in ("numpy", "array_api_strict"):
        emb = me.TPUEmbedding(cfg, backend=backend, num_shards=2)
        for step in range(3):
            emb.enqueue([np.array([1, 2, 2, 5, 9, 15])])
            acts = emb.dequeue()
            emb.apply_gradients([np.full((6, 3), 0.5 - 0.3 * step, np.float32)])
        out.append(emb.retrieve_parameters("t"))
    assert all(np.array_equal(out[0][k], out[1][k]) for k in out[0]), type(opt).__name__
    print(type(opt).__name__, "ok")
"""
    assert len(_in_strict_mode("2023.12", code)) == 4


def test_a_dtype_the_namespace_lacks_is_a_config_error(strict):
    with pytest.raises(ConfigError, match="float16"):
        strict.asarray([1.0], dtype="float16")  # array-api-strict has no float16


def test_cupy_factory_says_why_it_cannot_start_without_cupy():
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "cupy" in CupyBackend.unavailable_reason()
    else:
        pytest.skip("CuPy is installed: the GPU conformance run covers CupyBackend")


@pytest.mark.parametrize("n,vocab,dim", [(0, 5, 3), (1, 5, 3), (40, 6, 3), (300, 50, 4), (64, 1, 2)])
def test_segment_sums_equal_numpys_bit_for_bit(strict, n, vocab, dim):
    rng = np.random.default_rng(n)
    ids = (rng.zipf(1.3, n) % vocab).astype(np.int64)
    vals = rng.standard_normal((n, dim)).astype(np.float32) * 10 ** rng.uniform(-3, 3, (n, 1)).astype(np.float32)
    uids, sums = strict.segment_sum(strict.asarray(ids, "int64"), strict.asarray(vals))
    ref_uids, ref_sums = NP.segment_sum(ids, vals)
    np.testing.assert_array_equal(strict.to_numpy(uids), ref_uids)
    np.testing.assert_array_equal(strict.to_numpy(sums), ref_sums)
    dense = strict.segment_sum_to(strict.asarray(vals), strict.asarray(ids, "int64"), vocab + 2)
    np.testing.assert_array_equal(strict.to_numpy(dense), NP.segment_sum_to(vals, ids, vocab + 2))


@pytest.mark.parametrize("strategy", ["mod", "div"])
@pytest.mark.parametrize("shards", [1, 3, 7])
def test_gather_and_scatter_route_rows_to_their_shards(strict, strategy, shards):
    placement = Placement(11, shards, strategy)
    values = np.arange(11 * 2, dtype=np.float32).reshape(11, 2)  # row i holds 2i, 2i+1
    table = strict.create_table(values, placement)
    np.testing.assert_array_equal(strict.unshard(table), values)
    ids = np.array([10, 0, 3, 3, 7, 10], np.int64)
    np.testing.assert_array_equal(strict.to_numpy(strict.gather(table, strict.asarray(ids, "int64"))), values[ids])
    written = strict.scatter(table, strict.asarray([9, 0, 5], "int64"), strict.asarray(-np.ones((3, 2), np.float32)))
    expected = values.copy()
    expected[[9, 0, 5]] = -1
    np.testing.assert_array_equal(strict.unshard(written), expected)
    np.testing.assert_array_equal(strict.unshard(table), values)  # a write makes a new table
    host_rows = strict.scatter(table, np.array([1], np.int64), np.full((1, 2), 7.0))  # NumPy float64 in
    assert host_rows.dtype == table.dtype and strict.unshard(host_rows)[1].tolist() == [7.0, 7.0]


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_generic_backend_over_other_namespaces_equals_the_numpy_backend(library):
    """The same code over array_api_compat.numpy (same bits as NumPy's) and over torch (the
    whole conformance suite passes that way too; here one engine run, NumPy's tolerances)."""
    xp = compat_numpy if library == "numpy" else pytest.importorskip("torch")
    generic = ArrayAPIBackend(xp, name=f"generic-{library}")
    assert generic.capabilities.float64
    for strategy in ("mod", "div"):
        ref = me.TPUEmbedding(config(strategy=strategy), backend="numpy", num_shards=3, seed=5)
        emb = me.TPUEmbedding(config(strategy=strategy), backend=generic, num_shards=3, seed=5)
        run(ref)
        run(emb)
        assert_same_state(snapshot(ref), snapshot(emb), exact=library == "numpy")


@pytest.mark.parametrize("name", ["numpy", "torch", "jax"])
def test_checkpoint_from_array_api_strict_continues_on(tmp_path, name):
    if name not in me.available_backends():
        pytest.skip(f"{name} backend not available")
    opt = me.embedding.Adadelta(0.5, rho=0.9, epsilon=1e-6)
    straight = me.TPUEmbedding(config(opt, strategy="mod"), backend="numpy", num_shards=1, seed=7)
    run(straight, steps=4)
    first = me.TPUEmbedding(config(opt, strategy="mod"), backend="array_api_strict", num_shards=2, seed=7)
    run(first, steps=2)
    first.save(tmp_path / "ckpt")
    resumed = me.TPUEmbedding.restore(tmp_path / "ckpt", backend=name, num_shards=3)
    assert resumed.backend.name == name and resumed.step == 2
    run(resumed, steps=2, start=2)
    assert_same_state(snapshot(straight), snapshot(resumed), exact=name == "numpy")
