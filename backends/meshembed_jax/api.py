"""``me.jax``: the TPU embedding as pure functions over pytrees, for a user's own ``jax.jit``.

``init`` -> :class:`EmbeddingState` (tables and slots as sharded ``jax.Array``s, a step
counter); ``prepare`` (host, outside jit) -> :class:`Batch` of fixed-shape arrays;
``lookup(state, batch)`` -> activations by feature name; ``apply_gradients(state, batch,
grads, learning_rates)`` -> the new state. Underneath are the JAX backend's compiled kernels
and the core's update functions that ``TPUEmbedding(backend="jax")`` runs (nested ``jax.jit``
calls traced into the user's step), so both give the same bits.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshembed.embedding.layout import load_config
from meshembed.embedding import batch as batches
from meshembed.embedding import precision
from meshembed.embedding import step as steps
from meshembed.embedding.engine import TPUEmbedding
from meshembed.embedding.layout import Layout, build_layout
from meshembed.embedding.step import EngineState as _EngineState
from meshembed.embedding.updates import rule_values, update_kind
from meshembed.math.rule import UpdateRule
from meshembed.errors import CapacityError, ConfigError, InputError
from meshembed_jax import cpu_kernels, kernels
from meshembed_jax.adadelta import AdadeltaState, adadelta  # noqa: F401 (me.jax.adadelta)
from meshembed_jax.backend import JaxBackend, bucket, traced_rule_errors
from meshembed_jax.layout import ShardLayout
from meshembed_jax.table import JaxShardedTable

__all__ = ["EmbeddingState", "Batch", "init", "prepare", "lookup", "apply_gradients", "from_engine",
           "to_engine", "save", "restore", "adadelta", "AdadeltaState"]


class _Static:
    """What never changes between steps (config, layout, backend, placements): the pytree's
    aux data, compared by identity, so a state handed from step to step never retraces."""

    def __init__(self, config: Any, layout: Layout, backend: JaxBackend, shard_layouts: dict[int, ShardLayout],
                 num_shards: int | None) -> None:
        self.config, self.layout, self.backend = config, layout, backend
        self.shard_layouts, self.num_shards = shard_layouts, num_shards
        #: per table: "parameters", then the slots in Load/Retrieve order (the update's order)
        self.names = {t.index: ("parameters",) + tuple(t.optimizer.slot_names) for t in layout.tables}
        self.rules = steps.make_rules(backend, layout)  # the engine's rules, built once


@jax.tree_util.register_pytree_node_class
class EmbeddingState:
    """Every table and slot (``tables[name][slot]``, ``"parameters"`` first, as padded
    ``[shards, rows, D]`` arrays with their ``NamedSharding``) and the step counter.

    Plain arrays as leaves: Orbax-style tools checkpoint it as is; :func:`save` /
    :func:`restore` use meshembed's portable checkpoints (``TPUEmbedding.save`` files)."""

    def __init__(self, tables: dict[str, dict[str, Any]], step: Any, static: _Static) -> None:
        self.tables, self.step, self._static = tables, step, static

    def tree_flatten(self) -> tuple:
        return (self.tables, self.step), self._static

    @classmethod
    def tree_unflatten(cls, static: _Static, children: tuple) -> "EmbeddingState":
        return cls(children[0], children[1], static)

    @property
    def config(self) -> Any:
        return self._static.config

    def parameters(self, table: str) -> dict[str, np.ndarray]:
        """``{"parameters": [V, D], <slot>: ...}`` as NumPy (what ``retrieve_parameters`` gives)."""
        t = self._static.layout.table(table)
        sl = self._static.shard_layouts[t.index]
        return {k: self._static.backend.unshard(JaxShardedTable(self.tables[t.name][k], sl, t.dimension))
                for k in self._static.names[t.index]}

    def __repr__(self) -> str:
        return f"EmbeddingState(tables={list(self.tables)}, step={self.step})"


class _FeatureStatic(NamedTuple):
    name: str
    capacity: int
    num_slots: int
    weighted: bool


@jax.tree_util.register_pytree_node_class
class Batch:
    """One prepared batch: per feature ``ids`` (-1 padding), output ``slots`` (padding: out
    of range) and combiner factors ``scale``, all padded to the feature's static capacity."""

    def __init__(self, ids: tuple, slots: tuple, scale: tuple, features: tuple[_FeatureStatic, ...],
                 unique: tuple[int | None, ...] = ()) -> None:
        self.ids, self.slots, self.scale, self.features = ids, slots, scale, features
        self.unique = unique  # per table: the update's static unique-row capacity (None: all ids)

    def tree_flatten(self) -> tuple:
        return (self.ids, self.slots, self.scale), (self.features, self.unique)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> "Batch":
        return cls(*children, *aux)


