"""Optimizer application per table (spec §3.1 steps 2–6, §4.1): which rows, in what rounds.

* Gradient accumulation ON (the default): every contribution to a row — repeated ids,
  samples, features sharing the table — is summed, then the optimizer runs once per
  *looked-up* row (lazy: a row with zero net gradient still counts as touched).
* Non-lazy Adam / Lion: every row of the table is updated, with g = 0 where not looked up.
* Gradient accumulation OFF: contributions are applied one after another, unsummed. We apply
  them in rounds where each id occurs at most once (round r holds the r-th occurrence of
  every id, in enqueue order; with several processes, in rank order after that: the
  concatenated batch), which is one valid order of the unspecified hardware order
  (``Backend.update_rows_in_order``).
* Several processes: every process calls the backend for every table of a step, also when
  it has no ids (the backend's calls are collective; ``Backend.processes``).

The optimizer itself is the table's :class:`~meshembed.math.rule.UpdateRule` (built once by
:func:`make_rule`) with this step's values (:func:`rule_values`: the learning rates); the
backend's ``update_rows`` gathers, runs ``meshembed.math.apply_rule`` (or a kernel compiled
or fused from the rule) and scatters back, so the same math runs on every backend.
"""

from __future__ import annotations

from typing import Any, Sequence

import array_api_compat
import numpy as np

from meshembed.backend.protocol import occurrence_rounds  # noqa: F401 (re-exported)
from meshembed.embedding.layout import TableSpec, _is_dynamic
from meshembed.errors import ConfigError
from meshembed.math.rule import UpdateRule


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


