"""``me.jax``'s step functions (the public names are re-exported by :mod:`meshembed_jax.frontend`):
the TPU embedding as pure functions over pytrees, for a user's own ``jax.jit``.

``init`` -> :class:`EmbeddingState` (tables and slots as sharded ``jax.Array``s, a step
counter); ``prepare`` (host, outside jit) -> :class:`Batch` of fixed-shape arrays;
``lookup(state, batch)`` -> activations by feature name; ``apply_gradients(state, batch,
grads, learning_rates)`` -> the new state. Each table's update is the engine's
``routing.update_table`` run with :mod:`.updater` (the JAX backend's compiled programs that
``TPUEmbedding(backend="jax")`` runs, traced into the user's step), so both give the same bits.

Checks are the engine's (``meshembed.embedding.batch`` / ``step``): values are checked where
they are known (outside a trace); inside ``jax.jit`` the shapes, dtypes, the state's
structure and the batch's config are. ``jax.grad``/``jax.jvp`` with respect to the tables and
``jax.vmap`` of a step are refused with a meshembed error (the row kernels have neither a
derivative nor a batching rule; the activations are what is differentiable). Both pytree
types are registered for ``jax.export`` serialization; :func:`export` says why a CPU export
cannot carry the CPU kernels.

Low-precision tables (``TableConfig(precision=...)``, docs/low_precision.md) run the engine's
16-bit branch traced (``updater.TracedUpdater`` / ``_low_lookup``): the state holds their 16-bit arrays
as int16 patterns, and every step gives the engine's bits (the optimizer's float math through
``kernels/exact.py``, so XLA cannot fuse it differently from the op-by-op reference).
"""

from __future__ import annotations

import base64
import json
import operator
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshembed.config.rowwise import slot_width
from meshembed.embedding import batch as batches
from meshembed.embedding import dynamic
from meshembed.embedding import inputs
from meshembed.embedding import precision
from meshembed.embedding import routing
from meshembed.embedding import step as steps
from meshembed.embedding.engine import TPUEmbedding
from meshembed.embedding.layout import Layout, build_layout, load_config
from meshembed.embedding.step import EngineState as _EngineState
from meshembed.embedding.updates import rule_values
from meshembed.errors import CapacityError, ConfigError, InputError, StateError
from meshembed.math.rule import UpdateRule
from meshembed.sharding.placement import Placement
from meshembed_jax import kernels
from meshembed_jax.backend import JaxBackend
from meshembed_jax.distributed import AXIS, ShardLayout, bucket
from meshembed_jax.kernels import low_precision
from meshembed_jax.frontend.updater import PaddedInputs, TracedUpdater, weak_float
from meshembed_jax.table import JaxShardedTable

#: Version of the serialized static part of the pytrees (``jax.export`` aux data).
_FORMAT = 1


class _Static:
    """What never changes between steps (config, layout, backend, placements): the pytree's
    aux data, compared by identity (a state handed from step to step never retraces). One
    rebuilt by ``jax.export.deserialize`` also equals a live one with the same description
    (:meth:`key`: config, shard counts, devices), so ``Exported.call`` takes this process's state."""

    def __init__(self, config: Any, layout: Layout, backend: JaxBackend, shard_layouts: dict[int, ShardLayout],
                 num_shards: int | None, dtypes: Mapping[int, Any]) -> None:
        self.config, self.layout, self.backend = config, layout, backend
        self.shard_layouts, self.num_shards = shard_layouts, num_shards
        #: per table: "parameters", then the slots in Load/Retrieve order (the update's order)
        self.names = {t.index: ("parameters",) + tuple(t.optimizer.slot_names) for t in layout.tables}
        #: per table: every array's dtype and padded [shards, rows per shard, dimension] shape
        self.dtypes = {k: np.dtype(v) for k, v in dtypes.items()}
        #: per table: each array's dtype by name (16-bit arrays of a low-precision table: int16
        #: patterns; its float32 slots: float32; any other table: every array in the table's dtype)
        self.array_dtypes = {t.index: dict(zip(self.names[t.index], _storage_dtypes(t, self.dtypes[t.index])))
                             for t in layout.tables}
        self.shapes = {t.index: (shard_layouts[t.index].num_shards, shard_layouts[t.index].max_rows, t.dimension)
                       for t in layout.tables}
        #: what a Batch for this config carries (prepare's _FeatureStatic tail)
        self.batch_key = tuple(_feature_key(layout, f) for f in layout.features)
        self.rules = steps.make_rules(backend, layout)  # the engine's rules, built once
        self._key: Any = None
        self._why = ""
        self.deserialized = False

    def key(self) -> bytes | None:
        """The serialized description (None, with :attr:`_why` saying why, where it cannot be)."""
        if self._key is None:
            try:
                self._key = _describe(self)
            except (InputError, ConfigError, TypeError, ValueError) as exc:
                self._key, self._why = b"", str(exc)
        return self._key or None

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Static):
            return NotImplemented
        if not (self.deserialized or other.deserialized):  # two live ones: identity (their traces stay apart)
            return False
        mine = self.key()
        return mine is not None and mine == other.key()

    def __hash__(self) -> int:
        key = self.key()
        return hash(key) if key is not None else id(self)

    @property
    def replicated(self) -> Any:
        """Where a scalar (the step counter) or a dense array lives: replicated on the tables' mesh."""
        return next(iter(self.shard_layouts.values())).replicated if self.shard_layouts else None


def _storage_dtypes(t: Any, table_dtype: Any) -> tuple:
    """Table ``t``'s ``(parameters, *slots)`` array dtypes: a low-precision table's 16-bit
    arrays as their int16 patterns, its other arrays float32 (``embedding.precision``)."""
    n = 1 + len(tuple(t.optimizer.slot_names))
    if not precision.is_low(t):
        return (np.dtype(table_dtype),) * n
    return tuple(precision.STORAGE.get(d, np.dtype(np.float32)) for d in precision.array_dtypes(t))


def _feature_key(layout: Layout, f: Any) -> tuple:
    t = layout.tables[f.table]
    return (f.name, t.name, t.vocabulary_size, t.dimension, t.combiner, tuple(f.output_shape))


def _step_signature(layout: Layout, rules: Mapping[int, UpdateRule]) -> tuple:
    """Everything of a config the jitted step depends on: features and tables (sizes,
    combiners), the strategy and mode, and each table's rule and constant values."""
    probe = [0.0] * layout.num_dynamic_inputs
    return (layout.strategy, layout.mode, layout.num_dynamic_inputs, layout.per_table_layout, layout.keys,
            tuple(_feature_key(layout, f) for f in layout.features),
            tuple((t.name, rules[t.index], tuple(rule_values(t, rules[t.index], probe)), t.precision)
                  for t in layout.tables))


def _mesh_of(backend: JaxBackend) -> Any:
    """The backend's device description: None (the registry's backend: every JAX device),
    ``{"devices": ids}`` (a user's devices in its order) or, tables on one axis of a user's
    mesh, ``{"devices": nested ids, "axis_names": [...], "axis": name}``."""
    options = {"capacity": backend.capacity, "dedup": backend.dedup}  # they shape the compiled step
    if isinstance(backend, _AxisBackend):
        mesh = backend.user_mesh
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices).tolist()
        return {"devices": ids, "axis_names": list(mesh.axis_names), "axis": backend.axis, **options}
    devices = getattr(backend, "_devices", None)
    return {"devices": None if devices is None else [d.id for d in devices], **options}