# -- backends and state --------------------------------------------------------------------
_BACKENDS: dict[tuple[int, ...], JaxBackend] = {}


def _backend_for(mesh: Any) -> JaxBackend:
    """The registry's JAX backend (kernels shared with ``TPUEmbedding``), or one placing
    tables on ``mesh``'s devices in its order (a ``jax.sharding.Mesh`` or ``me.Mesh``)."""
    from meshembed.backend import get_backend

    if mesh is None:
        return get_backend("jax")
    native = getattr(mesh, "native", mesh)
    devices = getattr(native, "devices", None)
    if devices is None:
        raise ConfigError(f"Invalid `mesh`. Expected a jax.sharding.Mesh or me.Mesh. Received: {mesh!r}")
    flat = list(np.asarray(devices, dtype=object).reshape(-1))
    key = tuple(d.id for d in flat)
    if key not in _BACKENDS:
        _BACKENDS[key] = JaxBackend(devices=flat)
    return _BACKENDS[key]


def _int() -> Any:
    """Counters: int64 with the user's x64, else int32 (meshembed never turns x64 on)."""
    return jnp.int64 if jax.config.jax_enable_x64 else jnp.int32


def _same_devices(layout: Layout, layouts: dict[int, ShardLayout]) -> None:
    """One jitted step takes every table: they must live on the same devices (a default
    shard count is capped per table at its row count, which can leave a tiny table on fewer)."""
    sets = {t.name: tuple(d.id for d in layouts[t.index].mesh.devices.flat) for t in layout.tables}
    widest = max(sets.values(), key=len, default=())
    for name, devs in sets.items():
        if devs != widest:
            raise ConfigError(
                f"Table {name!r} is sharded over {len(devs)} device(s) but another table over {len(widest)}: "
                "one jitted me.jax step needs every table on the same devices. Fix: a vocabulary_size of at "
                f"least {len(widest)} rows for {name!r}, or a mesh of at most {len(devs)} device(s) "
                "(me.jax.init(config, mesh=...))."
            )


def from_engine(emb: TPUEmbedding) -> EmbeddingState:
    """The state of a ``TPUEmbedding`` on the JAX backend (its arrays, not copies: the engine
    must not step afterwards if the state is donated)."""
    if not isinstance(emb.backend, JaxBackend):
        raise ConfigError(f"Invalid engine: me.jax needs backend='jax'. Received: backend={emb.backend.name!r}")
    low = [t.name for t in emb.layout.tables if precision.is_low(t)]
    if low:  # me.jax's traced kernels read and write float32 rows
        raise ConfigError(
            f"Invalid config for me.jax: tables {low} store 16-bit arrays (TableConfig(precision=...)), which "
            "me.jax's traced step does not run yet. Nothing was changed. Fix: use the engine "
            "(me.TPUEmbedding(config, backend='jax')), me.tpu or me.torch for low-precision tables, or store "
            "them in float32 for me.jax (docs/low_precision.md).")
    tables, layouts = {}, {}
    for t in emb.layout.tables:
        state = emb.state.tables[t.index]
        layouts[t.index] = state[0].layout
        names = ("parameters",) + emb.table_slot_names(t.name)
        tables[t.name] = {n: s.data for n, s in zip(names, state)}
    _same_devices(emb.layout, layouts)
    static = _Static(emb.config, emb.layout, emb.backend, layouts, emb.num_shards)
    # replicated on the tables' mesh, as a jitted step returns it (else the 2nd step retraces)
    where = next(iter(layouts.values())).replicated if layouts else None
    step = jax.device_put(np.asarray(emb.step, dtype=_int()), where)
    return EmbeddingState(tables, step, static)


def init(config: Any, *, mesh: Any = None, seed: int = 0, initializers: Mapping[str, Any] | None = None) -> EmbeddingState:
    """Tables and slots initialised as ``TPUEmbedding(config, backend="jax", seed=seed)`` does,
    sharded over ``mesh``'s devices (default: every JAX device)."""
    backend = _backend_for(mesh)
    return from_engine(TPUEmbedding(config, backend=backend, seed=seed, initializers=initializers))


