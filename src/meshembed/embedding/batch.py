"""One embedding batch, validated and flattened on the host: ``prepare(layout, features) -> Batch``.

Every input check of an embedding step lives here (ids, weights, the structure of the
features, the mode), so every front end — the engine's ``enqueue``, ``me.ops``, ``me.tpu``,
``me.torch``, ``me.jax`` — refuses the same inputs with the same errors. A :class:`Batch`
is an immutable value: it holds read-only host arrays and may be looked up and trained on
by any backend (:mod:`meshembed.embedding.step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from meshembed.backend import memory
from meshembed.embedding import combiners, inputs
from meshembed.embedding.layout import FeatureSpec, Layout
from meshembed.errors import InputError

MODES = ("training", "inference", "backward_pass_only")


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view: the batch is a value, nobody may change it after ``prepare``."""
    a = a.view()
    a.flags.writeable = False
    return a


def _shared(a: np.ndarray) -> np.ndarray:
    """A writable view of a frozen batch array whose memory the batch owns, for a backend to
    share instead of copy (``torch.from_numpy`` copies read-only arrays: 2 MB a W1 step).
    No backend writes ids, slots or scales; memory nobody may write stays read-only."""
    view = a.view()
    try:
        view.flags.writeable = True
    except ValueError:  # the owner itself is read-only
        return a
    return view


@dataclass(frozen=True, eq=False)
class PreparedFeature:
    """One feature's lookups: id ``ids[k]`` adds ``scale[k] * row`` to output slot ``slots[k]``.

    ``scale`` is the combiner factor ``w_k / N_s`` of every id. ``unit_scale``: every factor
    is exactly 1 (sum combiner, unit weights), so the weighting is skipped (``x * 1 == x``).
    ``identity``: id ``k`` alone in slot ``k`` (a sequence feature with every position
    filled): the lookup is a plain gather and the activation gradient is one row per id.
    ``offsets`` (int64 ``[num_slots + 1]``, or None): the ids come grouped by slot in slot
    order, slot ``s`` owning positions ``offsets[s]:offsets[s + 1]`` (ragged rows), so a
    pooled lookup need not scan ``slots`` for its segments."""

    ids: np.ndarray  # int64 [n]
    slots: np.ndarray  # int64 [n]
    scale: np.ndarray  # float32 [n]
    num_slots: int
    unit_scale: bool = False
    identity: bool = False
    offsets: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class Batch:
    """A validated batch for ``layout``: one :class:`PreparedFeature` per feature (config
    order) and the ``mode`` it was enqueued in (``training``, ``inference`` or
    ``backward_pass_only``)."""

    layout: Layout
    mode: str
    features: tuple[PreparedFeature, ...]
    #: backend arrays made from the host arrays on first use, per backend (a cache, not state)
    _device: dict = field(default_factory=dict, repr=False)

    def device_array(self, backend: Any, k: int, name: str) -> Any:
        """Feature ``k``'s ``ids``/``slots`` (int64) or ``scale`` (float32) on ``backend``,
        made once: a lookup and its gradient step share them. Never kept when traced."""
        key = (id(backend), k, name)
        if key in self._device:
            return self._device[key]
        host = _shared(getattr(self.features[k], name))
        arr = backend.asarray(host, dtype="float32" if name == "scale" else "int64")
        if not backend.is_traced(arr):
            self._device[key] = arr
        return arr


def feature_info(layout: Layout, f: FeatureSpec) -> inputs.FeatureInfo:
    t = layout.tables[f.table]
    return inputs.FeatureInfo(f.name, t.name, t.vocabulary_size, f.output_shape)


def by_feature(layout: Layout, values: Any, what: str, allow_none: bool = False) -> list[Any]:
    """A list in config order from a sequence or a ``{feature_name: value}`` mapping.

    A config whose features were a dict takes a dict only (by its keys, or by feature
    name): a list would be matched by position and could silently swap features."""
    names = [f.name for f in layout.features]
    keys = layout.keys
    if values is None and allow_none:
        return [None] * len(names)
    if keys:
        if not isinstance(values, Mapping):
            raise InputError(
                f"Invalid `{what}`: the config's features were given as a dict, so pass a dict "
                f"keyed by {list(keys)}. Received: {type(values).__name__}. Fix: e.g. "
                f"{{{keys[0]!r}: ...}}; a list is not accepted because it would be matched by "
                "position, not by name."
            )
        if set(values) == set(keys):
            return [values[k] for k in sorted(keys)]
        if not set(values) <= set(names):  # by feature name otherwise (names differ from keys)
            extra = [k for k in values if k not in keys]
            missing = [k for k in keys if k not in values]
            if not allow_none or extra:
                raise InputError(
                    f"Invalid `{what}`: expected one entry per feature key {list(keys)}. "
                    f"Missing: {missing}; unknown: {extra}"
                )
            return [values.get(k) for k in sorted(keys)]
    if isinstance(values, Mapping):
        extra = sorted(set(values) - set(names), key=repr)
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


