"""CPU inference from trained tables: ``serving_embedding_lookup`` and ``TPUEmbeddingForServing``.

TF's serving semantics (``tpu_embedding_for_serving.cpu_embedding_lookup``): dense ids are a
plain gather (output ``ids.shape + [dim]``); sparse ids are combined over their last axis
(with ``validate_weights_and_indices`` ids < 0 and weights <= 0 are dropped first, as
``safe_embedding_lookup_sparse`` does); a rank-2 sparse/ragged input of a feature with
``max_sequence_length`` is a sequence; shapes follow each call's inputs. The combining is
the engine's own host normalisation and combiner (``meshembed.embedding.inputs`` /
``combiners``) on the NumPy backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshembed.backend import get_backend
from meshembed.embedding import RaggedIds, SparseIds
from meshembed.embedding import TPUEmbedding as _Engine
from meshembed.embedding import combiners, inputs
from meshembed.embedding.initializers import default_initializer, initial_values, table_rng
from meshembed.errors import InputError
from meshembed.tpu import nest as _nest
from meshembed.tpu._config import FeatureConfig, TableConfig
from meshembed.tpu._embedding import TPUEmbedding, flat_features, from_tf, is_tf, read_checkpoint, resolve_tables, to_tf

__all__ = ["TPUEmbeddingForServing", "serving_embedding_lookup"]


def _is_sparse(x: Any) -> bool:
    return isinstance(x, SparseIds) or all(hasattr(x, a) for a in ("indices", "values", "dense_shape"))


def _is_ragged(x: Any) -> bool:
    return isinstance(x, RaggedIds) or all(hasattr(x, a) for a in ("row_splits", "values"))


def _prune(x: Any, w: Any) -> tuple[SparseIds, Any]:
    """Drop ids < 0 (and weights <= 0), as safe_embedding_lookup_sparse does."""
    ids = np.asarray(x.values).reshape(-1)
    keep = ids >= 0
    wv = None
    if w is not None:
        wv = np.asarray(w.values if hasattr(w, "values") else w, dtype=np.float32).reshape(-1)
        if wv.shape == keep.shape:
            keep &= wv > 0
    pruned = SparseIds(np.asarray(x.indices)[keep], ids[keep], np.asarray(x.dense_shape))
    return pruned, (None if wv is None or wv.shape != keep.shape else wv[keep])


def host_table(value: Any, name: str, what: str = "tables") -> np.ndarray:
    """A float32 host array of a serving table; strings, bools and complex numbers are refused
    (a string table raised NumPy's ValueError, a complex one lost its imaginary part)."""
    arr = np.asarray(inputs_to_host(value))
    if arr.dtype.kind not in "fiu":
        raise InputError(f"Invalid `{what}` entry for table '{name}'. Expected real numbers (float or integer). "
                         f"Received: dtype={arr.dtype}")
    with np.errstate(over="ignore"):
        return arr.astype(np.float32)


def _check_finite(table: np.ndarray, name: str, what: str) -> None:
    """NaN/Inf (or a value past float32's range) in a served table is an error, not an activation."""
    bad = ~np.isfinite(table)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise InputError(f"Invalid `{what}` for table '{name}'. Expected finite float32 values. Received: "
                         f"{int(bad.sum())} NaN/Inf value(s), the first in row {row}. Nothing was changed.")


def _rows(table: np.ndarray, ids: np.ndarray, name: str) -> np.ndarray:
    """``table[ids]``, refusing NaN/Inf in the rows looked up (cheap: batch-sized)."""
    rows = table[ids]
    if not np.isfinite(rows).all():
        looked_up = np.unique(ids)
        bad = looked_up[~np.isfinite(table[looked_up]).all(axis=-1)]
        raise InputError(f"Invalid `tables` for table '{name}'. Expected finite float32 values in the rows looked "
                         f"up. Received: NaN/Inf in row(s) {bad[:8].tolist()}. Fix: load finite tables "
                         "(load_from refuses NaN/Inf).")
    return rows


def _lookup(x: Any, w: Any, feature: FeatureConfig, table: np.ndarray, path: str) -> np.ndarray:
    t = feature.table
    where = f"input '{path or '<top>'}'"
    m = feature.max_sequence_length
    if not _is_sparse(x) and not _is_ragged(x):
        if w is not None:
            raise InputError(f"Invalid `weights` for {where}: weights given but the input is dense.")
        if m:
            raise InputError(f"Invalid {where}: feature is a sequence feature (max_sequence_length={m}) but a "
                             "dense tensor was passed. Fix: pass SparseIds/RaggedIds.")
        ids = np.asarray(x)
        if ids.dtype.kind not in "iu":
            raise InputError(f"Invalid {where}: expected integer ids. Received: dtype={ids.dtype}")
        inputs.check_ids(ids.reshape(-1).astype(np.int64), inputs.FeatureInfo(path, str(t.name), t.vocabulary_size, ()))
        return _rows(table, ids, str(t.name))
    if w is not None and _is_sparse(w) != _is_sparse(x) and hasattr(w, "values"):
        raise InputError(f"Invalid `weights` for {where}: their type ({type(w).__name__}) does not match the "
                         f"input's ({type(x).__name__}).")
    if w is not None and m:
        raise InputError(f"Invalid `weights` for {where}: weights given for a sequence feature.")
    final = None
    if _is_sparse(x):
        shape = [int(d) for d in np.asarray(x.dense_shape).reshape(-1)]
        if feature.output_shape is None and m and len(shape) == 2:
            out = (shape[0], m)
        else:
            out = tuple(shape[:-1])
            if feature.validate_weights_and_indices:
                x, w = _prune(x, w)
    else:
        rows = int(np.shape(x.row_splits)[0]) - 1
        if feature.output_shape is not None:
            n = math.prod(feature.output_shape)
            final = feature.output_shape
            if n == rows:
                out = (rows,)
            elif rows and n > rows and n % rows == 0:
                out, w = (rows, n // rows), None  # TF ignores weights and combiner here
            else:
                raise InputError(f"Invalid {where}: output_shape {list(feature.output_shape)} is not a multiple "
                                 f"of the input's {rows} rows.")
        else:
            out = (rows, m) if m else (rows,)
    info = inputs.FeatureInfo(path, str(t.name), t.vocabulary_size, out)
    batch = inputs.normalize(x, w, info)
    scale = combiners.combiner_scale(batch.slots, batch.weights, batch.num_slots, t.combiner)
    rows = _rows(table, batch.ids, str(t.name))
    act = combiners.forward(get_backend("numpy"), rows, scale.reshape(-1, 1), batch.slots,
                            batch.num_slots)
    return np.asarray(act, dtype=np.float32).reshape(tuple(final or out) + (t.dim,))


def serving_embedding_lookup(inputs: Any, weights: Any, tables: Mapping[TableConfig, Any], feature_config: Any) -> Any:
    """TF's ``serving_embedding_lookup``: ``inputs`` is a nest whose paths are a subset of
    ``feature_config``'s; returns the activations in ``inputs``' nest (``tf.Tensor``s when
    the inputs are TensorFlow objects, NumPy otherwise)."""
    features = dict(flat_features(feature_config))
    leaf = lambda v: not _nest.is_container(v)  # noqa: E731
    flat = _nest.flatten_with_paths(inputs, leaf)
    unknown = sorted(p for p, _ in flat if p not in features)
    if unknown:
        raise InputError(f"Invalid `inputs`: paths {unknown} are not in feature_config (its paths: "
                         f"{sorted(features)}).")
    wflat: list[Any] = [None] * len(flat)
    if weights is not None:
        wflat = _nest.match(inputs, weights, "weights", leaf)
    outs, tf_io = [], False
    for (path, x), w in zip(flat, wflat):
        f = features[path]
        if f.table not in tables:
            raise InputError(f"Invalid `tables`: no table for input '{path}' (its TableConfig {f.table!r}).")
        table = host_table(tables[f.table], str(f.table.name or path))
        if table.shape != (f.table.vocabulary_size, f.table.dim):
            raise InputError(f"Invalid `tables` entry for input '{path}': expected shape "
                             f"{(f.table.vocabulary_size, f.table.dim)}. Received: shape={table.shape}")
        tf_io = tf_io or is_tf(x)
        outs.append(_lookup(from_tf(x, "inputs", path), from_tf(w, "weights", path), f, table, path))
    if tf_io:
        outs = [to_tf(o) for o in outs]
    return _nest.pack(inputs, outs, leaf)


def inputs_to_host(x: Any) -> np.ndarray:
    if is_tf(x):
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    return inputs.to_host(x)


class TPUEmbeddingForServing:
    """TF's ``TPUEmbeddingForServing``: the tables on the host for CPU inference.

    Tables start as a fresh ``TPUEmbedding`` with the same ``seed`` would (the same
    initialisers, table order and names); ``load_from`` copies trained tables in from a
    ``me.tpu.TPUEmbedding``, a ``me.TPUEmbedding``, a checkpoint path written by
    ``save``, or a ``{TableConfig or name: array}`` mapping. ``embedding_tables`` holds the
    live arrays; calling the object (or ``embedding_lookup``) looks features up."""

    def __init__(self, feature_config: Any, optimizer: Any = None, *, seed: int = 0) -> None:
        # the optimizer only fills in tables that have none (serving never updates them)
        tables, names, specs, _ = resolve_tables(flat_features(feature_config), optimizer)
        self._feature_config = feature_config
        self._names = dict(zip(tables, names))
        self._tables: dict[TableConfig, np.ndarray] = {}
        for index, (t, spec) in enumerate(zip(tables, specs)):
            init = spec.initializer if spec.initializer is not None else default_initializer(spec.optimizer)
            shape = (t.vocabulary_size, t.dim)
            self._tables[t] = np.array(initial_values(init, shape, table_rng(seed, index), spec.name), np.float32)

    @property
    def embedding_tables(self) -> dict[TableConfig, np.ndarray]:
        return dict(self._tables)

    def load_from(self, source: Any) -> None:
        """Copy trained tables in. All are checked (shape, real and finite values) before any
        is written; a checkpoint path needs no learning-rate callables passed again."""
        if isinstance(source, TPUEmbedding):
            by_name = source._live().embedding_tables
        elif isinstance(source, _Engine):
            by_name = source.embedding_tables
        elif isinstance(source, (str, os.PathLike)):
            by_name = {name: arrays["parameters"] for name, arrays in read_checkpoint(source)[1].items()}
        elif isinstance(source, Mapping):
            by_name = {(self._names.get(k) if isinstance(k, TableConfig) else k): v for k, v in source.items()}
        else:
            raise InputError("Invalid `source`. Expected a meshembed.tpu.TPUEmbedding, a me.TPUEmbedding, a "
                             f"checkpoint path or a mapping of tables. Received: {type(source).__name__}")
        new = {}
        for t, name in self._names.items():
            if name not in by_name:
                raise InputError(f"Invalid `source`: it has no table '{name}' (it has {sorted(map(str, by_name))}).")
            arr = host_table(by_name[name], name, "source")
            if arr.shape != self._tables[t].shape:
                raise InputError(f"Invalid `source` table '{name}': expected shape {self._tables[t].shape}. "
                                 f"Received: shape={arr.shape}")
            _check_finite(arr, name, "source")
            new[t] = arr
        for t, arr in new.items():
            self._tables[t][...] = arr

    def embedding_lookup(self, features: Any, weights: Any = None) -> Any:
        return serving_embedding_lookup(features, weights, self._tables, self._feature_config)

    __call__ = embedding_lookup