def to_engine(state: EmbeddingState) -> TPUEmbedding:
    """A ``TPUEmbedding`` holding ``state``'s arrays (for ``save``, ``retrieve_parameters``)."""
    st = state._static
    tables = {t.index: tuple(JaxShardedTable(state.tables[t.name][n], st.shard_layouts[t.index], t.dimension)
                             for n in st.names[t.index]) for t in st.layout.tables}
    return TPUEmbedding(st.config, backend=st.backend, num_shards=st.num_shards,
                        state=_EngineState(tables, int(state.step)))


def save(state: EmbeddingState, path: Any) -> Any:
    """A portable meshembed checkpoint (``TPUEmbedding.restore`` reads it on any backend)."""
    return to_engine(state).save(path)


def restore(path: Any, *, mesh: Any = None) -> EmbeddingState:
    """The state of a meshembed checkpoint (written by any backend), on ``mesh``'s devices."""
    return from_engine(TPUEmbedding.restore(path, backend=_backend_for(mesh)))


# -- prepare (host side) -------------------------------------------------------------------
def _layout_of(config: Any) -> tuple[Any, Layout]:
    if isinstance(config, EmbeddingState):
        return config.config, config._static.layout
    config = load_config(config)
    return config, build_layout(config)


def prepare(config: Any, features: Any, weights: Any = None, *, capacity: int | Mapping[str, int] | None = None,
            unique_capacity: int | Mapping[str, int] | None = None) -> Batch:
    """Validate a batch exactly as ``TPUEmbedding.enqueue`` does and pad every feature's ids to
    a static ``capacity`` (an int, ``{feature: int}``, or None: the batch's own size rounded
    up to a bucket), so a jitted step sees the same shapes batch after batch.

    ``unique_capacity`` (an int or ``{table: int}``; None: every id of the table's features)
    bounds the distinct rows of a table one step updates: the update's buffers are sized by
    it, so a bound near the real count (W1: ~30k distinct of 131k ids) makes core-function
    updates (Adam, FTRL, ...) several times cheaper.

    Raises ``CapacityError`` when a feature has more ids than its capacity, or a table more
    distinct ids than its unique capacity."""
    config, layout = _layout_of(config)
    prepared = batches.prepare(layout, features, weights)  # the engine's checks and flattening
    ids, slots, scales, statics = [], [], [], []
    for f, b in zip(layout.features, prepared.features):
        t = layout.tables[f.table]
        n = int(b.ids.shape[0])
        cap = capacity.get(f.name) if isinstance(capacity, Mapping) else capacity
        cap = bucket(n) if cap is None else int(cap)
        if n > cap:
            raise CapacityError(
                f"Feature {f.name!r} (table {t.name!r}): {n} ids this batch exceed its capacity {cap}. "
                f"Nothing was prepared. Fix: pass capacity >= {n} (e.g. capacity={{{f.name!r}: {bucket(n)}}}) "
                "to me.jax.prepare, or split the batch."
            )
        unit, scale = b.unit_scale, b.scale
        idt = np.int32 if t.vocabulary_size < 2**31 - 1 else np.int64
        pid = np.full(cap, -1, idt)
        pid[:n] = b.ids
        pslot = np.full(cap, bucket(b.num_slots), np.int32)  # out of range: dropped by the lookup
        pslot[:n] = b.slots
        pscale = np.zeros(cap, np.float32)
        pscale[:n] = scale.reshape(-1)
        ids.append(pid)
        slots.append(pslot)
        scales.append(pscale)
        statics.append(_FeatureStatic(f.name, cap, int(b.num_slots), not unit))
    unique = []
    for t in layout.tables:
        cap = unique_capacity.get(t.name) if isinstance(unique_capacity, Mapping) else unique_capacity
        if cap is not None:
            mine = [ids[k] for k, f in enumerate(layout.features) if f.table == t.index]
            n_ids = sum(int(m.shape[0]) for m in mine)
            trivial = int(cap) >= min(n_ids, t.vocabulary_size)  # no count needed
            count = 0 if trivial or not mine else _distinct(np.concatenate(mine), t.vocabulary_size)
            if count > int(cap):
                raise CapacityError(
                    f"Table {t.name!r}: {count} distinct ids this batch exceed its unique_capacity {int(cap)}. "
                    f"Nothing was prepared. Fix: pass unique_capacity >= {count} (e.g. "
                    f"{{{t.name!r}: {bucket(count + count // 4)}}}), or leave it None (every id), or split the batch."
                )
            cap = int(cap)
        unique.append(cap)
    return Batch(tuple(ids), tuple(slots), tuple(scales), tuple(statics), tuple(unique))


