"""The embedding step as functions over plain data, the one place its logic lives.

``lookup(backend, state, batch)`` is RecvTPUEmbeddingActivations and ``apply_gradients(backend,
state, batch, gradients, learning_rates)`` is SendTPUEmbeddingGradients: the per-table routing
(gradient accumulation on/off, non-lazy optimizers, the combiner's backward fused into the
update or not) and every gradient / learning-rate check. Both take an :class:`EngineState`
(tables and slots as backend arrays, the step counter) and a :class:`~meshembed.embedding.batch.Batch`
and return new values; nothing is changed in place that the caller still holds, except the
backend's donated buffers where its ``update_rows`` donates them (the returned state is the
one to use, as after a donating ``jax.jit``). ``TPUEmbedding`` is TF's state machine over
these functions; ``me.ops``, ``me.tpu``, ``me.torch`` and ``me.jax`` call them too.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from meshembed.backend import Backend, memory
from meshembed.embedding import combiners, inputs, precision, routing
from meshembed.embedding.agreement import agreed, fingerprint, first_argument, validated
from meshembed.embedding.batch import Batch, by_feature, prepare
from meshembed.embedding.layout import FeatureSpec, Layout, TableSpec
from meshembed.embedding.updates import apply_table, is_non_lazy, make_rule, rule_values
from meshembed.errors import CapacityError, InputError, NonFiniteError, StateError
from meshembed.math.rule import UpdateRule

__all__ = ["EngineState", "make_rules", "prepare_on", "lookup", "apply_gradients", "check_learning_rates",
           "check_gradients", "learning_rate_list"]


@dataclass(frozen=True)
class EngineState:
    """Every table's ``(parameters, *slots)`` backend arrays by table index (the slots in
    Load/Retrieve order), the number of steps applied, and the layout (config) they are for."""

    tables: Mapping[int, tuple[Any, ...]]
    step: int = 0
    layout: Layout | None = None

    def replace(self, tables: Mapping[int, Sequence[Any]], steps: int = 0) -> "EngineState":
        """This state with some tables replaced and ``steps`` more steps counted."""
        merged = dict(self.tables)
        merged.update({k: tuple(v) for k, v in tables.items()})
        return EngineState(merged, self.step + steps, self.layout)


def make_rules(backend: Any, layout: Layout) -> dict[int, UpdateRule]:
    """Each table's UpdateRule (build once per engine: a UserDefinedProgram compiles here)."""
    return {t.index: make_rule(t, backend) for t in layout.tables}


def traced_call_error(call: str) -> StateError:
    return StateError(
        f"Cannot call `{call}()` inside `jax.jit` (or another JAX transformation): the stateful "
        "TPUEmbedding runs eagerly and would store tracers. Nothing was changed. Fix: call it "
        "outside the traced function, or use the functional JAX API `me.jax` (`me.jax.init`, "
        "`prepare`, `lookup`, `apply_gradients`), which is made for jax.jit."
    )


def refuse_if_tracing(backend: Any, call: str) -> None:
    """Under jax.jit even concrete arrays become tracers in the backend's kernels
    (``Backend.tracing``): the stateful call is refused."""
    if backend.tracing():
        raise traced_call_error(call)


@agreed("enqueue", backend_of=first_argument)
def prepare_on(backend: Any, layout: Layout, features: Any, weights: Any = None, **options: Any) -> Batch:
    """``batch.prepare`` for ``backend``, agreed by every process: one rank's bad batch fails
    the call on every rank (before any collective), so none waits for the others."""
    prepared = prepare(layout, features, weights, backend=backend, **options)
    validated(backend, *mode_agreement(prepared.mode))
    return prepared


def mode_agreement(mode: str) -> tuple:
    """``validated``'s arguments for a batch: every process enqueues in the same mode."""
    return fingerprint(mode), "the batch's mode (training / inference / backward_pass_only)", InputError


