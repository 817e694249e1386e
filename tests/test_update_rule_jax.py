"""JAX takes the UpdateRule too: a learning rate that changes every step is a traced argument
of the compiled update, so 30 steps compile nothing after warm-up (issue #18)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import meshembed as me  # noqa: E402
from meshembed.math.rule import UpdateRule  # noqa: E402
from conformance.test_engine_optimizers import CASES  # noqa: E402
from tests.rule_runs import run_with_changing_lr  # noqa: E402

STEPS = 30
WARM_UP = 3  # one compilation per distinct batch shape: the three inputs repeat from step 3
_COMPILES = [0]


def _count(event: str, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)

COUNT_CASES = [(name, "plain") for name in CASES] + [
    (name, option) for name in ("adam_lazy_sum_inside_sqrt", "ftrl", "sgd")
    for option in ("gradient_clip", "weight_clip", "weight_decay_by_lr")]


def _run(backend, name, option):
    def compiles(emb):
        emb.retrieve_parameters("t")  # waits for the step (and any capacity redo)
        return _COMPILES[0]

    return run_with_changing_lr(backend, name, option, STEPS, num_shards=1, after_step=compiles)


@pytest.mark.parametrize("path", ["xla", "fused"])
@pytest.mark.parametrize("name,option", COUNT_CASES, ids=[f"{n}-{o}" for n, o in COUNT_CASES])
def test_changing_learning_rate_compiles_nothing_after_warm_up(monkeypatch, name, option, path):
    """Through the compiled core function (``MESHEMBED_JAX_FUSED=0``) and through the
    generated fused kernels (the values travel in a host-made parameter block)."""
    if path == "xla":
        monkeypatch.setenv("MESHEMBED_JAX_FUSED", "0")
    be = me.get_backend("jax")
    calls = be.stats().get("fused_updates", 0)
    got, counts = _run("jax", name, option)
    assert counts[-1] == counts[WARM_UP - 1], f"recompiled after warm-up: compilations so far per step {counts}"
    if path == "xla":
        assert any(k[0] == "update" and isinstance(k[-1], UpdateRule) for k in be._kernels), "no kernel keyed on the rule"
    elif name != "user_defined_program":  # every recordable rule takes the generated kernel
        assert be.stats().get("fused_updates", 0) - calls == STEPS, "the fused kernel did not run every step"
    want, _ = _run("numpy", name, option)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)