def _distinct(ids: np.ndarray, vocabulary_size: int) -> int:
    """How many distinct ids (>= 0) in ``ids``: a row mask where the vocabulary is small next
    to a sort (W1: 0.2 ms vs ``np.unique``'s ~10 ms for 131k ids; the engine's enqueue
    does no such count, so prepare must not cost a sort more than it)."""
    ids = ids[ids >= 0]
    if vocabulary_size <= max(1 << 16, 64 * ids.size):
        seen = np.zeros(vocabulary_size, np.bool_)
        seen[ids] = True
        return int(np.count_nonzero(seen))
    return int(np.unique(ids).size)


def _check_batch(layout: Layout, batch: Batch) -> None:
    names = tuple(f.name for f in layout.features)
    if not isinstance(batch, Batch) or tuple(s.name for s in batch.features) != names:
        raise InputError(f"Invalid `batch`. Expected me.jax.prepare(config, ...) for features {list(names)}.")


# -- lookup --------------------------------------------------------------------------------
def lookup(state: EmbeddingState, batch: Batch) -> dict[str, Any]:
    """Activations ``{feature: input_shape + [dim]}`` (RecvTPUEmbeddingActivations); for a config
    given a dict of features, keyed as that dict."""
    st = state._static
    layout, be = st.layout, st.backend
    _check_batch(layout, batch)
    out = {}
    for k, f in enumerate(layout.features):
        t = layout.tables[f.table]
        sl, dim = st.shard_layouts[t.index], t.dimension
        table = state.tables[t.name]["parameters"]
        fs = batch.features[k]
        nb, sb = fs.capacity, bucket(fs.num_slots)
        quant = getattr(t.optimizer, "simulated_quantization", None)
        if quant is not None and getattr(quant, "enabled", True):
            from meshembed.math import quantize

            lo = -np.inf if quant.lower is None else quant.lower
            hi = np.inf if quant.upper is None else quant.upper
            gather = be._kernel(("lookup", sl, dim), lambda: kernels.make_lookup(sl, dim))
            rows = quantize(be.xp, gather(table, jnp.asarray(batch.ids[k])), lo, hi, quant.num_buckets)
            act = be.segment_sum_to(rows * jnp.asarray(batch.scale[k])[:, None], jnp.asarray(batch.slots[k]), fs.num_slots)
        else:
            fn = be._kernel(("gather_combine", sl, dim, nb, sb, fs.weighted),
                            lambda: kernels.make_gather_combine(sl, dim, nb, sb, fs.weighted))
            w = jnp.asarray(batch.scale[k], table.dtype) if fs.weighted else jnp.zeros(1, table.dtype)
            act = fn(table, jnp.asarray(batch.ids[k]), jnp.asarray(batch.slots[k]), w)[: fs.num_slots]
        out[f.name] = act.reshape(f.output_shape + (dim,))
    return batches.structured(layout, [out[f.name] for f in layout.features]) if layout.keys else out


# -- apply_gradients -----------------------------------------------------------------------
def _weak(x: Any) -> Any:
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


def _traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _learning_rates(layout: Layout, learning_rates: Any) -> list[Any]:
    """The engine's learning-rate checks (a dict by tag, never its keys; the count; NaN/Inf
    and float32 overflow) on every concrete value; a traced one is checked for rank and dtype
    only (its value is not known while tracing)."""
    lrs = steps.learning_rate_list(layout, learning_rates)
    if not lrs and layout.num_dynamic_inputs:
        lrs = steps.check_learning_rates(layout, None)  # the config's callables (TF2)
    if len(lrs) != layout.num_dynamic_inputs:
        steps.check_learning_rates(layout, lrs)  # raises the engine's count error
    out = []
    for k, v in enumerate(lrs):
        what = f"`learning_rates[{k}]`"
        if not _traced(v):
            steps.check_learning_rate(v, what)
        elif jnp.ndim(v) != 0 or not jnp.issubdtype(jnp.result_type(v), jnp.number) \
                or jnp.issubdtype(jnp.result_type(v), jnp.complexfloating):
            raise InputError(f"Invalid {what}: expected a real scalar. Received: {v!r}")
        out.append(_weak(v))
    return out