def structured(layout: Layout, values: Sequence[Any]) -> list[Any] | dict[Any, Any]:
    """Config-order values in the structure the features were given in: a dict with the
    config's keys (in the order given) for a dict of features, else the list."""
    if not layout.keys:
        return list(values)
    index = {k: i for i, k in enumerate(sorted(layout.keys))}
    return {k: values[index[k]] for k in layout.keys}


def check_bool(value: Any, name: str, error: type = InputError) -> bool:
    """``True``/``False`` only: ``bool("False")`` is True, so strings are refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise error(f"Invalid `{name}`. Expected True or False. Received: {name}={value!r} "
                f"({type(value).__name__})")


def resolve_mode(layout: Layout, training: bool | None = None, mode_override: Any = None) -> str:
    """The batch's mode: ``mode_override``, else ``training``, else the config's."""
    mode = inputs.parse_mode(mode_override)
    if training is not None:
        training = check_bool(training, "training")  # "False" would train
    if mode is None and training is not None:
        mode = "training" if training else "inference"
    return mode or layout.mode


def prepare(
    layout: Layout,
    features: Any,
    weights: Any = None,
    *,
    training: bool | None = None,
    mode_override: str | None = None,
    backend: Any = None,
) -> Batch:
    """Validate and flatten one batch: one entry per feature in config order (or a dict).

    Each entry is a dense int array of the feature's ``input_shape`` (one id per slot),
    ``me.SparseIds`` or ``me.RaggedIds``; ``weights`` mirrors it (None = all ones). ``backend``
    lets backend arrays (e.g. torch tensors) be read as input."""
    mode = resolve_mode(layout, training, mode_override)
    ids_list = by_feature(layout, features, "features")
    weight_list = by_feature(layout, weights, "weights", allow_none=True)
    batches = []
    for f, x, w in zip(layout.features, ids_list, weight_list):
        t = layout.tables[f.table]  # an activation no process can hold: refused before any work
        memory.check_size(f"the activations of feature {f.name!r} (table {t.name!r})", f.output_shape + (t.dimension,),
                          nothing="Nothing was enqueued.")
        with _preparing(f, _count(x, f)):
            batches.append(inputs.normalize(x, w, feature_info(layout, f), backend))
    return from_feature_batches(layout, batches, mode)


def _count(x: Any, f: FeatureSpec) -> int:
    """How many ids feature ``f``'s input holds (for the bytes in an allocation error)."""
    if not (hasattr(x, "row_splits") or hasattr(x, "indices")):  # dense: one id per output slot
        return math.prod(f.output_shape)
    try:
        return int(len(x.values))
    except TypeError:  # not sized: the bytes are unknown
        return 0


def _preparing(f: FeatureSpec, n: int) -> Any:
    """``memory.allocating`` for feature ``f``'s prepared host arrays (``n`` ids)."""
    return memory.allocating(f"the prepared batch of feature {f.name!r} (ids, output slots, combiner scales)",
                             (n,), "int64", arrays=3, nothing="Nothing was enqueued.")


def from_feature_batches(layout: Layout, batches: Sequence[inputs.FeatureBatch], mode: str,
                         combiner_override: Sequence[str] | None = None) -> Batch:
    """A :class:`Batch` from already normalised per-feature batches (``me.ops`` builds those
    from TF's op inputs), with each table's combiner factors (``combiner_override``: one
    combiner per table, as the raw ops' ``combiners`` attribute)."""
    if mode not in MODES:
        raise InputError(f"Invalid `mode`. Expected one of {list(MODES)}. Received: mode={mode!r}")
    if len(batches) != len(layout.features):
        raise InputError(f"Expected {len(layout.features)} feature batches. Received: {len(batches)}")
    prepared = []
    for f, b in zip(layout.features, batches):
        combiner = combiner_override[f.table] if combiner_override else layout.tables[f.table].combiner
        with _preparing(f, max(len(b.ids), int(b.num_slots))):  # a mean combiner counts per slot
            if b.unit_weights and combiners.check_combiner(combiner) == "sum":
                scale, unit = b.weights, True  # all ones, known without a scan
            else:
                scale = combiners.combiner_scale(b.slots, b.weights, b.num_slots, combiner)
                unit = combiners.is_unit(scale)
            prepared.append(PreparedFeature(
                ids=_frozen(b.ids), slots=_frozen(b.slots), scale=_frozen(np.asarray(scale, np.float32).reshape(-1)),
                num_slots=int(b.num_slots), unit_scale=bool(unit),
                identity=bool(combiners.is_identity(b.slots, b.num_slots)),
                offsets=None if b.offsets is None else _frozen(b.offsets),
            ))
    return Batch(layout, mode, tuple(prepared))
