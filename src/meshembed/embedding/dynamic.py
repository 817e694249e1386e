"""Dynamic vocabularies: raw int64 keys mapped to table rows on the host, reproducibly.

A table with ``TableConfig(..., dynamic=DynamicVocabulary(...))`` takes arbitrary 64-bit keys
as its feature ids. Its ``vocabulary_size`` rows are a *capacity*: each key that is admitted
gets a row, keeps it while it is resident and loses it when it is evicted. The mapping is a
host step between ``batch.prepare`` and the lookup (:func:`map_batch`): the :class:`Batch`
the step functions see carries row ids, so ``step.lookup`` / ``step.apply_gradients`` and
every backend are unchanged.

Every decision is a pure function of the keys, the step counter and the seeds — never a
clock, a thread schedule, free memory or the shard count:

* ``assign(state, keys, step) -> (rows, new_state, rows_to_reinit)`` is the whole policy
  (admission, counters, eviction, row choice); ``rows[k] == -1`` means key ``k`` is not
  admitted (it reads zeros and gets no update: :func:`map_batch` drops it from the batch,
  keeping the combiner weights of the ids that stay, so a mean over a missing key divides
  by the count *with* it, as a zero row would).
* Hashes are splitmix64 finalisers over (seed, key, ...) — counter-based, so no global RNG
  and no order dependence.
* A row (re)assigned to a key is re-initialised from the table's initializer seeded by
  (engine seed, table index, key) (:func:`keyed_initial_values`): a key re-admitted after
  an eviction restarts from exactly the values of its first admission, on every backend.

The state (:class:`DynamicVocabularyState`) is row-indexed host data — ``row_key``,
``used``, ``count``, ``last_seen`` (+ a count-min sketch for :class:`AfterOccurrences`, and
statistics) — saved in checkpoints as arrays; the key → row index is derived from it (an
open-addressing hash table by default, or a sorted key array: ``index="sorted"``) and
rebuilt on restore. See docs/dynamic_vocab.md for the exact semantics and the measurements
behind the default index.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from meshembed.config.common import as_int
from meshembed.errors import CheckpointError, ConfigError, InputError

__all__ = [
    "DynamicVocabulary", "Always", "AfterOccurrences", "Probability", "LRU", "LFU", "TTL", "NormBelow",
    "DynamicVocabularyState", "new_state", "assign", "norms_due", "keyed_initial_values", "key_layout",
    "map_batch", "dynamic_tables", "refuse", "spec_to_json", "spec_from_json", "STATE_ARRAYS",
]

KEY_SPACE = 1 << 64  # the "vocabulary" of a dynamic table's keys: every int64 value


# ------------------------------------------------------------------------------------ hashing
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _u64(v: int) -> np.ndarray:
    """A Python int (any sign) as a 1-element uint64 array (two's complement, mod 2**64)."""
    return np.array([int(v) % KEY_SPACE], dtype=np.uint64)


def _as_u64(keys: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)


def hash_keys(keys: np.ndarray, *salts: int) -> np.ndarray:
    """uint64 hash of each int64 key under ``salts`` (seed, step, ...): counter-based."""
    h = mix64(_u64(0x6D65736865))  # "meshe": the stream's own constant
    for s in salts:
        h = mix64(h ^ mix64(_u64(s) + _GOLDEN))
    return mix64(_as_u64(keys) ^ h)


def uniform(keys: np.ndarray, *salts: int) -> np.ndarray:
    """A float64 in [0, 1) per key, from :func:`hash_keys` (53 bits)."""
    return (hash_keys(keys, *salts) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# ------------------------------------------------------------------------------------ the spec
def _int(name: str, value: Any, minimum: int, where: str = "DynamicVocabulary") -> int:
    return as_int(name, value, where, minimum=minimum, maximum=None)


def _float(name: str, value: Any, lo: float, hi: float, where: str, lo_open: bool = False) -> float:
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    ok = math.isfinite(out) and (out > lo if lo_open else out >= lo) and out <= hi
    if not ok:
        bound = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ConfigError(f"Invalid `{name}` for {where}. Expected a number in {bound}. Received: {name}={value!r}")
    return out


@dataclass(frozen=True)
class Always:
    """Admission: a key gets a row the first time a training batch holds it."""


@dataclass(frozen=True)
class AfterOccurrences:
    """Admission: a key gets a row in the training batch in which it reaches ``count``
    occurrences (every position of every training batch counts, weights ignored).

    Occurrences of keys without a row are counted in a count-min sketch of
    ``sketch_depth`` rows of ``sketch_width`` counters (default: the next power of two >=
    the capacity), hashed with ``seed``: bounded memory, never below the true count (a
    collision can only admit a key early). ``halve_every`` > 0 halves every counter at the
    first training batch of each step that is a multiple of it, so old occurrences fade."""

    count: int
    sketch_width: int | None = None
    sketch_depth: int = 4
    halve_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        w = "AfterOccurrences"
        object.__setattr__(self, "count", _int("count", self.count, 1, w))
        if self.sketch_width is not None:
            object.__setattr__(self, "sketch_width", _int("sketch_width", self.sketch_width, 1, w))
        object.__setattr__(self, "sketch_depth", _int("sketch_depth", self.sketch_depth, 1, w))
        object.__setattr__(self, "halve_every", _int("halve_every", self.halve_every, 0, w))
        object.__setattr__(self, "seed", _int("seed", self.seed, 0, w))


@dataclass(frozen=True)
class Probability:
    """Admission: in each training batch (step ``s``) holding a key without a row, the key
    is admitted when ``uniform(seed, key, s) < p`` — a counter-based hash, never a global
    RNG, so the decision depends on nothing but (seed, key, step)."""

    p: float
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _float("p", self.p, 0.0, 1.0, "Probability", lo_open=True))
        object.__setattr__(self, "seed", _int("seed", self.seed, 0, "Probability"))


@dataclass(frozen=True)
class LRU:
    """Eviction under pressure: the resident key with the oldest ``last_seen`` step goes
    first (ties: the lower ``count``, then the lower row)."""


@dataclass(frozen=True)
class LFU:
    """Eviction under pressure: the resident key with the lowest ``count`` (occurrences
    since its admission) goes first (ties: the older ``last_seen``, then the lower row)."""


@dataclass(frozen=True)
class TTL:
    """Expiry: at a training batch of step ``s``, a resident key with ``s - last_seen >
    steps`` is evicted (its row freed) before the batch's keys are looked up."""

    steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", _int("steps", self.steps, 0, "TTL"))


@dataclass(frozen=True)
class NormBelow:
    """Expiry: at a training batch of a step ``s`` with ``s % every == 0``, a resident key
    whose row's L2 norm (float64 over the float32 row) is below ``threshold`` is evicted.
    Keys already seen at step ``s`` are kept."""

    threshold: float
    every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", _float("threshold", self.threshold, 0.0, sys.float_info.max, "NormBelow"))
        object.__setattr__(self, "every", _int("every", self.every, 1, "NormBelow"))


ADMISSIONS = (Always, AfterOccurrences, Probability)
EVICTIONS = (LRU, LFU, TTL, NormBelow)
INDEXES = ("hash", "sorted")


@dataclass(frozen=True)
class DynamicVocabulary:
    """A table whose feature ids are arbitrary int64 keys (``TableConfig(dynamic=...)``).

    Args:
      capacity: rows of the table (= its ``vocabulary_size``; None: the table's).
      admission: :class:`Always` (default), :class:`AfterOccurrences` or :class:`Probability`.
      eviction: one policy or a tuple: at most one pressure order (:class:`LRU` — the
        default — or :class:`LFU`) and the expiries :class:`TTL` and :class:`NormBelow`.
        Without a pressure order, a new key finding no free row is not admitted.
      index: the host key → row structure: ``"hash"`` (open addressing, default) or
        ``"sorted"`` (a sorted key array); both give the same rows (docs/dynamic_vocab.md).

    Everything is driven by the engine's step counter (gradient steps applied), never a
    clock; inference batches read the vocabulary without changing it."""

    capacity: int | None = None
    admission: Any = field(default_factory=Always)
    eviction: Any = field(default_factory=LRU)
    index: str = "hash"

    def __post_init__(self) -> None:
        if self.capacity is not None:
            object.__setattr__(self, "capacity", _int("capacity", self.capacity, 1))
        if not isinstance(self.admission, ADMISSIONS):
            raise ConfigError(
                "Invalid `admission` for DynamicVocabulary. Expected one of me.embedding.Always(), "
                f"AfterOccurrences(count), Probability(p). Received: admission={self.admission!r}")
        ev = self.eviction
        policies = tuple(ev) if isinstance(ev, (tuple, list)) else (ev,)
        bad = [p for p in policies if not isinstance(p, EVICTIONS)]
        if bad or not policies:
            raise ConfigError(
                "Invalid `eviction` for DynamicVocabulary. Expected one of me.embedding.LRU(), LFU(), "
                f"TTL(steps), NormBelow(threshold) or a tuple of them. Received: eviction={ev!r}")
        kinds = [type(p) for p in policies]
        if sum(k in (LRU, LFU) for k in kinds) > 1 or kinds.count(TTL) > 1 or kinds.count(NormBelow) > 1:
            raise ConfigError(
                "Invalid `eviction` for DynamicVocabulary. Expected at most one of LRU()/LFU() (the order "
                f"under pressure), one TTL and one NormBelow. Received: eviction={ev!r}")
        object.__setattr__(self, "eviction", policies[0] if len(policies) == 1 else policies)
        if self.index not in INDEXES:
            raise ConfigError(f"Invalid `index` for DynamicVocabulary. Expected one of {list(INDEXES)}. "
                              f"Received: index={self.index!r}")

    @property
    def policies(self) -> tuple[Any, ...]:
        ev = self.eviction
        return tuple(ev) if isinstance(ev, tuple) else (ev,)

    def policy(self, kind: type) -> Any:
        for p in self.policies:
            if isinstance(p, kind):
                return p
        return None

    @property
    def order(self) -> Any:
        """The pressure order (LRU or LFU), or None."""
        return self.policy(LRU) or self.policy(LFU)

    def replace(self, **changes: Any) -> "DynamicVocabulary":
        return dataclasses.replace(self, **changes)


def spec_to_json(spec: DynamicVocabulary) -> dict:
    """The spec as JSON data (the checkpoint manifest keeps it: config.pb has no place for it)."""
    def one(p: Any) -> dict:
        return {"kind": type(p).__name__, **dataclasses.asdict(p)}
    return {"capacity": spec.capacity, "admission": one(spec.admission),
            "eviction": [one(p) for p in spec.policies], "index": spec.index}


def spec_from_json(data: Any) -> DynamicVocabulary:
    """Inverse of :func:`spec_to_json`; ConfigError for anything else."""
    kinds = {c.__name__: c for c in (*ADMISSIONS, *EVICTIONS)}

    def one(d: Any) -> Any:
        if not isinstance(d, dict) or d.get("kind") not in kinds:
            raise ConfigError(f"Invalid dynamic vocabulary policy {d!r}")
        cls = kinds[d["kind"]]
        args = {k: v for k, v in d.items() if k != "kind"}
        if set(args) != {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(f"Invalid dynamic vocabulary policy {d!r}: expected the fields of {cls.__name__}")
        return cls(**args)

    if not isinstance(data, dict) or set(data) != {"capacity", "admission", "eviction", "index"}:
        raise ConfigError(f"Invalid dynamic vocabulary spec {data!r}")
    ev = data["eviction"]
    if not isinstance(ev, list) or not ev:
        raise ConfigError(f"Invalid dynamic vocabulary spec {data!r}: `eviction` must be a non-empty list")
    policies = tuple(one(p) for p in ev)
    return DynamicVocabulary(capacity=data["capacity"], admission=one(data["admission"]),
                             eviction=policies if len(policies) > 1 else policies[0], index=data["index"])


# ------------------------------------------------------------------------------------ key -> row index
class HashIndex:
    """Open addressing, linear probing, over a power-of-two number of slots (>= 2 x
    capacity: load <= 1/2). ``slot_row`` is -1 (empty), -2 (tombstone) or the key's row;
    lookups and inserts run in vectorised probe rounds (one NumPy pass per probe distance).
    Removing leaves a tombstone; when tombstones and keys fill 3/4 of the slots the index is
    rebuilt. The layout depends on the insertion order, the rows it returns never do."""

    kind = "hash"

    def __init__(self, capacity: int, salt: int = 0) -> None:
        self.capacity = int(capacity)
        self.bits = max(4, int(math.ceil(math.log2(max(2, 2 * self.capacity)))))
        self.size = 1 << self.bits
        self.salt = int(salt)
        self.slot_key = np.zeros(self.size, dtype=np.int64)
        self.slot_row = np.full(self.size, -1, dtype=np.int32)
        self.live = 0
        self.tombstones = 0

    def copy(self) -> "HashIndex":
        new = object.__new__(HashIndex)
        new.__dict__.update(self.__dict__)
        new.slot_key = self.slot_key.copy()
        new.slot_row = self.slot_row.copy()
        return new

    @property
    def nbytes(self) -> int:
        return int(self.slot_key.nbytes + self.slot_row.nbytes)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (hash_keys(keys, self.salt) >> np.uint64(64 - self.bits)).astype(np.int64)

    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row or -1, slot or -1) of each key."""
        n = keys.shape[0]
        rows = np.full(n, -1, dtype=np.int64)
        slots = np.full(n, -1, dtype=np.int64)
        pos = self._home(keys)
        active = np.arange(n)
        mask = self.size - 1
        while active.size:
            p = pos[active]
            r = self.slot_row[p]
            hit = (r >= 0) & (self.slot_key[p] == keys[active])
            rows[active[hit]] = r[hit]
            slots[active[hit]] = p[hit]
            go = ~(hit | (r == -1))
            active = active[go]
            pos[active] = (p[go] + 1) & mask
        return rows, slots

    def find(self, keys: np.ndarray) -> np.ndarray:
        return self._probe(keys)[0]

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Insert distinct keys that are not in the index (``rows`` distinct too)."""
        if self.live + self.tombstones + keys.shape[0] > (3 * self.size) // 4:
            self._rebuild()
        rows = np.asarray(rows, dtype=np.int32)
        pos = self._home(keys)
        active = np.arange(keys.shape[0])
        mask = self.size - 1
        while active.size:
            p = pos[active]
            r = self.slot_row[p]
            free = r < 0
            cand, cp = active[free], p[free]
            if cand.size:
                # Several keys may reach one free slot in a round: all write their row, the one
                # whose row stays there wins (no sort), the others probe on.
                tomb = r[free] == -2
                self.slot_row[cp] = rows[cand]
                win = self.slot_row[cp] == rows[cand]
                self.slot_key[cp[win]] = keys[cand[win]]
                self.tombstones -= int(np.count_nonzero(tomb & win))
                placed = np.zeros(keys.shape[0], dtype=bool)
                placed[cand[win]] = True
                keep = ~placed[active]
            else:
                keep = np.ones(active.shape[0], dtype=bool)
            active = active[keep]
            pos[active] = (p[keep] + 1) & mask
        self.live += int(keys.shape[0])

    def remove(self, keys: np.ndarray) -> None:
        """Remove keys that are in the index."""
        _, slots = self._probe(keys)
        slots = slots[slots >= 0]
        self.slot_row[slots] = -2
        self.live -= int(slots.shape[0])
        self.tombstones += int(slots.shape[0])

    def _rebuild(self) -> None:
        live = self.slot_row >= 0
        keys, rows = self.slot_key[live], self.slot_row[live]
        order = np.argsort(rows, kind="stable")  # a canonical insertion order
        self.slot_key = np.zeros(self.size, dtype=np.int64)
        self.slot_row = np.full(self.size, -1, dtype=np.int32)
        self.live = self.tombstones = 0
        if keys.size:
            self.insert(keys[order], rows[order])


class SortedIndex:
    """The resident keys sorted, with their rows: ``searchsorted`` lookups, merges on
    insert and masks on remove (every change rewrites the arrays: O(keys) per step)."""

    kind = "sorted"

    def __init__(self, capacity: int, salt: int = 0) -> None:
        self.capacity = int(capacity)
        self.keys = np.zeros(0, dtype=np.int64)
        self.rows = np.zeros(0, dtype=np.int32)

    def copy(self) -> "SortedIndex":
        new = object.__new__(SortedIndex)
        new.__dict__.update(self.__dict__)  # arrays are never written in place: shared
        return new

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.rows.nbytes)

    def find(self, keys: np.ndarray) -> np.ndarray:
        m = self.keys.shape[0]
        if m == 0:
            return np.full(keys.shape[0], -1, dtype=np.int64)
        i = np.searchsorted(self.keys, keys)
        j = np.minimum(i, m - 1)
        hit = (i < m) & (self.keys[j] == keys)
        return np.where(hit, self.rows[j].astype(np.int64), -1)

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")
        k, r = keys[order], rows[order].astype(np.int32)
        at = np.searchsorted(self.keys, k)
        self.keys = np.insert(self.keys, at, k)
        self.rows = np.insert(self.rows, at, r)

    def remove(self, keys: np.ndarray) -> None:
        if keys.size == 0:
            return
        at = np.searchsorted(self.keys, keys)
        keep = np.ones(self.keys.shape[0], dtype=bool)
        keep[at] = False
        self.keys = self.keys[keep]
        self.rows = self.rows[keep]


