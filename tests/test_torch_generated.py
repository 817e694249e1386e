"""The torch backend's fused CPU path with generated row kernels (``meshembed_torch/fused_cpu``):
every case of tests/test_codegen.py through ``update_rows`` (dedup, batch-order sums, the
kernel) equals NumPy's segment sum + the core's math bit for bit, float32 and float64; and
TPUEmbedding(backend="torch") equals the NumPy backend through the kernel path, also with a
learning rate that changes every step."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch: pip install 'meshembed[torch]'")

import meshembed as me  # noqa: E402
from meshembed.embedding.updates import make_rule  # noqa: E402
from meshembed.math.rule import apply_rule  # noqa: E402
from meshembed.sharding.placement import Placement  # noqa: E402
from meshembed_native import codegen  # noqa: E402
from meshembed_torch import fused_cpu  # noqa: E402
from tests.test_codegen import IDS, LIBM_NUMPY, RULES, mixture, ulp_distance, values_for  # noqa: E402

VOCAB, DIM, N_IDS = 40, 13, 90


@pytest.fixture(scope="module")
def backends():
    codegen.prebuild([(rule, 1 + len(rule.slot_names)) for rule in RULES])  # one compiler run
    return me.get_backend("torch"), me.get_backend("numpy")


def _problem(rule, seed, weighted):
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.4, size=N_IDS) - 1) % VOCAB  # hot ids repeat
    tables = [mixture(rng, (VOCAB, DIM), rule.dtype)] + [
        mixture(rng, (VOCAB, DIM), rule.dtype, signed=False) for _ in rule.slot_names]
    if weighted:  # the combiner's backward: gradient rows by index, scaled
        grads = rng.standard_normal((30, DIM)).astype(rule.dtype)
        index = rng.integers(0, 30, size=N_IDS)
        weights = rng.uniform(0.1, 2.0, size=N_IDS).astype(np.float32)
    else:
        grads, index, weights = rng.standard_normal((N_IDS, DIM)).astype(rule.dtype), None, None
    return ids, tables, grads, index, weights


def _reference(np_be, rule, values, ids, tables, grads, index, weights):
    """The NumPy backend's segment sum, then the core's math (with the C library's pow/exp/log,
    as the kernels: see tests/test_codegen.py)."""
    rows = grads if index is None else grads[index] * (1.0 if weights is None else weights.reshape(-1, 1))
    uids, g = np_be.segment_sum(ids, rows.astype(rule.dtype))
    with np.errstate(all="ignore"):
        new = apply_rule(LIBM_NUMPY, rule, values, g, *(t[uids] for t in tables))
    out = [t.copy() for t in tables]
    for o, n in zip(out, new):
        o[uids] = n
    return out


#: Every case with one gradient row per id; the weighted (combiner backward) form for the
#: option-free cases of both dtypes (the driver's sums do not depend on the formula).
UPDATE_CASES = [(i, False) for i in range(len(RULES))] + [
    (i, True) for i, name in enumerate(IDS) if name.endswith(("-none-float32", "-none-float64"))]


@pytest.mark.parametrize("index,weighted", UPDATE_CASES,
                         ids=[f"{IDS[i]}-{'weighted' if w else 'rows'}" for i, w in UPDATE_CASES])
def test_fused_update_rows_equals_numpy(backends, index, weighted):
    torch_be, np_be = backends
    rule = RULES[index]
    ids, tables, grads, gindex, weights = _problem(rule, index, weighted)
    values = values_for(rule)
    want = _reference(np_be, rule, values, ids, tables, grads, gindex, weights)
    state = [torch_be.create_table(t.copy(), Placement(VOCAB)) for t in tables]
    before = me.get_backend("torch").stats().get("fused_updates", 0)
    extra = {} if gindex is None else {"grad_index": torch.as_tensor(gindex), "grad_weights": torch.as_tensor(weights)}
    state = torch_be.update_rows(state, torch.as_tensor(ids), torch.as_tensor(grads), rule, values=values, **extra)
    assert me.get_backend("torch").stats().get("fused_updates", 0) == before + 1, "the generated kernel did not run"
    for k, (t, w) in enumerate(zip(state, want)):
        got = torch_be.unshard(t)
        assert got.dtype == w.dtype
        d = ulp_distance(got, w)
        assert d.max() == 0, f"array {k}: {int((d > 0).sum())} elements differ, worst {d.max()} ulp"


ENGINE_CASES = {
    "adam_clip": lambda lr: me.embedding.Adam(learning_rate=lr, clipvalue=0.05, sum_inside_sqrt=False),
    "adam_non_lazy": lambda lr: me.embedding.Adam(learning_rate=lr, lazy_adam=False),
    "ftrl_decay": lambda lr: me.embedding.FTRL(learning_rate=lr, l1_regularization_strength=0.01,
                                               l2_regularization_strength=0.02, beta=0.1, weight_decay_factor=0.01,
                                               multiply_weight_decay_factor_by_learning_rate=True),
    "momentum_nesterov_wclip": lambda lr: me.embedding.Momentum(learning_rate=lr, use_nesterov=True,
                                                                clip_weight_min=-0.05, clip_weight_max=0.05),
    "lion": lambda lr: me.embedding.Lion(learning_rate=lr),
    "centered_rms_prop": lambda lr: me.embedding.CenteredRMSProp(learning_rate=lr, momentum=0.5),
    "proximal_yogi": lambda lr: me.embedding.ProximalYogi(learning_rate=lr, l1=0.001, l2=0.002),
    "adagrad_decay": lambda lr: me.embedding.Adagrad(learning_rate=lr, weight_decay_factor=0.05),
}


def _train(backend: str, make_opt, dynamic: bool, combiner: str = "mean", steps: int = 4) -> dict:
    rng = np.random.default_rng(7)
    lr = me.embedding.DynamicLearningRate(0) if dynamic else 0.05
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 300, 16, optimizer=make_opt(lr), combiner=combiner)],
        features=[me.FeatureConfig("t", (32,), name="f")],
    )
    emb = me.TPUEmbedding(cfg, backend=backend, seed=3)
    for step in range(steps):
        lengths = rng.integers(0, 6, size=32)
        ids = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % 300
        emb.enqueue([me.RaggedIds(np.concatenate([[0], np.cumsum(lengths)]), ids)])
        emb.dequeue()
        grads = [emb.backend.asarray(rng.standard_normal((32, 16)).astype(np.float32))]
        emb.apply_gradients(grads, learning_rates=[0.05 / (1 + step)] if dynamic else ())
    return {name: np.asarray(v) for name, v in emb.retrieve_parameters("t").items()}


@pytest.fixture(scope="module")
def engine_kernels():
    """The engine's rules for ENGINE_CASES, compiled in one compiler run."""
    rules = []
    for make in ENGINE_CASES.values():
        for lr in (0.05, me.embedding.DynamicLearningRate(0)):
            cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 300, 16, optimizer=make(lr))],
                                     features=[me.FeatureConfig("t", (32,), name="f")])
            rule = make_rule(me.TPUEmbedding(cfg, backend="numpy").layout.tables[0], "torch")
            rules.append((rule, 1 + len(rule.slot_names)))
    return codegen.prebuild(rules)


