"""The raw-op mirror: TensorFlow's TPU embedding ops (``tf.raw_ops``) as functions.

For code ported from TensorFlow. ``configure_tpu_embedding(config_bytes)`` creates the
*current* :class:`~meshembed.embedding.TPUEmbedding`; the enqueue / Recv / Send / Load /
Retrieve functions then act on it with the ops' argument names, orders and layouts
(spec §3): per-feature tensors when the config has feature descriptors, per-table
``[B·nf, dim]`` tensors, interleaved sample-major, in the legacy layout.

Differences from TF, on purpose: shapes, counts and learning rates are checked (TF 2.21
accepts a wrong Send shape at graph time), and errors name the feature or table.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import numpy as np

from meshembed.embedding import inputs
from meshembed.embedding.agreement import agreed
from meshembed.embedding.batch import feature_info, from_feature_batches, structured
from meshembed.embedding.engine import TPUEmbedding
from meshembed.errors import InputError, StateError

_current: TPUEmbedding | None = None
_current_bytes: bytes = b""


# -- configuration -------------------------------------------------------------------------
def configure_tpu_embedding(
    config: Any, backend: Any = None, num_shards: int | None = None, seed: int = 0
) -> TPUEmbedding:
    """ConfigureTPUEmbedding: build the engine for ``config`` (bytes, text, path or
    EmbeddingConfig) and make it current. Returns it (TF's op returns nothing)."""
    global _current, _current_bytes
    engine = TPUEmbedding(config, backend=backend, num_shards=num_shards, seed=seed)
    _current = engine
    _current_bytes = bytes(config) if isinstance(config, (bytes, bytearray)) else engine.config.to_proto()
    return engine


def shutdown_tpu_embedding() -> None:
    """ShutdownTPUEmbedding: forget the current engine."""
    global _current, _current_bytes
    _current, _current_bytes = None, b""


def is_tpu_embedding_initialized() -> bool:
    """IsTPUEmbeddingInitialized."""
    return _current is not None


def current_embedding(config: Any = b"") -> TPUEmbedding:
    """The configured engine; ``config`` (the ops' attr) is checked against it when given."""
    if _current is None:
        if config:
            return configure_tpu_embedding(config)
        raise StateError(
            "TPU embedding is not configured. Fix: call "
            "`me.ops.configure_tpu_embedding(config_bytes)` first."
        )
    if config and isinstance(config, (bytes, bytearray)) and bytes(config) != _current_bytes:
        if bytes(config) != _current.config.to_proto():
            raise StateError(
                "The `config` passed to this op differs from the configured one. Fix: pass the "
                "same config bytes, pass `config=b''`, or call `configure_tpu_embedding` again."
            )
    return _current


# -- enqueue -------------------------------------------------------------------------------
def _host(x: Any) -> np.ndarray:
    return inputs.to_host(x, None if _current is None else _current.backend)


def _mode(engine: TPUEmbedding, mode_override: Any) -> str:
    return inputs.parse_mode(mode_override) or engine.layout.mode


def _combiners(engine: TPUEmbedding, combiners: Sequence[Any]) -> list[str]:
    """Per-table combiners; an empty list means ``sum`` for every table (the ops' rule)."""
    from meshembed.embedding.combiners import check_combiner

    n = len(engine.layout.tables)
    combiners = [c.decode() if isinstance(c, bytes) else c for c in combiners]
    if not combiners:
        return ["sum"] * n
    if len(combiners) != n:
        raise InputError(
            f"Invalid `combiners`: expected one per table ({n}, in table order) or none. "
            f"Received: {len(combiners)}"
        )
    return [check_combiner(c, f" for table {t.name!r}") for c, t in zip(combiners, engine.layout.tables)]


def _count(values: Sequence[Any], n: int, what: str, per: str) -> list[Any]:
    values = list(values)
    if len(values) != n:
        raise InputError(f"Invalid `{what}`: expected {n} entries, one per {per}. Received: {len(values)}")
    return values


def _enqueue_args(engine: Any, per: str, indices: Sequence[Any], ids: Sequence[Any], weights: Sequence[Any],
                  combiners: Any, mode_override: Any) -> tuple[list, list, list, Any, Any]:
    """The checked arguments of an enqueue op with one entry per ``per`` ("feature" or
    "table"): ``(indices, ids, weights or Nones, mode, combiners)``; also checks that the
    engine may enqueue now."""
    n = len(engine.layout.features if per == "feature" else engine.layout.tables)
    indices = _count(indices, n, "sample_indices", per)
    ids = _count(ids, n, "embedding_indices", per)
    weights = _count(weights, n, "aggregation_weights", per) if len(weights) else [None] * n
    mode = _mode(engine, mode_override)
    comb = _combiners(engine, combiners)
    return indices, ids, weights, mode, comb


def _weights(w: Any) -> np.ndarray | None:
    arr = _host(w) if w is not None else np.zeros(0)
    return None if arr.size == 0 else arr.reshape(-1)


def _check_weights(w: np.ndarray | None, ids: np.ndarray, info: inputs.FeatureInfo) -> np.ndarray | None:
    """The weights as a private float32 copy (``astype`` copies), checked."""
    if w is not None and w.dtype.kind not in "fiu":
        raise InputError(
            f"Invalid `aggregation_weights` for feature {info.name!r}: expected a float array. "
            f"Received: dtype={w.dtype}"
        )
    if w is not None:
        with np.errstate(over="ignore"):  # 1e39 is inf in float32: refused below
            w = w.astype(np.float32)
    if w is not None and w.shape[0] != ids.shape[0]:
        raise InputError(
            f"Invalid `aggregation_weights` for feature {info.name!r}: expected {ids.shape[0]} "
            f"weights (one per id) or none. Received: {w.shape[0]}"
        )
    if w is not None and not np.all(np.isfinite(w)):
        raise InputError(f"Invalid `aggregation_weights` for feature {info.name!r}: weights must be finite.")
    return w


def _dense_batch(ids: np.ndarray, info: inputs.FeatureInfo, w: np.ndarray | None) -> inputs.FeatureBatch:
    n = int(np.prod(info.output_shape))
    if ids.size != n:
        raise InputError(
            f"Invalid `embedding_indices` for feature {info.name!r} (table {info.table!r}): with "
            f"empty sample indices there is one id per output slot, so expected {n} ids for output "
            f"shape {info.output_shape}. Received: {ids.size}"
        )
    return inputs.make_batch(ids.reshape(-1), np.arange(n), _check_weights(w, ids.reshape(-1), info), info)


def _feature_batch(engine: TPUEmbedding, k: int, index: Any, ids: Any, w: Any, ragged: bool | None) -> inputs.FeatureBatch:
    """One feature of an Arbitrary/Sparse/Ragged tensor batch → FeatureBatch."""
    info = feature_info(engine.key_layout, engine.layout.features[k])
    index = _host(index)
    ids = inputs.int_array(ids, "embedding_indices", info, None).reshape(-1)
    wts = _weights(w)
    if index.size == 0:
        return _dense_batch(ids, info, wts)
    index = inputs.int_array(index, "sample_indices_or_row_splits", info, None)
    if ragged is None:
        ragged = index.ndim == 1
    if ragged:
        inputs.check_row_splits(index.reshape(-1), ids.shape[0], info)
        return inputs.from_ragged(inputs.RaggedIds(index.reshape(-1), ids), _check_weights(wts, ids, info), info)
    if index.ndim == 1:  # the op's rank-1 form: sample of each id, combined per sample
        index = index.reshape(-1, 1)
        if len(info.output_shape) == 1:
            index = np.concatenate([index, np.zeros_like(index)], axis=1)
    return inputs.from_coo(index, ids, _check_weights(wts, ids, info), info)


@agreed("enqueue")  # one process's bad input fails the op on every process, none waits
def _enqueue_per_feature(engine, indices, ids, weights, combiners, mode_override, ragged) -> None:
    indices, ids, weights, mode, comb = _enqueue_args(engine, "feature", indices, ids, weights, combiners,
                                                      mode_override)
    batches = [_feature_batch(engine, k, indices[k], ids[k], weights[k], ragged) for k in range(len(ids))]
    engine.enqueue_batch(from_feature_batches(engine.key_layout, batches, mode, comb))


def enqueue_tpu_embedding_arbitrary_tensor_batch(
    sample_indices_or_row_splits: Sequence[Any], embedding_indices: Sequence[Any],
    aggregation_weights: Sequence[Any], combiners: Sequence[str] = (),
    mode_override: str = "unspecified", device_ordinal: int = -1,
) -> None:
    """EnqueueTPUEmbeddingArbitraryTensorBatch: one entry per feature, config order. Rank 2
    = sparse indices, rank 1 = ragged row splits, empty = one id per output slot."""
    engine = current_embedding()
    _enqueue_per_feature(engine, sample_indices_or_row_splits, embedding_indices, aggregation_weights,
                         combiners, mode_override, ragged=None)


def dynamic_enqueue_tpu_embedding_arbitrary_tensor_batch(
    sample_indices_or_row_splits: Sequence[Any], embedding_indices: Sequence[Any],
    aggregation_weights: Sequence[Any], mode_override: str = "unspecified", device_ordinal: int = -1,
    combiners: Sequence[str] = (),
) -> None:
    """DynamicEnqueueTPUEmbeddingArbitraryTensorBatch (``device_ordinal`` is an input)."""
    enqueue_tpu_embedding_arbitrary_tensor_batch(
        sample_indices_or_row_splits, embedding_indices, aggregation_weights, combiners, mode_override)


def _check_table_ids(engine: TPUEmbedding, table_ids: Sequence[int], max_sequence_lengths: Sequence[int],
                     num_features: Sequence[int]) -> None:
    feats = engine.layout.features
    table_ids = _count(table_ids, len(feats), "table_ids", "feature")
    for f, tid in zip(feats, table_ids):
        if int(tid) != f.table:
            raise InputError(
                f"Invalid `table_ids`: feature {f.name!r} looks up table {f.table} "
                f"({engine.layout.tables[f.table].name!r}) in the config. Received: {int(tid)}"
            )
    if len(max_sequence_lengths):
        for f, m in zip(feats, _count(max_sequence_lengths, len(feats), "max_sequence_lengths", "feature")):
            expected = f.output_shape[1] if len(f.output_shape) == 2 else 0
            if int(m) != expected:
                raise InputError(
                    f"Invalid `max_sequence_lengths` for feature {f.name!r}: the config gives "
                    f"{expected}. Received: {int(m)}"
                )
    if len(num_features) and any(int(n) != 1 for n in num_features):
        raise InputError(
            "Invalid `num_features`: only 1 per feature is supported; describe multi-valued "
            "features with `input_shape` in the config instead."
        )


def enqueue_tpu_embedding_sparse_tensor_batch(
    sample_indices: Sequence[Any], embedding_indices: Sequence[Any], aggregation_weights: Sequence[Any],
    table_ids: Sequence[int], combiners: Sequence[str] = (), mode_override: str = "unspecified",
    max_sequence_lengths: Sequence[int] = (), num_features: Sequence[int] = (), device_ordinal: int = -1,
) -> None:
    """EnqueueTPUEmbeddingSparseTensorBatch: per feature; ``sample_indices`` are the sparse
    indices (rank 2) or their first column (rank 1); empty means one id per sample."""
    engine = current_embedding()
    _check_table_ids(engine, table_ids, max_sequence_lengths, num_features)
    _enqueue_per_feature(engine, sample_indices, embedding_indices, aggregation_weights, combiners,
                         mode_override, ragged=False)


def enqueue_tpu_embedding_ragged_tensor_batch(
    sample_splits: Sequence[Any], embedding_indices: Sequence[Any], aggregation_weights: Sequence[Any],
    table_ids: Sequence[int], combiners: Sequence[str] = (), mode_override: str = "unspecified",
    max_sequence_lengths: Sequence[int] = (), num_features: Sequence[int] = (), device_ordinal: int = -1,
) -> None:
    """EnqueueTPUEmbeddingRaggedTensorBatch: per feature; sample b owns
    ``embedding_indices[splits[b]:splits[b+1]]``."""
    engine = current_embedding()
    _check_table_ids(engine, table_ids, max_sequence_lengths, num_features)
    _enqueue_per_feature(engine, sample_splits, embedding_indices, aggregation_weights, combiners,
                         mode_override, ragged=True)


def _per_table_features(engine: TPUEmbedding, op: str) -> None:
    feats = engine.layout.features
    if len(feats) != len(engine.layout.tables) or any(f.table != i for i, f in enumerate(feats)):
        raise InputError(
            f"`{op}` takes one input per table, so it needs exactly one feature per table in table "
            "order (the legacy layout). Fix: use `enqueue_tpu_embedding_arbitrary_tensor_batch`."
        )


def enqueue_tpu_embedding_sparse_batch(
    sample_indices: Sequence[Any], embedding_indices: Sequence[Any], aggregation_weights: Sequence[Any],
    combiners: Sequence[str] = (), mode_override: str = "unspecified", device_ordinal: int = -1,
) -> None:
    """EnqueueTPUEmbeddingSparseBatch (legacy, per table): ``sample_indices[i] = b·nf + f``
    is the output row of each id; empty means one id per output row."""
    _enqueue_sparse_batch(current_embedding(), sample_indices, embedding_indices, aggregation_weights,
                          combiners, mode_override)


@agreed("enqueue")
def _enqueue_sparse_batch(engine, sample_indices, embedding_indices, aggregation_weights, combiners,
                          mode_override) -> None:
    _per_table_features(engine, "enqueue_tpu_embedding_sparse_batch")
    sample_indices, embedding_indices, weights, mode, comb = _enqueue_args(
        engine, "table", sample_indices, embedding_indices, aggregation_weights, combiners, mode_override)
    batches = []
    for k, f in enumerate(engine.layout.features):
        info = feature_info(engine.key_layout, f)
        ids = inputs.int_array(embedding_indices[k], "embedding_indices", info, None).reshape(-1)
        slots = _host(sample_indices[k]).reshape(-1)
        w = _weights(weights[k])
        if slots.size == 0:
            batches.append(_dense_batch(ids, info, w))
            continue
        slots = inputs.int_array(slots, "sample_indices", info, None)
        if slots.shape[0] != ids.shape[0]:
            raise InputError(
                f"Invalid `sample_indices` for table {info.table!r}: {slots.shape[0]} indices for "
                f"{ids.shape[0]} ids."
            )
        batches.append(inputs.make_batch(ids, slots, _check_weights(w, ids, info), info))
    engine.enqueue_batch(from_feature_batches(engine.key_layout, batches, mode, comb))


def enqueue_tpu_embedding_integer_batch(
    batch: Sequence[Any], mode_override: str = "unspecified", device_ordinal: int = -1
) -> None:
    """EnqueueTPUEmbeddingIntegerBatch: one 1-D id tensor per table, one id per sample."""
    _enqueue_integer_batch(current_embedding(), batch, mode_override)


@agreed("enqueue")
def _enqueue_integer_batch(engine, batch, mode_override) -> None:
    _per_table_features(engine, "enqueue_tpu_embedding_integer_batch")
    batch = _count(batch, len(engine.layout.tables), "batch", "table")
    mode = _mode(engine, mode_override)
    batches = []
    for k, f in enumerate(engine.layout.features):
        info = feature_info(engine.key_layout, f)
        ids = inputs.int_array(batch[k], "batch", info, None).reshape(-1)
        batches.append(_dense_batch(ids, info, None))
    engine.enqueue_batch(from_feature_batches(engine.key_layout, batches, mode, ["sum"] * len(engine.layout.tables)))


# -- Recv / Send -----------------------------------------------------------------------------
def recv_tpu_embedding_activations(num_outputs: int, config: Any = b"") -> list[Any]:
    """RecvTPUEmbeddingActivations: one activation per feature (per table in the legacy
    layout, ``[B·nf, dim]`` sample-major)."""
    engine = current_embedding(config)
    expected = len(engine.layout.features)
    if int(num_outputs) != expected:
        raise InputError(
            f"Invalid `num_outputs`: the config has {expected} "
            f"{'tables' if engine.layout.per_table_layout else 'features'}. Received: {num_outputs}"
        )
    return engine.dequeue_list()  # the op's positional list, even for a dict of features


def send_tpu_embedding_gradients(inputs: Sequence[Any], learning_rates: Sequence[Any] = (), config: Any = b"") -> None:
    """SendTPUEmbeddingGradients: ``∂loss/∂activation`` in Recv's layout; learning_rates[k]
    is the value of dynamic tag k."""
    _send(current_embedding(config), inputs, learning_rates)


@agreed("apply_gradients")  # a wrong count on one process fails the op on every process
def _send(engine: TPUEmbedding, inputs: Sequence[Any], learning_rates: Sequence[Any]) -> None:
    per = "table" if engine.layout.per_table_layout else "feature"
    grads = _count(inputs, len(engine.layout.features), "inputs", per)
    engine.apply_gradients(structured(engine.layout, grads), learning_rates)


# -- Load / Retrieve -------------------------------------------------------------------------
#: Per-table Load/Retrieve ops of TF 2.21 (spec §3.4): op-name part -> proto algorithm.
PER_TABLE_OPS: dict[str, str] = {
    "stochastic_gradient_descent": "stochastic_gradient_descent",
    "adagrad": "adagrad",
    "adagrad_momentum": "adagrad_momentum",
    "adam": "adam",
    "adadelta": "adadelta",
    "ftrl": "ftrl",
    "momentum": "momentum",
    "rms_prop": "rms_prop",
    "centered_rms_prop": "centered_rms_prop",
    "mdl_adagrad_light": "mdl_adagrad_light",
    "proximal_adagrad": "proximal_adagrad",
    "proximal_yogi": "proximal_yogi",
    "frequency_estimator": "frequency_estimator",
}
MAX_AUXILIARY = 7


def _slot_names(algorithm: str) -> tuple[str, ...]:
    from meshembed.math import OPTIMIZERS

    return OPTIMIZERS[algorithm].slot_names


def _select_table(engine: TPUEmbedding, table_id: int, table_name: str, op: str, algorithm: str):
    if isinstance(table_name, bytes):
        table_name = table_name.decode()
    if (int(table_id) >= 0) == bool(table_name):
        raise InputError(
            f"`{op}`: set exactly one of `table_id` and `table_name`. Received: table_id={table_id}, "
            f"table_name={table_name!r}"
        )
    table = engine.layout.table(table_name if table_name else int(table_id))
    if table.optimizer.algorithm != algorithm:
        raise InputError(
            f"`{op}`: table {table.name!r} uses optimizer {table.optimizer.algorithm!r}, not "
            f"{algorithm!r}. Fix: call the op of its optimizer, or the load_all/retrieve_all ops."
        )
    return table


def _make_load(part: str, algorithm: str):
    slots = _slot_names(algorithm)
    op = f"load_tpu_embedding_{part}_parameters"

    def load(*args: Any, **kwargs: Any) -> None:
        bound = load.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        engine = current_embedding(a["config"])
        table = _select_table(engine, a["table_id"], a["table_name"], op, algorithm)
        engine.load_parameters(
            table.name, a["parameters"], num_shards=a["num_shards"], shard_id=a["shard_id"],
            **{s: a[s] for s in slots},
        )

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("parameters", *slots)]
    params += [inspect.Parameter("num_shards", inspect.Parameter.POSITIONAL_OR_KEYWORD),
               inspect.Parameter("shard_id", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
               for n, d in (("table_id", -1), ("table_name", ""), ("config", b""))]
    load.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    load.__name__ = load.__qualname__ = op
    load.__doc__ = (f"LoadTPUEmbedding{part}Parameters: write {', '.join(('parameters',) + slots)} of one "
                    "host shard (``[rows_in_shard, dim]`` each) of the table named or numbered.")
    return load


def _make_retrieve(part: str, algorithm: str):
    slots = _slot_names(algorithm)
    op = f"retrieve_tpu_embedding_{part}_parameters"

    def retrieve(num_shards: int, shard_id: int, table_id: int = -1, table_name: str = "", config: Any = b""):
        engine = current_embedding(config)
        table = _select_table(engine, table_id, table_name, op, algorithm)
        values = engine.retrieve_parameters(table.name, num_shards=num_shards, shard_id=shard_id)
        out = tuple(values[n] for n in ("parameters", *slots))
        return out[0] if len(out) == 1 else out

    retrieve.__name__ = retrieve.__qualname__ = op
    retrieve.__doc__ = (f"RetrieveTPUEmbedding{part}Parameters: ({', '.join(('parameters',) + slots)}) of one "
                        "host shard of the table named or numbered.")
    return retrieve


__all__ = [
    "PER_TABLE_OPS", "configure_tpu_embedding", "current_embedding", "is_tpu_embedding_initialized",
    "shutdown_tpu_embedding", "enqueue_tpu_embedding_integer_batch", "enqueue_tpu_embedding_sparse_batch",
    "enqueue_tpu_embedding_sparse_tensor_batch", "enqueue_tpu_embedding_ragged_tensor_batch",
    "enqueue_tpu_embedding_arbitrary_tensor_batch", "dynamic_enqueue_tpu_embedding_arbitrary_tensor_batch",
    "recv_tpu_embedding_activations", "send_tpu_embedding_gradients",
    "load_all_tpu_embedding_parameters", "retrieve_all_tpu_embedding_parameters",
]
for _part, _algorithm in PER_TABLE_OPS.items():
    for _fn in (_make_load(_part, _algorithm), _make_retrieve(_part, _algorithm)):
        globals()[_fn.__name__] = _fn
        __all__.append(_fn.__name__)


def load_all_tpu_embedding_parameters(
    parameters: Sequence[Any], auxiliary1: Sequence[Any], auxiliary2: Sequence[Any],
    auxiliary3: Sequence[Any], auxiliary4: Sequence[Any], auxiliary5: Sequence[Any],
    auxiliary6: Sequence[Any], auxiliary7: Sequence[Any], num_shards: int, shard_id: int, config: Any = b"",
) -> None:
    """LoadAllTPUEmbeddingParameters: lists of NumTables tensors; auxiliary k is slot k in
    §2.6 order, and must be empty (e.g. ``[0, 0]``) where the optimizer has no slot k."""
    engine = current_embedding(config)
    n = len(engine.layout.tables)
    aux = [auxiliary1, auxiliary2, auxiliary3, auxiliary4, auxiliary5, auxiliary6, auxiliary7]
    parameters = _count(parameters, n, "parameters", "table")
    aux = [_count(a, n, f"auxiliary{k + 1}", "table") for k, a in enumerate(aux)]
    loads = {}
    for i, t in enumerate(engine.layout.tables):
        slots = tuple(t.optimizer.slot_names)
        given = {}
        for k in range(MAX_AUXILIARY):
            arr = _host(aux[k][i])
            if k < len(slots):
                given[slots[k]] = arr
            elif arr.size:
                raise InputError(
                    f"Invalid `auxiliary{k + 1}` for table {t.name!r}: its optimizer has "
                    f"{len(slots)} slot(s), so it must be empty. Received: shape={arr.shape}"
                )
        loads[t.name] = dict(given, parameters=_host(parameters[i]))
    # every table's arrays are checked (shape, dtype, NaN policy) before any is written
    engine.load_tables(loads, num_shards=num_shards, shard_id=shard_id)


def retrieve_all_tpu_embedding_parameters(num_shards: int, shard_id: int, config: Any = b"") -> tuple[list[np.ndarray], ...]:
    """RetrieveAllTPUEmbeddingParameters: ``(parameters, auxiliary1, ..., auxiliary7)``, each
    a list over tables; unused auxiliaries are ``[0, 0]`` arrays."""
    engine = current_embedding(config)
    out: list[list[np.ndarray]] = [[] for _ in range(1 + MAX_AUXILIARY)]
    for t in engine.layout.tables:
        values = engine.retrieve_parameters(t.name, num_shards=num_shards, shard_id=shard_id)
        names = ("parameters", *t.optimizer.slot_names)
        for k in range(1 + MAX_AUXILIARY):
            out[k].append(values[names[k]] if k < len(names) else np.zeros((0, 0), np.float32))
    return tuple(out)