def _plain(value: Any) -> Any:
    """A value as the same text on every process (no object addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "tag") and not isinstance(value, (int, float)):
        return ("tag", int(value.tag))
    return type(value).__name__


def config_fingerprint(layout: Layout, *parts: Any) -> int:
    """What every process of a multi-process engine must agree on: tables (vocabulary,
    dimension, combiner, optimizer and its hyper-parameters), features, sharding, mode, and
    ``parts`` (e.g. num_shards, seed)."""
    tables = tuple((t.name, t.vocabulary_size, t.dimension, t.combiner, type(t.optimizer).__name__,
                    _plain(getattr(t.optimizer, "learning_rate", None)),
                    tuple(sorted((k, _plain(v)) for k, v in t.optimizer.hyperparameters().items())))
                   for t in layout.tables)
    features = tuple((f.name, f.table, f.output_shape) for f in layout.features)
    return fingerprint(tables, features, layout.strategy, layout.mode, layout.num_dynamic_inputs,
                       _plain(layout.keys), *(_plain(p) for p in parts))


# -- lookup ------------------------------------------------------------------------------------
def lookup(backend: Any, state: EngineState, batch: Batch) -> list[Any]:
    """Activations, one backend array per feature in config order, shape ``input_shape +
    [dimension]`` (``batch.structured`` gives the config's dict)."""
    if batch.mode == "backward_pass_only":
        raise StateError(
            "Cannot look up a batch enqueued in 'backward_pass_only' mode: the forward pass is not "
            "run. Fix: call `apply_gradients(...)`, or enqueue with `mode_override='training'`."
        )
    check_batch(state, batch)
    layout = batch.layout
    outs = []
    for k, (f, d) in enumerate(zip(layout.features, batch.features)):
        t = layout.tables[f.table]
        with memory.allocating(f"the activations of feature {f.name!r} (table {t.name!r})",
                               f.output_shape + (t.dimension,), nothing=_UNCHANGED):
            outs.append(_lookup_one(backend, state, batch, k, f, d, t))
    return outs


#: What a failed allocation of a step leaves: nothing (see ``memory.allocating``).
_UNCHANGED = "The tables, slots and the pending batch are unchanged."


def _lookup_one(backend: Any, state: EngineState, batch: Batch, k: int, f: FeatureSpec, d: Any, t: TableSpec) -> Any:
    """Feature ``k``'s activation, shape ``output_shape + [dimension]``."""
    xp = backend.xp
    table = state.tables[t.index][0]
    ids = batch.device_array(backend, k, "ids")
    quant = getattr(t.optimizer, "simulated_quantization", None)
    if precision.is_low(t):  # 16-bit rows: widened to float32, combined in float32
        return _low_precision_lookup(backend, t, f, d, table, ids, batch, k, quant)
    if quant is not None and getattr(quant, "enabled", True):
        from meshembed.math import quantize

        lo = -np.inf if quant.lower is None else quant.lower
        hi = np.inf if quant.upper is None else quant.upper
        rows = quantize(xp, backend.gather(table, ids), lo, hi, quant.num_buckets)
        scale = xp.reshape(batch.device_array(backend, k, "scale"), (-1, 1))
        act = combiners.forward(backend, rows, scale, batch.device_array(backend, k, "slots"), d.num_slots)
    elif d.identity:  # one id per slot: the rows themselves, no segment sum
        # shaped_rows: the rows come in the activation's shape (no reshape: a copy on JAX)
        shaped = backend.capabilities.shaped_rows and len(f.output_shape) != 1
        act = backend.gather(table, xp.reshape(ids, f.output_shape) if shaped else ids)
        if not d.unit_scale:
            act = act * xp.reshape(batch.device_array(backend, k, "scale"), tuple(act.shape[:-1]) + (1,))
    else:  # fused gather + combine where the backend has one
        weights = None if d.unit_scale else batch.device_array(backend, k, "scale")
        act = backend.gather_combine(table, ids, batch.device_array(backend, k, "slots"), d.num_slots, weights,
                                     offsets=d.offsets)
    shape = f.output_shape + (t.dimension,)
    return act if tuple(act.shape) == shape else xp.reshape(act, shape)


def _low_precision_lookup(backend: Any, t: TableSpec, f: FeatureSpec, d: Any, table: Any, ids: Any, batch: Batch,
                          k: int, quant: Any) -> Any:
    """One feature's float32 activation from a low-precision table (``embedding.precision``):
    the rows widened exactly, then simulated quantization and the combiner in float32."""
    xp = backend.xp
    dtype = precision.array_dtypes(t)[0]
    quantized = quant is not None and getattr(quant, "enabled", True)
    if dtype != "float32" and not quantized and not d.identity and d.unit_scale:
        # the backend's pooled sum that widens as it adds (the same bits), where it has one
        act = backend.gather_combine_low_precision(table, ids, batch.device_array(backend, k, "slots"), d.num_slots,
                                                   dtype, offsets=d.offsets)
        if act is not None:
            return xp.reshape(act, f.output_shape + (t.dimension,))
    rows = precision.lookup_rows(backend, table, ids, dtype)
    if quantized:
        from meshembed.math import quantize

        lo = -np.inf if quant.lower is None else quant.lower
        hi = np.inf if quant.upper is None else quant.upper
        rows = quantize(xp, rows, lo, hi, quant.num_buckets)
    if d.identity:
        act = rows if d.unit_scale else rows * xp.reshape(batch.device_array(backend, k, "scale"), (-1, 1))
    else:
        scale = xp.reshape(batch.device_array(backend, k, "scale"), (-1, 1))
        act = combiners.forward(backend, rows, scale, batch.device_array(backend, k, "slots"), d.num_slots)
    return xp.reshape(act, f.output_shape + (t.dimension,))


# -- validation ----------------------------------------------------------------------------------
def _tags(n: int) -> str:
    """``[0, 1, 2]``, or ``[0, ..., n-1]`` for many tags (never a list of n numbers)."""
    return str(list(range(n))) if n <= 4 else f"[0, 1, ..., {n - 1}]"


def learning_rate_list(layout: Layout, learning_rates: Any, backend: Any = None) -> list[Any]:
    """``learning_rates`` as a list in tag order: a sequence (or rank-1 array) with one value
    per tag, or a mapping with exactly the tags ``0..n-1`` as keys (never its keys as rates)."""
    n = layout.num_dynamic_inputs
    if learning_rates is None:
        return []
    if isinstance(learning_rates, Mapping):
        keys = list(learning_rates)
        ints = [k for k in keys if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))]
        if len(ints) != len(keys) or len(keys) != n or any(not 0 <= int(k) < n for k in keys):
            shown = keys[:8] + (["..."] if len(keys) > 8 else [])
            raise InputError(
                f"Invalid `learning_rates`: a mapping must have exactly the dynamic tags {_tags(n)} "
                f"as keys ({{tag: value}}). Received keys: {shown!r}. Fix: e.g. learning_rates=[0.1] "
                "or {0: 0.1} for tag 0."
            )
        by_tag = {int(k): v for k, v in learning_rates.items()}
        return [by_tag[k] for k in range(n)]
    if isinstance(learning_rates, Sequence) and not isinstance(learning_rates, (str, bytes)):
        return list(learning_rates)
    if not isinstance(learning_rates, (str, bytes)) and hasattr(learning_rates, "shape"):
        arr = inputs.to_host(learning_rates, backend, "`learning_rates`")
        if arr.ndim == 1:
            return list(arr)
    raise InputError(
        f"Invalid `learning_rates`: expected a sequence with one value per dynamic tag (tag "
        f"order) or a mapping {{tag: value}}. Received: {learning_rates!r} "
        f"({type(learning_rates).__name__}). Fix: e.g. learning_rates=[0.1] for tag 0."
    )


