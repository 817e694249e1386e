"""Optimizer application per table (spec §3.1 steps 2–6, §4.1): which rows, in what rounds.

* Gradient accumulation ON (the default): every contribution to a row — repeated ids,
  samples, features sharing the table — is summed, then the optimizer runs once per
  *looked-up* row (lazy: a row with zero net gradient still counts as touched).
* Non-lazy Adam / Lion: every row of the table is updated, with g = 0 where not looked up.
* Gradient accumulation OFF: contributions are applied one after another, unsummed. We apply
  them in rounds where each id occurs at most once (round r holds the r-th occurrence of
  every id, in enqueue order), which is one valid order of the unspecified hardware order.

The optimizer itself is ``meshembed.math.apply_update`` bound to this table's
hyper-parameters and learning rate; the backend's ``update_rows`` gathers, calls it and
scatters back, so the same math runs on every backend.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import array_api_compat
import numpy as np

from meshembed.embedding.layout import TableSpec, _is_dynamic


def resolve(value: Any, learning_rates: Sequence[float]) -> Any:
    """A constant, ``learning_rates[tag]`` for a DynamicLearningRate, or a callable's value
    (TF2's callable learning rates are evaluated once per step)."""
    if value is not None and _is_dynamic(value):
        return learning_rates[int(value.tag)]
    if callable(value):
        return float(value())
    return value


def _algorithm(opt: Any) -> Any:
    """What ``meshembed.math.get_math`` takes: the proto name, or a CustomOptimizer itself."""
    return opt if opt.algorithm == "custom" else opt.algorithm


def table_hyperparameters(table: TableSpec, learning_rates: Sequence[float]) -> tuple[float, dict[str, Any]]:
    """(lr, hyper-parameters with dynamic inputs such as ``step_counter`` resolved)."""
    from meshembed import math as me_math

    opt = table.optimizer
    lr = resolve(opt.learning_rate, learning_rates)
    hp = {k: resolve(v, learning_rates) for k, v in opt.hyperparameters().items()}
    for name in me_math.get_math(_algorithm(opt)).dynamic_inputs:
        hp[name] = resolve(getattr(opt, name, None), learning_rates)
    return float(lr), hp


def make_update_fn(xp: Any, table: TableSpec, learning_rates: Sequence[float]) -> Callable[..., tuple]:
    """``fn(grad_rows, param_rows, *slot_rows) -> (param_rows', *slot_rows')`` for this table."""
    from meshembed import math as me_math

    opt = table.optimizer
    algorithm = _algorithm(opt)
    lr, hp = table_hyperparameters(table, learning_rates)
    decay = float(getattr(opt, "weight_decay_factor", 0.0) or 0.0)
    by_lr = bool(getattr(opt, "multiply_weight_decay_factor_by_learning_rate", False))
    gradient_clip = opt.gradient_clipping_limits()
    weight_clip = opt.clipping_limits()

    def fn(grads: Any, params: Any, *slots: Any) -> tuple:
        new_params, new_slots = me_math.apply_update(
            xp, algorithm, params, grads, tuple(slots), lr=lr, hyperparameters=hp,
            gradient_clip=gradient_clip, weight_clip=weight_clip, weight_decay=decay,
            multiply_weight_decay_by_lr=by_lr,
        )
        return (new_params, *tuple(new_slots))

    return fn


def is_non_lazy(table: TableSpec) -> bool:
    hp = table.optimizer.hyperparameters()
    return bool(hp.get("use_non_lazy_adam", False) or hp.get("use_non_lazy_lion", False))


def uses_accumulation(table: TableSpec) -> bool:
    """UNSPECIFIED (None) counts as enabled, as in TF."""
    return getattr(table.optimizer, "use_gradient_accumulation", True) is not False


def occurrence_rounds(ids: np.ndarray) -> np.ndarray:
    """Round of each contribution: 0 for an id's first occurrence, 1 for its second, ..."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_ids)) + 1]
    run_start = np.repeat(starts, np.diff(np.r_[starts, ids.size]))
    rounds = np.empty(ids.size, dtype=np.int64)
    rounds[order] = np.arange(ids.size) - run_start
    return rounds


def apply_table(
    backend: Any,
    state: list[Any],
    table: TableSpec,
    host_ids: np.ndarray,
    row_grads: Any,
    learning_rates: Sequence[float],
) -> list[Any]:
    """Run the optimizer on ``table``'s rows; returns the new ``[params, *slots]``."""
    xp = backend.xp
    fn = make_update_fn(xp, table, learning_rates)
    if is_non_lazy(table):
        every = np.arange(table.vocabulary_size, dtype=np.int64)
        zeros = xp.zeros(
            (table.vocabulary_size, table.dimension), dtype=row_grads.dtype,
            device=array_api_compat.device(row_grads),
        )
        ids = backend.asarray(np.concatenate([host_ids, every]), dtype="int64")
        return list(backend.update_rows(state, ids, xp.concat([row_grads, zeros], axis=0), fn))
    if host_ids.size == 0:
        return state
    if uses_accumulation(table):
        return list(backend.update_rows(state, backend.asarray(host_ids, dtype="int64"), row_grads, fn))
    rounds = occurrence_rounds(host_ids)
    for r in range(int(rounds.max()) + 1):
        pick = np.flatnonzero(rounds == r)
        sel = xp.take(row_grads, backend.asarray(pick, dtype="int64"), axis=0)
        state = list(backend.update_rows(state, backend.asarray(host_ids[pick], dtype="int64"), sel, fn))
    return state
