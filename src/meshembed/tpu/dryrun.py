"""``me.tpu.dry_run``: what a TPU would do with your batches, before you rent one.

Given a config (a ``me.tpu`` feature_config nest, a ``me.EmbeddingConfig`` or a serialized
``TPUEmbeddingConfiguration``), sample batches and a target topology, it replays the TPU host
preprocessing (:mod:`meshembed.embedding.dryrun`) and reports, per table and partition, the ids
and unique ids against the limits, the CSR buffers, padding, an HBM estimate, suggested
limits and — with ``allow_id_dropping`` — every (feature, sample, position, id) the TPU would
drop, in the order it drops them. docs/dryrun.md has the JSON schema and every assumption.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from meshembed.embedding import dryrun as _dryrun
from meshembed.embedding.batch import prepare
from meshembed.embedding.inputs import RaggedIds, SparseIds
from meshembed.embedding.layout import Layout, build_layout, load_config
from meshembed.errors import ConfigError, InputError
from meshembed.tpu import nest as _nest
from meshembed.tpu._config import FeatureConfig

__all__ = ["dry_run", "load_npz", "save_npz", "Limits", "Topology", "PRESETS"]

Limits, Topology, PRESETS = _dryrun.Limits, _dryrun.Topology, _dryrun.PRESETS


def _is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig) or not _nest.is_container(x)


def _is_nest(config: Any) -> bool:
    if isinstance(config, FeatureConfig):
        return True
    if isinstance(config, (Mapping, list, tuple)):
        try:
            return any(isinstance(f, FeatureConfig) for _, f in _nest.flatten_with_paths(config, _is_feature))
        except Exception:
            return False
    return False


def load_npz(path: str | os.PathLike) -> dict[str, Any]:
    """One batch from a ``.npz`` file: ``name`` holds dense ids; ``name:values`` with
    ``name:row_splits`` a ragged feature, with ``name:indices`` and ``name:dense_shape`` a
    sparse one; ``name:weights`` its weights (docs/dryrun.md, "Batches on disk").
    Returns ``{"features": {...}, "weights": {...}}``."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    names = sorted({k.split(":", 1)[0] for k in arrays})
    features, weights = {}, {}
    for n in names:
        get = lambda part: arrays.get(f"{n}:{part}")  # noqa: E731
        if n in arrays:
            features[n] = arrays[n]
        elif get("row_splits") is not None:
            features[n] = RaggedIds(get("row_splits"), get("values"))
            if get("weights") is not None:
                weights[n] = RaggedIds(get("row_splits"), get("weights"))
        elif get("indices") is not None:
            features[n] = SparseIds(get("indices"), get("values"), get("dense_shape"))
            if get("weights") is not None:
                weights[n] = SparseIds(get("indices"), get("weights"), get("dense_shape"))
        else:
            raise InputError(f"Invalid batch file {os.fspath(path)!r}: feature {n!r} has neither dense ids ('{n}'), "
                             f"'{n}:values' with '{n}:row_splits', nor '{n}:indices'/'{n}:values'/'{n}:dense_shape'. "
                             f"Keys: {sorted(arrays)}")
    return {"features": features, "weights": weights or None}


def save_npz(path: str | os.PathLike, features: Mapping[str, Any], weights: Mapping[str, Any] | None = None) -> None:
    """Write one batch (``{name: dense ids, RaggedIds or SparseIds}``, optional weights alike) in
    the format :func:`load_npz` and ``meshembed dryrun`` read."""
    arrays: dict[str, np.ndarray] = {}
    for n, x in features.items():
        w = (weights or {}).get(n)
        if isinstance(x, RaggedIds):
            arrays.update({f"{n}:values": np.asarray(x.values), f"{n}:row_splits": np.asarray(x.row_splits)})
        elif isinstance(x, SparseIds):
            arrays.update({f"{n}:indices": np.asarray(x.indices), f"{n}:values": np.asarray(x.values),
                           f"{n}:dense_shape": np.asarray(x.dense_shape)})
        else:
            arrays[n] = np.asarray(x)
        if w is not None:
            arrays[f"{n}:weights"] = np.asarray(getattr(w, "values", w))
    np.savez(path, **arrays)


def _items(batches: Any) -> Iterable[tuple[Any, Any]]:
    """(features, weights) per batch: a dict (one batch), an iterable of dicts or of
    ``(features, weights)`` pairs, or ``.npz`` paths (one batch a file)."""
    if isinstance(batches, (str, os.PathLike)):
        batches = [batches]
    if isinstance(batches, Mapping):
        batches = [batches]
    for b in batches:
        if isinstance(b, (str, os.PathLike)):
            b = load_npz(Path(b))
        if isinstance(b, Mapping) and set(b) == {"features", "weights"}:
            yield b["features"], b["weights"]
        elif isinstance(b, tuple) and len(b) == 2:
            yield b
        else:
            yield b, None