def check_learning_rate(value: Any, what: str, backend: Any = None) -> float:
    """One learning rate: a real scalar, finite in float32 (the dtype of the update)."""
    arr = inputs.to_host(value, backend, what)
    if arr.ndim != 0:
        raise InputError(f"Invalid {what}: expected a scalar (rank 0). Received: shape={arr.shape}")
    if arr.dtype.kind not in "fiu":
        raise InputError(f"Invalid {what}: expected a real number. Received: {value!r} ({type(value).__name__})")
    with np.errstate(over="ignore", invalid="ignore"):
        finite32 = bool(np.isfinite(arr.astype(np.float32)))
    if not finite32:  # the update runs in float32: 1e39 would be inf there
        raise InputError(f"Invalid {what}: expected a finite number in float32, the dtype of the update. "
                         f"Received: {arr!r}")
    return float(arr)


def check_learning_rates(layout: Layout, learning_rates: Any, backend: Any = None) -> list[float]:
    """One float per dynamic tag, checked; with none given, the config's TF2 learning-rate
    callables are evaluated (once per step, as TF2 does)."""
    n = layout.num_dynamic_inputs
    lrs = learning_rate_list(layout, learning_rates, backend)
    fns = layout.learning_rate_fns
    source = "learning_rates"
    if not lrs and n and len(fns) >= n and all(fn is not None for fn in fns[:n]):
        lrs = [fn() for fn in fns[:n]]
        source = "learning-rate callable of tag"
    if len(lrs) != n:
        raise InputError(
            f"Invalid `learning_rates`: the config uses {n} dynamic tag(s), so expected {n} "
            f"value(s), learning_rates[k] for tag k. Received: {len(lrs)}."
        )
    return [check_learning_rate(v, f"`learning_rates[{k}]`" if source == "learning_rates" else f"the {source} {k}",
                                backend) for k, v in enumerate(lrs)]


