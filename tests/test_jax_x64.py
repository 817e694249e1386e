"""meshembed never changes ``jax_enable_x64``, and everything works with it off and on.

Each case runs in a fresh interpreter (the flag is process state: ``JAX_ENABLE_X64`` set or
not before jax starts), so the test sees what a user's program would.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = r'''
import numpy as np, jax, jax.numpy as jnp
before = bool(jax.config.jax_enable_x64)
import meshembed as me
from meshembed.errors import ConfigError, InputError
assert bool(jax.config.jax_enable_x64) == before, "import meshembed"
assert "jax" in me.available_backends()
assert bool(jax.config.jax_enable_x64) == before, "available_backends"
user = jnp.ones(2).dtype  # the user's own arrays keep the process's default
E = me.embedding
cfg = me.EmbeddingConfig(
    tables=[me.TableConfig(name="t", vocabulary_size=50, dimension=4, combiner="mean",
                           optimizer=E.Adam(learning_rate=E.DynamicLearningRate(0))),
            me.TableConfig(name="d", vocabulary_size=30, dimension=4, optimizer=E.Adadelta(learning_rate=0.1))],
    features=[me.FeatureConfig(table="t", input_shape=(6,), name="f"),
              me.FeatureConfig(table="d", input_shape=(6,), name="g")])
emb = me.TPUEmbedding(cfg, backend="jax")
ref = me.TPUEmbedding(cfg, backend="numpy")
for dt in (np.int32, np.int64):  # int32 and int64 ids both accepted at enqueue
    for e in (emb, ref):
        e.enqueue([np.arange(6, dtype=dt), np.arange(6, dtype=dt) * 2])
        acts = e.dequeue()
        e.apply_gradients([np.ones((6, 4), np.float32)] * 2, learning_rates=[0.1])
assert str(acts[0].dtype) == "float32"
np.testing.assert_allclose(emb.retrieve_parameters("t")["parameters"], ref.retrieve_parameters("t")["parameters"], rtol=1e-5, atol=1e-5)
assert bool(jax.config.jax_enable_x64) == before, "engine"
# the dense optimizer: int32 iteration counter without x64
w = me.Variable(np.ones(3, np.float32), name="w", backend="jax")
opt = me.optimizers.Adadelta(learning_rate=0.1)
opt.apply_gradients([(jnp.ones(3, jnp.float32), w)])
opt.apply_gradients([(np.ones(3, np.float32), w)])
assert int(opt.iterations.numpy()) == 2
assert str(opt.iterations.dtype) == ("int64" if before else "int32")
# me.jax: every public function
state = me.jax.init(cfg)
batch = me.jax.prepare(cfg, {"f": np.arange(6, dtype=np.int64), "g": np.arange(6)})
@jax.jit
def step(state, batch, lr):
    acts = me.jax.lookup(state, batch)
    grads = jax.grad(lambda a: sum(jnp.sum(v) for v in a.values()))(acts)
    return me.jax.apply_gradients(state, batch, grads, [lr])
state = step(state, batch, 0.1)
assert str(state.step.dtype) == ("int64" if before else "int32")
tx = me.jax.adadelta(learning_rate=0.1)
p = {"w": jnp.ones(3, jnp.float32)}
s = tx.init(p)
u, s = jax.jit(tx.update)(p, s, p)
assert str(s.iteration.dtype) == ("int64" if before else "int32")
if not before:  # float64 tables and >int32 vocabularies need the user's own x64, and say so
    from meshembed.sharding import Placement
    be = me.get_backend("jax")
    for bad, kind in ((lambda: be.create_table(np.zeros((5, 2), np.float64), Placement(5, 1, "mod")), InputError),
                      (lambda: be.layout(Placement(2**31, 1, "mod")), ConfigError),
                      (lambda: be.asarray(np.array([2**40]), dtype="int64"), InputError)):
        try:
            bad()
            raise AssertionError("accepted")
        except kind as exc:
            assert "jax_enable_x64" in str(exc), exc
    from meshembed_jax import JaxBackend
    try:
        JaxBackend(enable_x64=True)
        raise AssertionError("accepted")
    except ConfigError as exc:
        assert "never changes" in str(exc)
assert jnp.ones(2).dtype == user
assert bool(jax.config.jax_enable_x64) == before, "me.jax"
print("X64 OK", before)
'''


@pytest.mark.parametrize("x64", [False, True])
def test_flag_unchanged_and_everything_works(x64):
    env = dict(os.environ)
    env.pop("JAX_ENABLE_X64", None)
    env.pop("MESHEMBED_JAX_X64", None)
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"X64 OK {x64}" in out.stdout


def test_docs_tell_the_truth():
    """docs/tpu.md no longer says the backend turns x64 on."""
    text = (ROOT / "docs" / "tpu.md").read_text()
    assert "turns on `jax_enable_x64`" not in text
    assert "never changes `jax_enable_x64`" in text


def test_float64_conformance_with_the_users_x64():
    """The conformance suite's float64 cases on JAX, x64 turned on by the user (env)."""
    env = dict(os.environ, JAX_ENABLE_X64="1", MESHEMBED_TEST_BACKENDS="jax")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "conformance",
                          "-k", "float64"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]
