"""``me.tpu.TPUEmbedding``: TF2's mid-level API (nests in, the same nests out) over the engine.

The nest of FeatureConfigs is flattened once (``tf.nest`` order); feature ``k`` of the
engine is the flattened leaf ``k``, named by its path ("user", "towers/item", "0"). Every
call maps the user's nest to a ``{path: value}`` dict for the engine and back, so this layer
does not depend on how the engine orders or returns its features.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshembed import math as _math
from meshembed.config import SGD, EmbeddingConfig
from meshembed.config import FeatureConfig as _EngineFeature
from meshembed.config import TableConfig as _EngineTable
from meshembed.config.common import as_bool, invalid
from meshembed.config.optimizers import OptimizerSpec
from meshembed.embedding import RaggedIds, SparseIds
from meshembed.embedding import TPUEmbedding as _Engine
from meshembed.embedding import checkpoint as _checkpoint
from meshembed.errors import ConfigError, InputError, StateError
from meshembed.math.custom import CustomOptimizer
from meshembed.tpu import nest as _nest
from meshembed.tpu._config import FeatureConfig, StepSchedule, TableConfig, _shape

__all__ = ["TPUEmbedding", "flat_features", "from_tf", "to_tf", "is_tf", "incoming_output_shape",
           "resolve_tables", "read_checkpoint"]


def is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig) or not _nest.is_container(x)


def flat_features(feature_config: Any) -> list[tuple[str, FeatureConfig]]:
    """``[(path, FeatureConfig)]`` in tf.nest order. A feature is known by its path, so a
    non-FeatureConfig leaf, dict keys tf.nest cannot sort (``{1: f, "1": g}``) and two
    features on one path are ConfigErrors."""
    try:
        flat = _nest.flatten_with_paths(feature_config, is_feature)
    except InputError as exc:  # unsortable dict keys
        raise ConfigError(f"Invalid `feature_config`. Expected dict keys tf.nest can sort (all strings or all "
                          f"integers; a feature is known by its path, and 1 and '1' are both path '1'). "
                          f"Received: {str(exc).rpartition('Received ')[2]}") from None
    if not flat:
        raise ConfigError("Invalid `feature_config`. Expected a FeatureConfig or a nest (dict, list, tuple) "
                          "of FeatureConfigs. Received: an empty structure")
    seen: set[str] = set()
    for path, f in flat:
        at = f" at path '{path}'" if path else ""
        if not isinstance(f, FeatureConfig):
            raise ConfigError(f"Invalid `feature_config`{at}. Expected a meshembed.tpu.FeatureConfig. "
                              f"Received: {f!r}")
        if path in seen:
            raise ConfigError(f"Invalid `feature_config`{at}. Expected one feature per path (features are known "
                              "by their path; rename a key). Received: two features on this path")
        seen.add(path)
    return flat


def resolve_tables(flat: list[tuple[str, FeatureConfig]], optimizer: Any
                   ) -> tuple[list[TableConfig], list[str], list[_EngineTable], set[str]]:
    """The tables in order of first use, their engine names (``table_<i>`` when unnamed), their
    engine configs, and the names of those without an optimizer (they get SGD(0) and are only
    looked up: ``TPUEmbedding(optimizer=None)`` serves, as TF allows off TPU)."""
    if optimizer is not None and not isinstance(optimizer, (OptimizerSpec, CustomOptimizer)):
        raise invalid("optimizer", "TPUEmbedding", "an instance of a meshembed.tpu optimizer class (SGD, "
                      "Adagrad, Adam, FTRL, ...) or None", optimizer)
    tables: list[TableConfig] = []
    for _, f in flat:
        if not any(f.table is t for t in tables):
            tables.append(f.table)
    names = [t.name if t.name is not None else f"table_{i}" for i, t in enumerate(tables)]
    engine, untrained = [], set()
    for i, (t, name) in enumerate(zip(tables, names)):
        if names.index(name) != i:
            raise invalid("name", "TableConfig", "a unique name per table (several TableConfig objects are "
                          "named alike; share one object to share a table)", name)
        opt = t.optimizer if t.optimizer is not None else optimizer
        if opt is None:
            untrained.add(name)
        engine.append(t._engine(name, opt if opt is not None else SGD(0.0)))
    return tables, names, engine, untrained


def read_checkpoint(path: Any) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
    """(step, {table: {"parameters": ..., <slot>: ...}}) of a checkpoint, every file verified.

    Reads the arrays only, so a config whose learning rate was a callable (which a checkpoint
    cannot store) needs nothing passed again."""
    manifest, _, arrays = _checkpoint.read(path)
    tables = {e["name"]: {k: arrays[key] for k, key in e["arrays"].items()} for e in manifest["tables"]}
    return int(manifest["step"]), tables


def _check_trainable(tables: list[_EngineTable]) -> None:
    """What the engine would only find at the first step, refused when the object is built."""
    for t in tables:
        opt = t.optimizer
        check = getattr(opt, "check_domain", None)
        if check is not None:  # e.g. FrequencyAwareAdagrad without step_counter
            check(table=t.name)
        if isinstance(opt, OptimizerSpec) and not _math.get_math(opt.algorithm).supported:
            raise invalid("optimizer", f"table '{t.name}'",
                          f"an optimizer meshembed can run ({type(opt).__name__} has no public update formula, "
                          "so it cannot train; its configs still load and round-trip). Fix: choose another "
                          "optimizer, or serve the trained tables with TPUEmbeddingForServing", opt)


# -- TensorFlow objects, converted without importing TensorFlow --------------------------------
def is_tf(x: Any) -> bool:
    return type(x).__module__.startswith("tensorflow")


def from_tf(x: Any, what: str, path: str) -> Any:
    """A TF tensor / SparseTensor / RaggedTensor / IndexedSlices as NumPy or SparseIds/RaggedIds."""
    if x is None or not is_tf(x):
        return x
    kind = type(x).__name__
    try:
        if kind == "RaggedTensor":
            if x.ragged_rank != 1:
                raise InputError(f"Invalid `{what}` at path '{path}': only rank 2 RaggedTensors are supported "
                                 f"(as in TF). Received: ragged_rank={x.ragged_rank}")
            return RaggedIds(x.row_splits.numpy(), x.values.numpy())
        if kind == "SparseTensor":
            return SparseIds(x.indices.numpy(), x.values.numpy(), x.dense_shape.numpy())
        tf = sys.modules["tensorflow"]
        return tf.convert_to_tensor(x).numpy()
    except (AttributeError, NotImplementedError) as exc:
        raise InputError(
            f"Invalid `{what}` at path '{path}': a symbolic {kind} (inside tf.function or a graph). Fix: run "
            "enqueue/dequeue/apply_gradients eagerly (they are host calls, not ops to trace).") from exc


def to_tf(x: Any) -> Any:
    return sys.modules["tensorflow"].convert_to_tensor(np.asarray(x))


# -- output shapes, TF's rules ------------------------------------------------------------------
def incoming_output_shape(x: Any, feature: FeatureConfig, what: str, path: str) -> tuple[int, ...]:
    """The activation shape (without dim) an input implies, as TF's enqueue infers it."""
    m = feature.max_sequence_length if feature.output_shape is None else 0
    at = f"`{what}` at path '{path or '<top>'}'"
    if isinstance(x, SparseIds) or all(hasattr(x, a) for a in ("indices", "values", "dense_shape")):
        shape = [int(d) for d in np.asarray(x.dense_shape).reshape(-1)]
        if len(shape) < 2:
            raise InputError(f"Invalid {at}: sparse ids need rank 2 or more (the last axis is combined). "
                             f"Received: dense_shape={shape}")
        if m and len(shape) == 2:
            shape.insert(1, m)
        return tuple(shape[:-1])
    if isinstance(x, RaggedIds) or all(hasattr(x, a) for a in ("row_splits", "values")):
        rows = int(np.shape(x.row_splits)[0]) - 1
        return (rows, m) if m else (rows,)
    if x is None:
        raise InputError(f"Invalid {at}: every feature needs ids. Received: None")
    shape = tuple(int(d) for d in np.shape(x))
    if not shape:
        raise InputError(f"Invalid {at}: dense ids need rank 1 or more. Received: a scalar")
    if len(shape) > 1 and shape[-1] != 1:
        raise InputError(f"Invalid {at}: a dense id tensor of rank 2 or more must have last dimension 1 (it is "
                         f"reduced, as in TF). Received: shape={shape}. Fix: pass several ids per sample as "
                         "SparseIds/RaggedIds (or tf.SparseTensor/tf.RaggedTensor), or reshape to (..., 1).")
    return shape if len(shape) == 1 else shape[:-1]