def nonfinite_error(layout: Layout, feature: FeatureSpec) -> InputError:
    t = layout.tables[feature.table]
    return InputError(
        f"Invalid gradient for feature {feature.name!r} (table {t.name!r}): it contains NaN "
        "or Inf. Nothing was updated. Fix: check the loss, clip the gradients, or pass "
        "`allow_nonfinite=True` to apply them anyway."
    )


def is_real(backend: Any, g: Any) -> bool:
    """A real float or integer dtype, on the host or on the backend (no cast, no copy)."""
    if isinstance(g, np.ndarray):
        return g.dtype.kind in "fiu"
    try:
        return bool(backend.xp.isdtype(g.dtype, ("real floating", "integral")))
    except Exception:  # a namespace without isdtype: judge the dtype's name
        name = str(g.dtype).lower()
        return not any(k in name for k in ("complex", "bool", "str", "object"))


def check_gradient(backend: Any, layout: Layout, f: FeatureSpec, g: Any) -> Any:
    """One feature's gradient as a float32 backend array of its activation's shape: a real
    array of exactly that shape (None: zeros, with a warning)."""
    t = layout.tables[f.table]
    shape = f.output_shape + (t.dimension,)
    if g is None:
        warnings.warn(
            f"No gradient for feature {f.name!r}; sending zeros (its looked-up rows still "
            "count as touched, which moves lazy Adam/Momentum state).",
            stacklevel=4,
        )
        with memory.allocating(f"the zero gradient of feature {f.name!r} (table {t.name!r})", shape,
                               nothing=_UNCHANGED):
            g = np.zeros(shape, dtype=np.float32)
    where = f"gradient for feature {f.name!r} (table {t.name!r})"
    if backend.is_traced(g):
        raise inputs.traced_error(where)
    if not backend.is_native(g):
        g = inputs.to_host(g, None, where)
    if not is_real(backend, g):
        raise InputError(
            f"Invalid {where}: expected a real (float or integer) array. Received: "
            f"dtype={g.dtype}. Fix: pass float32 gradients (complex, bool, string and "
            "object arrays are not gradients)."
        )
    if tuple(g.shape) != shape:
        raise InputError(f"Invalid {where}: expected shape {shape} (input_shape + [dimension]). "
                         f"Received: shape={tuple(g.shape)}")
    with np.errstate(over="ignore"), memory.allocating(f"the float32 {where}", shape, nothing=_UNCHANGED):
        g = backend.asarray(g, dtype="float32")  # float64 beyond float32's range: inf, refused by the check
    if backend.is_traced(g):
        raise traced_call_error("apply_gradients")
    return g


