"""Input types and host-side normalisation of enqueued ids (what the TPU host does).

Every accepted input form — dense id arrays, :class:`SparseIds` (COO) and :class:`RaggedIds`
(row splits) — is reduced on the host, in NumPy, to one flat :class:`FeatureBatch`:
for each looked-up id its *output slot* (a sample, or a sample × sequence position) and its
weight. The device side then only gathers rows and segment-sums them into slots, the same
for every backend. All validation happens here, before any engine state changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from meshembed.errors import InputError

MODES = ("training", "inference", "backward_pass_only")
_MODE_ALIASES = {
    "train": "training",
    "training": "training",
    "inference": "inference",
    "backward_pass_only": "backward_pass_only",
    "unspecified": None,
    "": None,
}


def parse_mode(mode: Any) -> str | None:
    """Normalise a ``mode_override`` string; ``None`` means "use the configured mode".

    TF documents ``'training'`` but its Python layer sends ``'train'``; both are accepted.
    """
    if mode is None:
        return None
    if isinstance(mode, (bytes, bytearray)):
        mode = bytes(mode).decode("utf-8", errors="replace")  # TF sends bytes; never a raw decode error
    key = str(mode).strip().lower()
    if key not in _MODE_ALIASES:
        raise InputError(
            "Invalid `mode_override`. Expected one of ['train', 'training', 'inference', "
            f"'backward_pass_only', 'unspecified']. Received: mode_override={mode!r}"
        )
    return _MODE_ALIASES[key]


@dataclass(frozen=True)
class SparseIds:
    """COO ids of one feature, like ``tf.SparseTensor``: ``indices [nnz, rank]``,
    ``values [nnz]`` (the ids, or the weights when used as weights), ``dense_shape [rank]``."""

    indices: Any
    values: Any
    dense_shape: Any


@dataclass(frozen=True)
class RaggedIds:
    """Ragged ids of one feature, like a rank-2 ``tf.RaggedTensor``: row ``b`` owns
    ``values[row_splits[b]:row_splits[b+1]]``."""

    row_splits: Any
    values: Any

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[Any]], dtype: Any = np.int64) -> "RaggedIds":
        """Build from Python lists, e.g. ``RaggedIds.from_lists([[1, 2], [], [3]])``."""
        lengths = [len(r) for r in rows]
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = [v for r in rows for v in r]
        return cls(splits, np.asarray(flat, dtype=dtype))


@dataclass(frozen=True)
class FeatureBatch:
    """One feature's lookups, flattened: id ``ids[k]`` with weight ``weights[k]`` contributes
    to output slot ``slots[k]`` (``0 <= slot < num_slots``)."""

    ids: np.ndarray  # int64 [n]
    slots: np.ndarray  # int64 [n]
    weights: np.ndarray  # float32 [n]
    num_slots: int
    unit_weights: bool = False  # no weights were given: every weight is 1 (known without a scan)
    #: int64 [num_slots + 1] where the ids come grouped by slot in slot order (ragged rows):
    #: slot ``s`` owns positions ``offsets[s]:offsets[s + 1]``; None otherwise
    offsets: np.ndarray | None = None


@dataclass(frozen=True)
class FeatureInfo:
    """What normalisation needs to know about a feature (taken from the config)."""

    name: str
    table: str
    vocabulary_size: int
    output_shape: tuple[int, ...]


def _where(info: FeatureInfo) -> str:
    return f"feature {info.name!r} (table {info.table!r})"


def _untraced(x: Any) -> bool:
    return False


def traced_error(what: str) -> InputError:
    """A JAX tracer reached the stateful engine (it runs on the host, outside any trace)."""
    return InputError(
        f"Invalid {what}: it is a JAX tracer (the call is inside `jax.jit`/`jax.grad`/`vmap`). "
        "The stateful `TPUEmbedding` runs eagerly on the host and cannot be traced. Fix: call "
        "it outside the transformed function, or use the functional JAX API `me.jax` "
        "(`me.jax.init` / `prepare` / `lookup` / `apply_gradients`), which is jit-able."
    )


def to_host(x: Any, backend: Any = None, what: str = "input") -> np.ndarray:
    """A NumPy view of user data (NumPy, lists, or any backend's arrays).

    May alias the caller's buffer: callers that keep the result copy it."""
    if backend is not None and getattr(backend, "is_traced", _untraced)(x):
        raise traced_error(what)
    try:
        if backend is not None and not isinstance(x, np.ndarray) and backend.is_native(x):
            return np.asarray(backend.to_numpy(x))
        if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor given to another backend
            return x.detach().cpu().numpy()
        return np.asarray(x)
    except Exception as exc:  # e.g. a JAX tracer given to a non-JAX engine, a ragged list
        if type(x).__name__.endswith("Tracer") or "Tracer" in type(exc).__name__:
            raise traced_error(what) from None
        raise InputError(
            f"Invalid {what}: cannot read it as an array ({type(x).__name__}: {exc}). Fix: pass "
            "a NumPy array, a backend array or a (rectangular) nested list of numbers."
        ) from None


def int_array(x: Any, what: str, info: FeatureInfo, backend: Any, ndim: int | None = None) -> np.ndarray:
    """A private int64 copy: what was validated is what the engine uses, even if the caller
    refills its buffer after enqueue (a prefetching loader does)."""
    arr = to_host(x, backend, f"`{what}` for {_where(info)}")
    if arr.size == 0 and arr.dtype.kind not in "iu":
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise InputError(
            f"Invalid `{what}` for {_where(info)}: expected an integer array. "
            f"Received: dtype={arr.dtype}. Fix: cast the ids to int32 or int64."
        )
    if ndim is not None and arr.ndim != ndim:
        raise InputError(
            f"Invalid `{what}` for {_where(info)}: expected rank {ndim}. Received: shape={arr.shape}"
        )
    return np.array(arr, dtype=np.int64)  # always a copy, never a view of the caller's buffer


def _float_weights(x: Any, n: int, info: FeatureInfo, backend: Any) -> np.ndarray:
    """A private float32 copy of the weights (``astype`` copies)."""
    arr = to_host(x, backend, f"`weights` for {_where(info)}")
    if arr.dtype.kind not in "fiu":
        raise InputError(
            f"Invalid `weights` for {_where(info)}: expected a float array. Received: dtype={arr.dtype}"
        )
    with np.errstate(over="ignore"):  # 1e39 becomes inf in float32: refused just below
        arr = arr.reshape(-1).astype(np.float32)
    if arr.shape[0] != n:
        raise InputError(
            f"Invalid `weights` for {_where(info)}: expected one weight per id ({n}). "
            f"Received: {arr.shape[0]} weights"
        )
    if not np.all(np.isfinite(arr)):
        k = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise InputError(
            f"Invalid `weights` for {_where(info)}: weights must be finite. "
            f"Received: weight={arr[k]} at position {k}"
        )
    return arr


def check_ids(ids: np.ndarray, info: FeatureInfo) -> None:
    """Every id must address a row: ``0 <= id < vocabulary_size``."""
    if ids.size == 0:
        return
    # The common, valid case in one reduction and no temporary: as unsigned, a negative id
    # is larger than any vocabulary size.
    if ids.dtype == np.int64 and int(ids.view(np.uint64).max()) < info.vocabulary_size:
        return
    bad = (ids < 0) | (ids >= info.vocabulary_size)
    if np.any(bad):
        k = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"Invalid ids for {_where(info)}: expected every id in [0, {info.vocabulary_size}). "
            f"Received: id={int(ids[k])} at position {k}. Fix: map out-of-vocabulary ids to a "
            "valid row (e.g. hash or clip them) or enlarge `vocabulary_size`."
        )