@pytest.mark.parametrize("dynamic", [False, True], ids=["constant_lr", "lr_every_step"])
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_torch_engine_takes_the_generated_kernel_and_equals_numpy(engine_kernels, case, dynamic):
    assert all(k is not None for k in engine_kernels)
    before = me.get_backend("torch").stats().get("fused_updates", 0)
    fused = _train("torch", ENGINE_CASES[case], dynamic)
    assert me.get_backend("torch").stats().get("fused_updates", 0) == before + 4, "the generated kernel did not run on every step"
    reference = _train("numpy", ENGINE_CASES[case], dynamic)
    for name in reference:
        np.testing.assert_array_equal(fused[name], reference[name], err_msg=name)


def test_switched_off_by_the_environment(monkeypatch, engine_kernels):
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", "0")
    before = me.get_backend("torch").stats().get("fused_updates", 0)
    core = _train("torch", ENGINE_CASES["lion"], False, steps=2)
    assert me.get_backend("torch").stats().get("fused_updates", 0) == before
    reference = _train("numpy", ENGINE_CASES["lion"], False, steps=2)
    for name in reference:
        np.testing.assert_allclose(core[name], reference[name], rtol=2e-6, atol=1e-7, err_msg=name)


def test_not_taken_for_a_plain_callable_or_mixed_dtypes(backends):
    torch_be, _ = backends
    rule = RULES[IDS.index("adagrad-base-none-float32")]
    table = torch.zeros(VOCAB, DIM)
    acc = torch.ones(VOCAB, DIM)
    grads = torch.ones(4, DIM)
    assert fused_cpu.kernel_for(lambda g, *rows: rows, (0.1,), [table, acc], grads, 4, None, None) is None
    assert fused_cpu.kernel_for(rule, (0.1,), [table, acc.double()], grads, 4, None, None) is None
    assert fused_cpu.kernel_for(rule, (0.1,), [table, acc], grads.double(), 4, None, None) is None
    assert fused_cpu.kernel_for(rule, (0.1, 0.2), [table, acc], grads, 4, None, None) is None  # core reports it
    kernel = fused_cpu.kernel_for(rule, (0.1,), [table.double(), acc.double()], grads.double(), 4, None, None)
    assert kernel is not None and kernel[0].dtype == "float64" and kernel[1] == (0.1,)