def check_gradients(backend: Any, layout: Layout, gradients: Any, check_now: bool = True,
                    unchecked: int | None = None) -> list[Any]:
    """The gradients (a list in config order or a dict, as the activations came) as backend
    arrays; with ``check_now``, NaN/Inf raise — but for the features of table ``unchecked``,
    whose update checks them (``checked_updates``)."""
    out = []
    for f, g in zip(layout.features, by_feature(layout, gradients, "gradients")):
        g = check_gradient(backend, layout, f, g)
        if check_now and f.table != unchecked and not backend.all_finite(g):
            raise nonfinite_error(layout, f)
        out.append(g)
    return out


def check_batch(state: EngineState, batch: Any) -> Batch:
    """``batch`` is a :class:`Batch` prepared for the state's layout (ids of another config
    could lie past this one's tables)."""
    if not isinstance(batch, Batch):
        raise InputError(f"Invalid `batch`. Expected a meshembed Batch (embedding.batch.prepare). "
                         f"Received: {type(batch).__name__}")
    layout = state.layout
    if layout is None:
        raise InputError("Invalid `state`: an EngineState needs the layout it holds tables for (EngineState.layout).")
    if batch.layout is not layout and batch.layout != layout:
        raise InputError(
            "Invalid `batch`: it was prepared for another config (tables "
            f"{[t.name for t in batch.layout.tables]}, features {[f.name for f in batch.layout.features]}). "
            "Fix: prepare it with this engine's config."
        )
    if set(state.tables) != {t.index for t in layout.tables}:
        raise InputError(f"Invalid `state`: expected tables {[t.name for t in layout.tables]}.")
    return batch


# -- apply_gradients -------------------------------------------------------------------------
def _table_checked_in_update(backend: Any, layout: Layout) -> int | None:
    """Without a guard, a backend with checked updates checks one table's gradients (the
    largest) while it sums them instead of in a pass of their own; that table is updated
    first, so a NaN/Inf in it raises before any table is written."""
    if not backend.capabilities.checked_updates or not layout.tables:
        return None
    sizes = [0] * len(layout.tables)
    for f in layout.features:
        sizes[f.table] += int(np.prod(f.output_shape)) * layout.tables[f.table].dimension
    return layout.tables[int(np.argmax(sizes))].index


