"""``TPUEmbedding``: the TPU embedding mid-level API on any meshembed backend.

One step is ``enqueue`` (host: validate and flatten ids, compute combiner factors) →
``dequeue`` (device: gather rows, segment-sum into output slots) → ``apply_gradients``
(device: combiner backward, sum per row, one optimizer application per looked-up row), the
semantics of TensorFlow's Enqueue / RecvTPUEmbeddingActivations / SendTPUEmbeddingGradients.

The engine calls only the Backend protocol and ``backend.xp`` Array-API math, so the same
code runs on NumPy, Torch, JAX and CuPy. Every call validates all of its inputs before it
touches any table, slot or pending batch: a rejected call leaves the state bit-identical.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from meshembed.backend import Backend, get_backend
from meshembed.embedding import combiners, inputs
from meshembed.embedding.agreement import agreed, validated
from meshembed.embedding.initializers import Constant, default_initializer, initial_blocks, table_rng
from meshembed.embedding.layout import FeatureSpec, Layout, TableSpec, build_layout
from meshembed.embedding.updates import apply_table, is_non_lazy, make_rule, rule_values, uses_accumulation
from meshembed.errors import CapacityError, ConfigError, InputError, NonFiniteError, StateError
from meshembed.sharding.placement import Placement


@dataclass
class _DeviceFeature:
    """One feature's enqueued batch. The backend arrays are made on first use: a sum
    combiner without weights never reads ``scale``, so it never crosses to the device."""

    backend: Any
    host_ids: np.ndarray
    host_slots: np.ndarray
    host_scale: np.ndarray  # [n] float32: the combiner factor w_k / N_s of every id
    num_slots: int
    # Every factor is exactly 1 (sum combiner, unit weights): the weighting is skipped, which
    # changes no bit (x * 1 == x) and saves a pass over the ids on every backend.
    unit_scale: bool = False
    # Id k alone in slot k (a sequence feature with every position filled): the lookup is a
    # plain gather and the activation gradient is already one row per id (no slot index).
    identity: bool = False
    _arrays: dict = field(default_factory=dict)

    def _array(self, name: str, host: np.ndarray, dtype: str) -> Any:
        if name in self._arrays:
            return self._arrays[name]
        arr = self.backend.asarray(host, dtype=dtype)
        if self.backend.is_traced(arr):  # made inside jax.jit: never kept past the trace
            raise _traced_call_error("dequeue")
        self._arrays[name] = arr
        return arr

    @property
    def ids(self) -> Any:
        return self._array("ids", self.host_ids, "int64")

    @property
    def slots(self) -> Any:
        return self._array("slots", self.host_slots, "int64")

    @property
    def scale(self) -> Any:
        return self._array("scale", self.host_scale, "float32")


@dataclass
class _Pending:
    mode: str
    features: list[_DeviceFeature]
    dequeued: bool = False
    extra: dict = field(default_factory=dict)


def _load_config(config: Any) -> Any:
    """An EmbeddingConfig (or any object with ``tables``/``features``) or proto input."""
    if hasattr(config, "tables"):
        return config
    from meshembed.config import EmbeddingConfig

    if isinstance(config, (bytes, bytearray, str)) or hasattr(config, "__fspath__"):
        return EmbeddingConfig.from_proto(config)
    raise ConfigError(
        "Invalid `config`. Expected a me.EmbeddingConfig, serialized TPUEmbeddingConfiguration "
        f"bytes, text format or a path. Received: {type(config).__name__}"
    )


def _traced_call_error(call: str) -> StateError:
    return StateError(
        f"Cannot call `{call}()` inside `jax.jit` (or another JAX transformation): the stateful "
        "TPUEmbedding runs eagerly and would store tracers. Nothing was changed. Fix: call it "
        "outside the traced function, or use the functional JAX API `me.jax` (`me.jax.init`, "
        "`prepare`, `lookup`, `apply_gradients`), which is made for jax.jit."
    )


def _check_bool(value: Any, name: str, error: type = ConfigError) -> bool:
    """``True``/``False`` only: ``bool("False")`` is True, so strings are refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise error(f"Invalid `{name}`. Expected True or False. Received: {name}={value!r} "
                      f"({type(value).__name__})")


