"""me.jax's side of the step's routing (``meshembed.embedding.routing``), traced into a user's
``jax.jit``: :class:`PaddedInputs` reads a padded me.jax :class:`~.step.Batch`, and
:class:`TracedUpdater` runs each routed update with the programs ``TPUEmbedding(backend="jax")``
runs (the rule's fused CPU kernel or the XLA step, the rounds of gradient accumulation off, the
16-bit branch), so me.jax and the engine give the same bits through one routing.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshembed.config.rowwise import slot_width
from meshembed.embedding.layout import TableSpec
from meshembed.embedding.updates import is_non_lazy, rule_values, with_every_row
from meshembed.errors import ConfigError
from meshembed.math.rule import UpdateRule
from meshembed_jax import native
from meshembed_jax.backend import JaxBackend
from meshembed_jax.distributed import ShardLayout, bucket
from meshembed_jax.kernels import low_precision, traced_rule_errors


class PaddedInputs:
    """``routing.StepInputs`` over a me.jax batch: every feature padded to its static capacity
    (ids -1, slots out of range, scale 0), traced or concrete; no feature is known to be an
    identity (that is a property of values), and a feature is unit-scaled where it has no
    weights and the sum combiner (``weighted`` false)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def array(self, k: int, name: str) -> Any:
        return jnp.asarray(getattr(self.batch, name)[k])

    def joined(self, features: Sequence[int], name: str) -> Any:
        parts = [self.array(k, name) for k in features]
        if name == "slots":  # each feature's slots after the previous features' slots (padding: never read)
            offsets = np.cumsum([0] + [self.batch.features[k].num_slots for k in features[:-1]])
            parts = [p + int(o) for p, o in zip(parts, offsets)]
        return jnp.concatenate(parts)

    def count(self, k: int) -> int:
        return int(self.batch.features[k].capacity)

    def identity(self, k: int) -> bool:
        return False

    def unit_scale(self, k: int) -> bool:
        return not self.batch.features[k].weighted

    def backward(self, k: int, grad: Any) -> Any:
        """``scale · grad[slot]``; a padding slot (out of range) takes a zero row."""
        rows = jnp.take(grad, self.array(k, "slots"), axis=0, mode="fill", fill_value=0)
        return rows * self.array(k, "scale")[:, None] if self.batch.features[k].weighted else rows


class TracedUpdater:
    """``routing.TableUpdater`` for one me.jax step: the state's static part ``st``, the batch
    (``inputs``), the state's arrays ``tables`` (by table name, then array name), this step's
    learning rates ``lrs`` (traced or not), the device ``guard`` (false: nothing written) and
    ``step``, the steps applied before this one (a 16-bit table's random bits)."""

    grad_index_updates = True
    shaped_rows = False

    def __init__(self, st: Any, inputs: PaddedInputs, tables: Mapping[str, Mapping[str, Any]], lrs: Sequence[Any],
                 guard: Any, step: Any) -> None:
        self.st, self.inputs, self.tables, self.lrs, self.guard, self.step = st, inputs, tables, lrs, guard, step
        self.unique = inputs.batch.unique  # per table: the update's static unique-row capacity (None: every id)

    def _table(self, t: TableSpec) -> tuple:
        """(shard layout, the table's arrays in update order, its rule, this step's values)."""
        rule = self.st.rules[t.index]
        datas = tuple(self.tables[t.name][n] for n in self.st.names[t.index])  # jit returns sorted dict keys
        return self.st.shard_layouts[t.index], datas, rule, tuple(rule_values(t, rule, self.lrs))

    def _unique_cap(self, t: TableSpec, n_ids: int) -> int:
        """The update's static unique-row capacity: ``prepare``'s checked bound, else every id."""
        cap = self.unique[t.index] if t.index < len(self.unique) else None
        return n_ids if cap is None else max(1, min(int(cap), n_ids))

    def check(self, t: TableSpec, grads: Sequence[Any]) -> None:
        """Nothing: me.jax checked the concrete gradients before the trace (``return_finite``
        guards the traced ones)."""

    def update_rows(self, t: TableSpec, ids: Any, source: Any, checkable: bool, grad_index: Any = None,
                    grad_weights: Any = None) -> tuple:
        sl, datas, rule, values = self._table(t)
        cap = self._unique_cap(t, int(ids.shape[0]))  # a bound prepare checked
        if grad_index is None:
            return _step(self.st.backend, sl, t.dimension, rule, datas, values, self.guard, cap, ids, source)
        weighted = grad_weights is not None
        w = grad_weights.astype(datas[0].dtype) if weighted else jnp.zeros(1, datas[0].dtype)
        return _step(self.st.backend, sl, t.dimension, rule, datas, values, self.guard, cap, ids, source,
                     (grad_index, w, weighted))

    def per_id(self, t: TableSpec, kind: str, features: Sequence[int], row_grads: Any) -> tuple:
        be = self.st.backend
        sl, datas, rule, values = self._table(t)
        ids = self.inputs.joined(features, "ids")
        every_row = is_non_lazy(t)
        if every_row:  # every row, g = 0 where not looked up (appended last, as the engine's)
            ids, row_grads = with_every_row(t, ids, row_grads)
        if kind == "low_precision":  # 16-bit arrays: the engine's own branch (precision.update_table), traced
            cap = t.vocabulary_size if every_row else self._unique_cap(t, int(ids.shape[0]))
            run = _low_update if isinstance(ids, jax.core.Tracer) else _low_update_compiled
            return run(self.st, t, rule, datas, values, self.guard, ids, row_grads, self.step, cap)
        if kind == "every_row":
            cap = _every_row_cap(be, sl, int(ids.shape[0]))
            return _step(be, sl, t.dimension, rule, datas, values, self.guard, cap, ids, row_grads)
        if kind == "in_order":
            return _in_rounds(be, sl, t.dimension, rule, datas, values, self.guard, ids, row_grads)
        cap = self._unique_cap(t, int(ids.shape[0]))
        return _step(be, sl, t.dimension, rule, datas, values, self.guard, cap, ids, row_grads)