@agreed("apply_gradients", backend_of=first_argument)
def apply_gradients(
    backend: Any,
    state: EngineState,
    batch: Batch,
    gradients: Any,
    learning_rates: Any = (),
    *,
    allow_nonfinite: bool = False,
    rules: Mapping[int, UpdateRule] | None = None,
) -> EngineState:
    """SendTPUEmbeddingGradients: one gradient per feature (``∂loss/∂activation``, the shape of
    its activation; a list in config order or a dict as the activations came) and
    ``learning_rates[k]`` for dynamic tag k. Returns the new state; a rejected call raises a
    meshembed error before any table is written (``rules``: :func:`make_rules`, built once)."""
    check_batch(state, batch)
    layout = batch.layout
    if batch.mode == "inference":
        raise StateError(
            "Cannot apply gradients to a batch enqueued in 'inference' mode. Fix: enqueue "
            "with `training=True` (or mode_override='training') to train on it."
        )
    # A backend with guarded updates checks NaN/Inf on its devices while the updates run
    # (each writes nothing unless the one guard over every gradient holds); the others first.
    deferred = not allow_nonfinite and backend.capabilities.guarded_updates
    in_update = None if allow_nonfinite or deferred else _table_checked_in_update(backend, layout)
    grads = check_gradients(backend, layout, gradients, check_now=not allow_nonfinite and not deferred,
                            unchecked=in_update)
    lrs = check_learning_rates(layout, learning_rates, backend)
    refuse_if_tracing(backend, "apply_gradients")  # e.g. concrete gradients inside jax.jit
    guard = backend.finite_guard(grads) if deferred and grads else None
    # Every table's rule and values first: an unusable optimizer or learning rate raises
    # before any table is touched (update_rows may donate buffers).
    rules = make_rules(backend, layout) if rules is None else rules
    values = {t.index: rule_values(t, rules[t.index], lrs) for t in layout.tables}
    per_table: dict[int, list[int]] = {t.index: [] for t in layout.tables}
    for f in layout.features:
        per_table[f.table].append(f.index)
    # e.g. a fixed capacity: refuse before any table is written (a backend without the check,
    # the protocol's no-op, is not handed the joined ids: a copy of every id each step, and of
    # every row id for a non-lazy optimizer)
    checks = getattr(type(backend), "check_update", None) is not Backend.check_update
    for t in layout.tables if checks else ():
        ids = [batch.features[k].ids for k in per_table[t.index]]
        n = sum(len(i) for i in ids) + (t.vocabulary_size if is_non_lazy(t) else 0)
        with memory.allocating(f"the row ids of the update of table {t.name!r}", (n,), "int64", nothing=_UNCHANGED):
            if is_non_lazy(t):
                ids.append(np.arange(t.vocabulary_size, dtype=np.int64))
            joined = (ids[0] if len(ids) == 1 else np.concatenate(ids)) if ids else None
        if joined is not None:
            try:
                backend.check_update(state.tables[t.index], joined)
            except CapacityError as exc:
                raise CapacityError(f"Table {t.name!r}: {exc}") from None
    # every process's input is valid and its step, learning rates and mode agree: now the row exchange
    validated(backend, fingerprint(state.step, tuple(lrs), batch.mode, bool(allow_nonfinite)),
              "the step, the learning rates or allow_nonfinite", InputError)
    inputs = HostInputs(backend, batch)
    updater = _EngineUpdater(backend, state, inputs, rules, values, lrs, guard, in_update)
    new: dict[int, list[Any]] = {}
    rows = {t.index: sum(batch.features[k].ids.shape[0] for k in per_table[t.index]) for t in layout.tables}
    try:  # the largest update first: when memory runs out there, no table was written yet
        for t in sorted(layout.tables, key=lambda t: (t.index != in_update, -_config_size(layout, t))):
            with _updating(t, rows[t.index], written=[u.name for u in layout.tables if u.index in new]):
                features = per_table[t.index]
                table_grads = [grads[k] for k in features]
                new[t.index] = routing.update_table(updater, inputs, backend.xp, t, features, table_grads)
    except NonFiniteError:  # from the update of table in_update, which wrote nothing
        bad = [f for f, g in zip(layout.features, grads) if f.table == in_update and not backend.all_finite(g)]
        raise nonfinite_error(layout, bad[0] if bad else layout.features[0]) from None
    if guard is not None and not bool(guard):  # every update wrote nothing
        bad = [f for f, g in zip(layout.features, grads) if not backend.all_finite(g)]
        raise nonfinite_error(layout, bad[0] if bad else layout.features[0])
    return state.replace(new, steps=1)


def _config_size(layout: Layout, t: TableSpec) -> int:
    """Elements of table ``t``'s update as the config sizes it (its features' output slots, or
    every row for a non-lazy optimizer), the same on every process: the update order."""
    if is_non_lazy(t):
        return t.vocabulary_size * t.dimension
    return sum(math.prod(f.output_shape) for f in layout.features if f.table == t.index) * t.dimension


def _update_shape(t: TableSpec, ids: int) -> tuple[int, int]:
    """Rows x dimension of table ``t``'s update working set for ``ids`` looked-up ids (every
    row for a non-lazy optimizer)."""
    return (t.vocabulary_size if is_non_lazy(t) else ids, t.dimension)


def _updating(t: TableSpec, ids: int, written: Sequence[str]) -> Any:
    """``memory.allocating`` for table ``t``'s update: its gradient rows and the rows of its
    parameters and slots. ``written``: tables already updated in place this step."""
    nothing = (_UNCHANGED if not written else f"Tables {list(written)} were already updated in place this step "
               "(the step counter was not advanced and the pending batch was not consumed).")
    return memory.allocating(f"the update of table {t.name!r} (gradient rows, and rows of its parameters and slots)",
                             _update_shape(t, ids), arrays=2 + len(t.optimizer.slot_names), nothing=nothing)