def _check_int(value: Any, name: str, minimum: int, fix: str) -> int:
    """An integer (Python or NumPy) >= ``minimum``; floats, bools and strings are refused."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise ConfigError(f"Invalid `{name}`. Expected an integer. Received: {name}={value!r} "
                          f"({type(value).__name__}). Fix: {fix}") from None
    if out < minimum:
        raise ConfigError(f"Invalid `{name}`. Expected an integer >= {minimum}. Received: {name}={out}. Fix: {fix}")
    return out


def _allocation_failed(exc: BaseException) -> bool:
    """MemoryError, torch's allocator RuntimeError, XLA's RESOURCE_EXHAUSTED."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in ("alloc", "out of memory", "resource_exhausted"))


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
    ) -> None:
        self.config = _load_config(config)
        allow_nonfinite = _check_bool(allow_nonfinite, "allow_nonfinite")
        seed = _check_int(seed, "seed", 0, "pass a non-negative integer seed.")
        if num_shards is not None:
            num_shards = _check_int(num_shards, "num_shards", 1, "pass a positive integer, or None for the device count.")
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
        # The combiner's backward pass inside update_rows (grad_index/grad_weights); backends
        # without it get one expanded gradient row per id.
        self._backward_in_update = self.backend.capabilities.grad_index_updates
        self._rules: dict[int, Any] | None = None  # each table's UpdateRule, built on first use
        explicit = num_shards is not None
        if num_shards is None:
            num_shards = int(mesh.size) if mesh is not None else int(self.backend.capabilities.devices)
        self.num_shards = int(num_shards)
        self.mesh = mesh
        self.seed = int(seed)
        self.allow_nonfinite = bool(allow_nonfinite)
        self.step = 0
        self._pending: _Pending | None = None
        overrides = dict(initializers or {})
        unknown = set(overrides) - {t.name for t in self.layout.tables}
        if unknown:
            raise ConfigError(f"Invalid `initializers`: unknown tables {sorted(unknown)}.")
        self._placements: dict[int, Placement] = {}
        self._state: dict[int, list[Any]] = {}
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
            init = overrides.get(t.name, t.initializer)
            if init is None:
                init = default_initializer(t.optimizer)
            blocks = initial_blocks(init, (t.vocabulary_size, t.dimension), table_rng(self.seed, t.index), t.name)
            try:
                self._state[t.index] = self._fresh_state(t, blocks)
            except (MemoryError, RuntimeError) as exc:
                if not _allocation_failed(exc):
                    raise
                raise self._too_big(t, exc) from exc
        # A dict of features (EmbeddingConfig(features={...})): activations come back as a dict
        # with the same keys, and gradients are taken by key, never by position.
        self._keys: tuple[Any, ...] = tuple(getattr(self.config, "feature_keys", ()) or ())
        self._key_index = {k: i for i, k in enumerate(sorted(self._keys))}

    # -- construction helpers ---------------------------------------------------------------
    def _too_big(self, table: TableSpec, exc: BaseException) -> ConfigError:
        n = 1 + len(self._slot_names(table))
        total = table.vocabulary_size * table.dimension * 4 * n
        shards = self._placements[table.index].num_shards
        return ConfigError(
            f"Table {table.name!r} could not be allocated on backend {self.backend.name!r}: it asks "
            f"for {total:,} bytes ({table.vocabulary_size:,} rows x {table.dimension} x 4 bytes x "
            f"{n} array(s): parameters and {n - 1} slot(s)), {total // shards:,} bytes on each of "
            f"{shards} shard(s). The backend said: {type(exc).__name__}: {str(exc)[:200]}. Fix: a "
            "smaller `vocabulary_size` or `dimension`, or more shards (devices/ranks)."
        )

    def _slot_names(self, table: TableSpec) -> tuple[str, ...]:
        return tuple(table.optimizer.slot_names)

    def _fresh_state(self, table: TableSpec, blocks: Iterator[np.ndarray]) -> list[Any]:
        """The table (from its initial ``blocks`` of rows) and its slots, each made block by
        block, so creating them never holds a whole table on the host beside the backend's."""
        placement = self._placements[table.index]
        shape = (table.vocabulary_size, table.dimension)
        state = [self.backend.create_table_from_blocks(shape, blocks, placement)]
        for init in table.optimizer.slot_initial_values():
            state.append(self.backend.create_table_from_blocks(shape, Constant(init).blocks(shape), placement))
        return state

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
        return {t.name: self.backend.unshard(self._state[t.index][0]) for t in self.layout.tables}

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

    def _info(self, f: FeatureSpec) -> inputs.FeatureInfo:
        t = self.layout.tables[f.table]
        return inputs.FeatureInfo(f.name, t.name, t.vocabulary_size, f.output_shape)

    # -- enqueue ---------------------------------------------------------------------------
    def _by_feature(self, values: Any, what: str, allow_none: bool = False) -> list[Any]:
        """A list in config order from a sequence or a ``{feature_name: value}`` mapping.

        A config whose features were a dict takes a dict only (by its keys, or by feature
        name): a list would be matched by position and could silently swap features."""
        names = self.feature_names
        if values is None and allow_none:
            return [None] * len(names)
        if self._keys:
            if not isinstance(values, Mapping):
                raise InputError(
                    f"Invalid `{what}`: the config's features were given as a dict, so pass a dict "
                    f"keyed by {list(self._keys)}. Received: {type(values).__name__}. Fix: e.g. "
                    f"{{{self._keys[0]!r}: ...}}; a list is not accepted because it would be matched by "
                    "position, not by name."
                )
            if set(values) == set(self._keys):
                return [values[k] for k in sorted(self._keys)]
            if not set(values) <= set(names):  # by feature name otherwise (names differ from keys)
                extra = [k for k in values if k not in self._key_index]
                missing = [k for k in self._keys if k not in values]
                if not allow_none or extra:
                    raise InputError(
                        f"Invalid `{what}`: expected one entry per feature key {list(self._keys)}. "
                        f"Missing: {missing}; unknown: {extra}"
                    )
                return [values.get(k) for k in sorted(self._keys)]
        if isinstance(values, Mapping):
            extra = sorted(set(values) - set(names))
            missing = [n for n in names if n not in values]
            if extra or (missing and not allow_none):
                raise InputError(
                    f"Invalid `{what}`: expected one entry per feature {names}. "
                    f"Missing: {missing}; unknown: {extra}"
                )
            return [values.get(n) for n in names]
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            if len(names) == 1 and not isinstance(values, (str, bytes)):
                return [values]
            raise InputError(
                f"Invalid `{what}`: expected a list with one entry per feature (in config order) "
                f"or a dict keyed by feature name. Received: {type(values).__name__}"
            )
        values = list(values)
        if len(values) != len(names):
            raise InputError(
                f"Invalid `{what}`: expected {len(names)} entries, one per feature {names}. "
                f"Received: {len(values)} entries."
            )
        return values

    def _resolve_mode(self, training: bool | None, mode_override: Any) -> str:
        mode = inputs.parse_mode(mode_override)
        if training is not None:
            training = _check_bool(training, "training", InputError)  # "False" would train
        if mode is None and training is not None:
            mode = "training" if training else "inference"
        return mode or self.layout.mode

    def _check_can_enqueue(self) -> None:
        p = self._pending
        if p is not None and p.mode != "inference":
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
        mode = self._resolve_mode(training, mode_override)
        self._check_can_enqueue()
        ids_list = self._by_feature(features, "features")
        weight_list = self._by_feature(weights, "weights", allow_none=True)
        batches = [
            inputs.normalize(x, w, self._info(f), self.backend)
            for f, x, w in zip(self.layout.features, ids_list, weight_list)
        ]
        self._enqueue_batches(batches, mode)

    @agreed("enqueue")
    def _enqueue_batches(
        self, batches: Sequence[inputs.FeatureBatch], mode: str, combiners_override: Sequence[str] | None = None
    ) -> None:
        """Compute combiner factors and move the flat batch to the device (validated input)."""
        self._check_can_enqueue()
        if len(batches) != len(self.layout.features):
            raise InputError(f"Expected {len(self.layout.features)} feature batches. Received: {len(batches)}")
        device = []
        for f, b in zip(self.layout.features, batches):
            table = self.layout.tables[f.table]
            combiner = combiners_override[f.table] if combiners_override else table.combiner
            if b.unit_weights and combiners.check_combiner(combiner) == "sum":
                scale, unit = b.weights, True  # all ones, known without a scan (the batch's own array)
            else:
                scale = combiners.combiner_scale(b.slots, b.weights, b.num_slots, combiner)
                unit = combiners.is_unit(scale)
            device.append(
                _DeviceFeature(
                    self.backend,
                    host_ids=b.ids,
                    host_slots=b.slots,
                    host_scale=scale.reshape(-1),
                    num_slots=b.num_slots,
                    unit_scale=unit,
                    identity=combiners.is_identity(b.slots, b.num_slots),
                )
            )
        validated(self.backend)  # every process's batch is valid: only then is it stored
        self._pending = _Pending(mode, device)

    def _structured(self, values: list[Any]) -> list[Any] | dict[Any, Any]:
        """Config-order values in the structure the features were given in: a dict with the
        config's keys (in the order given) for a dict of features, else the list."""
        if not self._keys:
            return values
        return {k: values[self._key_index[k]] for k in self._keys}

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
        return self._structured(self._dequeue_list())

    def _dequeue_list(self) -> list[Any]:
        p = self._pending
        if p is None:
            raise StateError("Cannot dequeue: nothing was enqueued. Fix: call `enqueue(features)` first.")
        if p.mode == "backward_pass_only":
            raise StateError(
                "Cannot dequeue in 'backward_pass_only' mode: the forward pass is not run. Fix: "
                "call `apply_gradients(...)`, or enqueue with `mode_override='training'`."
            )
        xp = self.backend.xp
        outs = []
        for f, d in zip(self.layout.features, p.features):
            t = self.layout.tables[f.table]
            table = self._state[t.index][0]
            quant = getattr(t.optimizer, "simulated_quantization", None)
            if quant is not None and getattr(quant, "enabled", True):
                from meshembed.math import quantize

                lo = -np.inf if quant.lower is None else quant.lower
                hi = np.inf if quant.upper is None else quant.upper
                rows = quantize(xp, self.backend.gather(table, d.ids), lo, hi, quant.num_buckets)
                act = combiners.forward(self.backend, rows, xp.reshape(d.scale, (-1, 1)), d.slots, d.num_slots)
            elif d.identity:  # one id per slot: the rows themselves, no segment sum
                # shaped_rows: the rows come in the activation's shape (no reshape: a copy on JAX)
                shaped = self.backend.capabilities.shaped_rows and len(f.output_shape) != 1
                act = self.backend.gather(table, xp.reshape(d.ids, f.output_shape) if shaped else d.ids)
                act = act if d.unit_scale else act * xp.reshape(d.scale, tuple(act.shape[:-1]) + (1,))
            else:  # fused gather + combine where the backend has one
                weights = None if d.unit_scale else d.scale
                act = self.backend.gather_combine(table, d.ids, d.slots, d.num_slots, weights)
            shape = f.output_shape + (t.dimension,)
            outs.append(act if tuple(act.shape) == shape else xp.reshape(act, shape))
        if any(self.backend.is_traced(a) for a in outs):
            raise _traced_call_error("dequeue")  # the pending batch stays as it was
        p.dequeued = True
        return outs

    # -- apply_gradients ---------------------------------------------------------------------
    def _check_can_apply(self) -> _Pending:
        p = self._pending
        if p is None:
            raise StateError(
                "Cannot apply gradients: no batch is pending. Fix: call `enqueue(...)` and "
                "`dequeue()` first; each batch takes one `apply_gradients`."
            )
        if p.mode == "inference":
            raise StateError(
                "Cannot apply gradients to a batch enqueued in 'inference' mode. Fix: enqueue "
                "with `training=True` (or mode_override='training') to train on it."
            )
        if p.mode == "training" and not p.dequeued:
            raise StateError(
                "Cannot apply gradients before `dequeue()`: the activations of this batch were "
                "never read. Fix: call `dequeue()` first, or enqueue with "
                "mode_override='backward_pass_only'."
            )
        return p

    def _learning_rate_list(self, learning_rates: Any) -> list[Any]:
        """``learning_rates`` as a list in tag order: a sequence (or rank-1 array) with one
        value per tag, or a mapping with exactly the tags ``0..n-1`` as keys."""
        n = self.layout.num_dynamic_inputs
        if learning_rates is None:
            return []
        if isinstance(learning_rates, Mapping):
            keys = list(learning_rates)
            ints = [k for k in keys if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))]
            if len(ints) != len(keys) or sorted(int(k) for k in keys) != list(range(n)):
                raise InputError(
                    f"Invalid `learning_rates`: a mapping must have exactly the dynamic tags "
                    f"{list(range(n))} as keys ({{tag: value}}). Received keys: {keys!r}"
                )
            by_tag = {int(k): v for k, v in learning_rates.items()}
            return [by_tag[k] for k in range(n)]
        if isinstance(learning_rates, Sequence) and not isinstance(learning_rates, (str, bytes)):
            return list(learning_rates)
        if not isinstance(learning_rates, (str, bytes)) and hasattr(learning_rates, "shape"):
            arr = inputs.to_host(learning_rates, self.backend, "`learning_rates`")
            if arr.ndim == 1:
                return list(arr)
        raise InputError(
            f"Invalid `learning_rates`: expected a sequence with one value per dynamic tag (tag "
            f"order) or a mapping {{tag: value}}. Received: {learning_rates!r} "
            f"({type(learning_rates).__name__}). Fix: e.g. learning_rates=[0.1] for tag 0."
        )

    def _check_learning_rates(self, learning_rates: Any) -> list[float]:
        n = self.layout.num_dynamic_inputs
        lrs = self._learning_rate_list(learning_rates)
        fns = getattr(self.config, "learning_rate_fns", ())
        source = "learning_rates"
        if not lrs and n and len(fns) >= n and all(fn is not None for fn in fns[:n]):
            lrs = [fn() for fn in fns[:n]]  # TF2: callables are evaluated every step
            source = "learning-rate callable of tag"
        if len(lrs) != n:
            raise InputError(
                f"Invalid `learning_rates`: the config uses {n} dynamic tag(s), so expected {n} "
                f"value(s), learning_rates[k] for tag k. Received: {len(lrs)}."
            )
        out = []
        for k, v in enumerate(lrs):
            what = f"`learning_rates[{k}]`" if source == "learning_rates" else f"the {source} {k}"
            arr = inputs.to_host(v, self.backend, what)
            if arr.ndim != 0:
                raise InputError(f"Invalid {what}: expected a scalar (rank 0). Received: shape={arr.shape}")
            if arr.dtype.kind not in "fiu":
                raise InputError(f"Invalid {what}: expected a real number. Received: {v!r} ({type(v).__name__})")
            with np.errstate(over="ignore"):
                finite32 = bool(np.isfinite(arr.astype(np.float32)))
            if not finite32:  # the update runs in float32: 1e39 would be inf there
                raise InputError(
                    f"Invalid {what}: expected a finite number in float32, the dtype of the update. "
                    f"Received: {arr!r}"
                )
            out.append(float(arr))
        return out

    def _check_gradients(self, gradients: Any, check_now: bool, unchecked: int | None = None) -> list[Any]:
        """The gradients as backend arrays of their activation's shape (the update flattens
        them, or not: see ``shaped_rows``); with ``check_now``, NaN/Inf raise — but for the
        features of table ``unchecked``, whose update checks them (``checked_updates``)."""
        xp = self.backend.xp
        grads = self._by_feature(gradients, "gradients")
        out = []
        for f, g in zip(self.layout.features, grads):
            t = self.layout.tables[f.table]
            shape = f.output_shape + (t.dimension,)
            if g is None:
                warnings.warn(
                    f"No gradient for feature {f.name!r}; sending zeros (its looked-up rows still "
                    "count as touched, which moves lazy Adam/Momentum state).",
                    stacklevel=3,
                )
                g = np.zeros(shape, dtype=np.float32)
            where = f"gradient for feature {f.name!r} (table {t.name!r})"
            if self.backend.is_traced(g):
                raise inputs.traced_error(where)
            if not self.backend.is_native(g):
                g = inputs.to_host(g, None, where)
            if not self._is_real(g):
                raise InputError(
                    f"Invalid {where}: expected a real (float or integer) array. Received: "
                    f"dtype={g.dtype}. Fix: pass float32 gradients (complex, bool, string and "
                    "object arrays are not gradients)."
                )
            if tuple(g.shape) != shape:
                raise InputError(
                    f"Invalid gradient for feature {f.name!r} (table {t.name!r}): expected shape "
                    f"{shape} (input_shape + [dimension]). Received: shape={tuple(g.shape)}"
                )
            with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, refused below
                g = self.backend.asarray(g, dtype="float32")
            if self.backend.is_traced(g):
                raise _traced_call_error("apply_gradients")
            if check_now and f.table != unchecked and not self.backend.all_finite(g):
                raise self._nonfinite_error(f)
            out.append(g)
        return out

    def _is_real(self, g: Any) -> bool:
        """A real float or integer dtype, on the host or on the backend (no cast, no copy)."""
        if isinstance(g, np.ndarray):
            return g.dtype.kind in "fiu"
        try:
            return bool(self.backend.xp.isdtype(g.dtype, ("real floating", "integral")))
        except Exception:  # a namespace without isdtype: judge the dtype's name
            name = str(g.dtype).lower()
            return not any(k in name for k in ("complex", "bool", "str", "object"))

    def _refuse_if_tracing(self, call: str) -> None:
        """Under jax.jit even concrete arrays become tracers in the backend's kernels: a
        backend that can trace is asked with one scalar (eager backends skip this)."""
        if type(self.backend).is_traced is not Backend.is_traced:
            if self.backend.is_traced(self.backend.xp.zeros(())):
                raise _traced_call_error(call)

    def _nonfinite_error(self, feature: Any) -> InputError:
        t = self.layout.tables[feature.table]
        return InputError(
            f"Invalid gradient for feature {feature.name!r} (table {t.name!r}): it contains NaN "
            "or Inf. Nothing was updated. Fix: check the loss, clip the gradients, or pass "
            "`allow_nonfinite=True` to apply them anyway."
        )

    @agreed("apply_gradients")
    def apply_gradients(
        self,
        gradients: Any,
        learning_rates: Sequence[Any] = (),
        *,
        allow_nonfinite: bool | None = None,
    ) -> None:
        """SendTPUEmbeddingGradients: one gradient per feature (``∂loss/∂activation``, the
        shape of its activation), and ``learning_rates[k]`` for dynamic tag k."""
        p = self._check_can_apply()
        allow = self.allow_nonfinite if allow_nonfinite is None else _check_bool(
            allow_nonfinite, "allow_nonfinite", InputError)
        # A backend with guarded updates checks NaN/Inf on its devices while the updates
        # run (each writes nothing unless the one guard over every gradient holds); the
        # others check first.
        deferred = not allow and self.backend.capabilities.guarded_updates
        # Without a guard, a backend with checked updates checks one table's gradients (the
        # largest) while it sums them, instead of a pass of their own; that table is updated
        # first, so a NaN/Inf in it raises before any table is written.
        in_update = None
        if not allow and not deferred and self.backend.capabilities.checked_updates and self.layout.tables:
            sizes = [0] * len(self.layout.tables)
            for f in self.layout.features:
                sizes[f.table] += int(np.prod(f.output_shape)) * self.layout.tables[f.table].dimension
            in_update = self.layout.tables[int(np.argmax(sizes))].index
        grads = self._check_gradients(gradients, check_now=not allow and not deferred, unchecked=in_update)
        lrs = self._check_learning_rates(learning_rates)
        self._refuse_if_tracing("apply_gradients")  # e.g. concrete gradients inside jax.jit
        guard = self.backend.finite_guard(grads) if deferred and grads else None
        guarded = {} if guard is None else {"guard": guard}
        # Build every table's update first: an unusable optimizer or learning rate raises
        # before any table is touched (update_rows may donate buffers).
        # An UpdateRule per table (built once) and this step's values.
        if self._rules is None:
            self._rules = {t.index: make_rule(t, self.backend) for t in self.layout.tables}
        fns: dict[int, Any] = self._rules
        values = {t.index: rule_values(t, fns[t.index], lrs) for t in self.layout.tables}
        per_table: dict[int, list[tuple[_DeviceFeature, Any]]] = {t.index: [] for t in self.layout.tables}
        for f, d, g in zip(self.layout.features, p.features, grads):
            per_table[f.table].append((d, g))
        for t in self.layout.tables:  # e.g. a fixed capacity: refuse before any table is written
            ids = [d.host_ids for d, _ in per_table[t.index]]
            if is_non_lazy(t):
                ids.append(np.arange(t.vocabulary_size, dtype=np.int64))
            if ids:
                try:
                    self.backend.check_update(self._state[t.index], np.concatenate(ids))
                except CapacityError as exc:
                    raise CapacityError(f"Table {t.name!r}: {exc}") from None
        validated(self.backend)  # every process's input is valid: now the row exchange
        new_state = {}
        try:
            self._update_tables(p, per_table, fns, values, lrs, guard, guarded, in_update, new_state)
        except NonFiniteError:  # from the update of table in_update, which wrote nothing
            bad = [f for f, g in zip(self.layout.features, grads)
                   if f.table == in_update and not self.backend.all_finite(g)]
            raise self._nonfinite_error(bad[0] if bad else self.layout.features[0]) from None
        if guard is not None and not bool(guard):  # every update wrote nothing
            bad = [f for f, g in zip(self.layout.features, grads) if not self.backend.all_finite(g)]
            raise self._nonfinite_error(bad[0] if bad else self.layout.features[0])
        self._state.update(new_state)
        self._pending = None
        self.step += 1

    def _update_tables(self, p: Any, per_table: dict, fns: dict, values: dict, lrs: Any, guard: Any,
                       guarded: dict, in_update: int | None, new_state: dict) -> None:
        """Every table's update into ``new_state`` (table ``in_update`` first: see
        ``apply_gradients``); the tables themselves are not touched."""
        xp = self.backend.xp
        for t in sorted(self.layout.tables, key=lambda t: t.index != in_update):
            parts = per_table[t.index]
            # table in_update: its update_rows checks gradients passed as they are; any other
            # form of them is checked here, still before anything is written
            check = {"check_finite": True} if t.index == in_update else {}
            n_ids = sum(int(d.host_ids.shape[0]) for d, _ in parts)
            identity = n_ids and all(d.identity for d, _ in parts) and uses_accumulation(t) and not is_non_lazy(t)
            if not (identity and len(parts) == 1 and self.backend.capabilities.shaped_rows):
                parts = [(d, xp.reshape(g, (-1, t.dimension))) for d, g in parts]  # [ids, D]
            if identity:
                # Every feature has one id per slot: the (weighted) activation gradients are
                # the per-id gradients, in id order, so no slot index travels (see identity).
                rows = [g if d.unit_scale else g * xp.reshape(d.scale, tuple(g.shape[:-1]) + (1,)) for d, g in parts]
                ids = parts[0][0].ids if len(parts) == 1 else self.backend.asarray(
                    np.concatenate([d.host_ids for d, _ in parts]), dtype="int64")
                source = rows[0] if len(rows) == 1 else xp.concat(rows, axis=0)
                if check and not all(d.unit_scale for d, _ in parts):
                    self._check_now(parts)
                    check = {}
                new_state[t.index] = list(self.backend.update_rows(
                    self._state[t.index], ids, source, fns[t.index],
                    **guarded, **check, **({"values": values[t.index]} if values else {})))
                continue
            if n_ids and self._backward_in_update and uses_accumulation(t) and not is_non_lazy(t):
                # Combiner backward fused into the update: the backend sums
                # scale_k * grad[slot_k] per row without one gradient row per id.
                one = len(parts) == 1
                ids = parts[0][0].ids if one else self.backend.asarray(
                    np.concatenate([d.host_ids for d, _ in parts]), dtype="int64")
                # several features of one table: their ids, slots and weights (ragged, a new
                # length every step) are joined on the host, so no backend compiles per length
                offsets = np.cumsum([0] + [d.num_slots for d, _ in parts[:-1]])
                index = parts[0][0].slots if one else self.backend.asarray(
                    np.concatenate([d.host_slots + o for (d, _), o in zip(parts, offsets)]), dtype="int64")
                if all(d.unit_scale for d, _ in parts):
                    weights = None  # the sum combiner without weights: nothing to multiply
                elif one:
                    weights = parts[0][0].scale
                else:
                    weights = self.backend.asarray(np.concatenate([d.host_scale for d, _ in parts]), dtype="float32")
                source = parts[0][1] if one else xp.concat([g for _, g in parts], axis=0)
                new_state[t.index] = list(self.backend.update_rows(
                    self._state[t.index], ids, source, fns[t.index], grad_index=index, grad_weights=weights,
                    **guarded, **check, **({"values": values[t.index]} if values else {})))
                continue
            if check:
                self._check_now(parts)
            host_ids = np.concatenate([d.host_ids for d, _ in parts]) if parts else np.zeros(0, np.int64)
            rows = [combiners.backward(self.backend, g, xp.reshape(d.scale, (-1, 1)), d.slots, d.unit_scale,
                                       d.identity) for d, g in parts]
            row_grads = xp.concat(rows, axis=0) if len(rows) > 1 else rows[0] if rows else None
            if row_grads is None:
                row_grads = self.backend.asarray(np.zeros((0, t.dimension), np.float32))
            new_state[t.index] = apply_table(self.backend, self._state[t.index], t, host_ids, row_grads, lrs,
                                             fns[t.index], guard=guard,
                                             part_sizes=[int(d.host_ids.shape[0]) for d, _ in parts],
                                             values=values.get(t.index, ()))

    def _check_now(self, parts: Any) -> None:
        """NaN/Inf in one table's gradients (``(feature, gradient)`` pairs) raise NonFiniteError."""
        if not all(self.backend.all_finite(g) for _, g in parts):
            raise NonFiniteError()

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
        self._refuse_if_tracing("retrieve_parameters")
        t = self.layout.table(table)
        ids = self._shard_ids(t, num_shards, shard_id)
        names = ("parameters",) + self._slot_names(t)
        out = {}
        for name, st in zip(names, self._state[t.index]):
            if ids is None:
                out[name] = self.backend.unshard(st)
            else:
                out[name] = np.asarray(self.backend.to_numpy(self.backend.gather(st, self.backend.asarray(ids, dtype="int64"))))
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
        plan = self._plan_load(table, parameters, num_shards, shard_id, allow_nonfinite, slots)
        index, state = self._loaded_state(plan)
        self._state[index] = state

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
            if arr.shape != (rows, t.dimension):
                raise InputError(
                    f"Invalid {what}: expected shape {(rows, t.dimension)}. Received: shape={arr.shape}"
                )
            with np.errstate(over="ignore", invalid="ignore"):
                arr = np.array(arr, dtype=np.float32)  # a private copy, in the tables' dtype
            if not allow and not np.all(np.isfinite(arr)):
                k = np.argwhere(~np.isfinite(arr))[0].tolist()
                raise InputError(
                    f"Invalid {what}: it contains NaN or Inf in float32 (first at {k}: {arr[tuple(k)]}). "
                    "Nothing was loaded. Fix: load finite values, or pass `allow_nonfinite=True`."
                )
            values[name] = arr
        self._refuse_if_tracing("load_parameters")  # concrete values inside jax.jit
        return t, ids, values

    def _loaded_state(self, plan: tuple[TableSpec, Any, dict[str, np.ndarray]]) -> tuple[int, list[Any]]:
        """The table's new state lists with a validated plan written (not yet committed)."""
        t, ids, values = plan
        names = ("parameters",) + self._slot_names(t)
        state = list(self._state[t.index])
        for k, name in enumerate(names):
            if name not in values:
                continue
            if ids is None:
                state[k] = self.backend.create_table(values[name], self._placements[t.index])
            else:
                state[k] = self.backend.scatter(
                    state[k], self.backend.asarray(ids, dtype="int64"), self.backend.asarray(values[name], dtype="float32")
                )
        return t.index, state

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: Any) -> Any:
        """Write a checkpoint directory atomically (see ``meshembed.embedding.checkpoint``);
        returns its path. The pending batch, if any, is not part of it. ``path`` must be new,
        an empty directory or a checkpoint: anything else raises ``CheckpointError`` untouched.

        Several processes (torch.distributed): every rank calls it (gathering the tables is
        collective), only the backend's writer (rank 0) writes ``path``, and every rank returns
        once the checkpoint is complete."""
        from meshembed.embedding.checkpoint import save

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
    ) -> "TPUEmbedding":
        """A new engine from a checkpoint, on any backend and shard count.

        Every file is verified first (``CheckpointError`` naming the file and field). A
        learning-rate callable of the saved config cannot be stored: pass it again as
        ``learning_rates`` (one callable or None per dynamic tag, in tag order, or
        ``{tag: fn}``); restore says which tags need one when it is missing."""
        from meshembed.embedding.checkpoint import restore

        return restore(cls, path, backend=backend, num_shards=num_shards, mesh=mesh, learning_rates=learning_rates)

    def __repr__(self) -> str:
        return (
            f"TPUEmbedding(tables={self.table_names}, features={len(self.layout.features)}, "
            f"backend={self.backend.name!r}, num_shards={self.num_shards}, step={self.step})"
        )