def _low_widths(st: Any, t: Any) -> list[int]:
    return [slot_width(t.optimizer, name, t.dimension) for name in st.names[t.index]]


def _low_update(st: Any, t: Any, rule: UpdateRule, datas: tuple, values: tuple, guard: Any, ids: Any,
                grads: Any, step: Any, cap: int) -> tuple:
    """``precision.update_table`` traced: the program of the JAX engine's low-precision update
    (``meshembed_jax.kernels.low_precision.update``, the same code), on this state's layout."""
    try:
        return low_precision.update(st.backend, st.shard_layouts[t.index], t, rule, datas, values, guard, ids, grads,
                                    step, cap, _low_widths(st, t))
    except low_precision.Inexact as exc:
        raise ConfigError(str(exc)) from None


def _low_update_compiled(st: Any, t: Any, rule: UpdateRule, datas: tuple, values: tuple, guard: Any, ids: Any,
                         grads: Any, step: Any, cap: int) -> tuple:
    """:func:`_low_update` called eagerly: the same program, jitted once per table and shapes
    (``low_precision.update_compiled``; the config's constant values stay Python constants of
    the program, as inside a user's jit; array values, dynamic rates, are its inputs)."""
    cache = st.__dict__.setdefault("_low_programs", {})
    try:
        return low_precision.update_compiled(st.backend, cache, st.shard_layouts[t.index], t, rule, datas, values,
                                             guard, ids, grads, step, cap, _low_widths(st, t))
    except low_precision.Inexact as exc:
        raise ConfigError(str(exc)) from None


def weak_float(x: Any) -> Any:
    """A learning rate as the engine's Python floats are traced: a weakly-typed scalar of the
    *canonical* default float dtype (float32 without x64: float32 rows stay float32; scalar
    algebra as in the engine). Not ``jnp.dtype(float)``: that puts a float64 scalar in an
    x64-off program, and XLA turns ``x / convert(lr)`` into ``x * (1 / lr)`` (1 ulp off the
    engine on FTRL, OnlineYogi, non-lazy Adam on the XLA step)."""
    try:
        from jax._src.lax.lax import _convert_element_type

        return _convert_element_type(x, jax.dtypes.canonicalize_dtype(float), weak_type=True)
    except Exception:  # pragma: no cover - private API moved
        return jnp.asarray(x, jnp.float32)


def _runtime(values: tuple) -> tuple:
    """The values as the engine's compiled step receives them: runtime (weakly-typed) scalars,
    never constants XLA could fold into the math (a constant ``lr`` lets it rewrite
    ``x / lr`` as ``x * (1 / lr)``: 1 ulp off on FTRL with a config's constant rate)."""
    return jax.lax.optimization_barrier(tuple(weak_float(v) for v in values))


def _double_block(kernel: Any, values: tuple) -> Any:
    """The generated kernel's parameter block as the engine passes it: every value a double
    (the NumPy reference's Python floats). A constant (a config's learning rate) is exact;
    a traced value is its own dtype widened (float32 without x64, as it entered the jit).
    Without x64 the doubles travel as uint32 pairs (``native.hp_block``)."""
    if not any(isinstance(v, jax.Array) for v in values):  # all known now: the engine's exact block
        return jnp.asarray(native.hp_block(kernel.params(values)))
    if jax.config.jax_enable_x64:
        return jnp.stack([jnp.asarray(v, jnp.float64).reshape(()) for v in values])
    pairs = [jnp.asarray(native.hp_block([v])) if not isinstance(v, jax.Array) else _f64_bits(v)
             for v in values]
    return jnp.concatenate(pairs)


