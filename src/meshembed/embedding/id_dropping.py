"""Train on CPU with the ids the TPU would drop removed (``allow_id_dropping``).

:func:`simulate_id_dropping` is a pure function over one prepared batch: it replays the TPU
host preprocessing (:mod:`meshembed.embedding.dryrun`) and returns the batch without the
ids the TPU would drop, so every front end that prepares a :class:`Batch` (the engine's
``enqueue_batch``, ``me.ops``, ``me.tpu``) trains as the TPU would. It works on the prepared
batch, not on the raw inputs, because the TPU computes each id's combiner gain (``w / Σw``
for ``mean``) *before* it drops ids, and the remaining ids keep that gain; a filtered input
would be renormalised by ``prepare`` over the kept ids only. :func:`drop_from_inputs` is
that input-level filter, for front ends that only take raw inputs (``me.torch``, ``me.jax``):
exact for the ``sum`` combiner and sequence features, renormalised otherwise (it warns).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np

from meshembed.embedding import combiners, inputs
from meshembed.embedding.batch import Batch, PreparedFeature, by_feature, feature_info, structured
from meshembed.embedding.dryrun import Topology, plan_drops, resolve_limits, resolve_topology
from meshembed.embedding.layout import Layout

__all__ = ["drop_ids", "simulate_id_dropping", "drop_from_inputs"]


def _read_only(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def drop_ids(batch: Batch, drops: Mapping[int, np.ndarray]) -> Batch:
    """A new batch without entries ``drops[k]`` of feature ``k`` (indices into its ``ids``).
    The other ids keep their combiner factor, as on the TPU."""
    if not drops:
        return batch
    features = list(batch.features)
    for k, idx in drops.items():
        d = features[k]
        keep = np.ones(d.ids.shape[0], bool)
        keep[np.asarray(idx, np.int64)] = False
        ids, slots, scale = d.ids[keep], d.slots[keep], d.scale[keep]
        features[k] = PreparedFeature(
            ids=_read_only(ids), slots=_read_only(slots), scale=_read_only(scale), num_slots=d.num_slots,
            unit_scale=d.unit_scale, identity=bool(combiners.is_identity(slots, d.num_slots)))
    return Batch(batch.layout, batch.mode, tuple(features))


def _options(topology: str | Topology, chips: int | None, sparse_cores_per_chip: int | None, limits: Any,
             layout: Layout) -> tuple[Topology, Any]:
    topo = resolve_topology(topology, chips, sparse_cores_per_chip)
    return topo, resolve_limits(layout, limits, topo)[0]


def simulate_id_dropping(batch: Batch, topology: str | Topology = "v5p", *, chips: int | None = None,
                         sparse_cores_per_chip: int | None = None, limits: Any = None,
                         algorithm: str = "jax-tpu-embedding") -> Batch:
    """``batch`` without the ids the TPU (``topology``, ``limits``; see ``me.tpu.dry_run``) drops
    with ``allow_id_dropping=True``. Pure: the input batch is unchanged.

    Use it between ``prepare`` and the step, e.g.
    ``emb.enqueue_batch(simulate_id_dropping(prepare(emb.layout, features), "v6e", chips=4))``."""
    topo, table_limits = _options(topology, chips, sparse_cores_per_chip, limits, batch.layout)
    return drop_ids(batch, plan_drops(batch.layout, batch, topo, table_limits, algorithm))


def drop_from_inputs(layout: Layout, features: Any, weights: Any = None, topology: str | Topology = "v5p", *,
                     chips: int | None = None, sparse_cores_per_chip: int | None = None, limits: Any = None,
                     algorithm: str = "jax-tpu-embedding") -> tuple[Any, Any]:
    """``(features, weights)`` in the structure given, with the dropped ids removed: every
    feature that loses ids becomes a ``me.SparseIds`` (and its weights one too).

    A pooled ``mean``/``sqrtn`` sample that loses some of its ids is renormalised over the
    ids it keeps when the result is prepared (the TPU keeps the original gains): a warning
    says so; :func:`simulate_id_dropping` on the prepared batch is exact."""
    from meshembed.embedding.batch import from_feature_batches

    ids_list = by_feature(layout, features, "features")
    weight_list = by_feature(layout, weights, "weights", allow_none=True)
    raw = [inputs.normalize(x, w, feature_info(layout, f)) for f, x, w in zip(layout.features, ids_list, weight_list)]
    batch = from_feature_batches(layout, raw, layout.mode)
    topo, table_limits = _options(topology, chips, sparse_cores_per_chip, limits, layout)
    drops = plan_drops(layout, batch, topo, table_limits, algorithm)
    out_ids, out_w = list(ids_list), list(weight_list)
    for k, idx in drops.items():
        f, fb = layout.features[k], raw[k]
        keep = np.ones(fb.ids.shape[0], bool)
        keep[idx] = False
        kept_slots = fb.slots[keep]
        pooled = len(f.output_shape) == 1
        if pooled and layout.tables[f.table].combiner != "sum":
            lost = np.unique(fb.slots[~keep])
            if np.isin(lost, kept_slots).any():
                warnings.warn(f"drop_from_inputs: feature {f.name!r} keeps some ids of samples that lose others; its "
                              f"'{layout.tables[f.table].combiner}' combiner will renormalise them over the kept ids, "
                              "while the TPU keeps their original gains. Use simulate_id_dropping on the prepared "
                              "batch for the TPU's numbers.", stacklevel=2)
        if pooled:  # [slot, position] with a combined last axis
            order = np.argsort(kept_slots, kind="stable")
            s = kept_slots[order]
            pos = np.arange(s.shape[0]) - np.searchsorted(s, s, side="left")
            index = np.stack([s, pos], axis=1)
            shape = [f.output_shape[0], int(pos.max(initial=-1)) + 1]
        else:  # a sequence: the slot is the position
            order = np.arange(kept_slots.shape[0])
            index = np.stack(np.unravel_index(kept_slots, f.output_shape), axis=1)
            shape = list(f.output_shape)
        values = fb.ids[keep][order]
        dense_shape = np.asarray(shape, np.int64)
        out_ids[k] = inputs.SparseIds(index.astype(np.int64), values, dense_shape)
        if not fb.unit_weights:
            out_w[k] = inputs.SparseIds(index.astype(np.int64), fb.weights[keep][order], dense_shape)
    def shaped(values: list[Any]) -> Any:  # a dict by name came in: a dict goes out
        if isinstance(features, Mapping) and not layout.keys:
            return {f.name: v for f, v in zip(layout.features, values)}
        return structured(layout, values)

    if weights is None and all(w is None for w in out_w):
        return shaped(out_ids), None
    return shaped(out_ids), shaped(out_w)