class HostInputs:
    """A host-prepared :class:`Batch` as :func:`routing.update_table` reads it
    (``routing.StepInputs``): one feature's arrays made once on the backend, several joined on
    the host (ragged: a new length every step; no backend compiles per length)."""

    def __init__(self, backend: Any, batch: Batch) -> None:
        self.backend, self.batch = backend, batch

    def array(self, k: int, name: str) -> Any:
        return self.batch.device_array(self.backend, k, name)

    def joined(self, features: Sequence[int], name: str) -> Any:
        if len(features) == 1:
            return self.array(features[0], name)
        parts = [getattr(self.batch.features[k], name) for k in features]
        if name == "slots":  # each feature's slots after the previous features' slots
            offsets = np.cumsum([0] + [self.batch.features[k].num_slots for k in features[:-1]])
            parts = [p + o for p, o in zip(parts, offsets)]
        return self.backend.asarray(np.concatenate(parts), dtype="float32" if name == "scale" else "int64")

    def host_ids(self, features: Sequence[int]) -> np.ndarray:
        parts = [self.batch.features[k].ids for k in features]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def count(self, k: int) -> int:
        return int(self.batch.features[k].ids.shape[0])

    def identity(self, k: int) -> bool:
        return bool(self.batch.features[k].identity)

    def unit_scale(self, k: int) -> bool:
        return bool(self.batch.features[k].unit_scale)

    def backward(self, k: int, grad: Any) -> Any:
        d = self.batch.features[k]
        scale = self.backend.xp.reshape(self.array(k, "scale"), (-1, 1))
        return combiners.backward(self.backend, grad, scale, self.array(k, "slots"), d.unit_scale, d.identity)


@dataclass
class _EngineUpdater:
    """``routing.TableUpdater`` over the backend protocol on concrete arrays: one step's
    tables, rules, values and guard; ``checked``: the table whose gradients are checked for
    NaN/Inf by its update (``_table_checked_in_update``)."""

    backend: Any
    state: EngineState
    inputs: HostInputs
    rules: Mapping[int, UpdateRule]
    values: Mapping[int, tuple]
    lrs: list[float]
    guard: Any
    checked: int | None

    @property
    def grad_index_updates(self) -> bool:
        return bool(self.backend.capabilities.grad_index_updates)

    @property
    def shaped_rows(self) -> bool:
        return bool(self.backend.capabilities.shaped_rows)

    def _extra(self, t: TableSpec) -> dict[str, Any]:
        extra: dict[str, Any] = {"values": self.values[t.index]}
        if self.guard is not None:
            extra["guard"] = self.guard
        return extra

    def check(self, t: TableSpec, grads: Sequence[Any]) -> None:
        """NaN/Inf in the checked table's gradients raise NonFiniteError (nothing written yet)."""
        if t.index == self.checked and not all(self.backend.all_finite(g) for g in grads):
            raise NonFiniteError()

    def update_rows(self, t: TableSpec, ids: Any, source: Any, checkable: bool, grad_index: Any = None,
                    grad_weights: Any = None) -> list[Any]:
        extra = self._extra(t)
        if checkable and t.index == self.checked:
            extra["check_finite"] = True
        if grad_index is not None:
            extra.update(grad_index=grad_index, grad_weights=grad_weights)
        return list(self.backend.update_rows(self.state.tables[t.index], ids, source, self.rules[t.index], **extra))

    def per_id(self, t: TableSpec, kind: str, features: Sequence[int], row_grads: Any) -> list[Any]:
        host_ids = self.inputs.host_ids(features)
        rule, values = self.rules[t.index], self.values[t.index]
        if kind == "low_precision":
            return precision.update_table(self.backend, self.state.tables[t.index], t, rule, values, host_ids,
                                          row_grads, self.state.step, guard=self.guard)
        return apply_table(self.backend, list(self.state.tables[t.index]), t, host_ids, row_grads, self.lrs, rule,
                           guard=self.guard, part_sizes=[self.inputs.count(k) for k in features], values=values)