def _nest_layout(feature_config: Any, first: Any, optimizer: Any) -> tuple[Layout, Any]:
    """A me.tpu nest as an engine layout (shapes from FeatureConfig.output_shape, else from the
    first batch, TF's rules) and a function mapping a nest batch to ``{path: value}``."""
    from meshembed.config import EmbeddingConfig
    from meshembed.config import FeatureConfig as EngineFeature
    from meshembed.tpu._embedding import flat_features, from_tf, incoming_output_shape, resolve_tables

    flat = flat_features(feature_config)
    _, names, tables, _ = resolve_tables(flat, optimizer)
    paths = [p or f.name or "feature" for p, f in flat]
    table_of = {id(t): n for t, n in zip(dict.fromkeys(f.table for _, f in flat), names)}

    def by_path(value: Any, what: str) -> dict[str, Any]:
        leaves = _nest.match(feature_config, value, what, _is_feature)
        return {p: from_tf(x, what, p) for p, x in zip(paths, leaves)}

    shapes = []
    first_flat = by_path(first, "batches") if first is not None else {}
    for p, (_, f) in zip(paths, flat):
        if f.output_shape is not None:
            shapes.append(tuple(f.output_shape))
        elif p in first_flat:
            shapes.append(incoming_output_shape(first_flat[p], f, "batches", p))
        else:
            raise ConfigError(f"Feature '{p}' has no output shape. Fix: FeatureConfig(output_shape=...) or a batch.")
    features = [EngineFeature(table_of[id(f.table)], s, name=p) for p, (_, f), s in zip(paths, flat, shapes)]
    return build_layout(EmbeddingConfig(tables=tables, features=features)), by_path


def dry_run(config: Any, batches: Any, topology: str | Topology = "v5p", *, chips: int | None = None,
            sparse_cores_per_chip: int | None = None, limits: Any = None, allow_id_dropping: bool | None = None,
            algorithm: str = "jax-tpu-embedding", optimizer: Any = None,
            headroom: float = 0.0) -> _dryrun.DryRunReport:
    """Replay the TPU's input preprocessing for ``batches`` on ``topology`` and report.

    Args:
        config: a ``me.tpu`` FeatureConfig nest, a ``me.EmbeddingConfig``, or a serialized
            ``TPUEmbeddingConfiguration`` (bytes, text, or a ``.pb``/``.pbtxt`` path).
        batches: one batch (the structure ``enqueue`` takes), an iterable of batches (each may be
            a ``(features, weights)`` pair), or ``.npz`` path(s) (:func:`load_npz`). Each is the
            global batch, split evenly over ``chips`` and then over each chip's cores.
        topology: a preset (``"v4"``, ``"v5p"``, ``"v6e"``, ``"tpu7x"``; ``"v3"``: TensorCore era,
            counts only) or a :class:`Topology`; ``chips`` / ``sparse_cores_per_chip`` override it.
        limits: None (256/256, TF's and jax-tpu-embedding's defaults), one ``Limits``/dict for every
            table, ``{table: Limits or dict}``, or TF's ``SparseCoreEmbeddingConfig``. The
            ``TPUEmbeddingConfiguration`` proto carries no id limits.
        allow_id_dropping: list the ids the TPU drops instead of failing (None: the limits
            object's, else False).
        algorithm: ``"jax-tpu-embedding"`` (per-partition limits drop ids) or ``"tensorflow"``
            (``tpu_embedding_v3``: partition limits are errors, the chip buffer drops).
        optimizer: the nest's default optimizer (slots in the HBM estimate), as TPUEmbedding's.
        headroom: suggested limits are the observed maxima times ``1 + headroom``.
    """
    topo = _dryrun.resolve_topology(topology, chips, sparse_cores_per_chip)
    items = iter(_items(batches))
    first = next(items, None)
    if first is None:
        raise InputError("Invalid `batches`: no batch was given. Fix: pass at least one sample batch.")
    if _is_nest(config):
        layout, by_path = _nest_layout(config, first[0], optimizer)
        convert = lambda x, what: None if x is None else by_path(x, what)  # noqa: E731
    else:
        if not (hasattr(config, "tables") or isinstance(config, (bytes, bytearray, str, os.PathLike))):
            raise ConfigError("Invalid `config`. Expected a me.tpu FeatureConfig nest, a me.EmbeddingConfig or a "
                              f"serialized TPUEmbeddingConfiguration. Received: {type(config).__name__}")
        layout = build_layout(load_config(config))
        convert = lambda x, what: x  # noqa: E731

    def prepared() -> Iterable[Any]:
        for features, weights in _chain(first, items):
            yield prepare(layout, convert(features, "batches"), convert(weights, "weights"))

    return _dryrun.analyze(layout, prepared(), topo, limits=limits, allow_id_dropping=allow_id_dropping,
                           algorithm=algorithm, headroom=headroom)


def _chain(first: Any, rest: Iterable[Any]) -> Iterable[Any]:
    yield first
    yield from rest