def _f64_bits(x: Any) -> Any:
    """A float32 scalar's value as the float64 bit pattern, ``[low, high]`` uint32 words
    (little-endian), computed with integer ops so it works without x64: exact for normal,
    subnormal, zero, infinite and NaN values."""
    u = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32).reshape(()), jnp.uint32)
    sign, exp, man = u >> 31, (u >> 23) & 0xFF, u & 0x7FFFFF
    lz = jax.lax.clz(man)  # subnormal: normalise the mantissa (leading one at bit 31 - lz)
    shift = jnp.where(man > 0, lz - 8, 0).astype(jnp.uint32)
    sub_man = (man << shift) & 0x7FFFFF
    d_exp = jnp.where(exp == 0xFF, jnp.uint32(0x7FF),
                      jnp.where(exp > 0, exp + 896, jnp.where(man > 0, 905 - lz.astype(jnp.uint32), 0)))
    d_man = jnp.where((exp == 0) & (man > 0), sub_man, man)
    high = (sign << 31) | (d_exp.astype(jnp.uint32) << 20) | (d_man >> 3)
    return jnp.stack([(d_man & 0x7) << 29, high]).astype(jnp.uint32)


def _every_row_cap(be: JaxBackend, sl: ShardLayout, n_ids: int) -> int:
    """The unique-row capacity the engine's non-lazy update ends with (``JaxBackend.capacity_for`` of its
    padded batch, grown once to ``bucket(1.25 x)`` the rows a device owns when that is short):
    the same capacity, so the same row pieces: XLA:CPU compiles the math per piece shape, and
    [11, 3] pieces gave non-lazy Adam 1 ulp off the engine's [8, 3] (same HLO ops, measured)."""
    p = sl.placement
    owned = np.bincount(p.owner(np.arange(p.vocabulary_size)) // sl.shards_per_device, minlength=sl.n_dev).max()
    cap = be.capacity_for(sl, bucket(n_ids))
    return cap if cap >= owned else bucket(int(owned) + int(owned) // 4)


def _step(be: JaxBackend, sl: ShardLayout, dim: int, rule: UpdateRule, datas: tuple, values: tuple, guard: Any,
          cap: int, ids: Any, grads: Any, combined: tuple | None = None) -> tuple:
    """One update of ``datas`` with the programs ``TPUEmbedding(jax)`` runs: the rule's fused
    CPU kernel where the engine takes it (chosen when lowering, so the step also lowers for
    TPU/GPU), else the XLA step. ``combined``: ``(segs, w, weighted)``, the combiner's backward
    fused in (row ``i``'s gradient ``w[i] * grads[segs[i]]``)."""
    segs, w, weighted = combined or (None, None, False)
    dyn = _runtime(values)
    dedup = be.dedup_for(sl, int(ids.shape[0]))
    xla = be.update_program(sl, dim, len(datas), cap, dedup, rule, combined is not None, weighted)
    extra = (segs, w) if combined else ()

    def run_xla() -> tuple:
        with traced_rule_errors(rule, "me.jax", "train this table with me.TPUEmbedding"):
            return tuple(xla(datas, ids, grads, *extra, guard, dyn)[0])

    found = be.fused_program(sl, dim, rule, [d.dtype for d in datas], combined is not None, weighted)
    if found is None:
        return run_xla()
    fused, kernel = found
    if not combined:
        segs, w = jnp.zeros(1, jnp.int32), jnp.zeros(1, datas[0].dtype)
    hp = _double_block(kernel, values)
    return jax.lax.platform_dependent(cpu=lambda: tuple(fused(datas, ids, grads, segs, w, guard, hp)),
                                      default=run_xla)


def _in_rounds(be: JaxBackend, sl: ShardLayout, dim: int, rule: UpdateRule, datas: tuple, values: tuple,
               guard: Any, ids: Any, grads: Any) -> tuple:
    """Gradient accumulation off: each id's contributions applied one after another, in
    rounds where every id occurs at most once (round r: the r-th occurrence of each id, in
    batch order), as ``Backend.update_rows_in_order``; the number of rounds is a runtime
    value (a ``while`` loop), so a batch with more duplicates compiles nothing new."""
    n = int(ids.shape[0])
    big = jnp.iinfo(ids.dtype).max
    key = jnp.where(ids >= 0, ids, big)  # padding last, in no round
    srt, order = jax.lax.sort_key_val(key, jnp.arange(n, dtype=jnp.int32))  # stable: batch order per id
    pos = jnp.arange(n, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones(1, bool), srt[1:] != srt[:-1]])
    start = jax.lax.cummax(jnp.where(first, pos, 0))
    rounds = jnp.zeros(n, jnp.int32).at[order].set(jnp.where(srt != big, pos - start, -1))
    count = jnp.max(rounds, initial=-1) + 1

    def one(r: Any, tabs: tuple) -> tuple:
        return _step(be, sl, dim, rule, tabs, values, guard, n, jnp.where(rounds == r, ids, -1), grads)

    return jax.lax.fori_loop(0, count, one, datas)
