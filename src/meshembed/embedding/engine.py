"""``TPUEmbedding``: the TPU embedding mid-level API on any meshembed backend.

One step is ``enqueue`` (host: validate and flatten ids, compute combiner factors) →
``dequeue`` (device: gather rows, segment-sum into output slots) → ``apply_gradients``
(device: combiner backward, sum per row, one optimizer application per looked-up row), the
semantics of TensorFlow's Enqueue / RecvTPUEmbeddingActivations / SendTPUEmbeddingGradients.

The engine is TF's state machine (the pending batch, the order of the calls, Load/Retrieve,
save/restore) over the step functions of :mod:`meshembed.embedding.batch` (``prepare``) and
:mod:`meshembed.embedding.step` (``lookup``, ``apply_gradients``), which hold every check and
the per-table routing. Every call validates all of its inputs before it touches any table,
slot or pending batch: a rejected call leaves the state bit-identical.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from meshembed.backend import Backend, get_backend, memory
from meshembed.config.rowwise import slot_width
from meshembed.embedding import inputs, precision
from meshembed.embedding import step as steps
from meshembed.embedding.agreement import agreed, validated
from meshembed.embedding import dynamic
from meshembed.embedding.batch import Batch, check_bool, resolve_mode, structured
from meshembed.embedding.initializers import Constant, default_initializer, initial_blocks, table_rng
from meshembed.embedding.layout import FeatureSpec, Layout, TableSpec, build_layout, load_config
from meshembed.embedding.step import EngineState
from meshembed.config.common import as_int
from meshembed.errors import ConfigError, InputError, StateError, UntrainableError
from meshembed.sharding.placement import Placement


@dataclass
class _Pending:
    """The enqueued batch and whether its activations were read (TF's order: enqueue, dequeue,
    apply_gradients)."""

    batch: Batch
    dequeued: bool = False


def _check_bool(value: Any, name: str, error: type = ConfigError) -> bool:
    return check_bool(value, name, error)


class TPUEmbedding:
    """Embedding tables with their optimizer slots, sharded over ``num_shards`` by the
    config's ``sharding_strategy`` (MOD or DIV) on one backend.

    Args:
        config: ``me.EmbeddingConfig`` (or its proto bytes / text / path).
        backend: backend name or instance; default per ``me.get_backend()``.
        num_shards: shards the rows are placed over (devices or ranks); default the
            mesh's size, else the backend's device count.
        mesh: a ``me.Mesh``; supplies the backend and the shard count when not given.
        seed: seeds the default TruncatedNormal initialisers (per table). A table with no
            initialiser starts as TF2's TruncatedNormal(stddev=1/sqrt(dim)); a
            FrequencyEstimator table (D) starts at its ``max_delta`` instead (spec §4.2).
        initializers: optional ``{table_name: initializer}`` overriding the config's.
        allow_nonfinite: let NaN/Inf gradients through instead of raising.
        state: an existing :class:`EngineState` (tables made by this backend for these
            placements, e.g. a ``me.jax`` state) to hold instead of allocating new tables.
        pipelined: the TPU's pipelined schedule (``pipeline_execution_with_tensor_core``): the
            gradients of step t are applied right after the lookup of step t+1, so every
            lookup sees tables one step stale. ``flush()`` applies the kept step now (save,
            retrieve_parameters, load_* and embedding_tables flush first).
    """

    def __init__(
        self,
        config: Any,
        backend: str | Backend | None = None,
        num_shards: int | None = None,
        mesh: Any = None,
        seed: int = 0,
        *,
        initializers: Mapping[str, Any] | None = None,
        allow_nonfinite: bool = False,
        state: EngineState | None = None,
        pipelined: bool = False,
    ) -> None:
        self.config = load_config(config)
        allow_nonfinite = _check_bool(allow_nonfinite, "allow_nonfinite")
        seed = as_int("seed", seed, minimum=0, maximum=None, fix="pass a non-negative integer seed.")
        if num_shards is not None:
            num_shards = as_int("num_shards", num_shards, minimum=1, maximum=None,
                                fix="pass a positive integer, or None for the device count.")
        if mesh is not None and not hasattr(mesh, "size"):
            raise ConfigError(f"Invalid `mesh`. Expected a me.Mesh. Received: {type(mesh).__name__}")
        mesh_backend = getattr(mesh, "backend", None)
        if backend is None and mesh is not None:
            backend = mesh_backend
        self.backend: Backend = get_backend(backend)
        if mesh_backend is not None and getattr(mesh_backend, "name", mesh_backend) != self.backend.name:
            raise ConfigError(
                f"Invalid `mesh`: it is a {getattr(mesh_backend, 'name', mesh_backend)!r} mesh but "
                f"backend={self.backend.name!r}. Fix: build the mesh with "
                f"me.Mesh(..., backend={self.backend.name!r}), or leave `backend` out to use the mesh's."
            )
        self.layout: Layout = build_layout(self.config)
        precision.check_layout(self.layout, self.backend)  # 16-bit tables the step cannot run
        self._rules: dict[int, Any] | None = None  # each table's UpdateRule, built on first use
        if self.layout.mode != "inference":  # an optimizer it cannot train fails now, not at step 1
            try:
                self._rules = steps.make_rules(self.backend, self.layout)
            except NotImplementedError as exc:
                raise UntrainableError(f"{exc} Fix: build the engine with mode='inference' to serve this "
                                       "config, or choose another optimizer.") from None
        explicit = num_shards is not None
        if num_shards is None:
            num_shards = int(mesh.size) if mesh is not None else int(self.backend.capabilities.devices)
        self.num_shards = int(num_shards)
        self.mesh = mesh
        self.seed = int(seed)
        self.allow_nonfinite = bool(allow_nonfinite)
        self._pending: _Pending | None = None
        self._lock = threading.Lock()  # one apply_gradients at a time (see apply_gradients)
        self._applying: int | None = None  # the thread inside apply_gradients
        self._pipelined = _check_bool(pipelined, "pipelined")
        #: pipelined: the last step's (batch, gradients, learning rates, allow_nonfinite), not yet applied
        self._deferred: tuple[Batch, list[Any], list[float], bool] | None = None
        overrides = dict(initializers or {})
        unknown = set(overrides) - {t.name for t in self.layout.tables}
        if unknown:
            raise ConfigError(f"Invalid `initializers`: unknown tables {sorted(unknown)}.")
        # every process builds the same engine (one process's other config would train on)
        validated(self.backend, steps.config_fingerprint(self.layout, self.num_shards, explicit, self.seed),
                  "the config, num_shards or seed")
        self._placements: dict[int, Placement] = {}
        self._init_dynamic(overrides)  # dynamic vocabularies (see "dynamic vocabularies" below)
        tables: dict[int, tuple[Any, ...]] = {}
        for t in self.layout.tables:
            shards = self.num_shards if explicit else min(self.num_shards, t.vocabulary_size)
            if t.vocabulary_size < shards:
                raise ConfigError(
                    f"Table {t.name!r} has {t.vocabulary_size} rows, fewer than num_shards="
                    f"{self.num_shards}: every shard must hold a row. Fix: use fewer shards or a "
                    "larger `vocabulary_size`."
                )
            # A default shard count (the device count) is capped per table so that every shard
            # holds a row, as TF2 pads tiny vocabularies to num_hosts; an explicit one is kept.
            self._placements[t.index] = Placement(t.vocabulary_size, shards, self.layout.strategy)
            if state is not None:
                continue
            init = overrides.get(t.name, t.initializer)
            if init is None:
                init = default_initializer(t.optimizer)
            if t.index in self._vocab:  # its rows get their values when a key is admitted
                init = "zeros"
            blocks = initial_blocks(init, (t.vocabulary_size, t.dimension), table_rng(self.seed, t.index), t.name)
            with self._allocating_table(t):
                tables[t.index] = tuple(self._fresh_state(t, blocks))
        #: the tables and slots (backend arrays) and the step counter: plain data the step
        #: functions (meshembed.embedding.step) take and return
        if state is None:
            state = EngineState(tables, 0, self.layout)
        elif state.layout is None:  # tables made for this config (e.g. me.jax's): held as they are
            state = EngineState(state.tables, state.step, self.layout)
        elif state.layout != self.layout:
            raise ConfigError("Invalid `state`: it holds the tables of another config.")
        self.state = state

    @property
    def step(self) -> int:
        """How many gradient steps were applied."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state = EngineState(self.state.tables, int(value), self.layout)

    # -- construction helpers ---------------------------------------------------------------
    def _allocating_table(self, table: TableSpec) -> Any:
        """``memory.allocating`` for table ``table`` with its slots (a ResourceError stating
        the bytes; no engine exists after a failure)."""
        n = 1 + len(self._slot_names(table))
        shards = self._placements[table.index].num_shards
        return memory.allocating(
            f"table {table.name!r} with its {n - 1} slot(s) on backend {self.backend.name!r} over {shards} "
            f"shard(s)", (table.vocabulary_size, table.dimension), precision.array_dtypes(table)[0], arrays=n,
            nothing="No engine was created.",
            fix="a smaller `vocabulary_size` or `dimension`, more shards (`num_shards`: devices/ranks), or "
                "lower-precision tables (`TableConfig(precision=...)`).")

    def _slot_names(self, table: TableSpec) -> tuple[str, ...]:
        return tuple(table.optimizer.slot_names)

    def _fresh_state(self, table: TableSpec, blocks: Iterator[np.ndarray]) -> list[Any]:
        """The table (from its initial ``blocks`` of rows) and its slots, each made block by
        block, so creating them never holds a whole table on the host beside the backend's."""
        placement = self._placements[table.index]
        if precision.is_low(table):  # 16-bit arrays, rounded to nearest on the host
            return precision.fresh_state(self.backend, table, blocks, placement, table.optimizer.slot_initial_values())
        shape = (table.vocabulary_size, table.dimension)
        state = [self.backend.create_table_from_blocks(shape, blocks, placement)]
        for name, init in zip(self._slot_names(table), table.optimizer.slot_initial_values()):
            slot = self._slot_shape(table, name)  # (V, 1) for a row-wise slot
            state.append(self.backend.create_table_from_blocks(slot, Constant(init).blocks(slot), placement))
        return state

    @staticmethod
    def _slot_shape(table: TableSpec, name: str, rows: int | None = None) -> tuple[int, int]:
        """Shape of array ``name`` ("parameters" or a slot): row-wise slots have one column."""
        rows = table.vocabulary_size if rows is None else rows
        return (rows, slot_width(table.optimizer, name, table.dimension))

    # -- introspection ---------------------------------------------------------------------
    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.layout.tables]

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.layout.features]

    @property
    def embedding_tables(self) -> dict[str, np.ndarray]:
        """The logical ``[V, D]`` parameters of every table, as NumPy (a copy)."""
        self.flush()
        out = {}
        for t in self.layout.tables:
            with self._host_copy(t, "parameters", t.vocabulary_size):
                out[t.name] = precision.from_storage(self.backend.unshard(self.state.tables[t.index][0]),
                                                     precision.array_dtypes(t)[0])
        return out

    def _host_copy(self, t: TableSpec, name: str, rows: int) -> Any:
        """``memory.allocating`` for a float32 host copy of ``rows`` rows of table ``t``'s ``name``."""
        return memory.allocating(
            f"a host copy of table {t.name!r} `{name}`", (rows, t.dimension), "float32",
            nothing="The tables are unchanged.",
            fix="free host memory, or read the table one shard at a time (retrieve_parameters(table, "
                "num_shards=..., shard_id=...)).")

    def table_slot_names(self, table: str | int) -> tuple[str, ...]:
        """TPU slot names of a table after ``parameters``, in Load/Retrieve order."""
        return self._slot_names(self.layout.table(table))

    def output_shape(self, feature: int | str) -> tuple[int, ...]:
        """Shape of a feature's activation / gradient: ``input_shape + [dimension]``."""
        f = self._feature(feature)
        return f.output_shape + (self.layout.tables[f.table].dimension,)

    def _feature(self, key: int | str) -> FeatureSpec:
        for f in self.layout.features:
            if f.name == key or (isinstance(key, int) and f.index == key):
                return f
        raise InputError(f"Invalid feature. Expected one of {self.feature_names}. Received: {key!r}")

    # -- enqueue ---------------------------------------------------------------------------
    def _check_can_enqueue(self) -> None:
        p = self._pending
        if p is not None and p.batch.mode != "inference":
            raise StateError(
                "Cannot enqueue: the previous training batch has not been consumed. Fix: call "
                "`apply_gradients(...)` for it first (after `dequeue()`), or enqueue evaluation "
                "batches with `training=False`."
            )

    @agreed("enqueue")
    def enqueue(
        self,
        features: Any,
        weights: Any = None,
        *,
        training: bool | None = None,
        mode_override: str | None = None,
    ) -> None:
        """Queue one batch: one entry per feature in config order (or a dict by name).

        Each entry is a dense int array of the feature's ``input_shape`` (one id per slot),
        ``me.SparseIds`` or ``me.RaggedIds``; ``weights`` mirrors it (None = all ones).
        ``training=False`` (or ``mode_override="inference"``) runs the forward pass only;
        ``mode_override="backward_pass_only"`` skips it.
        """
        mode = resolve_mode(self.layout, training, mode_override)
        self._check_can_enqueue()
        self.enqueue_batch(steps.prepare_on(self.backend, self.key_layout, features, weights, mode_override=mode))

    @agreed("enqueue")
    def enqueue_batch(self, batch: Batch) -> None:
        """Queue a batch made by ``meshembed.embedding.batch.prepare`` for this engine's config."""
        self._check_can_enqueue()
        if self._vocab:  # dynamic vocabularies: a batch of keys, mapped to rows here
            self._check_key_batch(batch)
            validated(self.backend)
            self._pending = _Pending(self.map_batch(batch))
            return
        if not isinstance(batch, Batch) or (batch.layout is not self.layout and batch.layout != self.layout):
            raise InputError("Invalid `batch`: expected a Batch prepared for this engine's config "
                             "(meshembed.embedding.batch.prepare(engine.layout, ...)).")
        validated(self.backend, *steps.mode_agreement(batch.mode))  # valid everywhere: only then stored
        self._pending = _Pending(batch)

    @property
    def pending(self) -> Batch | None:
        """The enqueued batch not yet consumed by ``apply_gradients`` (None: nothing pending)."""
        p = self._pending
        return None if p is None else p.batch

    def discard(self) -> bool:
        """Drop the pending batch, if any, without applying anything (e.g. to recover after
        a step that failed between ``enqueue`` and ``apply_gradients``). Returns whether one
        was pending. Tables, slots and ``step`` are unchanged."""
        pending, self._pending = self._pending, None
        return pending is not None

    # -- dequeue ---------------------------------------------------------------------------
    def dequeue(self) -> list[Any] | dict[Any, Any]:
        """Activations, one backend array per feature, shape ``input_shape + [dimension]``:
        a list in config order, or a dict with the config's keys when its features were a dict."""
        return structured(self.layout, self.dequeue_list())

    def dequeue_list(self) -> list[Any]:
        """The activations as a list in config order (the raw op's positional outputs)."""
        p = self._pending
        if p is None:
            raise StateError("Cannot dequeue: nothing was enqueued. Fix: call `enqueue(features)` first.")
        steps.refuse_if_tracing(self.backend, "dequeue")  # the pending batch stays as it was
        outs = steps.lookup(self.backend, self.state, p.batch)
        if any(self.backend.is_traced(a) for a in outs):
            raise steps.traced_call_error("dequeue")  # the pending batch stays as it was
        p.dequeued = True
        self.flush()  # pipelined: the previous step's gradients, right after this lookup
        return outs

    # -- apply_gradients ---------------------------------------------------------------------
    def _check_can_apply(self) -> _Pending:
        p = self._pending
        if p is None:
            raise StateError(
                "Cannot apply gradients: no batch is pending. Fix: call `enqueue(...)` and "
                "`dequeue()` first; each batch takes one `apply_gradients`."
            )
        if p.batch.mode == "training" and not p.dequeued:
            raise StateError(
                "Cannot apply gradients before `dequeue()`: the activations of this batch were "
                "never read. Fix: call `dequeue()` first, or enqueue with "
                "mode_override='backward_pass_only'."
            )
        return p

    @agreed("apply_gradients")
    def apply_gradients(
        self,
        gradients: Any,
        learning_rates: Sequence[Any] = (),
        *,
        allow_nonfinite: bool | None = None,
    ) -> None:
        """SendTPUEmbeddingGradients: one gradient per feature (``∂loss/∂activation``, the
        shape of its activation), and ``learning_rates[k]`` for dynamic tag k.

        Thread-safe: calls from several threads run one at a time, and one pending batch is
        applied once (the second call finds no batch pending: ``StateError``)."""
        allow = self.allow_nonfinite if allow_nonfinite is None else _check_bool(
            allow_nonfinite, "allow_nonfinite", InputError)
        if self._applying == threading.get_ident():
            raise StateError(
                "Cannot apply gradients from inside apply_gradients (e.g. a learning-rate callable "
                "that calls it again): the pending batch would be applied twice. Nothing was changed.")
        with self._lock:  # another thread's call first; then this one finds its batch consumed
            self._applying = threading.get_ident()
            try:
                p = self._check_can_apply()
                if self._pipelined:
                    self._defer(p.batch, gradients, learning_rates, allow)
                else:
                    self.state = steps.apply_gradients(self.backend, self.state, p.batch, gradients, learning_rates,
                                                       allow_nonfinite=allow, rules=self.rules)
                self._pending = None
            finally:
                self._applying = None

    def send(self, batch: Batch, gradients: Any, learning_rates: Any = (), *,
             allow_nonfinite: bool | None = None) -> None:
        """SendTPUEmbeddingGradients for a batch the caller holds (a front end keeping one
        Batch per forward, as me.torch does): applied now, or — pipelined — checked now and
        applied right after the next lookup (``flush``), exactly as ``apply_gradients``."""
        allow = self.allow_nonfinite if allow_nonfinite is None else _check_bool(
            allow_nonfinite, "allow_nonfinite", InputError)
        with self._lock:
            if self._pipelined:
                self._defer(batch, gradients, learning_rates, allow)
            else:
                self.state = steps.apply_gradients(self.backend, self.state, batch, gradients, learning_rates,
                                                   allow_nonfinite=allow, rules=self.rules)

    # -- the pipelined schedule -------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        """Whether each step's gradients wait for the next lookup (set at construction)."""
        return self._pipelined

    def _defer(self, batch: Batch, gradients: Any, learning_rates: Any, allow: bool) -> None:
        """Check this step's gradients and learning rates now (a bad one raises here, nothing
        changed; callables are called now, as TF sends them with the step) and keep private
        copies until the next lookup. A step still kept (no lookup in between, e.g.
        backward_pass_only batches) is applied first."""
        if batch.mode == "inference":
            raise StateError("Cannot apply gradients to a batch enqueued in 'inference' mode. Fix: enqueue with "
                             "`training=True` (or mode_override='training') to train on it.")
        grads = [self._private(g) for g in steps.check_gradients(self.backend, self.layout, gradients,
                                                                  check_now=not allow)]
        lrs = steps.check_learning_rates(self.layout, learning_rates, self.backend)
        self._apply_deferred()
        self._deferred = (batch, grads, lrs, allow)

    def _private(self, g: Any) -> Any:
        """A copy the caller cannot change before the deferred step runs."""
        try:
            return self.backend.xp.asarray(g, copy=True)
        except TypeError:  # a namespace without `copy=`
            return np.array(g) if isinstance(g, np.ndarray) else g

    def _apply_deferred(self) -> None:
        if self._deferred is not None:
            batch, grads, lrs, allow = self._deferred
            self.state = steps.apply_gradients(self.backend, self.state, batch, grads, lrs, allow_nonfinite=allow,
                                               rules=self.rules)
            self._deferred = None

    def flush(self) -> bool:
        """Pipelined: apply the kept step's gradients now. Returns whether one was kept."""
        if self._deferred is None:
            return False
        with self._lock:
            kept = self._deferred is not None
            self._apply_deferred()
        return kept

    @property
    def rules(self) -> dict[int, Any]:
        """Each table's UpdateRule (built on first use, once)."""
        if self._rules is None:
            self._rules = steps.make_rules(self.backend, self.layout)
        return self._rules

    # -- parameters --------------------------------------------------------------------------
    def _shard_ids(self, table: TableSpec, num_shards: int | None, shard_id: int | None) -> np.ndarray | None:
        """Global ids of a Load/Retrieve host shard (spec §3.4); None = the whole table."""
        if num_shards is None and shard_id is None:
            return None
        if num_shards is None or shard_id is None:
            raise InputError("Pass both `num_shards` and `shard_id`, or neither.")
        try:
            if any(isinstance(v, (bool, np.bool_)) for v in (num_shards, shard_id)):
                raise TypeError
            num_shards, shard_id = operator.index(num_shards), operator.index(shard_id)
        except TypeError:
            raise InputError(
                f"Invalid `num_shards`/`shard_id`: expected integers. Received: num_shards={num_shards!r}, "
                f"shard_id={shard_id!r}"
            ) from None
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise InputError(
                f"Invalid `shard_id`. Expected 0 <= shard_id < num_shards. Received: shard_id={shard_id}, "
                f"num_shards={num_shards}"
            )
        if num_shards > table.vocabulary_size:
            raise InputError(
                f"All embedding shards must be non-empty: table {table.name!r} has "
                f"{table.vocabulary_size} rows but num_shards={num_shards}."
            )
        return Placement(table.vocabulary_size, num_shards, self.layout.strategy).global_ids(shard_id)

    def retrieve_parameters(
        self, table: str | int, num_shards: int | None = None, shard_id: int | None = None
    ) -> dict[str, np.ndarray]:
        """``{"parameters": ..., <slot>: ...}`` as NumPy, the whole table or one host shard."""
        steps.refuse_if_tracing(self.backend, "retrieve_parameters")
        self.flush()
        t = self.layout.table(table)
        ids = self._shard_ids(t, num_shards, shard_id)
        names = ("parameters",) + self._slot_names(t)
        out = {}
        for name, st, dtype in zip(names, self.state.tables[t.index], precision.array_dtypes(t)):
            with self._host_copy(t, name, t.vocabulary_size if ids is None else len(ids)):
                if ids is None:
                    out[name] = self.backend.unshard(st)
                else:
                    out[name] = np.asarray(self.backend.to_numpy(self.backend.gather(st, self.backend.asarray(ids, dtype="int64"))))
                out[name] = precision.from_storage(out[name], dtype)  # 16-bit storage: its exact float32 values
        return out

    def load_parameters(
        self,
        table: str | int,
        parameters: Any = None,
        *,
        num_shards: int | None = None,
        shard_id: int | None = None,
        allow_nonfinite: bool | None = None,
        **slots: Any,
    ) -> None:
        """Overwrite a table's parameters and/or slots (whole table or one host shard).

        Arrays not passed are left as they are. Every array is checked (shape, a real dtype,
        finite unless ``allow_nonfinite``, default the engine's) before any write."""
        self.load_tables({table: dict(slots, parameters=parameters)}, num_shards=num_shards, shard_id=shard_id,
                         allow_nonfinite=allow_nonfinite)

    @agreed("load_parameters")
    def load_tables(self, values: Mapping[str | int, Mapping[str, Any]], *, num_shards: int | None = None,
                    shard_id: int | None = None, allow_nonfinite: bool | None = None) -> None:
        """Load several tables at once, ``{table: {"parameters": ..., <slot>: ...}}``: every
        array of every table is checked before anything is written (all or nothing)."""
        self.flush()
        plans = []
        for table, arrays in values.items():
            arrays = dict(arrays)
            parameters = arrays.pop("parameters", None)
            plans.append(self._plan_load(table, parameters, num_shards, shard_id, allow_nonfinite, arrays))
        validated(self.backend)  # every process's arrays are valid: none loads half (a NaN on one rank)
        new = dict(self._loaded_state(plan) for plan in plans)
        self.state = self.state.replace(new)

    def _plan_load(self, table: str | int, parameters: Any, num_shards: Any, shard_id: Any,
                   allow_nonfinite: Any, slots: Mapping[str, Any]) -> tuple[TableSpec, Any, dict[str, np.ndarray]]:
        """Validate one table's Load: (table, shard ids or None, {name: private float32 copy})."""
        t = self.layout.table(table)
        allow = self.allow_nonfinite if allow_nonfinite is None else _check_bool(
            allow_nonfinite, "allow_nonfinite", InputError)
        ids = self._shard_ids(t, num_shards, shard_id)
        names = ("parameters",) + self._slot_names(t)
        unknown = sorted(set(slots) - set(names[1:]))
        if unknown:
            raise InputError(
                f"Invalid slot(s) {unknown} for table {t.name!r} ({type(t.optimizer).__name__}). "
                f"Expected some of {list(names[1:])}."
            )
        given = dict(slots, parameters=parameters)
        rows = t.vocabulary_size if ids is None else ids.shape[0]
        values = {}
        for name in names:
            v = given.get(name)
            if v is None:
                continue
            what = f"`{name}` for table {t.name!r}"
            arr = inputs.to_host(v, self.backend, what)
            if arr.dtype.kind not in "fiu":
                raise InputError(
                    f"Invalid {what}: expected a real (float or integer) array. Received: dtype={arr.dtype}. "
                    "Fix: pass float32 values (strings, None, bool and complex are not parameters)."
                )
            if arr.shape != self._slot_shape(t, name, rows):
                raise InputError(
                    f"Invalid {what}: expected shape {self._slot_shape(t, name, rows)}. Received: shape={arr.shape}"
                )
            with np.errstate(over="ignore", invalid="ignore"), memory.allocating(
                    f"a float32 copy of {what}", arr.shape, nothing="Nothing was loaded."):
                arr = np.array(arr, dtype=np.float32)  # a private copy, in the tables' dtype
            if not allow and not np.all(np.isfinite(arr)):
                k = np.argwhere(~np.isfinite(arr))[0].tolist()
                raise InputError(
                    f"Invalid {what}: it contains NaN or Inf in float32 (first at {k}: {arr[tuple(k)]}). "
                    "Nothing was loaded. Fix: load finite values, or pass `allow_nonfinite=True`."
                )
            values[name] = arr
        steps.refuse_if_tracing(self.backend, "load_parameters")  # concrete values inside jax.jit
        return t, ids, values

    def _loaded_state(self, plan: tuple[TableSpec, Any, dict[str, np.ndarray]]) -> tuple[int, list[Any]]:
        """The table's new state lists with a validated plan written (not yet committed)."""
        t, ids, values = plan
        names = ("parameters",) + self._slot_names(t)
        state = list(self.state.tables[t.index])
        dtypes = precision.array_dtypes(t)
        for k, name in enumerate(names):
            if name not in values:
                continue
            stored = precision.to_storage(values[name], dtypes[k])  # 16-bit storage: rounded to nearest
            if ids is None:
                with memory.allocating(f"table {t.name!r} `{name}` on backend {self.backend.name!r}", stored.shape,
                                       str(stored.dtype), nothing="Nothing was loaded."):
                    state[k] = self.backend.create_table(stored, self._placements[t.index])
            else:
                state[k] = self.backend.scatter(
                    state[k], self.backend.asarray(ids, dtype="int64"), self.backend.asarray(stored, dtype=stored.dtype)
                )
        return t.index, tuple(state)

    # -- dynamic vocabularies (embedding/dynamic.py, docs/dynamic_vocab.md) ---------------------
    def _init_dynamic(self, overrides: Mapping[str, Any]) -> None:
        """Each dynamic table's empty vocabulary and the initializer its rows take when a key is
        admitted; ``key_layout``: the layout a batch of keys is prepared for."""
        specs = dynamic.dynamic_tables(self.config)
        self.key_layout: Layout = dynamic.key_layout(self.layout, specs)
        self._vocab: dict[int, dynamic.DynamicVocabularyState] = {}
        self._dynamic_init: dict[int, Any] = {}
        if specs and self.backend.processes > 1:
            raise ConfigError(
                f"Table(s) {[self.layout.tables[i].name for i in specs]} have a dynamic vocabulary, which needs "
                f"every process's keys on one host; backend {self.backend.name!r} runs {self.backend.processes} "
                "processes, each with its own batch. Fix: use one process (any number of shards), or hash the "
                "keys to rows yourself and drop `dynamic=`.")
        for i, spec in specs.items():
            t = self.layout.tables[i]
            init = overrides.get(t.name, t.initializer)
            init = default_initializer(t.optimizer) if init is None else init
            dynamic.keyed_initial_values(init, np.zeros(1, np.int64), t.dimension, self.seed, i, t.name)  # usable?
            self._dynamic_init[i] = init
            self._vocab[i] = dynamic.new_state(spec, t.vocabulary_size)

    @property
    def vocabularies(self) -> dict[str, "dynamic.DynamicVocabularyState"]:
        """``{table name: DynamicVocabularyState}`` of the dynamic tables (plain host data)."""
        return {self.layout.tables[i].name: st for i, st in self._vocab.items()}

    @property
    def dynamic_initializers(self) -> dict[str, Any]:
        """``{table name: initializer}`` a dynamic table's rows take when a key is admitted."""
        return {self.layout.tables[i].name: init for i, init in self._dynamic_init.items()}

    def vocabulary(self, table: str | int) -> "dynamic.DynamicVocabularyState":
        t = self.layout.table(table)
        if t.index not in self._vocab:
            raise InputError(f"Invalid `table`: {t.name!r} has no dynamic vocabulary. Expected one of "
                             f"{[self.layout.tables[i].name for i in self._vocab]}.")
        return self._vocab[t.index]

    def load_vocabulary(self, table: str | int, state: "dynamic.DynamicVocabularyState") -> None:
        """Replace a dynamic table's vocabulary (e.g. from a checkpoint); the rows' values are
        the table's, loaded with ``load_parameters``."""
        current = self.vocabulary(table)
        if not isinstance(state, dynamic.DynamicVocabularyState) or state.spec != current.spec \
                or state.capacity != current.capacity:
            raise InputError(f"Invalid vocabulary for table {self.layout.table(table).name!r}: expected a "
                             f"DynamicVocabularyState with spec {current.spec!r} and capacity {current.capacity}.")
        self._vocab[self.layout.table(table).index] = state.copy()

    def export_dynamic(self, table: str | int) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)`` of a dynamic table for serving: every resident key (ascending,
        int64) and its row of parameters (float32 [n, dimension])."""
        st = self.vocabulary(table)
        self.flush()
        t = self.layout.table(table)
        keys, rows = st.resident()
        return keys, self._rows_of(t, rows)

    def _rows_of(self, t: TableSpec, rows: np.ndarray) -> np.ndarray:
        """float32 [n, dimension]: the parameters of ``rows`` of table ``t`` (exact values)."""
        values = self.backend.to_numpy(self.backend.gather(self.state.tables[t.index][0],
                                                           self.backend.asarray(rows, dtype="int64")))
        values = precision.from_storage(np.asarray(values), precision.array_dtypes(t)[0])
        return values.reshape(rows.shape[0], t.dimension)

    def _check_key_batch(self, batch: Any) -> None:
        if isinstance(batch, Batch) and (batch.layout is self.key_layout or batch.layout == self.key_layout):
            return
        names = [self.layout.tables[i].name for i in self._vocab]
        rows = isinstance(batch, Batch) and batch.layout == self.layout
        raise InputError(
            "Invalid `batch`: " + ("it was prepared for engine.layout, whose dynamic tables' ids are rows, but "
                                   if rows else "expected a Batch of keys: ")
            + f"the ids of tables {names} are raw int64 keys that the engine maps to rows. Fix: prepare it with "
            "meshembed.embedding.batch.prepare(engine.key_layout, ...) (engine.enqueue does), or use "
            "engine.enqueue(features).")

    def _vocab_step(self) -> int:
        """The step a batch enqueued now belongs to: steps applied, plus a pipelined step kept."""
        return self.state.step + (1 if self._deferred is not None else 0)

    def map_batch(self, batch: Batch, keep: Sequence[Batch] = ()) -> Batch:
        """A Batch of keys (prepared for ``key_layout``) as the Batch of rows the step functions
        take: a training or backward-only batch admits, counts and evicts keys at the current
        step (:func:`dynamic.assign`) and re-initialises the rows it gives to keys; an inference
        batch only reads. Keys without a row are left out of the returned batch (they read zeros
        and get no update). The rows of ``keep`` (row Batches not yet applied, e.g. a front end's
        forwards awaiting their backward) and of a pipelined step kept are never evicted.
        Thread-safe with ``apply_gradients``."""
        self._check_key_batch(batch)
        with self._lock:
            step = self._vocab_step()
            protect: dict[int, list[np.ndarray]] = {i: [] for i in self._vocab}
            pending = list(keep) + ([self._deferred[0]] if self._deferred is not None else [])
            for b in pending:
                for f, d in zip(self.layout.features, b.features):
                    if f.table in protect:
                        protect[f.table].append(d.ids)
            norms = {}
            if batch.mode != "inference":
                for i, st in self._vocab.items():
                    if dynamic.norms_due(st, step):
                        norms[i] = self._row_norms(i, st)
            rows_batch, states, reinit = dynamic.map_batch(
                self.layout, batch, self._vocab, step, norms=norms,
                protect={i: np.concatenate(p) for i, p in protect.items() if p})
            new = dict(self._reinit_rows(i, rows, states[i]) for i, rows in reinit.items())
            self.state = self.state.replace(new) if new else self.state
            self._vocab = states
        return rows_batch

    def _row_norms(self, index: int, st: "dynamic.DynamicVocabularyState") -> np.ndarray:
        """float64 L2 norm of every used row of table ``index`` (0 for free rows)."""
        rows = np.flatnonzero(st.used)
        t = self.layout.tables[index]
        norms = np.zeros(st.capacity, np.float64)
        if rows.size:
            v = self._rows_of(t, rows).astype(np.float64)
            norms[rows] = np.sqrt(np.einsum("ij,ij->i", v, v))
        return norms

    def _reinit_rows(self, index: int, rows: np.ndarray, st: "dynamic.DynamicVocabularyState") -> tuple[int, Any]:
        """Table ``index``'s state with ``rows`` at their keys' initial values and slots."""
        t = self.layout.tables[index]
        values = {"parameters": dynamic.keyed_initial_values(self._dynamic_init[index], st.row_key[rows], t.dimension,
                                                              self.seed, index, t.name)}
        for name, v in zip(self._slot_names(t), t.optimizer.slot_initial_values()):
            values[name] = np.full(self._slot_shape(t, name, rows.shape[0]), v, np.float32)
        return self._loaded_state((t, rows, values))

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: Any) -> Any:
        """Write a checkpoint directory atomically (see ``meshembed.embedding.checkpoint``);
        returns its path. The pending batch, if any, is not part of it. ``path`` must be new,
        an empty directory or a checkpoint: anything else raises ``CheckpointError`` untouched.

        Several processes (torch.distributed): every rank calls it (gathering the tables is
        collective), only the backend's writer (rank 0) writes ``path``, and every rank returns
        once the checkpoint is complete."""
        from meshembed.embedding.checkpoint import save

        self.flush()
        return save(self, path)

    @classmethod
    def restore(
        cls,
        path: Any,
        backend: str | Backend | None = None,
        num_shards: int | None = None,
        mesh: Any = None,
        *,
        learning_rates: Sequence[Any] | Mapping[int, Any] | None = None,
        allow_nonfinite: bool = False,
        initializers: Mapping[str, Any] | None = None,
        precision: Any = "saved",
    ) -> "TPUEmbedding":
        """A new engine from a checkpoint, on any backend and shard count.

        Every file is verified first (``CheckpointError`` naming the file and field). A
        learning-rate callable of the saved config cannot be stored: pass it again as
        ``learning_rates`` (one callable or None per dynamic tag, in tag order, or
        ``{tag: fn}``); restore says which tags need one when it is missing.
        ``allow_nonfinite``: restore NaN/Inf values (saved by an engine created with it).
        ``precision``: ``"saved"``, or ``{table: me.embedding.Precision or None}`` to restore
        tables into other storage dtypes (docs/low_precision.md).
        ``initializers``: ``{table: initializer}`` of dynamic tables whose initializer was a
        callable (a checkpoint records meshembed's own initializers, not callables)."""
        from meshembed.embedding.checkpoint import restore

        extra = {} if initializers is None else {"initializers": initializers}  # dynamic vocabularies
        return restore(cls, path, backend=backend, num_shards=num_shards, mesh=mesh, learning_rates=learning_rates,
                       allow_nonfinite=_check_bool(allow_nonfinite, "allow_nonfinite"), precision=precision, **extra)

    def __repr__(self) -> str:
        return (
            f"TPUEmbedding(tables={self.table_names}, features={len(self.layout.features)}, "
            f"backend={self.backend.name!r}, num_shards={self.num_shards}, step={self.step})"
        )
