"""Dynamic vocabularies inside ``jax.jit``: me.jax's port of ``meshembed.embedding.dynamic.assign``.

The key table of each dynamic table is part of me.jax's state pytree at its fixed capacity
(``EmbeddingState.vocab[table]``: row-indexed arrays, as the NumPy reference's
``DynamicVocabularyState``), and :func:`map_keys` — a pure function, jit-able — maps a batch of
int64 keys to rows, admits, counts and evicts exactly as the reference does (same rows, same
decisions, same statistics) and re-initialises the rows it gives to keys.

Without x64 JAX has no 64-bit integers, and meshembed never turns x64 on, so every 64-bit
quantity (keys, counts, statistics, the splitmix64 hashes) travels as two uint32 words
``(lo, hi)`` and the hashes run as 32-bit multiplies (:func:`mix64`); only equality and the
reference's tie orders are needed, so no signed comparison of keys is ever made. Lookups sort
the resident keys together with the batch's distinct keys (one ``lax.sort`` of capacity + batch
entries) instead of probing a hash table: the reference's rows do not depend on its index.

What cannot be expressed under jit with identical results is refused (``ConfigError``):
``NormBelow`` (its float64 norms), a sketch wider than 2**31. The initial values of admitted
rows (the reference draws them with float64 Box–Muller) come from the reference itself through
``jax.pure_callback``; a ``Constant`` initializer is filled in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshembed.embedding import dynamic as ref
from meshembed.embedding.initializers import Constant
from meshembed.errors import ConfigError, InputError, StateError

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B97F4A7C15  # dynamic.py's splitmix64 constants (checked against it by the tests)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
STREAM = 0x6D65736865  # hash_keys' own constant ("meshe")
PROB_SALT, SKETCH_SALT = 0x70726F62, 0x736B65746368
#: statistics, in the reference's ``scalars`` order
SCALARS = ref.SCALARS
ARRAYS = ("key_lo", "key_hi", "used", "count_lo", "count_hi", "last_seen", "stats_lo", "stats_hi")


# ------------------------------------------------------------------------------------ 64-bit words
def _u32(x: Any) -> Any:
    return jnp.asarray(x, jnp.uint32)


def _mul32(a: Any, b: Any) -> tuple[Any, Any]:
    """The full 64-bit product of two uint32 arrays as ``(lo, hi)`` (16-bit halves: no overflow)."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    ll, lh, hl, hh = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)
    return (ll & 0xFFFF) | (mid << 16), hh + (lh >> 16) + (hl >> 16) + (mid >> 16)


def _mulc(x: tuple, c: int) -> tuple[Any, Any]:
    """``x * c mod 2**64`` for a constant ``c``."""
    lo, hi = _mul32(x[0], _u32(c & M32))
    return lo, hi + x[0] * _u32(c >> 32) + x[1] * _u32(c & M32)


def _shr(x: tuple, n: int) -> tuple[Any, Any]:
    return (x[0] >> n) | (x[1] << (32 - n)), x[1] >> n


def _xor(x: tuple, y: tuple) -> tuple[Any, Any]:
    return x[0] ^ y[0], x[1] ^ y[1]


def add64(x: tuple, y: tuple) -> tuple[Any, Any]:
    """``x + y mod 2**64`` (the carry from the low words)."""
    lo = x[0] + y[0]
    return lo, x[1] + y[1] + (lo < x[0]).astype(jnp.uint32)


def mix64(x: tuple) -> tuple[Any, Any]:
    """splitmix64's finaliser (``dynamic.mix64``) on ``(lo, hi)`` words."""
    x = _xor(x, _shr(x, 30))
    x = _mulc(x, MIX1)
    x = _xor(x, _shr(x, 27))
    x = _mulc(x, MIX2)
    return _xor(x, _shr(x, 31))


def _mix_int(v: int) -> int:
    return int(ref.mix64(np.array([v % (1 << 64)], np.uint64))[0])


def salt_prefix(*salts: int) -> int:
    """``h`` of ``dynamic.hash_keys(keys, *salts) == mix64(keys ^ h)`` for constant salts."""
    h = _mix_int(STREAM)
    for s in salts:
        h = _mix_int(h ^ _mix_int((s + GOLDEN) % (1 << 64)))
    return h


def _const(v: int) -> tuple[Any, Any]:
    return _u32(v & M32), _u32(v >> 32)


