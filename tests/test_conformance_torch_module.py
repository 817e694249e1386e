"""conformance/functional_torch.py (the ``torch-module`` entries) catches what it exists to catch:
one ulp of difference between me.torch.EmbeddingCollection and the engine, in the activations or
in the update, fails the step; and its compiled subset follows the rule its README states."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import meshembed as me  # noqa: E402
from conformance import functional_torch as ft  # noqa: E402
from conformance import test_engine as cases  # noqa: E402


def _pair():
    return ft.ModuleEngine(cases.config(), backend="torch"), me.TPUEmbedding(cases.config(), backend="torch")


def test_steps_through_the_module_equal_the_engines_bits():
    wrapped, plain = _pair()
    cases.run(wrapped, steps=2)
    cases.run(plain, steps=2)
    assert wrapped._module is not None and wrapped.step == 2  # the module ran, and its tables were kept
    cases.assert_same_state(cases.snapshot(wrapped), cases.snapshot(plain), exact=True)


def test_one_ulp_in_the_modules_activations_fails(monkeypatch):
    from meshembed_torch.frontend.module import EmbeddingCollection

    forward = EmbeddingCollection._run_forward

    def off_by_one_ulp(self, spec, tensors, lrs):
        outs = forward(self, spec, tensors, lrs)
        return [torch.nextafter(outs[0], torch.full_like(outs[0], np.inf))] + list(outs[1:])

    monkeypatch.setattr(EmbeddingCollection, "_run_forward", off_by_one_ulp)
    wrapped, _ = _pair()
    with pytest.raises(AssertionError, match=r"\[torch-module\].*differ in the activations of 'fa'"):
        cases.run(wrapped, steps=1)


def test_a_different_update_in_the_module_fails(monkeypatch):
    from meshembed_torch.frontend.module import EmbeddingCollection

    send = EmbeddingCollection._send

    def nudged(self, pending, grads, lrs):
        return send(self, pending, [grads[0] + 1e-3] + list(grads[1:]), lrs)

    monkeypatch.setattr(EmbeddingCollection, "_send", nudged)
    wrapped, _ = _pair()
    with pytest.raises(AssertionError, match=r"\[torch-module\].*differ in table 'a' 'parameters' after step 1"):
        cases.run(wrapped, steps=1)


def test_a_module_that_accepts_a_refused_batch_fails():
    wrapped, _ = _pair()
    wrapped._forward = lambda features, weights, training: []  # a module that takes anything
    feats, weights = cases.batch(0)
    with pytest.raises(AssertionError, match="the module's forward accepted the same inputs"):
        wrapped.enqueue([feats[0], feats[1], np.full(cases.B, 7)], weights)  # id 7 >= vocabulary 7


def test_compiled_subset_is_the_first_case_of_each_test_and_every_combiner():
    ids = ["conformance/test_engine.py::test_a[torch-module-compiled-1]",
           "conformance/test_engine.py::test_a[torch-module-compiled-2]",
           "conformance/test_engine.py::test_combiner_backward_matches_finite_differences[torch-module-compiled-sum]",
           "conformance/test_engine.py::test_combiner_backward_matches_finite_differences[torch-module-compiled-mean]",
           "conformance/test_engine_optimizers.py::test_optimizer_matches_reference[torch-module-compiled-sgd-plain]",
           "conformance/test_engine_optimizers.py::test_optimizer_matches_reference[torch-module-compiled-sgd-clip]",
           "conformance/test_engine_golden.py::test_gradients_match_tensorflow[torch-module-compiled]",
           "conformance/test_backend_protocol.py::test_gather[torch-module-compiled]"]
    subset = ft.compiled_subset(ids)
    assert subset == {ids[0], ids[2], ids[3], ids[4], ids[6]}
    assert not ft.covers(ids[7], ft.COMPILED_NAME, subset) and not ft.covers(ids[7], ft.NAME)
    assert ft.covers(ids[1], ft.NAME) and ft.covers(ids[1], ft.COMPILED_NAME, subset) == ft.COMPILE_ALL


def test_the_conformance_report_tells_torch_from_torch_module():
    """``meshembed conformance --backends torch,torch-module,...``: each test id goes to its own column
    (the backend names are matched longest first)."""
    from types import SimpleNamespace

    from meshembed.conformance_report import Report, _Collector

    report = Report(backends=["torch", "torch-module", "torch-module-compiled", "jax", "jax-functional", "all"])
    collector = _Collector(report)
    for backend in ("torch", "torch-module", "torch-module-compiled", "jax", "jax-functional"):
        collector.pytest_runtest_logreport(SimpleNamespace(
            when="call", skipped=False, failed=False, outcome="passed", user_properties=[], longrepr=None,
            nodeid=f"conformance/test_engine.py::test_sharding_changes_no_number[{backend}-2-mod]"))
    assert list(report.rows) == ["test_sharding_changes_no_number[2-mod]"]
    assert sorted(report.rows["test_sharding_changes_no_number[2-mod]"]) == sorted(
        ["torch", "torch-module", "torch-module-compiled", "jax", "jax-functional"])
