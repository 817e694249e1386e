"""JAX backend: re-initialising a dynamic vocabulary's rows compiles nothing per row count.

The engine writes the rows it re-initialises (``TPUEmbedding._loaded_state``) with
``backend.scatter(table, backend.asarray(ids), backend.asarray(rows))``; that count changes
every step. Padding those native arrays eagerly on the device compiled a pad program per count
(the dynamic step ran ~35x slower than the plain one); they are now padded on the host to the
backend's size bucket, so only the scatter kernel is compiled, once per bucket.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import meshembed as me  # noqa: E402,F401
from meshembed.sharding import Placement  # noqa: E402
from meshembed_jax import JaxBackend  # noqa: E402
from meshembed_jax.distributed import bucket  # noqa: E402


def _reinit(be: JaxBackend, table, ids: np.ndarray, rows: np.ndarray):
    """The engine's call for re-initialised rows (``_loaded_state``)."""
    return be.scatter(table, be.asarray(ids, dtype="int64"), be.asarray(rows, dtype=rows.dtype))


def _compiles(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


def test_second_reinit_in_same_bucket_compiles_nothing(caplog):
    be = JaxBackend()
    vocab, dim = 256, 4
    values = np.arange(vocab * dim, dtype=np.float32).reshape(vocab, dim)
    table = be.create_table(values, Placement(vocab, 1, "div"))
    rng = np.random.default_rng(0)
    first, second = 17, 19  # different counts, one bucket
    assert bucket(first) == bucket(second) != first
    expected = values.copy()
    ids = rng.choice(vocab, first, replace=False)  # warm-up: this bucket's scatter kernel compiles
    rows = rng.standard_normal((first, dim)).astype(np.float32)
    table = _reinit(be, table, ids, rows)
    expected[ids] = rows
    ids = rng.choice(vocab, second, replace=False)
    rows = rng.standard_normal((second, dim)).astype(np.float32)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        table = _reinit(be, table, ids, rows)
        table.data.block_until_ready()
    expected[ids] = rows
    assert _compiles(caplog) == []
    got = be.unshard(table)
    np.testing.assert_array_equal(got, expected)  # written rows exact, untouched rows unchanged


def test_reinit_of_a_new_bucket_compiles_only_the_scatter(caplog):
    be = JaxBackend()
    vocab, dim = 256, 4
    values = np.zeros((vocab, dim), np.float32)
    table = be.create_table(values, Placement(vocab, 1, "div"))
    table = _reinit(be, table, np.arange(3), np.ones((3, dim), np.float32))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        table = _reinit(be, table, np.arange(10, 43), np.full((33, dim), 2, np.float32))  # bucket 36
        table.data.block_until_ready()
    msgs = _compiles(caplog)
    assert not [m for m in msgs if "concatenate" in m or "broadcast_in_dim" in m], msgs
    expected = values.copy()
    expected[:3] = 1
    expected[10:43] = 2
    np.testing.assert_array_equal(be.unshard(table), expected)
