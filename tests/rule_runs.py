"""The engine run both backends' no-recompilation tests share (test_update_rule.py for torch,
test_update_rule_jax.py for JAX): a conformance optimizer case trained with a learning rate
that changes every step."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import meshembed as me
from conformance.test_engine_optimizers import CASES, OPTIONS, D, V, _config, _gradients, _inputs


def lr_at(step: int) -> float:
    return 0.3 / (1 + step)


def run_with_changing_lr(backend: str, name: str, option: str, steps: int, num_shards: int,
                         after_step: Callable[[Any], Any]) -> tuple[dict, list]:
    """Final parameters of ``CASES[name]`` with ``OPTIONS[option]`` after ``steps`` steps with
    ``learning_rates=[lr_at(step)]`` (and a step counter where the case has one), and
    ``after_step(engine)`` after each step (e.g. a compile count)."""
    case = CASES[name]
    kw = dict(OPTIONS[option])
    if case["dynamic"]:
        kw["_tag"] = 1
    opt = case["spec"](me.embedding.DynamicLearningRate(0), **kw)
    table0 = np.random.default_rng(7).uniform(-0.5, 0.5, (V, D)).astype(np.float32)
    emb = me.TPUEmbedding(_config(opt), backend=backend, num_shards=num_shards, initializers={"t": table0})
    seen = []
    for s in range(steps):
        feats, weights = _inputs(s % 3)
        emb.enqueue(feats, weights)
        emb.dequeue()
        lrs = [np.float32(lr_at(s))] if name != "assign" else []  # Assign takes no learning rate
        lrs += [np.float32(10 + s)] if case["dynamic"] else []
        emb.apply_gradients(_gradients(s % 3, case["grad_scale"]), learning_rates=lrs)
        seen.append(after_step(emb))
    return emb.retrieve_parameters("t"), seen