def _make_index(kind: str, capacity: int, row_key: np.ndarray, used: np.ndarray) -> Any:
    index = (HashIndex if kind == "hash" else SortedIndex)(capacity)
    rows = np.flatnonzero(used)
    if rows.size:
        index.insert(row_key[rows], rows)
    return index


# ------------------------------------------------------------------------------------ the state
#: the arrays a checkpoint keeps per dynamic table (``sketch`` only with AfterOccurrences)
STATE_ARRAYS = ("row_key", "used", "count", "last_seen", "sketch", "scalars")
#: the scalars, in the order of the ``scalars`` array
SCALARS = ("sketch_halved_at", "lookups", "hits", "admitted", "evicted", "rejected")


@dataclass(eq=False)
class DynamicVocabularyState:
    """One dynamic table's vocabulary: plain host data, indexed by row.

    ``row_key[r]`` is the key of row ``r`` where ``used[r]``; ``count[r]`` its occurrences
    in training batches since it was admitted; ``last_seen[r]`` the step of its last
    training batch. ``sketch``: AfterOccurrences' counters (uint32 [depth, width]) or None.
    ``stats``: ``lookups`` (training occurrences), ``hits`` (occurrences whose key had a row
    before the batch), ``admitted``/``evicted`` (keys), ``rejected`` (occurrences left without
    a row). ``index`` is derived (rebuilt from ``row_key``/``used``)."""

    spec: DynamicVocabulary
    capacity: int
    row_key: np.ndarray
    used: np.ndarray
    count: np.ndarray
    last_seen: np.ndarray
    sketch: np.ndarray | None
    stats: dict[str, int]
    index: Any = field(repr=False)

    def copy(self) -> "DynamicVocabularyState":
        return DynamicVocabularyState(
            self.spec, self.capacity, self.row_key.copy(), self.used.copy(), self.count.copy(),
            self.last_seen.copy(), None if self.sketch is None else self.sketch.copy(), dict(self.stats),
            self.index.copy())

    # -- views ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Keys holding a row."""
        return int(np.count_nonzero(self.used))

    def rows_of(self, keys: Any) -> np.ndarray:
        """The row of each key, -1 for a key without one (reads only)."""
        return self.index.find(np.ascontiguousarray(np.asarray(keys, dtype=np.int64).reshape(-1)))

    def resident(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of every resident key, keys ascending (the order of ``export``)."""
        rows = np.flatnonzero(self.used)
        keys = self.row_key[rows]
        order = np.argsort(keys, kind="stable")
        return keys[order], rows[order]

    @property
    def hit_rate(self) -> float:
        n = self.stats["lookups"]
        return self.stats["hits"] / n if n else 0.0

    @property
    def nbytes(self) -> int:
        """Host bytes of the state and its index (what memory per key is measured from)."""
        arrays = (self.row_key, self.used, self.count, self.last_seen) + (() if self.sketch is None else (self.sketch,))
        return int(sum(a.nbytes for a in arrays) + self.index.nbytes)

    # -- checkpoints ---------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {"row_key": self.row_key, "used": self.used.astype(np.uint8), "count": self.count,
               "last_seen": self.last_seen,
               "scalars": np.array([self.stats[k] for k in SCALARS], dtype=np.int64)}
        if self.sketch is not None:
            out["sketch"] = self.sketch
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    @classmethod
    def from_arrays(cls, spec: DynamicVocabulary, capacity: int, arrays: Mapping[str, np.ndarray]
                    ) -> "DynamicVocabularyState":
        """The state of :meth:`to_arrays`, every invariant checked (ValueError naming the array)."""
        want = state_shapes(spec, capacity)
        if set(arrays) != set(want):
            raise ValueError(f"expected arrays {sorted(want)}, found {sorted(arrays)}")
        for name, (shape, dtype) in want.items():
            a = arrays[name]
            if a.dtype != dtype or a.shape != shape:
                raise ValueError(f"array {name!r} has dtype {a.dtype} and shape {a.shape}; expected "
                                 f"{np.dtype(dtype)} {shape}")
        used = arrays["used"]
        if np.any(used > 1):
            raise ValueError("array 'used' holds values other than 0 and 1")
        used = used.astype(bool)
        keys = arrays["row_key"][used]
        if np.unique(keys).shape[0] != keys.shape[0]:
            raise ValueError("array 'row_key' gives one key two rows")
        count, last_seen, scalars = arrays["count"], arrays["last_seen"], arrays["scalars"]
        if np.any(count < 0) or np.any(last_seen < 0) or np.any(scalars < 0):
            raise ValueError("a counter, a step or a statistic is negative")
        if np.any(arrays["row_key"][~used] != 0) or np.any(count[~used] != 0) or np.any(last_seen[~used] != 0):
            raise ValueError("a free row holds a key, a count or a step (free rows hold zeros)")
        row_key = np.array(arrays["row_key"], dtype=np.int64)
        return cls(spec, capacity, row_key, used, np.array(count, dtype=np.int64),
                   np.array(last_seen, dtype=np.int64),
                   np.array(arrays["sketch"], dtype=np.uint32) if "sketch" in want else None,
                   dict(zip(SCALARS, (int(v) for v in scalars))),
                   _make_index(spec.index, capacity, row_key, used))

    def equal(self, other: "DynamicVocabularyState") -> bool:
        """Same vocabulary, counters, sketch and statistics (the index is derived)."""
        a, b = self.to_arrays(), other.to_arrays()
        return self.spec == other.spec and set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _sketch_shape(spec: DynamicVocabulary, capacity: int) -> tuple[int, int] | None:
    adm = spec.admission
    if not isinstance(adm, AfterOccurrences):
        return None
    width = adm.sketch_width or (1 << max(4, int(math.ceil(math.log2(max(2, capacity))))))
    return adm.sketch_depth, width


def state_shapes(spec: DynamicVocabulary, capacity: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{array: (shape, dtype)}`` of :meth:`DynamicVocabularyState.to_arrays`."""
    out = {"row_key": ((capacity,), np.dtype(np.int64)), "used": ((capacity,), np.dtype(np.uint8)),
           "count": ((capacity,), np.dtype(np.int64)), "last_seen": ((capacity,), np.dtype(np.int64)),
           "scalars": ((len(SCALARS),), np.dtype(np.int64))}
    sketch = _sketch_shape(spec, capacity)
    if sketch is not None:
        out["sketch"] = (sketch, np.dtype(np.uint32))
    return out


def new_state(spec: DynamicVocabulary, capacity: int | None = None) -> DynamicVocabularyState:
    """An empty vocabulary of ``capacity`` rows (default: the spec's)."""
    capacity = spec.capacity if capacity is None else int(capacity)
    if capacity is None or capacity < 1:
        raise ConfigError("Invalid `capacity` for DynamicVocabulary. Expected an integer >= 1 (or a table's "
                          f"vocabulary_size). Received: capacity={capacity!r}")
    shape = _sketch_shape(spec, capacity)
    return DynamicVocabularyState(
        spec, capacity, np.zeros(capacity, np.int64), np.zeros(capacity, bool), np.zeros(capacity, np.int64),
        np.zeros(capacity, np.int64), None if shape is None else np.zeros(shape, np.uint32),
        {k: 0 for k in SCALARS}, _make_index(spec.index, capacity, np.zeros(0, np.int64), np.zeros(0, bool)))


# ------------------------------------------------------------------------------------ assign
def norms_due(state: DynamicVocabularyState, step: int) -> bool:
    """Whether :func:`assign` at ``step`` needs the rows' L2 norms (NormBelow's check)."""
    p = state.spec.policy(NormBelow)
    return p is not None and int(step) % p.every == 0 and bool(state.used.any())


def _sketch_buckets(spec: DynamicVocabulary, shape: tuple[int, int], keys: np.ndarray) -> np.ndarray:
    depth, width = shape
    seed = spec.admission.seed
    return np.stack([(hash_keys(keys, seed, 0x736B65746368, d) % np.uint64(width)).astype(np.int64)
                     for d in range(depth)])


def _kth_smallest(vals: np.ndarray, k: int) -> int:
    """The ``k``-th smallest (1-based) of non-negative int64 ``vals``: a capped histogram
    above the minimum when the answer lies near it (steps and small counts: the usual case,
    two passes), a partition otherwise."""
    lo = int(vals.min())
    cap = 1 << 12
    hist = np.bincount(np.minimum(vals - lo, cap), minlength=cap + 1)
    at = int(np.searchsorted(np.cumsum(hist), k))
    if at < cap:
        return lo + at
    return int(np.partition(vals, k - 1)[k - 1])


def _smallest(k: int, cand: np.ndarray, order: Sequence[np.ndarray]) -> np.ndarray:
    """The ``k`` entries of ``cand`` (ascending rows) that come first by ``order`` (arrays
    indexed by row, most significant first; the lower row breaks the last ties), in that
    order: a threshold on the first key, then a sort of the entries it cannot separate."""
    if k <= 0 or cand.size == 0:
        return cand[:0]

    def sort(rows: np.ndarray) -> np.ndarray:  # lexsort is stable: equal keys keep row order
        return rows[np.lexsort(tuple(o[rows] for o in reversed(order)))] if rows.size else rows

    if k >= cand.size:
        return sort(cand)
    first = order[0][cand]
    v = _kth_smallest(first, k)
    below = sort(cand[first < v])
    tie = sort(cand[first == v])
    return np.concatenate([below, tie[: k - below.shape[0]]])


def assign(state: DynamicVocabularyState, keys: Any, step: int, *, training: bool = True,
           norms: np.ndarray | None = None, protect: np.ndarray | None = None, inplace: bool = False
           ) -> tuple[np.ndarray, DynamicVocabularyState, np.ndarray]:
    """The rows of ``keys`` (int64, any order, repeats allowed) at step ``step``.

    Returns ``(rows, new_state, rows_to_reinit)``: ``rows[k]`` is key ``k``'s row or -1
    (not admitted: it reads zeros and gets no update); ``rows_to_reinit`` are the rows given
    to a key in this call (ascending), to be re-initialised for ``new_state.row_key[rows]``
    before any lookup. ``training=False`` (inference) only reads: ``new_state is state``.
    ``norms``: float64 [capacity] L2 norms of the rows, needed when :func:`norms_due`.
    ``protect``: rows never evicted in this call (those of batches looked up but not yet
    applied: a pipelined step, a front end's pending forwards).
    ``inplace``: update ``state`` itself (the caller gives it up) instead of a copy.

    A training call at step ``s`` runs, in this order (docs/dynamic_vocab.md):
    1. AfterOccurrences' sketch is halved if a multiple of ``halve_every`` was reached.
    2. Expiry: TTL evicts residents with ``s - last_seen > steps``; NormBelow (when due)
       those with norm < threshold. Keys already seen at step ``s`` are never evicted.
    3. Residents among ``keys``: ``count += occurrences``, ``last_seen = s`` (hits).
    4. The other keys, in order of first occurrence, are admitted or not (the policy).
    5. Admitted keys take the free rows, lowest first, then, if the table is full, the rows
       of residents not seen at step ``s`` in the pressure order (LRU/LFU); keys left
       without a row are not admitted this time. Each gets ``count`` = its occurrences,
       ``last_seen = s``."""
    keys = np.ascontiguousarray(np.asarray(keys).reshape(-1))
    if keys.dtype.kind not in "iu":
        raise InputError(f"Invalid `keys`: expected an integer array. Received: dtype={keys.dtype}")
    keys = keys.astype(np.int64, copy=False)
    step = int(step)
    if step < 0:
        raise InputError(f"Invalid `step`: expected an integer >= 0. Received: step={step}")
    if not training:
        return state.index.find(keys) if keys.size else np.zeros(0, np.int64), state, np.zeros(0, np.int64)
    if norms_due(state, step) and (norms is None or np.shape(norms) != (state.capacity,)):
        raise InputError(f"Invalid `norms`: NormBelow is due at step {step}, so assign needs the L2 norm of "
                         f"every row (float64 [{state.capacity}]). Received: "
                         f"{None if norms is None else np.shape(norms)}")
    st = state if inplace else state.copy()
    spec, stats = st.spec, st.stats
    evicted_keys: list[np.ndarray] = []

    def evict(rows: np.ndarray) -> None:
        if rows.size:
            evicted_keys.append(st.row_key[rows].copy())
            st.index.remove(st.row_key[rows])
            st.used[rows] = False
            st.row_key[rows] = 0
            st.count[rows] = 0
            st.last_seen[rows] = 0
            stats["evicted"] += int(rows.size)

    # 1. sketch decay
    adm = spec.admission
    if st.sketch is not None and adm.halve_every:
        period = step // adm.halve_every
        done = stats["sketch_halved_at"]
        if period > done:
            st.sketch >>= np.uint32(min(32, period - done))
            stats["sketch_halved_at"] = period
    # 2. expiry (keys seen at this step, and protected rows, stay)
    def evictable() -> np.ndarray:
        ok = st.used & (st.last_seen < step)
        if protect is not None and np.size(protect):
            ok[np.asarray(protect, dtype=np.int64).reshape(-1)] = False
        return ok

    ttl = spec.policy(TTL)
    if ttl is not None:
        evict(np.flatnonzero(evictable() & (step - st.last_seen > ttl.steps)))
    nb = spec.policy(NormBelow)
    if nb is not None and norms_due(state, step):
        evict(np.flatnonzero(evictable() & (np.asarray(norms, np.float64) < nb.threshold)))
    if keys.size == 0:
        return np.zeros(0, np.int64), st, np.zeros(0, np.int64)
    # 3. residents
    uniq, first, inverse, occ = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    rows_u = st.index.find(uniq)
    hit = rows_u >= 0
    stats["lookups"] += int(keys.shape[0])
    stats["hits"] += int(occ[hit].sum())
    hr = rows_u[hit]
    st.count[hr] += occ[hit]
    st.last_seen[hr] = step
    # 4. admission of the others, in first-occurrence order
    miss = np.flatnonzero(~hit)
    miss = miss[np.argsort(first[miss], kind="stable")]
    if isinstance(adm, AfterOccurrences) and miss.size:
        buckets = _sketch_buckets(spec, st.sketch.shape, uniq[miss])
        depth = st.sketch.shape[0]
        add = occ[miss].astype(np.int64)
        for d in range(depth):  # only the touched counters: O(keys), saturating at 2**32 - 1
            touched, inv = np.unique(buckets[d], return_inverse=True)
            sums = np.zeros(touched.shape[0], np.int64)
            np.add.at(sums, inv, add)
            total = st.sketch[d][touched].astype(np.int64) + sums
            st.sketch[d][touched] = np.minimum(total, 0xFFFFFFFF).astype(np.uint32)
        estimate = np.min(np.stack([st.sketch[d][buckets[d]] for d in range(depth)]), axis=0)
        miss = miss[estimate >= adm.count]
    elif isinstance(adm, Probability) and miss.size:
        miss = miss[uniform(uniq[miss], adm.seed, 0x70726F62, step) < adm.p]
    # 5. rows: free ones lowest first, then victims in the pressure order
    free = np.flatnonzero(~st.used)[: miss.size]
    need = miss.size - free.size
    victims = np.zeros(0, np.int64)
    order = spec.order
    if need > 0 and order is not None:
        cand = np.flatnonzero(evictable())
        if isinstance(order, LRU):
            victims = _smallest(need, cand, (st.last_seen, st.count))
        else:
            victims = _smallest(need, cand, (st.count, st.last_seen))
        evict(victims)
    given = np.concatenate([free, victims]).astype(np.int64)
    admitted = miss[: given.size]
    if admitted.size:
        st.row_key[given] = uniq[admitted]
        st.used[given] = True
        st.count[given] = occ[admitted]
        st.last_seen[given] = step
        st.index.insert(uniq[admitted], given)
        rows_u[admitted] = given
        stats["admitted"] += int(admitted.size)
    stats["rejected"] += int(occ[rows_u < 0].sum())
    return rows_u[inverse], st, np.sort(given)


# ------------------------------------------------------------------------------------ values
def _truncated_normal(keys: np.ndarray, dim: int, mean: float, std: float, seed: int, table: int) -> np.ndarray:
    """TruncatedNormal(mean, std) rows (draws beyond 2 std redrawn), one per key, from a
    counter-based hash of (seed, table, key, column, attempt): Box-Muller in float64."""
    n = keys.shape[0]
    base = hash_keys(keys, seed, table, 0x696E6974)  # [n]
    ctr = base[:, None] + (np.arange(dim, dtype=np.uint64)[None, :] * np.uint64(2) + np.uint64(1)) * _GOLDEN
    ctr = ctr.reshape(-1)
    z = np.empty(n * dim, dtype=np.float64)
    todo = np.arange(n * dim)
    attempt = 0
    while todo.size:
        h1 = mix64(ctr[todo] + np.uint64((attempt * int(_M2)) % KEY_SPACE))
        h2 = mix64(h1 ^ _M1)
        u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
        u2 = (h2 >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        draw = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        ok = np.abs(draw) <= 2.0
        z[todo[ok]] = draw[ok]
        todo = todo[~ok]
        attempt += 1
    return (mean + std * z).reshape(n, dim).astype(np.float32)


def keyed_initial_values(init: Any, keys: np.ndarray, dim: int, seed: int, table_index: int,
                         table_name: str = "") -> np.ndarray:
    """float32 [n, dim]: the initial row of each key, a function of (seed, table, key) only.

    meshembed's TruncatedNormal (the default) and Constant are drawn vectorised from
    counter-based hashes; any other initializer is called once per key with shape
    ``(1, dim)`` and ``np.random.default_rng([seed, table_index, key mod 2**64])``."""
    from meshembed.embedding.initializers import Constant, TruncatedNormal, _resolve, initial_values

    keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
    init = _resolve(init, table_name)
    if isinstance(init, TruncatedNormal):
        std = init.stddev if init.stddev is not None else 1.0 / math.sqrt(dim)
        return _truncated_normal(keys, dim, float(init.mean), float(std), seed, table_index)
    if isinstance(init, Constant):
        return np.full((keys.shape[0], dim), init.value, dtype=np.float32)
    out = np.empty((keys.shape[0], dim), dtype=np.float32)
    for i, k in enumerate(keys.view(np.uint64).tolist()):
        rng = np.random.default_rng([int(seed), int(table_index), int(k)])
        out[i] = initial_values(init, (1, dim), rng, table_name)[0]
    return out


# ------------------------------------------------------------------------------------ batches
def dynamic_tables(config: Any) -> dict[int, DynamicVocabulary]:
    """``{table index: spec}`` of the config's dynamic tables (config order = layout order)."""
    out = {}
    for i, t in enumerate(getattr(config, "tables", ()) or ()):
        spec = getattr(t, "dynamic", None)
        if spec is not None:
            out[i] = spec
    return out


def key_layout(layout: Any, dynamic: Mapping[int, Any]) -> Any:
    """``layout`` with every dynamic table's vocabulary the whole int64 key space: the layout
    a batch of keys is prepared for (``batch.prepare(key_layout, ...)`` checks everything
    but the range of those tables' ids). ``layout`` itself when there is no dynamic table."""
    if not dynamic:
        return layout
    tables = tuple(dataclasses.replace(t, vocabulary_size=KEY_SPACE) if t.index in dynamic else t
                   for t in layout.tables)
    return dataclasses.replace(layout, tables=tables)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = a.view()
    a.flags.writeable = False
    return a


def map_batch(layout: Any, batch: Any, states: Mapping[int, DynamicVocabularyState], step: int, *,
              norms: Mapping[int, np.ndarray] | None = None, protect: Mapping[int, np.ndarray] | None = None
              ) -> tuple[Any, dict[int, DynamicVocabularyState], dict[int, np.ndarray]]:
    """A batch of keys (prepared for :func:`key_layout`) as a batch of rows for ``layout``.

    Every dynamic table's keys (its features', in config order) go through one
    :func:`assign`; a training or backward-only batch admits and evicts, an inference batch
    only reads. Ids without a row are dropped from their feature (with their combiner
    weight: the others keep theirs, so the activation is what a zero row would give) and so
    get no update. Returns ``(row batch, new states, {table: rows to re-initialise})``."""
    from meshembed.embedding import combiners
    from meshembed.embedding.batch import Batch, PreparedFeature

    training = batch.mode != "inference"
    new_states = dict(states)
    reinit: dict[int, np.ndarray] = {}
    features = list(batch.features)
    for t, st in states.items():
        ks = [k for k, f in enumerate(layout.features) if f.table == t]
        keys = [batch.features[k].ids for k in ks]
        joined = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        rows, new, fresh = assign(st, joined, step, training=training, norms=(norms or {}).get(t),
                                  protect=(protect or {}).get(t))
        new_states[t] = new
        if fresh.size:
            reinit[t] = fresh
        start = 0
        for k, part in zip(ks, keys):
            r = rows[start:start + part.shape[0]]
            start += part.shape[0]
            d = batch.features[k]
            keep = r >= 0
            if keep.all():
                features[k] = PreparedFeature(_frozen(r), d.slots, d.scale, d.num_slots, d.unit_scale, d.identity,
                                               d.offsets)
            else:
                slots = np.ascontiguousarray(d.slots[keep])
                features[k] = PreparedFeature(
                    _frozen(np.ascontiguousarray(r[keep])), _frozen(slots),
                    _frozen(np.ascontiguousarray(d.scale[keep])), d.num_slots, d.unit_scale,
                    bool(combiners.is_identity(slots, d.num_slots)))
    return Batch(layout, batch.mode, tuple(features)), new_states, reinit


def refuse(config: Any, front_end: str, why: str = "") -> None:
    """ConfigError when ``config`` has a dynamic table, for a front end that cannot map keys."""
    tables = [getattr(t, "name", str(i)) for i, t in enumerate(getattr(config, "tables", ()) or ())
              if getattr(t, "dynamic", None) is not None]
    if tables:
        raise ConfigError(
            f"Invalid `config` for {front_end}: table(s) {tables} have a dynamic vocabulary (raw int64 keys "
            f"mapped to rows on the host by the engine), which {front_end} does not support"
            f"{': ' + why if why else ''}. Fix: use me.TPUEmbedding (any backend), me.tpu or me.torch's "
            "EmbeddingCollection for these tables, or hash the keys to rows yourself and drop `dynamic=`.")


def export(state: DynamicVocabularyState, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys ascending, their rows of ``values``) for serving."""
    keys, rows = state.resident()
    return keys, np.asarray(values)[rows]


def checkpoint_error(where: Any, table: str, exc: Exception) -> CheckpointError:
    return CheckpointError(f"Invalid checkpoint at {str(where)!r}: arrays.npz dynamic vocabulary of table {table!r}: "
                           f"{exc}. Nothing was restored. Fix: the checkpoint was changed or damaged after it was "
                           "written; restore it from an intact copy, or use an earlier checkpoint.")


def initializer_to_json(init: Any) -> dict:
    """A dynamic table's initializer as JSON data for the checkpoint manifest: meshembed's
    own initialisers and numbers exactly; any other callable by name only (``restore`` then
    asks for it, as it asks for learning-rate callables)."""
    from meshembed.embedding.initializers import Constant, TruncatedNormal

    if isinstance(init, TruncatedNormal):
        return {"kind": "truncated_normal", "mean": float(init.mean),
                "stddev": None if init.stddev is None else float(init.stddev)}
    if isinstance(init, Constant):
        return {"kind": "constant", "value": float(init.value)}
    if isinstance(init, str):
        return {"kind": "named", "name": init}
    if not callable(init) and np.ndim(init) == 0:
        return {"kind": "constant", "value": float(init)}
    return {"kind": "callable", "name": str(getattr(init, "__qualname__", type(init).__name__))}


def initializer_from_json(data: Any) -> Any:
    """Inverse of :func:`initializer_to_json`; None for a callable (it must be passed again)."""
    from meshembed.embedding.initializers import Constant, TruncatedNormal

    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "truncated_normal" and set(data) == {"kind", "mean", "stddev"}:
        return TruncatedNormal(float(data["mean"]), None if data["stddev"] is None else float(data["stddev"]))
    if kind == "constant" and set(data) == {"kind", "value"}:
        return Constant(float(data["value"]))
    if kind == "named" and set(data) == {"kind", "name"} and data["name"] in ("zeros", "ones", "truncated_normal"):
        return data["name"]
    if kind == "callable" and set(data) == {"kind", "name"} and isinstance(data["name"], str):
        return None
    raise ConfigError(f"Invalid dynamic vocabulary initializer {data!r}")
