"""Row kernels written only with the Array API standard (2023.12): gather, write, segment sums.

The standard has no scatter and no in-place indexed add, so:

* **segment sums** sort the ids stably (``argsort(stable=True)``), count them
  (``unique_counts``) and add the r-th occurrence of every id in round r, over the ids that
  occur more than r times (a prefix once ids are ordered by count). Each id's sum is
  ``((0 + v_first) + v_second) + ...`` in input order — the order of NumPy's ``np.add.at``, so
  the sums are bit-identical to the NumPy backend's and deterministic on any library. Work is
  O(len(ids) · D). Once at most ``HOT_IDS`` ids (the most frequent, under Zipf) are left, each
  finishes with one ``cumulative_sum`` of its running sum and its remaining rows — the same
  order where the library's scan is sequential (NumPy's is). A GPU library's scan is a tree
  (CuPy's: the GPU conformance run found last-bit differences), so such a backend passes
  ``finish``: the hot ids' remaining rows summed in row order, by its own kernel.
* **row writes** find, for every row of a shard, its position among the sorted written ids
  (``searchsorted``) and choose new or old with ``where``: a new array, O(rows · D) per write.

Correct first; a library with an indexed add or in-place writes overrides these.
"""

from __future__ import annotations

from typing import Any, Callable


#: Below this many ids still summing, each finishes with one ``cumulative_sum`` over its rows.
HOT_IDS = 16


def take_rows(xp: Any, x: Any, index: Any) -> Any:
    return xp.take(x, index, axis=0)


def replace_rows(xp: Any, base: Any, rows_ids: Any, rows: Any) -> Any:
    """``base`` with ``base[rows_ids[i]] = rows[i]`` (unique ``rows_ids``), as a new array."""
    k = int(rows_ids.shape[0])
    if k == 0:
        return base
    order = xp.argsort(rows_ids)
    sorted_ids = xp.take(rows_ids, order)
    targets = xp.arange(int(base.shape[0]), dtype=sorted_ids.dtype, device=_device(base))
    pos = xp.searchsorted(sorted_ids, targets)
    pos = xp.minimum(pos, xp.full_like(pos, k - 1))
    hit = xp.take(sorted_ids, pos) == targets
    new = take_rows(xp, take_rows(xp, rows, order), pos)
    hit = xp.reshape(hit, (-1,) + (1,) * (base.ndim - 1))
    return xp.where(hit, new, base)


#: ``finish(xp, acc, svals, starts, counts)`` -> ``[k, ...]``: row i is
#: ``((acc[i] + svals[starts[i]]) + svals[starts[i] + 1]) + ...`` over ``counts[i]`` rows, or None
#: where it cannot (a dtype its kernel lacks: the rounds then go on, one row per id each).
Finish = Callable[[Any, Any, Any, Any, Any], Any]


def scan_finish(xp: Any, acc: Any, svals: Any, starts: Any, counts: Any) -> Any:
    """The default ``finish``: one ``cumulative_sum`` per hot id (in order where the scan is)."""
    hot = []
    for i in range(int(acc.shape[0])):
        start, count = int(starts[i]), int(counts[i])
        run = xp.concat([acc[i : i + 1, ...], svals[start : start + count, ...]], axis=0)
        hot.append(xp.cumulative_sum(run, axis=0)[-1:, ...])
    return xp.concat(hot, axis=0) if hot else acc


def segment_sum(xp: Any, ids: Any, values: Any, finish: Finish | None = None) -> tuple[Any, Any]:
    """(sorted unique ids, per-id sums of ``values`` rows in input order); see the module."""
    rest = tuple(int(d) for d in values.shape[1:])
    if int(ids.shape[0]) == 0:
        return ids, xp.zeros((0,) + rest, dtype=values.dtype, device=_device(values))
    order = xp.argsort(ids, stable=True)
    svals = take_rows(xp, values, order)
    uids, counts = xp.unique_counts(xp.take(ids, order))
    starts = xp.cumulative_sum(counts, include_initial=True)[:-1]
    by_count = xp.argsort(counts, descending=True, stable=True)
    counts, starts = xp.take(counts, by_count), xp.take(starts, by_count)
    # how many ids occur more than r times, for every round r (counts are descending)
    more_than = xp.searchsorted(-counts, -xp.arange(int(counts[0]), dtype=counts.dtype, device=_device(ids)))
    acc = xp.zeros((int(uids.shape[0]),) + rest, dtype=values.dtype, device=_device(values))
    done, rounds = [], int(more_than.shape[0])
    for r in range(rounds):
        k = int(more_than[r])
        if k < int(acc.shape[0]):
            done.append(acc[k:, ...])
            acc = acc[:k, ...]
        if k <= HOT_IDS:  # the few most frequent ids: each one's remaining rows at once
            summed = (finish or scan_finish)(xp, acc, svals, starts[:k] + r, counts[:k] - r)
            if summed is not None:
                acc = summed
                break
        acc = acc + take_rows(xp, svals, starts[:k] + r)
    done.append(acc)
    sums = xp.concat(done[::-1], axis=0)  # in by_count order
    return uids, take_rows(xp, sums, xp.argsort(by_count))


def segment_sum_to(xp: Any, values: Any, segment_ids: Any, num_segments: int, finish: Finish | None = None) -> Any:
    """Dense ``out[k] = Σ values[i] for segment_ids[i] == k``, shape ``[num_segments, ...]``."""
    uids, sums = segment_sum(xp, segment_ids, values, finish)
    rest = tuple(int(d) for d in values.shape[1:])
    out = xp.zeros((num_segments,) + rest, dtype=values.dtype, device=_device(values))
    return replace_rows(xp, out, uids, sums)


def split_by_shard(xp: Any, placement: Any, ids: Any) -> list[tuple[int, Any, Any]]:
    """``(shard, positions in ids, local rows)`` for each shard that owns any of ``ids``."""
    if placement.num_shards == 1:
        return [(0, None, ids)]
    owner = placement.owner(ids, xp)
    local = placement.local_row(ids, xp, owner=owner)
    parts = []
    for s in range(placement.num_shards):
        pos = xp.nonzero(owner == s)[0]
        if int(pos.shape[0]):
            parts.append((s, pos, xp.take(local, pos)))
    return parts


def gather(xp: Any, shards: list[Any], placement: Any, ids: Any) -> Any:
    """Rows of global ``ids`` (duplicates allowed) from per-shard arrays, in ids' order."""
    parts = split_by_shard(xp, placement, ids)
    if len(parts) == 1 and parts[0][1] is None:
        return take_rows(xp, shards[0], ids)
    if not parts:
        return xp.zeros((0, int(shards[0].shape[1])), dtype=shards[0].dtype, device=_device(shards[0]))
    rows = xp.concat([take_rows(xp, shards[s], local) for s, _, local in parts], axis=0)
    where = xp.concat([pos for _, pos, _ in parts])
    return take_rows(xp, rows, xp.argsort(where))


def scatter(xp: Any, shards: list[Any], placement: Any, ids: Any, rows: Any) -> list[Any]:
    """New per-shard arrays with ``rows`` written at unique global ``ids``."""
    out = list(shards)
    for s, pos, local in split_by_shard(xp, placement, ids):
        out[s] = replace_rows(xp, out[s], local, rows if pos is None else take_rows(xp, rows, pos))
    return out


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)