def _config_from(desc: dict) -> Any:
    """The EmbeddingConfig of a description: its proto, with what the proto has no field for
    (combiners, a dict's keys) put back as the checkpoints do."""
    from meshembed.config import EmbeddingConfig

    config = EmbeddingConfig.from_proto(base64.b64decode(desc["config"]), combiners=desc["combiners"])
    precisions = desc.get("precision") or {}  # the proto's extension (docs/low_precision.md), as checkpoints carry it
    if precisions:
        from meshembed.config.precision import Precision

        config = config.replace(tables=tuple(t.replace(precision=Precision.from_json(precisions[t.name]))
                                             if t.name in precisions else t for t in config.tables))
    if desc["feature_keys"]:
        object.__setattr__(config, "feature_keys", tuple(desc["feature_keys"]))
    return config


def _describe(st: _Static) -> bytes:
    """``st`` as JSON bytes: everything needed to build it again in another process. Refused
    (InputError) for a config whose step depends on more than those bytes carry."""
    config = st.config
    why = ""
    if not hasattr(config, "to_proto"):
        why = f"its config is a {type(config).__name__}, not a me.EmbeddingConfig (no proto form)"
    elif any(fn is not None for fn in getattr(config, "learning_rate_fns", ()) or ()):
        why = ("its config has learning-rate callables, which are not data (inside jit they were "
               "evaluated once, when traced). Fix: use DynamicLearningRate(tag) and pass learning_rates=")
    if not why and dynamic.dynamic_tables(config):
        why = ("its config has dynamic vocabularies, whose re-initialisation runs a host callback an exported "
               "artifact cannot carry")
    keys = list(getattr(config, "feature_keys", ()) or ())
    if not why and any(not isinstance(k, str) for k in keys):
        why = f"its feature keys {keys!r} are not all strings"
    if why:
        raise InputError(f"Cannot serialize this me.jax EmbeddingState's static part: {why}.")
    import meshembed

    tables = {t.name: {"shards": st.shard_layouts[t.index].num_shards, "devices": st.shard_layouts[t.index].n_dev,
                       "dtype": st.dtypes[t.index].name} for t in st.layout.tables}
    desc = {"format": _FORMAT, "meshembed": meshembed.__version__,
            "config": base64.b64encode(config.to_proto()).decode("ascii"), "feature_keys": keys,
            "combiners": {t.name: t.combiner for t in st.layout.tables},
            "num_shards": st.num_shards, "mesh": _mesh_of(st.backend), "tables": tables}
    precisions = {t.name: t.precision.to_json() for t in st.layout.tables if t.precision is not None}
    if precisions:  # only where there is one: the bytes of other states are unchanged
        desc["precision"] = precisions
    layout = build_layout(_config_from(desc))
    if _step_signature(layout, steps.make_rules(st.backend, layout)) != _step_signature(st.layout, st.rules):
        raise InputError("Cannot serialize this me.jax EmbeddingState's static part: its config holds something "
                         "the TPUEmbeddingConfiguration proto cannot carry that changes the step.")
    return json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()


def _serialize_static(st: _Static) -> bytes:
    key = st.key()
    if key is None:
        raise InputError(st._why)
    return key