def make_batch(ids: np.ndarray, slots: np.ndarray, weights: np.ndarray | None, info: FeatureInfo,
               *, slots_in_range: bool = False, offsets: np.ndarray | None = None) -> FeatureBatch:
    """Validate flat ids/slots/weights and pack them (the form every input reduces to).

    ``slots_in_range``: the caller built ``slots`` inside ``[0, prod(output_shape))`` by
    construction, so the scan that checks it is skipped. ``offsets``: the checked row splits
    ``slots`` was built from (:attr:`FeatureBatch.offsets`)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    slots = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
    check_ids(ids, info)
    num_slots = int(np.prod(info.output_shape))
    if slots.size and not slots_in_range and (slots.min() < 0 or slots.max() >= num_slots):
        k = int(np.flatnonzero((slots < 0) | (slots >= num_slots))[0])
        raise InputError(
            f"Invalid sample indices for {_where(info)}: expected each in [0, {num_slots}) for "
            f"output shape {info.output_shape}. Received: {int(slots[k])} at position {k}"
        )
    if weights is None:
        return FeatureBatch(ids, slots, np.ones(ids.shape[0], dtype=np.float32), num_slots, unit_weights=True,
                            offsets=offsets)
    return FeatureBatch(ids, slots, np.ascontiguousarray(weights, dtype=np.float32), num_slots, offsets=offsets)


# -- the three input forms ---------------------------------------------------------------

def from_dense(x: Any, weights: Any, info: FeatureInfo, backend: Any = None) -> FeatureBatch:
    """Dense ids: exactly one id per output slot, weight 1 (shape ``S`` or ``S + [1]``)."""
    arr = int_array(x, "ids", info, backend)
    shape = info.output_shape
    if tuple(arr.shape) not in (shape, shape + (1,)):
        raise InputError(
            f"Invalid dense ids for {_where(info)}: expected shape {shape} (or {shape + (1,)}). "
            f"Received: shape={tuple(arr.shape)}. Fix: pass multi-hot ids as "
            "`me.SparseIds` or `me.RaggedIds`, or fix the feature's `input_shape`."
        )
    if weights is not None:
        raise InputError(
            f"Invalid `weights` for {_where(info)}: weights are not allowed with dense ids "
            "(each slot holds one id). Fix: pass `None`, or use `me.SparseIds`/`me.RaggedIds`."
        )
    flat = arr.reshape(-1)
    return make_batch(flat, np.arange(flat.shape[0]), None, info)


def from_sparse(sp: Any, weights: Any, info: FeatureInfo, backend: Any = None) -> FeatureBatch:
    """COO ids (``SparseIds`` or anything with ``indices``/``values``/``dense_shape``)."""
    indices = int_array(sp.indices, "indices", info, backend)
    ids = int_array(sp.values, "values", info, backend).reshape(-1)
    dense_shape = int_array(sp.dense_shape, "dense_shape", info, backend).reshape(-1)
    if indices.ndim != 2 and indices.size == 0:
        indices = indices.reshape(0, dense_shape.shape[0])
    w = None
    if weights is not None:
        if hasattr(weights, "indices"):
            widx = to_host(weights.indices, backend)
            if widx.shape != indices.shape or not np.array_equal(widx, indices):
                raise InputError(
                    f"Invalid `weights` for {_where(info)}: the weights' indices must equal the ids' indices."
                )
            weights = weights.values
        w = _float_weights(weights, ids.shape[0], info, backend)
    return from_coo(indices, ids, w, info, dense_shape)


def from_coo(
    indices: np.ndarray, ids: np.ndarray, weights: np.ndarray | None, info: FeatureInfo,
    dense_shape: np.ndarray | None = None,
) -> FeatureBatch:
    """COO ids. Index rank ``len(S)+1`` combines the last axis into each slot; rank ``len(S)``
    with ``len(S) >= 2`` is a sequence: the last axis is the position, cut at ``S[-1]``."""
    shape = info.output_shape
    if indices.ndim != 2:
        raise InputError(
            f"Invalid sparse `indices` for {_where(info)}: expected shape [nnz, rank]. "
            f"Received: shape={indices.shape}"
        )
    nnz, rank = indices.shape
    if ids.shape[0] != nnz:
        raise InputError(f"Invalid sparse ids for {_where(info)}: {nnz} indices but {ids.shape[0]} values.")
    if rank == len(shape) + 1:
        lead_dims, sequence = len(shape), False
    elif rank == len(shape) and rank >= 2:
        lead_dims, sequence = rank - 1, True
    elif rank == len(shape) == 1:
        lead_dims, sequence = 1, False
    else:
        raise InputError(
            f"Invalid sparse ids for {_where(info)}: index rank {rank} does not fit output shape "
            f"{shape}. Expected rank {len(shape) + 1} (combine the last axis) or rank "
            f"{len(shape)} (a sequence feature)."
        )
    bound = np.asarray(shape[:lead_dims] + (np.iinfo(np.int64).max,) * (rank - lead_dims))
    if dense_shape is not None:
        if dense_shape.shape[0] != rank:
            raise InputError(
                f"Invalid sparse ids for {_where(info)}: `dense_shape` has rank {dense_shape.shape[0]} "
                f"but `indices` has rank {rank}."
            )
        if tuple(dense_shape[:lead_dims].tolist()) != shape[:lead_dims]:
            raise InputError(
                f"Invalid sparse ids for {_where(info)}: expected leading dense_shape "
                f"{list(shape[:lead_dims])}. Received: dense_shape={dense_shape.tolist()}. Fix: the "
                "batch size must match the feature's `input_shape`."
            )
        bound = dense_shape
    if nnz and (np.any(indices < 0) or np.any(indices >= bound)):
        k = int(np.flatnonzero(np.any((indices < 0) | (indices >= bound), axis=1))[0])
        raise InputError(
            f"Invalid sparse ids for {_where(info)}: index {indices[k].tolist()} is outside the "
            f"shape {list(shape[:lead_dims])} (+ the id axis)."
        )
    keep = indices[:, -1] < shape[-1] if sequence else np.ones(nnz, dtype=bool)
    sel = indices[keep]
    if not sel.size:
        slots = np.zeros(0, np.int64)
    elif sequence:
        slots = np.ravel_multi_index(tuple(sel.T), shape)
    else:
        slots = np.ravel_multi_index(tuple(sel[:, :lead_dims].T), shape[:lead_dims])
    return make_batch(ids[keep], slots, None if weights is None else weights[keep], info)


def check_row_splits(splits: np.ndarray, num_values: int, info: FeatureInfo) -> None:
    if splits.shape[0] < 1 or splits[0] != 0:
        raise InputError(f"Invalid `row_splits` for {_where(info)}: must start with 0. Received: {splits[:4].tolist()}...")
    steps = np.diff(splits)
    if np.any(steps < 0):
        k = int(np.flatnonzero(steps < 0)[0])
        raise InputError(
            f"Invalid `row_splits` for {_where(info)}: must be non-decreasing. "
            f"Received: row_splits[{k}]={int(splits[k])} > row_splits[{k + 1}]={int(splits[k + 1])}"
        )
    if splits[-1] != num_values:
        raise InputError(
            f"Invalid `row_splits` for {_where(info)}: the last split must equal the number of "
            f"values ({num_values}). Received: {int(splits[-1])}"
        )


def from_ragged(rg: Any, weights: Any, info: FeatureInfo, backend: Any = None) -> FeatureBatch:
    """Ragged ids. ``prod(S) == rows``: combine each row; ``prod(S) == rows*M``: a sequence,
    position ``p`` of row ``b`` goes to slot ``b*M + p`` and positions ``>= M`` are dropped."""
    splits = int_array(rg.row_splits, "row_splits", info, backend, ndim=1)
    ids = int_array(rg.values, "values", info, backend).reshape(-1)
    check_row_splits(splits, ids.shape[0], info)
    nrows = splits.shape[0] - 1
    num_slots = int(np.prod(info.output_shape))
    row = np.repeat(np.arange(nrows, dtype=np.int64), np.diff(splits))
    if num_slots == nrows:
        keep = None  # every id is kept: a plain copy, not a boolean mask
        slots = row
    elif nrows and num_slots % nrows == 0 and len(info.output_shape) >= 2 and info.output_shape[0] == nrows:
        m = num_slots // nrows
        pos = np.arange(ids.shape[0], dtype=np.int64) - splits[row]
        keep = pos < m
        slots = (row * m + pos)[keep]
    else:
        raise InputError(
            f"Invalid ragged ids for {_where(info)}: {nrows} rows do not fit output shape "
            f"{info.output_shape}. Fix: the number of rows must equal the batch size "
            f"{info.output_shape[0]}."
        )
    w = None
    if weights is not None:
        if hasattr(weights, "row_splits"):
            wsplits = to_host(weights.row_splits, backend)
            if wsplits.shape != splits.shape or not np.array_equal(wsplits, splits):
                raise InputError(
                    f"Invalid `weights` for {_where(info)}: the weights' row_splits must equal the ids' row_splits."
                )
            weights = weights.values
        w = _float_weights(weights, ids.shape[0], info, backend)  # a fresh array
        w = w if keep is None else w[keep]
    # ids is already a private copy (int_array). The slots are row numbers (or
    # row * M + position < M) of the checked splits: in range by construction; with one slot
    # per row the splits are the slots' offsets.
    return make_batch(ids if keep is None else ids[keep], slots, w, info, slots_in_range=True,
                      offsets=splits if keep is None else None)


def normalize(x: Any, weights: Any, info: FeatureInfo, backend: Any = None) -> FeatureBatch:
    """Any accepted input form → :class:`FeatureBatch` (duck-types tf.SparseTensor/RaggedTensor)."""
    if x is None:
        raise InputError(f"Missing input for {_where(info)}: every feature needs ids at enqueue.")
    if isinstance(x, SparseIds) or all(hasattr(x, a) for a in ("indices", "values", "dense_shape")):
        return from_sparse(x, weights, info, backend)
    if isinstance(x, RaggedIds) or all(hasattr(x, a) for a in ("row_splits", "values")):
        return from_ragged(x, weights, info, backend)
    return from_dense(x, weights, info, backend)