def _check_shape(old: tuple[int, ...] | None, new: tuple[int, ...], path: str) -> None:
    """TF's ``_check_output_shapes``: a rank 1/2 incoming shape below a higher-rank configured
    one is a ragged input reshaped by the engine, checked there."""
    if old is None or old == new or (len(new) in (1, 2) and len(old) > len(new)):
        return
    raise InputError(f"Inconsistent shape for input feature '{path}': its output shape is {list(old)}, but "
                     f"this input implies {list(new)}. Fix: every batch must have the shapes of the first one "
                     "(or of FeatureConfig(output_shape=...) / build(per_replica_input_shapes=...)).")


class TPUEmbedding:
    """``tf.tpu.experimental.embedding.TPUEmbedding`` on a meshembed backend.

    ``feature_config`` is a FeatureConfig or any nest of them; ``enqueue``, ``dequeue`` and
    ``apply_gradients`` take and return that nest. Tables are ordered by first appearance
    in the flattened nest and unnamed ones are called ``table_<i>``, as TF does (the user's
    TableConfig objects are not modified). meshembed's own options are keyword-only:
    ``backend``, ``num_shards``, ``mesh`` and ``seed`` (see ``me.TPUEmbedding``).
    With TensorFlow inputs (tf.Tensor/SparseTensor/RaggedTensor) ``dequeue`` returns
    ``tf.Tensor``s, so a ``tf.GradientTape`` program runs as written (eagerly).
    """

    def __init__(self, feature_config: Any, optimizer: OptimizerSpec | CustomOptimizer | None = None,
                 pipeline_execution_with_tensor_core: bool = False, *, backend: Any = None,
                 num_shards: int | None = None, mesh: Any = None, seed: int = 0) -> None:
        flat = flat_features(feature_config)
        tables, names, engine_tables, untrained = resolve_tables(flat, optimizer)
        if not untrained:
            _check_trainable(engine_tables)
        self._feature_config = feature_config
        self._features = [f for _, f in flat]
        self._paths = [p or f.name or "feature" for p, f in flat]
        self._tables = tables
        self._table_names = dict(zip(map(id, tables), names))
        self._untrained = untrained
        self._engine_tables = self._bind_schedules(engine_tables)
        self._optimizer = optimizer
        self._pipeline = as_bool("pipeline_execution_with_tensor_core", pipeline_execution_with_tensor_core,
                                 "TPUEmbedding")
        self._engine_args = dict(backend=backend, num_shards=num_shards, mesh=mesh, seed=seed)
        self._output_shapes: list[tuple[int, ...] | None] = [f.output_shape for f in self._features]
        self._engine: _Engine | None = None
        self._tf_io = False

    def _bind_schedules(self, tables: list[_EngineTable]) -> list[_EngineTable]:
        """Give each StepSchedule learning rate this object's step (one callable per schedule,
        so tables sharing one share its dynamic tag)."""
        bound: dict[int, Any] = {}
        out = []
        for t in tables:
            lr = getattr(t.optimizer, "learning_rate", None)
            if isinstance(lr, StepSchedule):
                fn = bound.setdefault(id(lr), lr.at(lambda: self._engine.step if self._engine is not None else 0))
                t = t.replace(optimizer=t.optimizer.replace(learning_rate=fn))
            out.append(t)
        return out

    def _refuse_training(self, head: str, tail: str = "") -> None:
        """Tables without an optimizer only serve: training them is a ConfigError, before anything."""
        if self._untrained:
            raise ConfigError(f"{head}: table '{sorted(self._untrained)[0]}' has no optimizer, so this TPUEmbedding "
                              "only looks up (enqueue(..., training=False), dequeue, restore, embedding_tables). "
                              f"Fix: give the TableConfig an optimizer or pass TPUEmbedding(optimizer=...).{tail}")

    # -- structure helpers --------------------------------------------------------------------
    def _leaves(self, value: Any, what: str) -> list[Any]:
        return _nest.match(self._feature_config, value, what, is_feature)

    def _pack(self, flat: list[Any]) -> Any:
        return _nest.pack(self._feature_config, flat, is_feature)

    def _by_path(self, flat: list[Any]) -> dict[str, Any]:
        return dict(zip(self._paths, flat))

    @property
    def built(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> _Engine:
        """The underlying ``me.TPUEmbedding`` (built on first use): save, retrieve, load.

        An object with a table without optimizer has none to hand out (ConfigError): its
        engine holds a stand-in SGD(0) that another front end would silently train with."""
        if self._untrained:
            raise ConfigError(f"Invalid `optimizer` for table '{sorted(self._untrained)[0]}'. Expected an optimizer "
                              "to use this TPUEmbedding's engine (without one it only looks up: enqueue(..., "
                              "training=False), dequeue, restore, embedding_tables). Fix: give the TableConfig an "
                              "optimizer, or pass optimizer=... Received: optimizer=None")
        return self._live()

    def _live(self) -> _Engine:
        """The engine, built on first use (also for an object that only serves)."""
        self.build()
        assert self._engine is not None
        return self._engine

    def table_name(self, table: TableConfig) -> str:
        """The engine's name of ``table`` (its own, or ``table_<i>``)."""
        try:
            return self._table_names[id(table)]
        except KeyError:
            raise InputError(f"Invalid table {table!r}: not part of this TPUEmbedding's feature_config.") from None

    # -- build --------------------------------------------------------------------------------
    def _merged(self, incoming: list[tuple[int, ...] | None]) -> list[tuple[int, ...] | None]:
        out = []
        for path, old, new in zip(self._paths, self._output_shapes, incoming):
            if new is not None:
                _check_shape(old, new, path)
            out.append(old if old is not None else new)
        return out

    def build(self, per_replica_input_shapes: Any = None, per_replica_batch_size: int | None = None) -> None:
        """Create the tables and slots. Output shapes come from FeatureConfig.output_shape,
        then ``per_replica_input_shapes`` (a nest like feature_config, or a batch size), then
        the first ``enqueue``; a second call is a no-op, as in TF."""
        if self._engine is not None:
            return
        incoming: list[tuple[int, ...] | None] = [None] * len(self._features)
        batch = per_replica_input_shapes if isinstance(per_replica_input_shapes, int) else per_replica_batch_size
        if isinstance(batch, bool) or (batch is not None and (not isinstance(batch, int) or batch < 1)):
            raise invalid("per_replica_batch_size", "TPUEmbedding.build", "an int >= 1", batch)
        if batch is not None and not isinstance(per_replica_input_shapes, int) and per_replica_input_shapes is not None:
            raise invalid("per_replica_batch_size", "TPUEmbedding.build",
                          "None when per_replica_input_shapes is given", batch)
        if batch is not None:
            incoming = [(batch, f.max_sequence_length) if f.output_shape is None and f.max_sequence_length
                        else (batch,) for f in self._features]
        elif per_replica_input_shapes is not None:
            shapes = self._leaves(per_replica_input_shapes, "per_replica_input_shapes")
            incoming = []
            for path, f, s in zip(self._paths, self._features, shapes):
                s = _shape(s, "per_replica_input_shapes", f"feature '{path}'")
                if s is None:
                    raise invalid("per_replica_input_shapes", f"feature '{path}'", "a shape of rank >= 1", s)
                if len(s) == 2 and s[-1] != 1 and f.output_shape is None and f.max_sequence_length:
                    s = (s[0], f.max_sequence_length, s[1])
                incoming.append(s if len(s) == 1 else s[:-1])
        self._build(self._merged(incoming))

    def _build(self, shapes: list[tuple[int, ...] | None]) -> None:
        for path, s in zip(self._paths, shapes):
            if s is None:
                raise ConfigError(
                    f"Input feature '{path}' has no output shape yet. Fix: give FeatureConfig(output_shape=...), "
                    "call build(per_replica_input_shapes=...), or enqueue a batch first.")
        feats = [_EngineFeature(self._table_names[id(f.table)], s, name=p)
                 for p, f, s in zip(self._paths, self._features, shapes)]
        cfg = EmbeddingConfig(tables=self._engine_tables, features=feats,
                              mode="inference" if self._untrained else "training",
                              pipeline_execution_with_tensor_core=self._pipeline)
        self._engine = _Engine(cfg, pipelined=self._pipeline, **self._engine_args)  # TF: one step stale
        self._output_shapes = list(shapes)

    # -- the step -----------------------------------------------------------------------------
    def enqueue(self, features: Any, weights: Any = None, training: bool = True, name: str | None = None) -> None:
        """Queue one batch: the nest of feature_config holding dense ids, SparseIds/RaggedIds or
        tf.Tensor/SparseTensor/RaggedTensor; ``weights`` mirrors it (None leaves allowed).
        ``name`` (TF's op name) is accepted and unused."""
        if not isinstance(training, (bool, np.bool_)):  # bool("False") is True: a string would train
            raise InputError("Invalid `training`. Expected a bool (True: a training batch, False: lookup only). "
                             f"Received: training={training!r}")
        if training:
            self._refuse_training("Invalid `training`. Expected False", " Received: training=True")
        raw = self._leaves(features, "features")
        flat = [from_tf(x, "features", p) for x, p in zip(raw, self._paths)]
        wflat = [None] * len(flat)
        if weights is not None:
            wflat = [from_tf(w, "weights", p) for w, p in zip(self._leaves(weights, "weights"), self._paths)]
        incoming = [incoming_output_shape(x, f, "features", p) for x, f, p in zip(flat, self._features, self._paths)]
        shapes = self._merged(incoming)
        fresh = self._engine is None
        before = list(self._output_shapes)
        if fresh:
            self._build(shapes)
        assert self._engine is not None
        try:
            self._engine.enqueue(self._by_path(flat), None if weights is None else self._by_path(wflat),
                                 training=bool(training))
        except Exception:
            if fresh:  # a rejected first batch leaves the object unbuilt, as it was
                self._engine, self._output_shapes = None, before
            raise
        self._tf_io = any(is_tf(x) for x in raw)

    def _require_built(self, what: str) -> _Engine:
        if self._engine is None:
            raise StateError(f"{what} called on an unbuilt TPUEmbedding. Fix: call enqueue(...) first, or build().")
        return self._engine

    def dequeue(self, name: str | None = None) -> Any:
        """The activations in feature_config's nest, each ``output_shape + [dim]``."""
        engine = self._require_built("dequeue")
        acts = engine.dequeue()
        flat = [acts[p] for p in self._paths] if isinstance(acts, Mapping) else list(acts)
        if self._tf_io:
            flat = [to_tf(engine.backend.to_numpy(a)) for a in flat]
        return self._pack(flat)

    def apply_gradients(self, gradients: Any, name: str | None = None) -> None:
        """One gradient per feature in feature_config's nest (None: zeros, with a warning);
        callable learning rates are evaluated here, as in TF."""
        self._refuse_training("Cannot apply gradients")
        engine = self._require_built("apply_gradients")
        flat = [from_tf(g, "gradients", p) for g, p in zip(self._leaves(gradients, "gradients"), self._paths)]
        engine.apply_gradients(self._by_path(flat))

    # -- tables -------------------------------------------------------------------------------
    @property
    def embedding_tables(self) -> dict[TableConfig, np.ndarray]:
        """``{TableConfig: [vocabulary_size, dim] array}`` (NumPy copies of the tables)."""
        tables = self._live().embedding_tables
        return {t: tables[self._table_names[id(t)]] for t in self._tables}

    @property
    def variables(self) -> dict[TableConfig, dict[str, np.ndarray]]:
        """``{TableConfig: {"parameters": ..., <slot>: ...}}`` (TF's slot names are the TPU's)."""
        return {t: self._live().retrieve_parameters(self._table_names[id(t)]) for t in self._tables}

    # -- checkpoints (TF's tf.train.Checkpoint has no meshembed counterpart) --------------------
    def save(self, path: Any) -> Any:
        """Write the tables, slots and step as the engine's checkpoint directory."""
        return self._live().save(path)

    def restore(self, path: Any) -> None:
        """Load tables, slots and step from a checkpoint of the same tables (any backend or
        shard count wrote it). Every table is checked before any is written. Learning-rate
        callables and schedules are this object's own: nothing needs passing again. A table
        without an optimizer takes the parameters only."""
        engine = self._live()
        step, saved = read_checkpoint(path)
        values = {}
        for t in self._tables:
            name = self._table_names[id(t)]
            if name not in saved:
                raise InputError(f"Invalid checkpoint {str(path)!r}: it has no table '{name}' "
                                 f"(it has {sorted(saved)}).")
            got = saved[name]
            if name in self._untrained:
                got = {"parameters": got["parameters"]}
            want = ("parameters",) + engine.table_slot_names(name)
            if set(got) == set(want):
                got = {k: got[k] for k in want}
            if tuple(got) != want or got["parameters"].shape != (t.vocabulary_size, t.dim):
                raise InputError(f"Invalid checkpoint {str(path)!r} for table '{name}': expected "
                                 f"{list(want)} of shape {(t.vocabulary_size, t.dim)}. Received: {list(got)} of "
                                 f"shape {got['parameters'].shape}.")
            values[name] = got
        for name, got in values.items():
            engine.load_parameters(name, **got)
        engine.step = step

    def __repr__(self) -> str:
        return f"meshembed.tpu.TPUEmbedding(features={self._paths}, tables={list(self._table_names.values())})"
