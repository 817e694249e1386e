"""UpdateRule: a table's update as data, and what backends do with it (issue #18).

* the rule is frozen and hashable, equal for equal tables, and splits static options from the
  call-time values (every learning rate, every hyper-parameter fed from ``learning_rates``);
* ``apply_rule`` is ``apply_update`` (no second formula);
* torch: with the values as tensor inputs of the compiled update, a learning rate that changes
  every step compiles nothing after warm-up, for every trainable optimizer and the clipping /
  weight-decay options, and the numbers stay the NumPy engine's.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from conformance.test_engine_optimizers import CASES, D, V, _config, _gradients, _inputs
from meshembed.embedding.updates import make_rule, rule_values
from meshembed.math import UpdateRule, apply_rule, apply_update, get_math
from tests.rule_runs import run_with_changing_lr

E = me.embedding


def _table(opt, dim=D):
    return me.TPUEmbedding(_config(opt, dim=dim), backend="numpy").layout.tables[0]


def test_rule_is_hashable_data_built_from_the_config():
    a = make_rule(_table(E.Adam(0.1, beta_1=0.8, clipvalue=(-1.0, 2.0), weight_decay_factor=0.5)))
    b = make_rule(_table(E.Adam(0.1, beta_1=0.8, clipvalue=(-1.0, 2.0), weight_decay_factor=0.5)))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.algorithm == "adam" and a.slot_names == ("momenta", "velocities")
    assert a.dynamic == ("lr",) and dict(a.static)["beta1"] == pytest.approx(0.8)
    assert a.gradient_clip == (-1.0, 2.0) and a.weight_decay == 0.5 and not a.plain and a.lazy
    # another constant is another rule (another compiled kernel); another lr is not
    assert make_rule(_table(E.Adam(0.1, beta_1=0.7))) != make_rule(_table(E.Adam(0.1, beta_1=0.8)))
    assert make_rule(_table(E.Adam(0.1))) == make_rule(_table(E.Adam(0.3)))
    assert not make_rule(_table(E.Adam(0.1, lazy_adam=False))).lazy


def test_dynamic_values_are_the_learning_rates():
    opt = E.FrequencyAwareAdagrad(E.DynamicLearningRate(0), step_counter=E.DynamicLearningRate(1))
    t = _table(opt)
    rule = make_rule(t)
    assert rule.dynamic == ("lr", "step_counter") and "step_counter" not in dict(rule.static)
    assert rule_values(t, rule, [0.25, 7.0]) == (0.25, 7.0)
    with pytest.raises(ValueError, match="'lr'"):
        UpdateRule(get_math("stochastic_gradient_descent"), (), dynamic=("rho",))
    with pytest.raises(ValueError, match="values"):
        apply_rule(np, make_rule(_table(E.SGD(0.1))), (0.1, 0.2), np.ones((1, 2)), np.ones((1, 2)))


def test_apply_rule_is_apply_update():
    rng = np.random.default_rng(0)
    p, g = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32)
    slots = (np.full_like(p, 0.1), np.zeros_like(p))
    opt = E.FTRL(0.2, l1_regularization_strength=0.01, clip_weight_min=-0.3, clip_weight_max=0.4,
                 weight_decay_factor=0.1, multiply_weight_decay_factor_by_learning_rate=True)
    rule = make_rule(_table(opt))
    got = apply_rule(np, rule, (0.2,), g, p, *slots)
    want_p, want_s = apply_update(np, "ftrl", p, g, slots, lr=0.2, hyperparameters=opt.hyperparameters(),
                                  weight_clip=(-0.3, 0.4), weight_decay=0.1, multiply_weight_decay_by_lr=True)
    for a, b in zip(got, (want_p, *want_s)):
        np.testing.assert_array_equal(a, b)


def test_engine_hands_backends_the_rule_once_per_table():
    seen = []
    emb = me.TPUEmbedding(_config(E.Adam(E.DynamicLearningRate(0))), backend="numpy")
    real = emb.backend.update_rows

    def spy(tables, ids, grads, fn, **kw):
        seen.append((fn, kw.get("values")))
        return real(tables, ids, grads, fn, **kw)

    emb.backend.update_rows = spy  # an instance attribute: only this engine's backend object
    try:
        for s, lr in enumerate((0.1, 0.2)):
            feats, weights = _inputs(s)
            emb.enqueue(feats, weights)
            emb.dequeue()
            emb.apply_gradients(_gradients(s, 1.0), learning_rates=[lr])
    finally:
        del emb.backend.update_rows
    assert [v for _, v in seen] == [(0.1,), (0.2,)]
    assert isinstance(seen[0][0], UpdateRule) and seen[0][0] is seen[1][0]


@pytest.mark.parametrize("name", ["numpy", "torch", "array_api_strict"])
def test_update_rows_takes_only_rules(name):
    """A plain update function (the old closure protocol) or a wrong number of values is an
    InputError naming the fix, from update_rows and update_rows_in_order; nothing is written."""
    from meshembed.sharding import Placement

    if name not in me.available_backends():
        pytest.skip(f"{name} is not installed")
    be = me.get_backend(name)
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    table = be.create_table(values, Placement(6, 2, "mod"))
    ids, grads = be.asarray(np.array([1, 4, 1])), be.asarray(np.ones((3, 2), np.float32))
    rule = make_rule(_table(E.SGD(0.1)))
    for call in (be.update_rows, be.update_rows_in_order):
        host_ids = np.array([1, 4, 1]) if call == be.update_rows_in_order else ids
        with pytest.raises(me.InputError, match=r"Expected a meshembed.math.UpdateRule.*Received: function"):
            call([table], host_ids, grads, lambda g, p: (p - g,))
        with pytest.raises(me.InputError, match=r"Expected 1 values, one per \('lr',\)\. Received: 2"):
            call([table], host_ids, grads, rule, values=(0.1, 0.2))
    np.testing.assert_array_equal(be.unshard(table), values)


# -- torch: no recompilation when a learning rate changes ----------------------------------------
torch = pytest.importorskip("torch")
from meshembed_torch.backend import TorchBackend  # noqa: E402

STEPS = 30
WARM_UP = 3  # the first calls compile (and may recompile once for dynamic row counts)

#: Every trainable optimizer (the conformance cases: 17 algorithms, some in two forms; the
#: 18th, FrequencyEstimator, below) with a learning rate that changes every step, and the
#: clipping / weight-decay options on a few of them.
COUNT_CASES = [(name, "plain") for name in CASES] + [
    (name, option) for name in ("sgd", "adagrad", "adam_lazy_sum_inside_sqrt", "ftrl", "adadelta", "custom")
    for option in ("gradient_clip", "weight_clip", "weight_decay", "weight_decay_by_lr")]


def _run(backend, name, option, steps=STEPS, counter=None):
    """Final state of an engine with ``learning_rates=[lr(step)]`` (and a step counter), and
    the compile count after each step."""
    return run_with_changing_lr(backend, name, option, steps, num_shards=2,
                                after_step=lambda emb: None if counter is None else counter.frame_count)


@pytest.fixture
def counting_compile(monkeypatch):
    """``torch.compile`` with a backend that counts dynamo compilations (and runs the graph
    as traced: no inductor time); the registered fused kernels off, so every optimizer takes
    the compiled path."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", "0")
    return counter


