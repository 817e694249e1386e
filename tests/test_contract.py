"""The config spec classes and the math registry agree (docs/internals.md contract)."""

from __future__ import annotations

import pytest

import meshembed.config as cfg
from meshembed.math import OPTIMIZERS

SPECS = [cfg.SGD, cfg.Adagrad, cfg.AdagradMomentum, cfg.BoundedAdagrad, cfg.FrequencyAwareAdagrad,
         cfg.FTRL, cfg.Adam, cfg.Momentum, cfg.Lion, cfg.RMSProp, cfg.CenteredRMSProp,
         cfg.MDLAdagradLight, cfg.Adadelta, cfg.ProximalAdagrad, cfg.OnlineYogi, cfg.ProximalYogi,
         cfg.FrequencyEstimator, cfg.Assign]


def test_every_proto_algorithm_has_a_spec_and_a_rule():
    algorithms = {s.algorithm for s in SPECS} | {cfg.UserDefinedProgram.algorithm}
    assert len(algorithms) == 19
    assert algorithms <= set(OPTIMIZERS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.__name__)
def test_spec_matches_math(spec):
    kwargs = {"learning_rate": cfg.DynamicLearningRate(0)} if spec is cfg.FrequencyEstimator else {}
    if spec is cfg.FrequencyAwareAdagrad:
        kwargs["step_counter"] = cfg.DynamicLearningRate(1)
    try:
        instance = spec(**kwargs)
    except TypeError:
        instance = spec()
    rule = OPTIMIZERS[spec.algorithm]
    assert spec.slot_names == rule.slot_names
    assert len(instance.slot_initial_values()) == len(rule.slot_names)
    assert set(instance.hyperparameters()) <= set(rule.hyperparameter_names) | set(rule.dynamic_inputs)