def _deserialize_static(data: bytes) -> _Static:
    """A :class:`_Static` built from :func:`_describe`'s bytes on this process's devices."""
    try:
        desc = json.loads(bytes(data).decode())
        fmt = desc["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"Cannot read a me.jax EmbeddingState's static part: not meshembed's description ({exc}).") from None
    if fmt != _FORMAT:
        raise InputError(f"Cannot read a me.jax EmbeddingState's static part of format {fmt!r}: this meshembed "
                         f"reads format {_FORMAT}. Fix: deserialize with the meshembed version that exported it.")
    config = _config_from(desc)
    layout = build_layout(config)
    backend = _backend_from(desc["mesh"])
    layouts, dtypes = {}, {}
    for t in layout.tables:
        entry = desc["tables"][t.name]
        sl = backend.layout(Placement(t.vocabulary_size, int(entry["shards"]), layout.strategy))
        if sl.n_dev != int(entry["devices"]):
            raise InputError(
                f"Cannot rebuild me.jax's EmbeddingState here: table {t.name!r} was sharded over {entry['devices']} "
                f"device(s), here over {sl.n_dev}. Fix: deserialize on a host with the same JAX device count "
                "(or the same mesh) as the one that exported it."
            )
        layouts[t.index], dtypes[t.index] = sl, np.dtype(entry["dtype"])
    st = _Static(config, layout, backend, layouts, desc["num_shards"], dtypes)
    st._key, st.deserialized = bytes(data), True
    return st


@jax.tree_util.register_pytree_node_class
class EmbeddingState:
    """Every table and slot (``tables[name][slot]``, ``"parameters"`` first, as padded
    ``[shards, rows, D]`` arrays with their ``NamedSharding``) and the step counter.

    Plain arrays as leaves: Orbax-style tools checkpoint it as is; :func:`save` /
    :func:`restore` use meshembed's portable checkpoints (``TPUEmbedding.save`` files).
    ``vocab[table]``: a dynamic table's key table (``meshembed_jax.frontend.dynamic``; {} without one)."""

    def __init__(self, tables: dict[str, dict[str, Any]], step: Any, static: _Static, vocab: Any = None) -> None:
        self.tables, self.step, self._static = tables, step, static
        self.vocab = {} if vocab is None else vocab

    def tree_flatten(self) -> tuple:  # the vocab child only where there is one: other pytrees unchanged
        return ((self.tables, self.step, self.vocab) if self.vocab else (self.tables, self.step)), self._static

    @classmethod
    def tree_unflatten(cls, static: _Static, children: tuple) -> "EmbeddingState":
        return cls(children[0], children[1], static, children[2] if len(children) > 2 else None)

    @property
    def config(self) -> Any:
        return self._static.config

    def parameters(self, table: str) -> dict[str, np.ndarray]:
        """``{"parameters": [V, D], <slot>: ...}`` as NumPy (what ``retrieve_parameters`` gives)."""
        st = _check_state(self)
        t = st.layout.table(table)
        _refuse_traced(self.tables[t.name], "EmbeddingState.parameters")
        sl = st.shard_layouts[t.index]
        out = {}
        for k, d in zip(st.names[t.index], precision.array_dtypes(t)):
            v = st.backend.unshard(JaxShardedTable(self.tables[t.name][k], sl, slot_width(t.optimizer, k, t.dimension)))
            out[k] = v if d == "float32" else precision.from_storage(v, d)  # 16-bit: the exact float32 values
        return out

    def __repr__(self) -> str:
        return f"EmbeddingState(tables={list(self.tables)}, step={self.step})"


class _FeatureStatic(NamedTuple):
    name: str
    capacity: int
    num_slots: int
    weighted: bool
    #: the config the batch was prepared for (a batch of another config is refused: its ids
    #: could lie past this one's tables): table, its rows, dimension and combiner, output shape
    table: str | None = None
    vocabulary_size: int | None = None
    dimension: int | None = None
    combiner: str | None = None
    output_shape: tuple = ()


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

    def config_key(self) -> tuple:
        """Per feature: its name, table, the table's rows, dimension and combiner, its output
        shape (as :attr:`_Static.batch_key`)."""
        return tuple((f.name, f.table, f.vocabulary_size, f.dimension, f.combiner, tuple(f.output_shape))
                     for f in self.features)


def _serialize_batch(aux: tuple) -> bytes:
    features, unique = aux
    return json.dumps({"format": _FORMAT, "features": [list(f[:8]) + [list(f.output_shape)] for f in features],
                       "unique": list(unique)}, separators=(",", ":")).encode()


def _deserialize_batch(data: bytes) -> tuple:
    desc = json.loads(bytes(data).decode())
    if desc.get("format") != _FORMAT:
        raise InputError(f"Cannot read a me.jax Batch's static part of format {desc.get('format')!r}: this "
                         f"meshembed reads format {_FORMAT}.")
    features = tuple(_FeatureStatic(*f[:8], tuple(f[8])) for f in desc["features"])
    return features, tuple(desc["unique"])


def _register_serialization() -> None:
    """Both pytree types for ``jax.export`` (``Exported.serialize`` / ``jax.export.deserialize``)."""
    try:
        from jax import export as jexport
    except ImportError:  # pragma: no cover - jax without jax.export
        return
    for cls, name, ser, de in ((EmbeddingState, "meshembed.jax.EmbeddingState", _serialize_static, _deserialize_static),
                               (Batch, "meshembed.jax.Batch", _serialize_batch, _deserialize_batch)):
        try:
            jexport.register_pytree_node_serialization(cls, serialized_name=name, serialize_auxdata=ser,
                                                       deserialize_auxdata=de)
        except ValueError:  # already registered (the module imported twice)
            pass


_register_serialization()


# -- backends and state --------------------------------------------------------------------
class _AxisBackend(JaxBackend):
    """The JAX backend with every table sharded over one axis of a user's mesh and replicated
    over its other axes: the kernels' mesh is the user's devices with that axis named
    ``shard`` (each replica runs the same update on the same ids and gradients)."""

    def __init__(self, mesh: Any, axis: str) -> None:
        from jax.sharding import Mesh

        super().__init__(devices=list(np.asarray(mesh.devices, dtype=object).flat))
        self.user_mesh, self.axis = mesh, axis
        names = tuple(AXIS if a == axis else (f"{a}_" if a == AXIS else a) for a in mesh.axis_names)
        self._table_mesh = Mesh(mesh.devices, names)

    def _capabilities(self) -> Any:
        import dataclasses

        return dataclasses.replace(super()._capabilities(), devices=int(self.user_mesh.shape[self.axis]))

    def layout(self, placement: Placement) -> ShardLayout:
        found = self._layouts.get(placement)
        if found is None:
            super().layout(placement)  # its checks (e.g. ids past int32 without x64)
            n = int(self.user_mesh.shape[self.axis])
            if placement.num_shards % n:
                raise ConfigError(
                    f"Invalid shard count {placement.num_shards} for mesh axis {self.axis!r} of {n} devices: "
                    f"each of its devices holds the same number of shards. Fix: a num_shards that is a multiple "
                    f"of {n} (me.jax.init(config, mesh=..., axis={self.axis!r}, num_shards=...)), and tables of "
                    f"at least that many rows."
                )
            found = self._layouts[placement] = ShardLayout(placement, n, self._table_mesh)
        return found


_BACKENDS: dict[Any, JaxBackend] = {}


def _backend_for(mesh: Any, axis: Any = None) -> JaxBackend:
    """The registry's JAX backend (kernels shared with ``TPUEmbedding``), or one placing
    tables on ``mesh``'s devices in its order (a ``jax.sharding.Mesh`` or ``me.Mesh``): over
    all of them, or over the mesh axis ``axis`` (replicated over the others)."""
    from meshembed.backend import get_backend

    if mesh is None:
        if axis is not None:
            raise ConfigError(f"Invalid `axis`={axis!r} without a `mesh`. Fix: pass the jax.sharding.Mesh "
                              "whose axis the tables are sharded over (me.jax.init(config, mesh=mesh, axis=...)).")
        return get_backend("jax")
    native = getattr(mesh, "native", mesh)
    devices = getattr(native, "devices", None)
    if devices is None:
        raise ConfigError(f"Invalid `mesh`. Expected a jax.sharding.Mesh or me.Mesh. Received: {mesh!r}")
    ids = tuple(d.id for d in np.asarray(devices, dtype=object).flat)
    if axis is None:
        key: Any = ids
        if key not in _BACKENDS:
            _BACKENDS[key] = JaxBackend(devices=list(np.asarray(devices, dtype=object).flat))
        return _BACKENDS[key]
    names = tuple(getattr(native, "axis_names", ()))
    if not isinstance(axis, str) or axis not in names:
        raise ConfigError(f"Invalid `axis`. Expected one of the mesh's axis names {list(names)}. Received: axis={axis!r}")
    key = (ids, np.shape(devices), names, axis)
    if key not in _BACKENDS:
        _BACKENDS[key] = _AxisBackend(native, axis)
    return _BACKENDS[key]


def _backend_from(mesh: dict) -> JaxBackend:
    """:func:`_backend_for` from :func:`_mesh_of`'s description, on this process's devices
    (a backend of its own where the described capacity and dedup options differ)."""
    from jax.sharding import Mesh

    user_mesh, axis = None, None
    if mesh["devices"] is not None:
        here = {d.id: d for d in jax.devices()}
        ids = np.asarray(mesh["devices"], dtype=np.int64)
        missing = sorted(set(ids.reshape(-1).tolist()) - set(here))
        if missing:
            raise InputError(f"Cannot rebuild me.jax's EmbeddingState here: its tables were on JAX devices "
                             f"{ids.reshape(-1).tolist()}, and devices {missing} do not exist in this process. "
                             "Fix: deserialize where those devices exist (the same device count and mesh).")
        devices = np.vectorize(lambda i: here[int(i)], otypes=[object])(ids)
        if "axis" in mesh:
            user_mesh, axis = Mesh(devices, tuple(mesh["axis_names"])), mesh["axis"]
        else:
            user_mesh = Mesh(devices.reshape(-1), ("devices",))
    backend = _backend_for(user_mesh, axis)
    if (backend.capacity, backend.dedup) == (mesh["capacity"], mesh["dedup"]):
        return backend
    if axis is not None:
        backend = _AxisBackend(user_mesh, axis)
    else:
        backend = JaxBackend(devices=None if user_mesh is None else list(user_mesh.devices.flat))
    backend.capacity, backend.dedup = mesh["capacity"], mesh["dedup"]
    return backend


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
    _refuse_inexact_low_precision(emb.layout, dynamic.dynamic_tables(emb.config))
    from meshembed_jax.frontend import dynamic as jdyn

    vocab_static = jdyn.statics(emb)  # refuses the policies me.jax cannot run exactly
    tables, layouts, dtypes = {}, {}, {}
    for t in emb.layout.tables:
        state = emb.state.tables[t.index]
        layouts[t.index] = state[0].layout
        dtypes[t.index] = state[0].dtype
        names = ("parameters",) + emb.table_slot_names(t.name)
        tables[t.name] = {n: s.data for n, s in zip(names, state)}
    _same_devices(emb.layout, layouts)
    static = _Static(emb.config, emb.layout, emb.backend, layouts, emb.num_shards, dtypes)
    static.dynamic_tables = vocab_static
    # replicated on the tables' mesh, as a jitted step returns it (else the 2nd step retraces)
    step = jax.device_put(np.asarray(emb.step, dtype=_int()), static.replicated)
    vocab = jax.device_put({tv.name: jdyn.to_arrays(emb.vocabulary(tv.name)) for tv in vocab_static.values()},
                           static.replicated)
    return EmbeddingState(tables, step, static, vocab)


#: Low-precision rules whose traced step is measured to differ from the engine's: (optimizer
#: class, what, why). Empty: FTRL with a dynamic learning rate (11 of 174 float32 `linears` a
#: last bit apart) came from XLA's division by a broadcast scalar, now element-wise (exact.py).
_INEXACT_LOW: tuple = ()


def _refuse_inexact_low_precision(layout: Layout, dynamic_tables: Any = ()) -> None:
    """ConfigError for a low-precision table whose me.jax step does not give the engine's bits
    (or is not built: a dynamic vocabulary, whose traced re-initialisation writes float32 rows)."""
    for t in layout.tables:
        if not precision.is_low(t):
            continue
        if t.index in dynamic_tables:
            raise ConfigError(
                f"Table {t.name!r}: me.jax does not run a dynamic vocabulary on a low-precision table yet: "
                "map_keys re-initialises the rows it gives to keys as float32 values, not rounded into the "
                "16-bit storage. Nothing was changed. Fix: train it with me.TPUEmbedding(config, backend='jax'), "
                "or store it in float32 for me.jax (docs/low_precision.md).")
        for name, what, why in _INEXACT_LOW:
            if type(t.optimizer).__name__ == name and type(getattr(t.optimizer, "learning_rate", None)).__name__ \
                    == "DynamicLearningRate":
                raise ConfigError(
                    f"Table {t.name!r}: me.jax does not run a low-precision {name} table with {what}: {why}. "
                    "Nothing was changed. Fix: a constant learning rate for this table, float32 storage, or train "
                    "it with me.TPUEmbedding(config, backend='jax') (docs/low_precision.md).")


def init(config: Any, *, mesh: Any = None, axis: str | None = None, num_shards: int | None = None, seed: int = 0,
         initializers: Mapping[str, Any] | None = None) -> EmbeddingState:
    """Tables and slots initialised as ``TPUEmbedding(config, backend="jax", seed=seed)`` does,
    sharded over ``mesh``'s devices (default: every JAX device), or with ``axis`` over that
    axis of ``mesh`` only (e.g. ``"model"`` of a ``("data", "model")`` mesh: each table's
    shards split over the ``model`` devices, replicated over ``data``). ``num_shards``: the
    logical shards (default: the device count, or the axis size), a multiple of the axis size."""
    backend = _backend_for(mesh, axis)
    from meshembed_jax.frontend import dynamic as jdyn

    cfg = load_config(config)
    jdyn.refuse_unsupported(cfg)  # before any table
    _refuse_inexact_low_precision(build_layout(cfg), dynamic.dynamic_tables(cfg))
    return from_engine(TPUEmbedding(config, backend=backend, num_shards=num_shards, seed=seed,
                                    initializers=initializers))


def place(tree: Any, state: EmbeddingState) -> Any:
    """``tree``'s arrays (dense parameters, optimizer state) replicated on the devices of
    ``state``'s tables, where a jitted step that also takes ``state`` returns them: an array
    first put on one device comes back from step 1 replicated, a new input sharding, so JAX
    traces and compiles the step again at step 2 (its rule for any sharded input); placed
    first, step 2 reuses step 1's program. Arrays you shard yourself need not pass here."""
    return jax.device_put(tree, _check_state(state).replicated)


def to_engine(state: EmbeddingState, *, allow_nonfinite: bool = False) -> TPUEmbedding:
    """A ``TPUEmbedding`` holding ``state``'s arrays (for ``save``, ``retrieve_parameters``)."""
    st = _check_state(state)
    _refuse_traced(state, "me.jax.to_engine")
    step = _step_value(state)
    tables = {t.index: tuple(JaxShardedTable(state.tables[t.name][n], st.shard_layouts[t.index],
                                             slot_width(t.optimizer, n, t.dimension))  # row-wise slots: 1 column
                             for n in st.names[t.index]) for t in st.layout.tables}
    tvs = getattr(st, "dynamic_tables", {})
    extra = {"seed": next(iter(tvs.values())).seed, "initializers": {tv.name: tv.init for tv in tvs.values()}} if tvs else {}
    emb = TPUEmbedding(st.config, backend=st.backend, num_shards=st.num_shards, allow_nonfinite=allow_nonfinite,
                       state=_EngineState(tables, step), **extra)
    if tvs:  # dynamic vocabularies: me.jax's words as the engine's host state
        from meshembed_jax.frontend import dynamic as jdyn

        jdyn.check_vocab(tvs, state.vocab)
        for tv in tvs.values():
            emb.load_vocabulary(tv.name, jdyn.from_arrays(tv, state.vocab[tv.name]))
    return emb


def save(state: EmbeddingState, path: Any, *, allow_nonfinite: bool = False) -> Any:
    """A portable meshembed checkpoint (``TPUEmbedding.restore`` reads it on any backend).
    The engine's checks run before anything is written, so what is written restores: NaN/Inf
    tables are refused unless ``allow_nonfinite=True`` (then restore them with it too), and
    so are slots an optimizer needs non-negative. Call it outside ``jax.jit``."""
    _refuse_traced(state, "me.jax.save")
    return to_engine(state, allow_nonfinite=allow_nonfinite).save(path)


def restore(path: Any, *, mesh: Any = None, axis: str | None = None, allow_nonfinite: bool = False,
            initializers: Mapping[str, Any] | None = None) -> EmbeddingState:
    """The state of a meshembed checkpoint (written by any backend), on ``mesh``'s devices
    (over its axis ``axis``, as :func:`init`). ``initializers``: ``{table: callable}`` of
    dynamic tables whose initializer was a callable (a checkpoint cannot store one)."""
    extra = {} if initializers is None else {"initializers": initializers}
    return from_engine(TPUEmbedding.restore(path, backend=_backend_for(mesh, axis), allow_nonfinite=allow_nonfinite,
                                            **extra))


# -- checks of the pytrees -----------------------------------------------------------------
def _traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _refuse_traced(tree: Any, call: str) -> None:
    """Host-side calls (save, parameters) need values: inside jit they would get tracers."""
    if any(_traced(x) for x in jax.tree.leaves(tree)):
        raise StateError(
            f"Cannot call `{call}()` inside `jax.jit` (or another JAX transformation): it reads the "
            "tables' values on the host (a traced state has none yet). Nothing was written. Fix: call it "
            "outside the jitted function, on the state the step returns."
        )


def _check_state(state: Any) -> _Static:
    """``state`` is an EmbeddingState whose tables, slots and step have the shapes and dtypes
    of its config (a dict with a table missing, a sliced or recast array: refused before use)."""
    st = getattr(state, "_static", None)
    if not isinstance(state, EmbeddingState) or not isinstance(st, _Static):
        raise InputError("Invalid `state`. Expected the me.jax EmbeddingState of me.jax.init / restore / "
                         f"from_engine (or a step's result). Received: {type(state).__name__}")
    layout, tables = st.layout, state.tables
    names = [t.name for t in layout.tables]
    if not isinstance(tables, Mapping) or set(tables) != set(names):
        got = sorted(map(str, tables)) if isinstance(tables, Mapping) else type(tables).__name__
        raise InputError(f"Invalid `state`: expected tables {names}. Received: {got}")
    for t in layout.tables:
        slots, want = tables[t.name], st.names[t.index]
        if not isinstance(slots, Mapping) or set(slots) != set(want):
            got = sorted(map(str, slots)) if isinstance(slots, Mapping) else type(slots).__name__
            raise InputError(f"Invalid `state`: table {t.name!r} needs the arrays {list(want)}. Received: {got}")
        for n in want:
            dtype = st.array_dtypes[t.index][n]
            a = slots[n]
            shape = st.shapes[t.index][:2] + (slot_width(t.optimizer, n, t.dimension),)  # row-wise slots: 1 column
            got_shape, got_dtype = tuple(getattr(a, "shape", ())), getattr(a, "dtype", None)
            if got_shape != shape or got_dtype is None or np.dtype(got_dtype) != dtype:
                raise InputError(
                    f"Invalid `state`: table {t.name!r} `{n}` must be a {dtype} array of shape {shape} "
                    f"([shards, rows per shard, dimension]). Received: shape={got_shape}, dtype={got_dtype}. "
                    "Fix: pass the state me.jax.init / restore or the previous step returned, unchanged."
                )
    step = state.step
    if np.ndim(step) != 0 or not jnp.issubdtype(jnp.result_type(step), jnp.integer):
        raise InputError(f"Invalid `state`: `step` must be an integer scalar. Received: {step!r}")
    return st


def _step_value(state: EmbeddingState) -> int:
    step = int(state.step)
    if step < 0:
        raise InputError(f"Invalid `state`: `step` is {step}; a step count is >= 0.")
    return step


# -- prepare (host side) -------------------------------------------------------------------
def _layout_of(config: Any) -> tuple[Any, Layout]:
    if isinstance(config, EmbeddingState):
        return config.config, config._static.layout
    config = load_config(config)
    return config, build_layout(config)


#: The largest capacity: positions in a feature's padded ids are int32.
MAX_CAPACITY = 2**31 - 1


def _capacity_value(value: Any, name: str, where: str) -> int | None:
    """A capacity: None or an integer from 1 to :data:`MAX_CAPACITY` (a float, a string, a bool,
    NaN/Inf or a huge value is an InputError naming the argument)."""
    if value is None:
        return None
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise InputError(f"Invalid `{name}`{where}. Expected an integer from 1 to {MAX_CAPACITY}, or None. "
                         f"Received: {name}={value!r} ({type(value).__name__})") from None
    if not 1 <= v <= MAX_CAPACITY:
        raise InputError(f"Invalid `{name}`{where}. Expected an integer from 1 to {MAX_CAPACITY} (positions are "
                         f"int32), or None. Received: {name}={v}")
    return v


def _capacities(value: Any, name: str, keys: Sequence[str], what: str) -> list[int | None]:
    """One checked capacity per key from an int, ``{key: int}`` or None."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in keys]
        if unknown:
            raise InputError(f"Invalid `{name}`: unknown {what}s {unknown!r}. Expected keys among {list(keys)}.")
        return [_capacity_value(value.get(k), name, f" for {what} {k!r}") for k in keys]
    one = _capacity_value(value, name, "")
    return [one] * len(keys)


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
    distinct ids than its unique capacity; ``InputError`` for a capacity that is not an
    integer from 1 to 2**31 - 1."""
    config, layout = _layout_of(config)
    caps = _capacities(capacity, "capacity", [f.name for f in layout.features], "feature")
    unique_caps = _capacities(unique_capacity, "unique_capacity", [t.name for t in layout.tables], "table")
    dyn = dynamic.dynamic_tables(config)  # their ids are int64 keys: map_keys makes them rows
    prepared = batches.prepare(dynamic.key_layout(layout, dyn), features, weights)  # the engine's checks
    ids, slots, scales, statics = [], [], [], []
    for f, b, cap in zip(layout.features, prepared.features, caps):
        t = layout.tables[f.table]
        n = int(b.ids.shape[0])
        cap = bucket(n) if cap is None else cap
        if n > cap:
            raise CapacityError(
                f"Feature {f.name!r} (table {t.name!r}): {n} ids this batch exceed its capacity {cap}. "
                f"Nothing was prepared. Fix: pass capacity >= {n} (e.g. capacity={{{f.name!r}: {bucket(n)}}}) "
                "to me.jax.prepare, or split the batch."
            )
        unit, scale = b.unit_scale, b.scale
        idt = np.int32 if t.vocabulary_size < 2**31 - 1 and f.table not in dyn else np.int64
        try:
            pid = np.full(cap, -1, idt)
            pslot = np.full(cap, bucket(b.num_slots), np.int32)  # out of range: dropped by the lookup
            pscale = np.zeros(cap, np.float32)
        except MemoryError:
            raise InputError(f"Invalid `capacity` for feature {f.name!r}: {cap} positions need "
                             f"{cap * (np.dtype(idt).itemsize + 8)} bytes of host memory, more than this "
                             f"machine has. Fix: a capacity near the batch's {n} ids.") from None
        pid[:n] = b.ids
        pslot[:n] = b.slots
        pscale[:n] = scale.reshape(-1)
        ids.append(pid)
        slots.append(pslot)
        scales.append(pscale)
        statics.append(_FeatureStatic(f.name, cap, int(b.num_slots), not unit, *_feature_key(layout, f)[1:]))
    unique = []
    for t, cap in zip(layout.tables, unique_caps):
        if cap is not None:
            mine = [ids[k] for k, f in enumerate(layout.features) if f.table == t.index]
            n_ids = sum(int(m.shape[0]) for m in mine)
            trivial = cap >= min(n_ids, t.vocabulary_size)  # no count needed
            if t.index in dyn and not trivial and mine:  # distinct keys (any int64), padding left out
                count = int(np.unique(np.concatenate([ids[k][slots[k] < statics[k].num_slots] for k, f in
                                                      enumerate(layout.features) if f.table == t.index])).size)
            else:
                count = 0 if trivial or not mine else _distinct(np.concatenate(mine), t.vocabulary_size)
            if count > cap:
                raise CapacityError(
                    f"Table {t.name!r}: {count} distinct ids this batch exceed its unique_capacity {cap}. "
                    f"Nothing was prepared. Fix: pass unique_capacity >= {count} (e.g. "
                    f"{{{t.name!r}: {bucket(count + count // 4)}}}), or leave it None (every id), or split the batch."
                )
        unique.append(cap)
    batch = Batch(tuple(ids), tuple(slots), tuple(scales), tuple(statics), tuple(unique))
    if dyn:
        from meshembed_jax.frontend import dynamic as jdyn

        return jdyn.key_batch(batch, layout, dyn)
    return batch


def map_keys(state: EmbeddingState, batch: Any, *, training: bool = True) -> tuple[EmbeddingState, Batch]:
    """Dynamic vocabularies: the keys of ``batch`` (what :func:`prepare` returns for a config
    with ``dynamic=`` tables) mapped to rows at step ``state.step`` exactly as the engine's
    ``dynamic.assign`` does: with ``training`` keys are counted, admitted and evicted and the
    rows given to keys re-initialised; without, only read. Returns ``(state, Batch of rows)``
    for :func:`lookup` / :func:`apply_gradients`; a key without a row reads zeros and gets no
    update. Pure and jit-able (the key tables live in ``state.vocab`` at a fixed capacity)."""
    from meshembed_jax.frontend import dynamic as jdyn

    st = _check_state(state)
    training = batches.check_bool(training, "training")
    tvs = getattr(st, "dynamic_tables", {})
    if not isinstance(batch, jdyn.KeyBatch):
        raise InputError("Invalid `batch` for me.jax.map_keys: expected the batch me.jax.prepare returns for a config "
                         f"with dynamic tables. Received: {type(batch).__name__}"
                         + ("" if tvs else " (and this state's config has no dynamic table: pass its Batch to "
                            "lookup / apply_gradients directly)"))
    _check_batch(st, batch.batch)
    jdyn.check_vocab(tvs, state.vocab)
    def fn(tabs: Any, voc: Any, b: Any, step: Any) -> tuple:
        return jdyn.map_tables(tvs, st.layout, st.shard_layouts, st.names, tabs, voc, b, step, training)

    args = (state.tables, state.vocab, batch, state.step)
    if not any(_traced(x) for x in jax.tree.leaves(args)):  # eager: one program (op by op, the host
        fn = jdyn.eager_program(st, training, fn)             # callback's result would sit on one device)
    tables, vocab, ids = _in_transformations("map_keys", fn, *args)
    return EmbeddingState(tables, state.step, st, vocab), jdyn.row_batch(batch, ids)


def vocabulary(state: EmbeddingState, table: str) -> dynamic.DynamicVocabularyState:
    """A dynamic table's vocabulary as the engine's host ``DynamicVocabularyState`` (``stats``,
    ``hit_rate``, ``rows_of``, ``resident``): read outside jit, every invariant checked."""
    from meshembed_jax.frontend import dynamic as jdyn

    st = _check_state(state)
    _refuse_traced(state.vocab, "me.jax.vocabulary")
    tvs = {tv.name: tv for tv in getattr(st, "dynamic_tables", {}).values()}
    if table not in tvs:
        raise InputError(f"Invalid `table`: {table!r} has no dynamic vocabulary. Expected one of {sorted(tvs)}.")
    jdyn.check_vocab(getattr(st, "dynamic_tables", {}), state.vocab)
    return jdyn.from_arrays(tvs[table], state.vocab[table])


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


def _check_batch(st: _Static, batch: Any) -> None:
    """``batch`` is a :class:`Batch` prepared for ``st``'s config (the engine's ``check_batch``:
    ids of another config could lie past this one's tables, and read as zeros), its arrays
    of the capacities it was prepared with."""
    if not isinstance(batch, Batch):
        raise InputError("Invalid `batch`. Expected a me.jax Batch (me.jax.prepare(config, features)). "
                         f"Received: {type(batch).__name__}" + (" (a batch of keys: map it to rows first, "
                         "`state, batch = me.jax.map_keys(state, batch)`)" if type(batch).__name__ == "KeyBatch" else ""))
    if batch.config_key() != st.batch_key:
        tables = list(dict.fromkeys(f.table for f in batch.features))
        raise InputError(
            f"Invalid `batch`: it was prepared for another config (tables {tables}, features "
            f"{[f.name for f in batch.features]}). Fix: prepare it with this state's config "
            "(me.jax.prepare(state, features))."
        )
    arrays = (batch.ids, batch.slots, batch.scale)
    for k, f in enumerate(batch.features):
        for what, group in zip(("ids", "slots", "scale"), arrays):
            a = group[k] if isinstance(group, (tuple, list)) and len(group) == len(batch.features) else None
            kind = "f" if what == "scale" else "iu"
            if a is None or tuple(getattr(a, "shape", ())) != (f.capacity,) or np.dtype(a.dtype).kind not in kind:
                raise InputError(
                    f"Invalid `batch`: feature {f.name!r} `{what}` must be a 1-D {'float' if kind == 'f' else 'integer'} "
                    f"array of its capacity {f.capacity}. Received: "
                    f"{None if a is None else (tuple(getattr(a, 'shape', ())), getattr(a, 'dtype', None))}. "
                    "Fix: pass the Batch me.jax.prepare returned, unchanged."
                )


# -- transformations: what is differentiable -----------------------------------------------
def _not_differentiable(what: str) -> InputError:
    return InputError(
        f"Cannot differentiate me.jax.{what} with respect to the embedding tables (or the batch): its row "
        "kernels have no derivative, and the tables are not trained by jax.grad but by their own TPU "
        "optimizer. What is differentiable: the activations `me.jax.lookup` returns. Fix: differentiate the "
        "loss with respect to them and pass those gradients on: `acts = me.jax.lookup(state, batch); "
        "grads = jax.grad(loss)(acts); state = me.jax.apply_gradients(state, batch, grads)`. Gradients of "
        "other arguments (dense parameters) are fine: keep `state` and `batch` out of the differentiated "
        "arguments (argnums, or close over them)."
    )


def _not_batchable(what: str) -> InputError:
    return InputError(
        f"Cannot jax.vmap me.jax.{what}: a me.jax Batch already holds a whole batch of samples and the state "
        "one set of tables, and the row kernels have no batching rule. Fix: prepare one Batch with every "
        "sample (me.jax.prepare), or step through several batches with jax.lax.scan / jax.lax.map or a "
        "Python loop; vmap the dense part of the model only."
    )


def _in_transformations(what: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` (``args``: the arrays it reads), with ``jax.jvp``/``grad`` through it and
    ``jax.vmap`` of it refused by a meshembed error, also where a ``jax.jit`` stands between
    (``grad(jit(step))``). Only traced calls are wrapped: called eagerly it runs as it is."""
    if not any(_traced(x) for x in jax.tree.leaves(args)):
        return fn(*args)
    from jax.custom_batching import custom_vmap

    @jax.custom_jvp
    def differentiable(*a: Any) -> Any:
        return fn(*a)

    @differentiable.defjvp
    def _jvp(primals: Any, tangents: Any) -> Any:
        raise _not_differentiable(what)

    @custom_vmap
    def batchable(*a: Any) -> Any:
        return differentiable(*a)

    @batchable.def_vmap
    def _vmap(axis_size: int, in_batched: Any, *a: Any) -> Any:
        raise _not_batchable(what)

    return batchable(*args)


# -- lookup --------------------------------------------------------------------------------
def lookup(state: EmbeddingState, batch: Batch) -> dict[str, Any]:
    """Activations ``{feature: input_shape + [dim]}`` (RecvTPUEmbeddingActivations); for a config
    given a dict of features, keyed as that dict. (Dynamic tables: the Batch of :func:`map_keys`.)"""
    st = _check_state(state)
    _check_batch(st, batch)
    layout = st.layout
    params = tuple(state.tables[layout.tables[f.table].name]["parameters"] for f in layout.features)
    acts = _in_transformations("lookup", lambda *a: _lookup(st, batch.features, *a), params,
                               tuple(batch.ids), tuple(batch.slots), tuple(batch.scale))
    out = {f.name: a for f, a in zip(layout.features, acts)}
    return batches.structured(layout, list(acts)) if layout.keys else out


def _lookup(st: _Static, features: tuple, params: tuple, ids: tuple, slots: tuple, scales: tuple) -> tuple:
    layout, be = st.layout, st.backend
    out = []
    for k, f in enumerate(layout.features):
        t = layout.tables[f.table]
        sl, dim = st.shard_layouts[t.index], t.dimension
        table = params[k]
        fs = features[k]
        nb, sb = fs.capacity, bucket(fs.num_slots)
        quant = getattr(t.optimizer, "simulated_quantization", None)
        if precision.is_low(t):  # 16-bit rows, widened and combined in float32 (the engine's branch)
            act = _low_lookup(be, sl, t, fs, table, jnp.asarray(ids[k]), jnp.asarray(slots[k]),
                              jnp.asarray(scales[k]), quant)
            out.append(act.reshape(f.output_shape + (dim,)))
            continue
        if quant is not None and getattr(quant, "enabled", True):
            from meshembed.math import quantize

            lo = -np.inf if quant.lower is None else quant.lower
            hi = np.inf if quant.upper is None else quant.upper
            gather = be._kernel(("lookup", sl, dim), lambda: kernels.make_lookup(sl, dim))
            rows = quantize(be.xp, gather(table, jnp.asarray(ids[k])), lo, hi, quant.num_buckets)
            act = be.segment_sum_to(rows * jnp.asarray(scales[k])[:, None], jnp.asarray(slots[k]), fs.num_slots)
        else:
            fn = be._kernel(("gather_combine", sl, dim, nb, sb, fs.weighted),
                            lambda: kernels.make_gather_combine(sl, dim, nb, sb, fs.weighted))
            w = jnp.asarray(scales[k], table.dtype) if fs.weighted else jnp.zeros(1, table.dtype)
            act = fn(table, jnp.asarray(ids[k]), jnp.asarray(slots[k]), w)[: fs.num_slots]
        out.append(act.reshape(f.output_shape + (dim,)))
    return tuple(out)


# -- low-precision tables (docs/low_precision.md) ---------------------------------------------
# The engine's branch for 16-bit tables (``embedding/precision.py``: lookup_rows, update_table)
# as one traced program: the same integer and float functions of ``meshembed.math.rounding`` /
# ``meshembed.math.rule``, called with the backend's jnp namespace; what the engine computes on
# the host from concrete ids (the sorted unique ids, the counters of the random bits) comes
# from the traced ids here, bounded by the batch's unique capacity.
def _low_lookup(be: JaxBackend, sl: ShardLayout, t: Any, fs: _FeatureStatic, table: Any, ids: Any, slots: Any,
                scale: Any, quant: Any) -> Any:
    """One feature's float32 activation from a low-precision table, as ``step._low_precision_lookup``:
    the stored rows widened exactly, simulated quantization, then ``scale · rows`` summed per
    slot — or, for a batch whose every slot holds exactly one id (the engine's ``identity``),
    the rows themselves (a sum into zeros would turn a stored -0.0 into +0.0)."""
    dim, n, s = t.dimension, fs.capacity, fs.num_slots
    gather = be._kernel(("lookup", sl, dim), lambda: kernels.make_lookup(sl, dim))
    rows = precision.widen(be, gather(table, ids), precision.array_dtypes(t)[0])
    if quant is not None and getattr(quant, "enabled", True):
        from meshembed.math import quantize

        lo = -np.inf if quant.lower is None else quant.lower
        hi = np.inf if quant.upper is None else quant.upper
        rows = quantize(be.xp, rows, lo, hi, quant.num_buckets)
    weighted = rows * scale[:, None]  # padding: a zero row times a zero scale, in a dropped slot
    act = be.segment_sum_to(weighted, slots, s)
    if n < s:  # fewer positions than slots: never one id per slot
        return act
    ident = jnp.all(slots[:s] == jnp.arange(s, dtype=slots.dtype))
    if n > s:  # the first position after them is padding (an out-of-range slot), not an id
        ident = ident & (slots[s] >= s)
    return jnp.where(ident, weighted[:s], act)


def _low_counters(uniq: Any, step: Any, dim: int) -> tuple:
    """``low_precision.counters`` (kept under this name for callers of me.jax's internals)."""
    return low_precision.counters(uniq, step, dim)


def _materialized(fn: Callable, zero: Any, *args: Any) -> Any:
    """``low_precision.materialized``."""
    return low_precision.materialized(fn, zero, *args)


# -- apply_gradients -----------------------------------------------------------------------
def _learning_rates(layout: Layout, learning_rates: Any) -> list[Any]:
    """The engine's learning-rate checks (a dict by tag, never its keys; the count; NaN/Inf
    and float32 overflow) on every concrete value; a traced one is checked for rank and dtype
    only (its value is not known while tracing)."""
    if _traced(learning_rates) and jnp.ndim(learning_rates) == 1:  # a traced [n] array: one per tag
        learning_rates = [learning_rates[k] for k in range(jnp.shape(learning_rates)[0])]
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
        elif jnp.ndim(v) != 0:
            raise InputError(f"Invalid {what}: expected a scalar (rank 0). Received: shape={jnp.shape(v)}")
        elif np.dtype(v.dtype).kind not in "fiu":
            raise InputError(f"Invalid {what}: expected a real number. Received: a traced {v.dtype} value")
        out.append(weak_float(v))
    return out


def _update_fn(t: Any, rule: UpdateRule, lrs: list[Any]) -> tuple:
    """This step's values of the table's rule (the engine's ``rule_values``), with the traced
    learning rates; static hyper-parameters stay Python constants (as in the NumPy reference)."""
    return tuple(rule_values(t, rule, lrs))


class _ShapesOnly:
    """A stand-in backend for the engine's gradient checks (``steps.check_gradient``) on a
    traced gradient: its shape and dtype are known, its values are not."""

    xp = np

    @staticmethod
    def is_traced(x: Any) -> bool:
        return False

    @staticmethod
    def is_native(x: Any) -> bool:
        return True

    @staticmethod
    def asarray(x: Any, dtype: Any = None) -> Any:
        return x


def _checked_gradients(st: _Static, gradients: Any, check_values: bool) -> list[Any]:
    """The engine's gradient checks (``steps.check_gradient``: a real array of the activation's
    shape, None as zeros with a warning) on every gradient, and its NaN/Inf check
    (``steps.nonfinite_error``) on every concrete one when ``check_values``; float32 rows."""
    layout, be = st.layout, st.backend
    tracing = _traced(jnp.zeros(()))  # inside a trace even a constant gradient has no value now
    rows = []
    for f, g in zip(layout.features, batches.by_feature(layout, gradients, "gradients")):
        if tracing or _traced(g):  # shape and dtype; values are checked by return_finite only
            if g is not None and not hasattr(g, "dtype"):
                g = inputs.to_host(g, None, f"gradient for feature {f.name!r}")
            probe = g if g is None or isinstance(g, np.ndarray) else jax.ShapeDtypeStruct(g.shape, g.dtype)
            checked = steps.check_gradient(_ShapesOnly, layout, f, probe)
            g = jnp.asarray(checked if g is None else g).astype(jnp.float32)
        else:
            g = steps.check_gradient(be, layout, f, g)
            if not be.is_native(g):  # None: the engine's zeros
                g = jnp.asarray(g, jnp.float32)
            if check_values and not be.all_finite(g):
                raise steps.nonfinite_error(layout, f)
        rows.append(g.reshape(-1, layout.tables[f.table].dimension))
    return rows


def apply_gradients(state: EmbeddingState, batch: Batch, gradients: Any, learning_rates: Sequence[Any] = (),
                    *, allow_nonfinite: bool = False, return_finite: bool = False) -> Any:
    """SendTPUEmbeddingGradients as a pure function: ``gradients`` as :func:`lookup` returned
    the activations (a dict by feature name, or a list in config order), ``learning_rates[k]``
    for dynamic tag k (traced scalars: changing them never recompiles). Returns the new state.

    Called outside jit, the engine's checks hold: NaN/Inf gradients or learning rates raise
    ``InputError`` naming the feature (unless ``allow_nonfinite=True``). Inside ``jax.jit`` the
    values are not known while tracing: shapes, dtypes, the state and the batch are checked,
    and NaN/Inf gradients are applied as on a TPU, unless ``return_finite=True``: then the
    step returns ``(state, all_finite)``, a traced boolean over every gradient and learning
    rate, and when it is false no table or slot is written and the step counter stays
    (one pass over the gradients). Called outside jit, the kernels donate ``state``'s buffers:
    use the returned state, as after a donating ``jax.jit``."""
    allow_nonfinite = batches.check_bool(allow_nonfinite, "allow_nonfinite")
    return_finite = batches.check_bool(return_finite, "return_finite")
    if allow_nonfinite and return_finite:
        raise InputError("Invalid `allow_nonfinite=True` with `return_finite=True`: the one applies NaN/Inf "
                         "gradients, the other skips the step on them. Fix: pass one of them.")
    st = _check_state(state)
    _check_batch(st, batch)
    rows = _checked_gradients(st, gradients, check_values=not (allow_nonfinite or return_finite))
    lrs = _learning_rates(st.layout, learning_rates)
    tables, finite = _in_transformations(
        "apply_gradients", lambda *a: _apply(st, batch.features, batch.unique, return_finite, *a),
        state.tables, rows, tuple(batch.ids), tuple(batch.slots), tuple(batch.scale), lrs, state.step)
    if not return_finite:
        return EmbeddingState(tables, state.step + 1, st, state.vocab)
    return EmbeddingState(tables, state.step + finite.astype(jnp.result_type(state.step)), st, state.vocab), finite


def _apply(st: _Static, features: tuple, unique: tuple, with_finite: bool, tables_in: dict, rows: list,
           ids_in: tuple, slots: tuple, scales: tuple, lrs: list, step: Any) -> tuple:
    """Every table's update (``routing.update_table``, as the engine); ``(tables, all_finite)``
    where ``with_finite`` (else ``(tables, None)``). ``step``: the steps applied before this
    one (the counter of a low-precision table's random bits)."""
    layout = st.layout
    finite = None
    if with_finite:  # sum(x * 0): 0 where every value is finite, NaN otherwise (cannot overflow)
        zero = sum(jnp.sum(r * 0) for r in rows) + sum(jnp.asarray(v, jnp.float32) * 0 for v in lrs)
        finite = jnp.isfinite(zero)
    # The tables are written in place after the gradients exist: when those come from this
    # step's lookup (they do in training), the lookup's reads are done by then, so XLA need
    # not copy a table around the in-place update (W1: 0.2 s a step).
    tables_in, rows = jax.lax.optimization_barrier((tables_in, rows))
    # a runtime value, as the engine's guard: constant, XLA would unroll the kernels' one-trip
    # loops around their in-place FFI calls and copy each table twice (W1: 0.5 s a step);
    # with return_finite the updates write nothing unless every value is finite
    guard = jax.lax.optimization_barrier(jnp.asarray(True) if finite is None else finite)
    inputs = PaddedInputs(Batch(ids_in, slots, scales, features, unique))
    updater = TracedUpdater(st, inputs, tables_in, lrs, guard, step)
    tables = dict(tables_in)
    for t in layout.tables:  # the engine's routing, traced
        parts = [k for k, f in enumerate(layout.features) if f.table == t.index]
        if parts:
            new = routing.update_table(updater, inputs, jnp, t, parts, [rows[k] for k in parts])
            tables[t.name] = dict(zip(st.names[t.index], new))
    return tables, finite


# -- jax.export ----------------------------------------------------------------------------
def _cpu_export_error(exc: BaseException) -> ConfigError:
    return ConfigError(
        "Cannot export this me.jax step for platform 'cpu': on CPU it runs meshembed's C++ row kernels "
        "(XLA FFI custom calls named meshembed_*, compiled on this machine; a fused update also holds the "
        "address of a kernel generated in this process), and an exported artifact cannot carry them. Fix: "
        "export for the platform that will run it, e.g. platforms=('tpu',) or ('cuda',): there those "
        "kernels are absent (a CPU-only branch) and the artifact serializes; or, for a CPU artifact, run the "
        "exporting process with MESHEMBED_JAX_CPU_KERNELS=0 (the pure-XLA kernels: the same numbers, slower). "
        f"(JAX: {str(exc).splitlines()[0]})"
    )


def export(fun: Callable, *, platforms: Sequence[str] | None = None, **kwargs: Any) -> Callable:
    """``jax.export.export(fun, platforms=...)`` for a step that calls me.jax, with a meshembed
    error saying why and what to do where JAX refuses the CPU kernels' custom calls (a CPU
    export while those kernels are on). The result's ``Exported.serialize()`` and
    ``jax.export.deserialize`` carry ``EmbeddingState`` and ``Batch`` (both registered)."""
    from jax import export as jexport

    exporter = jexport.export(fun if hasattr(fun, "lower") else jax.jit(fun), platforms=platforms, **kwargs)

    def run(*args: Any, **kw: Any) -> Any:
        try:
            return exporter(*args, **kw)
        except ValueError as exc:
            if "custom call" in str(exc) and "meshembed_" in str(exc):
                raise _cpu_export_error(exc) from exc
            raise

    return run