def _update_fn(t: Any, rule: UpdateRule, lrs: list[Any]) -> tuple:
    """This step's values of the table's rule (the engine's ``rule_values``), with the traced
    learning rates; static hyper-parameters stay Python constants (as in the NumPy reference)."""
    return tuple(rule_values(t, rule, lrs))


def _runtime(values: tuple) -> tuple:
    """The values as the engine's compiled step receives them: runtime (weakly-typed) scalars,
    never constants XLA could fold into the math (a constant ``lr`` lets it rewrite
    ``x / lr`` as ``x * (1 / lr)``: 1 ulp off on FTRL with a config's constant rate)."""
    return jax.lax.optimization_barrier(tuple(_weak(v) for v in values))


def _unique_cap(batch: Batch, table: int, n_ids: int) -> int:
    """The update's static unique-row capacity: ``prepare``'s checked bound, else every id."""
    cap = batch.unique[table] if table < len(batch.unique) else None
    return n_ids if cap is None else max(1, min(int(cap), n_ids))


def _double_block(kernel: Any, values: tuple) -> Any:
    """The generated kernel's parameter block as the engine passes it: every value a double
    (the NumPy reference's Python floats). A constant (a config's learning rate) is exact;
    a traced value is its own dtype widened (float32 without x64, as it entered the jit).
    Without x64 the doubles travel as uint32 pairs (``cpu_kernels.hp_block``)."""
    if not any(isinstance(v, jax.Array) for v in values):  # all known now: the engine's exact block
        return jnp.asarray(cpu_kernels.hp_block(kernel.params(values)))
    if jax.config.jax_enable_x64:
        return jnp.stack([jnp.asarray(v, jnp.float64).reshape(()) for v in values])
    pairs = [jnp.asarray(cpu_kernels.hp_block([v])) if not isinstance(v, jax.Array) else _f64_bits(v)
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
    """The unique-row capacity the engine's non-lazy update ends with (``_capacity_for`` of its
    padded batch, grown once to ``bucket(1.25 x)`` the rows a device owns when that is short):
    the same capacity, so the same row pieces: XLA:CPU compiles the math per piece shape, and
    [11, 3] pieces gave non-lazy Adam 1 ulp off the engine's [8, 3] (same HLO ops, measured)."""
    p = sl.placement
    owned = np.bincount(p.owner(np.arange(p.vocabulary_size)) // sl.shards_per_device, minlength=sl.n_dev).max()
    cap = be._capacity_for(sl, bucket(n_ids))
    return cap if cap >= owned else bucket(int(owned) + int(owned) // 4)


def _row_grads(batch: Batch, rows: list, parts: list) -> list:
    """Each id's own gradient ``scale · grad[slot]`` (the engine's ``combiners.backward``;
    padding: slot out of range -> 0)."""
    out = []
    for k, _ in parts:
        g = jnp.take(rows[k], jnp.asarray(batch.slots[k]), axis=0, mode="fill", fill_value=0)
        out.append(g * jnp.asarray(batch.scale[k])[:, None] if batch.features[k].weighted else g)
    return out


def _step(be: JaxBackend, sl: ShardLayout, dim: int, rule: UpdateRule, datas: tuple, values: tuple, guard: Any,
          cap: int, ids: Any, grads: Any, combined: tuple | None = None) -> tuple:
    """One update of ``datas`` with the programs ``TPUEmbedding(jax)`` runs: the rule's fused
    CPU kernel where the engine takes it (chosen when lowering, so the step also lowers for
    TPU/GPU), else the XLA step. ``combined``: ``(segs, w, weighted)``, the combiner's backward
    fused in (row ``i``'s gradient ``w[i] * grads[segs[i]]``)."""
    segs, w, weighted = combined or (None, None, False)
    dyn = _runtime(values)
    dedup = be._dedup_for(sl, int(ids.shape[0]))
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


def apply_gradients(state: EmbeddingState, batch: Batch, gradients: Any, learning_rates: Sequence[Any] = (),
                    *, allow_nonfinite: bool = False) -> EmbeddingState:
    """SendTPUEmbeddingGradients as a pure function: ``gradients`` as :func:`lookup` returned
    the activations (a dict by feature name, or a list in config order), ``learning_rates[k]``
    for dynamic tag k (traced scalars: changing them never recompiles). Returns the new state.

    Called outside jit, the engine's checks hold: NaN/Inf gradients or learning rates raise
    ``InputError`` naming the feature (unless ``allow_nonfinite=True``). Inside jit nothing can
    be checked against the values: NaN/Inf gradients are applied as on a TPU. Called outside jit, the kernels donate ``state``'s
    buffers: use the returned state, as after a donating ``jax.jit``."""
    st = state._static
    layout, be = st.layout, st.backend
    _check_batch(layout, batch)
    grads = batches.by_feature(layout, gradients, "gradients")
    rows = []
    for f, g in zip(layout.features, grads):
        t = layout.tables[f.table]
        shape = f.output_shape + (t.dimension,)
        where = f"gradient for feature {f.name!r} (table {t.name!r})"
        if g is None or tuple(jnp.shape(g)) != shape:
            raise InputError(
                f"Invalid {where}: expected shape {shape} "
                f"(input_shape + [dimension]). Received: {None if g is None else tuple(jnp.shape(g))}"
            )
        dtype = np.dtype(jnp.result_type(g)) if hasattr(g, "dtype") else np.asarray(g).dtype
        if dtype.kind not in "fiu":
            raise InputError(f"Invalid {where}: expected a real (float or integer) array. Received: "
                             f"dtype={dtype}. Fix: pass float32 gradients (complex, bool, string and "
                             "object arrays are not gradients).")
        g = jnp.asarray(g).astype(jnp.float32)
        if not allow_nonfinite and not _traced(g) and not bool(jnp.all(jnp.isfinite(g))):
            raise steps.nonfinite_error(layout, f)
        rows.append(g.reshape(-1, t.dimension))
    lrs = _learning_rates(layout, learning_rates)
    # The tables are written in place after the gradients exist: when those come from this
    # step's lookup (they do in training), the lookup's reads are done by then, so XLA need
    # not copy a table around the in-place update (W1: 0.2 s a step).
    tables_in, rows = jax.lax.optimization_barrier((state.tables, rows))
    # a runtime value, as the engine's guard: constant, XLA would unroll the kernels' one-trip
    # loops around their in-place FFI calls and copy each table twice (W1: 0.5 s a step)
    guard = jax.lax.optimization_barrier(jnp.asarray(True))
    tables = dict(state.tables)
    for t in layout.tables:
        parts = [(k, f) for k, f in enumerate(layout.features) if f.table == t.index]
        if not parts:
            continue
        sl, dim = st.shard_layouts[t.index], t.dimension
        names = st.names[t.index]  # a dict comes back from jit with sorted keys: the order is ours
        datas = tuple(tables_in[t.name][n] for n in names)
        rule = st.rules[t.index]
        values = _update_fn(t, rule, lrs)
        kind = update_kind(t)  # the engine's routing
        ids = jnp.concatenate([jnp.asarray(batch.ids[k]) for k, _ in parts])
        if kind == "every_row":  # non-lazy Adam/Lion: every row, g = 0 where not looked up (as apply_table)
            every = jnp.arange(t.vocabulary_size, dtype=ids.dtype)
            ids = jnp.concatenate([ids, every])
            g = jnp.concatenate([*_row_grads(batch, rows, parts), jnp.zeros((t.vocabulary_size, dim), jnp.float32)])
            cap = _every_row_cap(be, sl, int(ids.shape[0]))
            new = _step(be, sl, dim, rule, datas, values, guard, cap, ids, g)
        elif kind == "in_order":
            new = _in_rounds(be, sl, dim, rule, datas, values, guard, ids, jnp.concatenate(_row_grads(batch, rows, parts)))
        else:  # the combiner's backward fused into the update, as the engine
            offsets = np.cumsum([0] + [batch.features[k].num_slots for k, _ in parts[:-1]])
            segs = jnp.concatenate([jnp.asarray(batch.slots[k]) + int(o) for (k, _), o in zip(parts, offsets)])
            weighted = any(batch.features[k].weighted for k, _ in parts)
            w = (jnp.concatenate([jnp.asarray(batch.scale[k]) for k, _ in parts]).astype(datas[0].dtype) if weighted
                 else jnp.zeros(1, datas[0].dtype))
            source = jnp.concatenate([rows[k] for k, _ in parts]) if len(parts) > 1 else rows[parts[0][0]]
            cap = _unique_cap(batch, t.index, int(ids.shape[0]))  # a bound prepare checked
            new = _step(be, sl, dim, rule, datas, values, guard, cap, ids, source, (segs, w, weighted))
        tables[t.name] = dict(zip(names, new))
    return EmbeddingState(tables, state.step + 1, st)
