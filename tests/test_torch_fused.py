"""The torch backend's fused CPU updates (``meshembed_torch/fused_cpu.py``, driving generated row
kernels) against the core functions they stand in for: SGD, Adagrad, Adadelta, plain and weighted
(mean combiner) gradients, 1 shard, 3 MOD shards and 2 DIV shards, on torch with the
kernel, on torch without it and on the NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install 'meshembed[torch]'")

import meshembed as me  # noqa: E402
from meshembed_torch import fused_cpu  # noqa: E402
from tests.fused_cases import OPTIMIZERS, train  # noqa: E402


@pytest.mark.parametrize("algorithm", sorted(OPTIMIZERS))
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("shards,dim,strategy", [(1, 64, "mod"), (3, 7, "mod"), (2, 16, "div")])
def test_fused_kernel_equals_the_core_function(monkeypatch, algorithm, combiner, shards, dim, strategy):
    before = me.get_backend("torch").stats().get("fused_updates", 0)
    fused = train("torch", algorithm, combiner, shards, dim, strategy=strategy)
    assert me.get_backend("torch").stats().get("fused_updates", 0) == before + 3, "the fused kernel did not run"
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", "0")
    core = train("torch", algorithm, combiner, shards, dim, strategy=strategy)
    assert me.get_backend("torch").stats().get("fused_updates", 0) == before + 3
    reference = train("numpy", algorithm, combiner, shards, dim, strategy=strategy)
    for name in reference:
        # Same float32 operations in the same order (batch-order sums, no fused multiply-add)
        # as the NumPy reference: equal to the last bit.
        np.testing.assert_array_equal(fused[name], reference[name], err_msg=name)
        np.testing.assert_allclose(core[name], reference[name], rtol=2e-6, atol=1e-7, err_msg=name)


def test_clipping_takes_the_generated_kernel_too():
    """Gradient clipping wraps the formula: recorded with it, the kernel still runs and equals NumPy."""
    def run(backend):
        cfg = me.EmbeddingConfig(
            tables=[me.TableConfig("t", 100, 4, optimizer=me.embedding.SGD(learning_rate=0.1, clipvalue=0.5))],
            features=[me.FeatureConfig("t", (4,), name="f")],
        )
        emb = me.TPUEmbedding(cfg, backend=backend, seed=1)
        emb.enqueue([np.array([1, 2, 2, 3])])
        emb.dequeue()
        emb.apply_gradients([emb.backend.asarray(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4))])
        return emb.retrieve_parameters("t")["parameters"]

    before = me.get_backend("torch").stats().get("fused_updates", 0)
    fused = run("torch")
    assert me.get_backend("torch").stats().get("fused_updates", 0) == before + 1
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(run("numpy")))


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_cpu, "_state", {})
    with pytest.warns(RuntimeWarning, match="fused CPU updates are unavailable"):
        fused = train("torch", "adagrad", "sum", 1, 8, steps=2)
    reference = train("numpy", "adagrad", "sum", 1, 8, steps=2)
    np.testing.assert_allclose(fused["parameters"], reference["parameters"], rtol=2e-6, atol=1e-7)


def test_bad_gradient_index_raises_and_changes_nothing():
    """Called directly (the engine builds valid indices itself), an index outside the
    gradient rows is an InputError raised before anything is written."""
    from meshembed.embedding.updates import make_rule

    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 50, 8, optimizer=me.embedding.Adagrad(learning_rate=0.1))],
                             features=[me.FeatureConfig("t", (4,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="torch")
    be, state = emb.backend, emb.state.tables[0]
    fn = make_rule(emb.layout.tables[0])
    before = [t.data.clone() for t in state]
    ids, grads = torch.tensor([1, 2, 2, 7]), torch.ones(3, 8)
    calls = me.get_backend("torch").stats().get("fused_updates", 0)
    be.update_rows(state, ids, grads, fn, values=(0.1,), grad_index=torch.tensor([0, 1, 2, 2]))
    assert me.get_backend("torch").stats().get("fused_updates", 0) == calls + 1 and not torch.equal(state[0].data, before[0])
    before = [t.data.clone() for t in state]
    with pytest.raises(me.errors.InputError, match="grad_index"):
        be.update_rows(state, ids, grads, fn, values=(0.1,), grad_index=torch.tensor([0, 1, 3, 2]))
    for t, b in zip(state, before):
        assert torch.equal(t.data, b)