def hash_words(keys: tuple, h: tuple) -> tuple[Any, Any]:
    """``dynamic.hash_keys`` of keys ``(lo, hi)`` given the salts' prefix ``h`` (words)."""
    return mix64(_xor(keys, h))


def mod_words(x: tuple, width: int) -> Any:
    """``x mod width`` (int32) for a width up to 2**31: the high word's remainder, then the low
    word one bit at a time (no product past 32 bits)."""
    if width & (width - 1) == 0:
        return (x[0] & _u32(width - 1)).astype(jnp.int32)
    w = _u32(width)

    def bit(i: Any, r: Any) -> Any:  # r < w <= 2**31: 2r + 1 fits
        r = r * 2 + ((x[0] >> (31 - i).astype(jnp.uint32)) & 1)
        return jnp.where(r >= w, r - w, r)

    return lax.fori_loop(0, 32, bit, x[1] % w).astype(jnp.int32)


def to_words(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64/uint64 host values as ``(lo, hi)`` uint32 words (two's complement)."""
    u = np.ascontiguousarray(a).astype(np.int64, copy=False).view(np.uint64)
    return (u & np.uint64(M32)).astype(np.uint32), (u >> np.uint64(32)).astype(np.uint32)


def from_words(lo: Any, hi: Any) -> np.ndarray:
    """Inverse of :func:`to_words` (int64)."""
    u = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
    return u.view(np.int64)


# ------------------------------------------------------------------------------------ static part
@dataclass(frozen=True, eq=False)
class TableVocab:
    """What never changes for one dynamic table: its spec, rows, initializer and seed."""

    index: int
    name: str
    spec: ref.DynamicVocabulary
    capacity: int
    dimension: int
    init: Any
    seed: int
    slot_values: tuple[float, ...]


def refuse_unsupported(config: Any) -> None:
    """ConfigError for the policies :func:`map_keys` cannot run with the reference's results."""
    for i, spec in ref.dynamic_tables(config).items():
        name = config.tables[i].name
        if spec.policy(ref.NormBelow) is not None:
            raise ConfigError(
                f"Invalid `config` for me.jax: table {name!r} evicts with NormBelow, whose decisions compare "
                "float64 L2 norms of the rows (dynamic.assign), which a jitted me.jax step without x64 cannot "
                "compute with the same bits, so its evictions could differ from the engine's. Nothing was "
                "changed. Fix: use LRU()/LFU()/TTL(steps) for this table under me.jax, or run it with "
                "me.TPUEmbedding(config, backend='jax') (docs/dynamic_vocab.md).")
        adm = spec.admission
        if isinstance(adm, ref.AfterOccurrences) and adm.sketch_width is not None and adm.sketch_width > 1 << 31:
            raise ConfigError(
                f"Invalid `config` for me.jax: table {name!r} has AfterOccurrences(sketch_width="
                f"{adm.sketch_width}), wider than me.jax's 2**31 counters per sketch row. Fix: a "
                "sketch_width <= 2**31 (the default is the next power of two >= the capacity).")


def statics(emb: Any) -> dict[int, TableVocab]:
    """The :class:`TableVocab` of each dynamic table of engine ``emb``."""
    refuse_unsupported(emb.config)
    inits = emb.dynamic_initializers
    out = {}
    for i, spec in ref.dynamic_tables(emb.config).items():
        t = emb.layout.tables[i]
        out[i] = TableVocab(i, t.name, spec, emb.vocabulary(t.name).capacity, t.dimension, inits[t.name],
                            int(emb.seed), tuple(float(v) for v in t.optimizer.slot_initial_values()))
    return out


def int_dtype() -> Any:
    """Steps as me.jax keeps them: int64 with the user's x64, else int32."""
    return jnp.int64 if jax.config.jax_enable_x64 else jnp.int32


# ------------------------------------------------------------------------------------ host <-> state
def to_arrays(st: ref.DynamicVocabularyState) -> dict[str, np.ndarray]:
    """A reference state as me.jax's vocabulary arrays (host NumPy)."""
    dt = np.dtype(int_dtype())
    if st.last_seen.size and int(st.last_seen.max()) > np.iinfo(dt).max:
        raise StateError(f"Cannot hold this vocabulary in me.jax: a last-seen step {int(st.last_seen.max())} is "
                         f"past {dt} (x64 is off). Fix: run the step with jax.enable_x64(True).")
    key_lo, key_hi = to_words(st.row_key)
    count_lo, count_hi = to_words(st.count)
    stats_lo, stats_hi = to_words(np.array([st.stats[k] for k in SCALARS], np.int64))
    out = {"key_lo": key_lo, "key_hi": key_hi, "used": st.used.astype(bool), "count_lo": count_lo,
           "count_hi": count_hi, "last_seen": st.last_seen.astype(dt), "stats_lo": stats_lo, "stats_hi": stats_hi}
    if st.sketch is not None:
        out["sketch"] = st.sketch.astype(np.uint32)
    return out


def from_arrays(tv: TableVocab, arrays: Mapping[str, Any]) -> ref.DynamicVocabularyState:
    """me.jax's vocabulary arrays as a reference state (every invariant checked there)."""
    a = {k: np.asarray(v) for k, v in arrays.items()}
    host = {"row_key": from_words(a["key_lo"], a["key_hi"]), "used": a["used"].astype(np.uint8),
            "count": from_words(a["count_lo"], a["count_hi"]), "last_seen": a["last_seen"].astype(np.int64),
            "scalars": from_words(a["stats_lo"], a["stats_hi"])}
    if "sketch" in a:
        host["sketch"] = a["sketch"].astype(np.uint32)
    try:
        return ref.DynamicVocabularyState.from_arrays(tv.spec, tv.capacity, host)
    except ValueError as exc:
        raise StateError(f"Invalid `state`: the vocabulary of dynamic table {tv.name!r} is inconsistent ({exc}). "
                         "Fix: pass the state me.jax returned, unchanged.") from None


def check_vocab(tvs: Mapping[int, TableVocab], vocab: Any) -> None:
    """``vocab`` holds each dynamic table's arrays with their shapes and dtypes."""
    names = sorted(tv.name for tv in tvs.values())
    if not isinstance(vocab, Mapping) or sorted(vocab) != names:
        got = sorted(map(str, vocab)) if isinstance(vocab, Mapping) else type(vocab).__name__
        raise InputError(f"Invalid `state`: expected the vocabularies of dynamic tables {names}. Received: {got}. "
                         "Fix: pass the state me.jax.init / restore or the previous step returned, unchanged.")
    for tv in tvs.values():
        want = ref.state_shapes(tv.spec, tv.capacity)
        shapes = {k: ((tv.capacity,), np.uint32) for k in ("key_lo", "key_hi", "count_lo", "count_hi")}
        shapes.update(used=((tv.capacity,), np.bool_), last_seen=((tv.capacity,), int_dtype()),
                      stats_lo=((len(SCALARS),), np.uint32), stats_hi=((len(SCALARS),), np.uint32))
        if "sketch" in want:
            shapes["sketch"] = (want["sketch"][0], np.uint32)
        got = vocab[tv.name]
        if not isinstance(got, Mapping) or set(got) != set(shapes):
            raise InputError(f"Invalid `state`: dynamic table {tv.name!r} needs the arrays {sorted(shapes)}. "
                             f"Received: {sorted(got) if isinstance(got, Mapping) else type(got).__name__}")
        for k, (shape, dtype) in shapes.items():
            a = got[k]
            if tuple(getattr(a, "shape", ())) != shape or np.dtype(getattr(a, "dtype", object)) != np.dtype(dtype):
                raise InputError(
                    f"Invalid `state`: dynamic table {tv.name!r} `{k}` must be a {np.dtype(dtype)} array of shape "
                    f"{shape}. Received: {getattr(a, 'shape', None)}, {getattr(a, 'dtype', None)}. Fix: pass the "
                    "state me.jax returned, unchanged (with x64 toggled, restore it again).")


# ------------------------------------------------------------------------------------ the batch of keys
@jax.tree_util.register_pytree_node_class
class KeyBatch:
    """A me.jax batch whose dynamic tables' ids are int64 keys: ``batch`` is the
    :class:`~meshembed_jax.frontend.Batch` of rows :func:`map_keys` fills in (those features' ids
    are -1 until then), ``key_lo``/``key_hi`` each feature's keys as uint32 words (None for
    the features of other tables). Padding positions have an out-of-range slot, as in any Batch."""

    def __init__(self, batch: Any, key_lo: tuple, key_hi: tuple) -> None:
        self.batch, self.key_lo, self.key_hi = batch, key_lo, key_hi

    def tree_flatten(self) -> tuple:
        return (self.batch, self.key_lo, self.key_hi), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: tuple) -> "KeyBatch":
        return cls(*children)

    @property
    def features(self) -> tuple:
        return self.batch.features


def key_batch(batch: Any, layout: Any, dyn: Mapping[int, Any]) -> KeyBatch:
    """Split the int64 keys of ``batch`` (prepared with int64 ids for the dynamic tables) into words."""
    ids, lo, hi = list(batch.ids), [], []
    for k, f in enumerate(layout.features):
        if f.table in dyn:
            wl, wh = to_words(np.asarray(ids[k], np.int64))
            lo.append(wl)
            hi.append(wh)
            ids[k] = np.full(ids[k].shape[0], -1, np.int32)
        else:
            lo.append(None)
            hi.append(None)
    row_batch = type(batch)(tuple(ids), batch.slots, batch.scale, batch.features, batch.unique)
    return KeyBatch(row_batch, tuple(lo), tuple(hi))


# ------------------------------------------------------------------------------------ assign under jit
def _stat_add(stats: tuple, i: int, v: Any) -> tuple:
    """``stats[i] += v`` (v a non-negative int32 scalar) on the words."""
    lo, hi = stats
    nlo, nhi = add64((lo[i], hi[i]), (v.astype(jnp.uint32), _u32(0)))
    return lo.at[i].set(nlo), hi.at[i].set(nhi)


def _scatter_set(a: Any, idx: Any, v: Any) -> Any:
    return a.at[idx].set(v, mode="drop")


def assign(tv: TableVocab, arrs: dict, lo: Any, hi: Any, valid: Any, step: Any, training: bool
           ) -> tuple[Any, dict, Any, Any, Any, Any]:
    """``dynamic.assign`` on words. ``lo``/``hi``/``valid``: the table's keys, its features'
    positions concatenated in config order (padding invalid). Returns ``(rows per position
    (-1: none), new arrays, given row per distinct key (capacity: none), its key words, given
    mask)``."""
    spec, cap = tv.spec, tv.capacity
    n = lo.shape[0]
    a = dict(arrs)
    used, klo, khi, last = a["used"], a["key_lo"], a["key_hi"], a["last_seen"]
    clo, chi = a["count_lo"], a["count_hi"]
    stats = (a["stats_lo"], a["stats_hi"])
    s = jnp.asarray(step).astype(last.dtype)
    # distinct keys of the batch: u_* indexed by run (one per distinct key, in key order)
    pos = jnp.arange(n, dtype=jnp.int32)
    inv = (~valid).astype(jnp.uint32)
    inv_s, hi_s, lo_s, pos_s = lax.sort((inv, hi, lo, pos), num_keys=3, is_stable=True)
    start = jnp.concatenate([jnp.ones(1, bool), (hi_s[1:] != hi_s[:-1]) | (lo_s[1:] != lo_s[:-1])
                             | (inv_s[1:] != inv_s[:-1])])
    run = jnp.cumsum(start.astype(jnp.int32)) - 1
    at = jnp.where(start, run, n)
    u_lo = _scatter_set(jnp.zeros(n, jnp.uint32), at, lo_s)
    u_hi = _scatter_set(jnp.zeros(n, jnp.uint32), at, hi_s)
    u_first = _scatter_set(jnp.full(n, n, jnp.int32), at, pos_s)
    u_valid = _scatter_set(jnp.zeros(n, bool), at, inv_s == 0)
    u_occ = jnp.zeros(n, jnp.int32).at[run].add(jnp.where(inv_s == 0, 1, 0))
    run_of = jnp.zeros(n, jnp.int32).at[pos_s].set(run)

    if training and spec.policy(ref.TTL) is not None:  # 2. expiry (1., the sketch's decay, below)
        ttl = spec.policy(ref.TTL).steps
        ex = used & (last < s) & (s - last > ttl)
        stats = _stat_add(stats, SCALARS.index("evicted"), jnp.sum(ex.astype(jnp.int32)))
        used = used & ~ex
        klo, khi, clo, chi = (jnp.where(ex, _u32(0), v) for v in (klo, khi, clo, chi))
        last = jnp.where(ex, jnp.zeros((), last.dtype), last)

    # residents: one sort of the resident keys (tag 0) with the distinct batch keys (tag 1; 2:
    # a free row or no key): a batch key's resident, if any, sorts right before it
    tag = jnp.concatenate([jnp.where(used, 0, 2), jnp.where(u_valid, 1, 2)]).astype(jnp.uint32)
    idx = jnp.concatenate([jnp.arange(cap, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32)])
    h_s, l_s, t_s, i_s = lax.sort((jnp.concatenate([khi, u_hi]), jnp.concatenate([klo, u_lo]), tag, idx),
                                  num_keys=3)
    match = jnp.concatenate([jnp.zeros(1, bool), (h_s[1:] == h_s[:-1]) & (l_s[1:] == l_s[:-1])
                             & (t_s[:-1] == 0) & (t_s[1:] == 1)])
    prev = jnp.concatenate([jnp.zeros(1, jnp.int32), i_s[:-1]])
    target = jnp.where(t_s == 1, i_s, n)
    u_row = _scatter_set(jnp.full(n, -1, jnp.int32), target, jnp.where(match, prev, -1))
    if not training:
        rows = jnp.where(valid, u_row[run_of], -1)
        none = jnp.full(n, cap, jnp.int32)
        return rows, arrs, none, u_lo, u_hi, jnp.zeros(n, bool)

    adm_spec = spec.admission
    sketch = a.get("sketch")
    if sketch is not None and adm_spec.halve_every:  # 1. sketch decay (order-free with 2.)
        period = (s // adm_spec.halve_every).astype(jnp.int32)
        done = stats[0][0].astype(jnp.int32)  # sketch_halved_at <= step: one word
        go = period > done
        shift = jnp.minimum(32, period - done).astype(jnp.uint32)
        sketch = jnp.where(go, jnp.where(shift >= 32, _u32(0), sketch >> jnp.minimum(shift, 31)), sketch)
        stats = (stats[0].at[0].set(jnp.where(go, period, done).astype(jnp.uint32)), stats[1])

    # 3. hits
    hit = u_row >= 0
    hr = jnp.where(hit, u_row, cap)
    inc = jnp.zeros(cap, jnp.uint32).at[hr].add(u_occ.astype(jnp.uint32), mode="drop")
    clo, chi = add64((clo, chi), (inc, jnp.zeros(cap, jnp.uint32)))
    last = _scatter_set(last, hr, jnp.broadcast_to(s, (n,)))
    stats = _stat_add(stats, SCALARS.index("lookups"), jnp.sum(valid.astype(jnp.int32)))
    stats = _stat_add(stats, SCALARS.index("hits"), jnp.sum(jnp.where(hit, u_occ, 0)))

    # 4. admission
    miss = u_valid & ~hit
    if isinstance(adm_spec, ref.AfterOccurrences):
        depth, width = sketch.shape
        add = jnp.where(miss, u_occ, 0).astype(jnp.uint32)
        est = None
        rows_d = []
        for d in range(depth):
            b = mod_words(hash_words((u_lo, u_hi), _const(salt_prefix(adm_spec.seed, SKETCH_SALT, d))), width)
            sums = jnp.zeros(width, jnp.uint32).at[b].add(add)
            new = sketch[d] + sums
            rows_d.append(jnp.where(new < sketch[d], _u32(M32), new))  # saturating, as min(total, 2**32 - 1)
            e = rows_d[d][b]
            est = e if est is None else jnp.minimum(est, e)
        sketch = jnp.stack(rows_d)
        adm = miss & (est >= adm_spec.count)
    elif isinstance(adm_spec, ref.Probability):
        h = _const(salt_prefix(adm_spec.seed, PROB_SALT))
        s64 = jnp.asarray(s)
        sw = (s64.astype(jnp.uint32), (s64 >> 32).astype(jnp.uint32) if s64.dtype.itemsize == 8 else _u32(0))
        h = mix64(_xor(h, mix64(add64(sw, _const(GOLDEN)))))
        u = hash_words((u_lo, u_hi), h)
        m_hi, m_lo = u[1] >> 11, ((u[1] & 0x7FF) << 21) | (u[0] >> 11)  # the 53 bits of uniform()
        t = math.ceil(adm_spec.p * 2.0 ** 53)  # uniform < p  <=>  bits < ceil(p * 2**53)
        t_hi, t_lo = _u32(t >> 32), _u32(t & M32)
        adm = miss & ((m_hi < t_hi) | ((m_hi == t_hi) & (m_lo < t_lo)))
    else:
        adm = miss

    # 5. rows: free ones lowest first, then evictable residents in the pressure order
    cand = used & (last < s)
    order = spec.order
    free = ~used
    z32 = jnp.zeros(cap, jnp.uint32)
    o_chi, o_clo = jnp.where(free, z32, chi), jnp.where(free, z32, clo)
    rows_all = jnp.arange(cap, dtype=jnp.int32)  # a stable sort: the lower row breaks the last ties
    if isinstance(order, ref.LRU):  # free rows (-1) first, then candidates by last_seen (>= 0), then the rest
        top = jnp.where(free, -1, jnp.where(cand, last, jnp.iinfo(last.dtype).max)).astype(last.dtype)
        keys = (top, o_chi, o_clo)
    else:
        cls = jnp.where(free, 0, jnp.where(cand & (order is not None), 1, 2)).astype(jnp.int32)
        keys = (cls, o_chi, o_clo, jnp.where(free, jnp.zeros((), last.dtype), last))
    supply = lax.sort((*keys, rows_all), num_keys=len(keys), is_stable=True)[-1]
    n_free = jnp.sum(free.astype(jnp.int32))
    n_supply = n_free + (jnp.sum(cand.astype(jnp.int32)) if order is not None else 0)
    j_sorted = lax.sort(((~adm).astype(jnp.int32), u_first, jnp.arange(n, dtype=jnp.int32)), num_keys=2)[-1]
    rank = jnp.zeros(n, jnp.int32).at[j_sorted].set(jnp.arange(n, dtype=jnp.int32))
    take = adm & (rank < n_supply)
    new_row = jnp.where(take, supply[jnp.clip(rank, 0, cap - 1)], -1)
    n_adm = jnp.sum(adm.astype(jnp.int32))
    given = jnp.minimum(n_adm, n_supply)
    stats = _stat_add(stats, SCALARS.index("evicted"), jnp.maximum(given - n_free, 0))
    gr = jnp.where(take, new_row, cap)
    klo, khi = _scatter_set(klo, gr, u_lo), _scatter_set(khi, gr, u_hi)
    used = _scatter_set(used, gr, jnp.ones(n, bool))
    clo, chi = _scatter_set(clo, gr, u_occ.astype(jnp.uint32)), _scatter_set(chi, gr, jnp.zeros(n, jnp.uint32))
    last = _scatter_set(last, gr, jnp.broadcast_to(s, (n,)))
    u_row = jnp.where(take, new_row, u_row)
    stats = _stat_add(stats, SCALARS.index("admitted"), given)
    stats = _stat_add(stats, SCALARS.index("rejected"), jnp.sum(jnp.where(u_valid & (u_row < 0), u_occ, 0)))
    a.update(key_lo=klo, key_hi=khi, used=used, count_lo=clo, count_hi=chi, last_seen=last,
             stats_lo=stats[0], stats_hi=stats[1])
    if sketch is not None:
        a["sketch"] = sketch
    rows = jnp.where(valid, u_row[run_of], -1)
    return rows, a, gr, u_lo, u_hi, take


# ------------------------------------------------------------------------------------ re-initialisation
def initial_values(tv: TableVocab, lo: Any, hi: Any, mask: Any) -> Any:
    """float32 [n, dim]: the reference's ``keyed_initial_values`` of the masked keys (zeros
    elsewhere): a Constant in place, anything else on the host (``jax.pure_callback``: its
    float64 Box–Muller has no bit-exact float32 form)."""
    n, dim = lo.shape[0], tv.dimension
    init = tv.init
    named = {"zeros": 0.0, "ones": 1.0}  # the reference's named constants
    if isinstance(init, Constant) or (isinstance(init, str) and init in named) or (
            not callable(init) and not isinstance(init, str) and np.ndim(init) == 0):
        value = init.value if isinstance(init, Constant) else named[init] if isinstance(init, str) else float(init)
        return jnp.full((n, dim), np.float32(value), jnp.float32)

    def host(lo_h: np.ndarray, hi_h: np.ndarray, mask_h: np.ndarray) -> np.ndarray:
        out = np.zeros((lo_h.shape[0], dim), np.float32)
        m = np.asarray(mask_h, bool)
        if m.any():
            keys = from_words(np.asarray(lo_h)[m], np.asarray(hi_h)[m])
            out[m] = ref.keyed_initial_values(init, keys, dim, tv.seed, tv.index, tv.name)
        return out

    return jax.pure_callback(host, jax.ShapeDtypeStruct((n, dim), jnp.float32), lo, hi, mask,
                             vmap_method="sequential")


def reinit(tv: TableVocab, placement: Any, arrays: Mapping[str, Any], names: tuple, rows: Any, lo: Any, hi: Any,
           mask: Any) -> dict:
    """The table's arrays (padded ``[shards, rows, width]``) with ``rows`` (capacity: none) at their
    keys' initial parameters and the optimizer's initial slot values."""
    safe = jnp.where(mask, rows, 0)
    owner = placement.owner(safe, xp=jnp)
    local = placement.local_row(safe, xp=jnp, owner=owner)
    shard = jnp.where(mask, owner, arrays[names[0]].shape[0])  # out of range: dropped
    out = dict(arrays)
    values = initial_values(tv, lo, hi, mask)
    for name, fill in zip(names, (None,) + tv.slot_values):
        a = arrays[name]
        v = values if fill is None else jnp.full((rows.shape[0], a.shape[2]), np.float32(fill), jnp.float32)
        out[name] = a.at[shard, local].set(v.astype(a.dtype), mode="drop")
    return out


def map_tables(tvs: Mapping[int, TableVocab], layout: Any, shard_layouts: Mapping[int, Any],
               names: Mapping[int, tuple], tables: dict, vocab: dict, kb: KeyBatch, step: Any, training: bool
               ) -> tuple[dict, dict, tuple]:
    """Every dynamic table's :func:`assign` and re-initialisation; ``(tables, vocab, ids)``:
    the row ids of each feature (-1: padding or no row), other features' ids unchanged."""
    batch = kb.batch
    ids = list(batch.ids)
    tables, vocab = dict(tables), dict(vocab)
    for i, tv in tvs.items():
        parts = [k for k, f in enumerate(layout.features) if f.table == i]
        if not parts:
            continue
        lo = jnp.concatenate([jnp.asarray(kb.key_lo[k], jnp.uint32) for k in parts])
        hi = jnp.concatenate([jnp.asarray(kb.key_hi[k], jnp.uint32) for k in parts])
        valid = jnp.concatenate([jnp.asarray(batch.slots[k]) < batch.features[k].num_slots for k in parts])
        rows, new, gr, u_lo, u_hi, take = assign(tv, vocab[tv.name], lo, hi, valid, step, training)
        vocab[tv.name] = new
        if training:
            tables[tv.name] = reinit(tv, shard_layouts[i].placement, tables[tv.name], names[i], gr, u_lo, u_hi, take)
        start = 0
        for k in parts:
            c = batch.features[k].capacity
            ids[k] = rows[start:start + c].astype(jnp.int32)
            start += c
    return tables, vocab, tuple(ids)


def eager_program(static: Any, training: bool, fn: Any) -> Any:
    """``fn`` jitted once per state's static part and mode: what an eager ``map_keys`` runs."""
    cache = static.__dict__.setdefault("dynamic_programs", {})
    if training not in cache:
        cache[training] = jax.jit(fn)
    return cache[training]


def row_batch(kb: KeyBatch, ids: tuple) -> Any:
    """The Batch of rows: each position without a row gets the padding's slot and no factor, so
    it reads nothing and gets no gradient (the reference drops it from its feature)."""
    from meshembed_jax.distributed import bucket

    b = kb.batch
    slots, scale = list(b.slots), list(b.scale)
    for k, f in enumerate(b.features):
        if kb.key_lo[k] is None:
            continue
        keep = jnp.asarray(ids[k]) >= 0
        slots[k] = jnp.where(keep, jnp.asarray(b.slots[k]), bucket(f.num_slots)).astype(jnp.asarray(b.slots[k]).dtype)
        scale[k] = jnp.where(keep, jnp.asarray(b.scale[k]), 0).astype(jnp.asarray(b.scale[k]).dtype)
    return type(b)(tuple(ids), tuple(slots), tuple(scale), b.features, b.unique)