def table_hyperparameters(table: TableSpec, learning_rates: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """(lr, hyper-parameters with dynamic inputs such as ``step_counter`` resolved)."""
    from meshembed import math as me_math

    opt = table.optimizer
    lr = resolve(opt.learning_rate, learning_rates)
    hp = {k: resolve(v, learning_rates) for k, v in opt.hyperparameters().items()}
    for name in me_math.get_math(_algorithm(opt)).dynamic_inputs:
        hp[name] = resolve(getattr(opt, name, None), learning_rates)
    if lr is None:
        if opt.algorithm != "assign":  # Assign ignores the learning rate; others need one
            raise ConfigError(
                f"Table {table.name!r}: {type(opt).__name__} has no learning rate. Fix: pass "
                "`learning_rate=` (a float, a callable or a DynamicLearningRate)."
            )
        lr = 0.0
    # a float, or a traced scalar (me.jax's learning rates under jit: never made concrete)
    return (float(lr) if isinstance(lr, (int, float, np.number)) else lr), hp


def _runs_hlo(backend: Any) -> Any:
    """The backend (an instance or a registered name, "" = the current one) when it runs HLO
    programs (``Capabilities.runs_hlo``), else None."""
    from meshembed.backend.registry import get_backend

    try:
        found = get_backend(backend or None)
    except Exception:  # an unknown or unusable name cannot run anything
        return None
    return found if found.capabilities.runs_hlo else None


def _program_runner(table: TableSpec, backend: Any) -> dict[str, Any]:
    """UserDefinedProgram's ``hlo_runner``/``takes_learning_rate``, from a backend that runs HLO."""
    opt = table.optimizer
    return _runs_hlo(backend).hlo_program(table.name, bytes(opt.program), len(opt.slot_initial_values()))


def _check_trainable(table: TableSpec, backend_name: Any) -> None:
    from meshembed import math as me_math

    opt = table.optimizer
    if not me_math.get_math(_algorithm(opt)).supported:
        raise NotImplementedError(
            f"Table {table.name!r}: {type(opt).__name__} has no public update formula (the TPU "
            "kernel is closed source), so meshembed cannot train it. Its configs load, save and "
            "round-trip; to train, choose another optimizer or a CustomOptimizer."
        )
    if opt.algorithm == "user_defined_program" and _runs_hlo(backend_name) is None:
        name = backend_name if isinstance(backend_name, str) else getattr(backend_name, "name", "")
        raise NotImplementedError(
            f"Table {table.name!r}: UserDefinedProgram runs an XLA HLO program, which the "
            f"{name or 'current'!r} backend cannot compile; only a backend with "
            "capabilities.runs_hlo (the 'jax' backend, through XLA's CPU client) runs it. Fix: use "
            "backend='jax', or a CustomOptimizer with a Python update function."
        )


def _changes_per_step(value: Any) -> bool:
    return value is not None and (_is_dynamic(value) or callable(value))


def make_rule(table: TableSpec, backend_name: Any = "", dtype: str = "float32") -> UpdateRule:
    """The table's :class:`UpdateRule` (build once per table): a learning rate, and every
    hyper-parameter given as a DynamicLearningRate or a callable, are its dynamic values
    (:func:`rule_values`); the others are static."""
    from meshembed import math as me_math
    from meshembed.math.rule import build_rule

    _check_trainable(table, backend_name)
    opt = table.optimizer
    algorithm = _algorithm(opt)
    given = dict(opt.hyperparameters())
    for name in me_math.get_math(algorithm).dynamic_inputs:
        given[name] = getattr(opt, name, None)
    dynamic = [k for k, v in given.items() if _changes_per_step(v)]
    if opt.algorithm == "user_defined_program":  # the backend's HLO runner (static)
        given.update(_program_runner(table, backend_name))
    options = dict(
        gradient_clip=opt.gradient_clipping_limits(), weight_clip=opt.clipping_limits(),
        weight_decay=float(getattr(opt, "weight_decay_factor", 0.0) or 0.0),
        multiply_weight_decay_by_lr=bool(getattr(opt, "multiply_weight_decay_factor_by_learning_rate", False)),
        lazy=not is_non_lazy(table), dtype=str(dtype))
    if hasattr(opt, "slot_names"):
        options["slot_names"] = tuple(opt.slot_names)
    return build_rule(algorithm, given, dynamic=dynamic, **options)


def rule_values(table: TableSpec, rule: UpdateRule, learning_rates: Sequence[float]) -> tuple:
    """This step's values of ``rule.dynamic`` (raises ConfigError without a learning rate)."""
    lr, hp = table_hyperparameters(table, learning_rates)
    return (lr, *(hp[name] for name in rule.dynamic[1:]))


def is_non_lazy(table: TableSpec) -> bool:
    hp = table.optimizer.hyperparameters()
    return bool(hp.get("use_non_lazy_adam", False) or hp.get("use_non_lazy_lion", False))


def with_every_row(table: TableSpec, ids: Any, row_grads: Any) -> tuple[Any, Any]:
    """``(ids, row_grads)`` with every row of ``table`` appended with a zero gradient, after the
    looked-up ids: a non-lazy optimizer's update touches every row. Host (NumPy) or backend
    ids, traced ones too, and backend gradients (each in its own namespace: host ids in NumPy's
    own, so no Array API wrapper is imported in the middle of an update, perhaps short of
    memory); the one padding every front end runs."""
    every = table.vocabulary_size
    if isinstance(ids, np.ndarray):
        ids = np.concatenate([ids, np.arange(every, dtype=ids.dtype)])
    else:
        ixp = array_api_compat.array_namespace(ids)
        ids = ixp.concat([ids, ixp.arange(every, dtype=ids.dtype)])
    gxp = array_api_compat.array_namespace(row_grads)
    zeros = gxp.zeros((every, table.dimension), dtype=row_grads.dtype, device=array_api_compat.device(row_grads))
    return ids, gxp.concat([row_grads, zeros], axis=0)


def uses_accumulation(table: TableSpec) -> bool:
    """UNSPECIFIED (None) counts as enabled, as in TF."""
    return getattr(table.optimizer, "use_gradient_accumulation", True) is not False


def update_kind(table: TableSpec) -> str:
    """How a table's rows are updated, the one routing every front end follows:
    ``"every_row"`` (non-lazy Adam/Lion), ``"in_order"`` (gradient accumulation off:
    contributions one after another) or ``"accumulate"`` (summed per looked-up row)."""
    if is_non_lazy(table):
        return "every_row"
    return "accumulate" if uses_accumulation(table) else "in_order"


def apply_table(
    backend: Any,
    state: list[Any],
    table: TableSpec,
    host_ids: np.ndarray,
    row_grads: Any,
    learning_rates: Sequence[float],
    rule: UpdateRule,
    guard: Any = None,
    part_sizes: Sequence[int] | None = None,
    values: Sequence[Any] = (),
) -> list[Any]:
    """Run the optimizer on ``table``'s rows; returns the new ``[params, *slots]``.

    ``rule`` is the table's rule (:func:`make_rule`) and ``values`` this step's values of it
    (:func:`rule_values`), both built and so validated by the caller; ``learning_rates`` are
    not read here (the caller resolved them into ``values``). ``guard`` goes to every
    ``update_rows`` (false: nothing is written). ``part_sizes``: how many of ``host_ids``
    each feature contributed, in order (gradient accumulation off with several processes
    orders an id's contributions by feature, then rank)."""
    extra: dict[str, Any] = {"values": tuple(values)}
    if guard is not None:
        extra["guard"] = guard
    if is_non_lazy(table):
        ids, grads = with_every_row(table, np.asarray(host_ids, dtype=np.int64), row_grads)
        return list(backend.update_rows(state, backend.asarray(ids, dtype="int64"), grads, rule, **extra))
    if host_ids.size == 0 and backend.processes == 1:
        return state  # with several processes an empty rank still takes part in the update
    if uses_accumulation(table):
        return list(backend.update_rows(state, backend.asarray(host_ids, dtype="int64"), row_grads, rule, **extra))
    groups = None if part_sizes is None else np.repeat(np.arange(len(part_sizes)), part_sizes)
    return list(backend.update_rows_in_order(state, host_ids, row_grads, rule, groups=groups, **extra))