@pytest.mark.parametrize("name,option", COUNT_CASES, ids=[f"{n}-{o}" for n, o in COUNT_CASES])
def test_changing_learning_rate_compiles_nothing_after_warm_up(counting_compile, name, option):
    got, counts = _run(TorchBackend(device="cpu", compile="always"), name, option, counter=counting_compile)
    assert counts[0] >= 1, "the compiled path was not taken"
    assert counts[-1] == counts[WARM_UP - 1], f"recompiled after warm-up: compilations per step {counts}"
    want, _ = _run("numpy", name, option)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)


def test_frequency_estimator_step_compiles_once(counting_compile):
    """The 18th trainable optimizer: its learning rate is the global step (width-1 table)."""
    def run(backend):
        opt = E.FrequencyEstimator(E.DynamicLearningRate(0), tau=0.25, max_delta=6.0, outlier_threshold=2.0)
        emb = me.TPUEmbedding(_config(opt, dim=1), backend=backend, num_shards=2,
                              initializers={"t": np.full((V, 1), 6.0, np.float32)})
        counts = []
        for s in range(STEPS):
            feats, weights = _inputs(s % 3)
            emb.enqueue(feats, weights)
            emb.dequeue()
            emb.apply_gradients([np.zeros((4, 1), np.float32)] * 2, learning_rates=[np.float32(1 + 2 * s)])
            counts.append(counting_compile.frame_count)
        return emb.retrieve_parameters("t"), counts

    got, counts = run(TorchBackend(device="cpu", compile="always"))
    assert counts[0] >= 1 and counts[-1] == counts[WARM_UP - 1], counts
    want, _ = run("numpy")
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)


def test_inductor_adam_with_a_changing_learning_rate(monkeypatch):
    """The real compiler (inductor): Adam with a new learning rate every step compiles one
    kernel and matches the NumPy engine."""
    monkeypatch.setenv("MESHEMBED_TORCH_FUSED", "0")
    graphs = []
    real = torch.compile

    def counting(gm, inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counting, **kw))
    be = TorchBackend(device="cpu", compile="always")
    got, _ = _run(be, "adam_lazy_sum_inside_sqrt", "plain", steps=12)
    assert 1 <= len(graphs) <= 2 and len(be._compiled_updates) == 1 and not be._compile_broken
    n = len(graphs)
    _run(be, "adam_lazy_sum_inside_sqrt", "plain", steps=4)  # a new engine, the same rule
    assert len(graphs) == n
    want, _ = _run("numpy", "adam_lazy_sum_inside_sqrt", "plain", steps=12)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)
