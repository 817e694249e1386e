"""The generic segment sums' hot ids (``kernels.segment_sum``'s ``finish``) on a library whose
scan is a tree, as CuPy's is: the default finish then leaves NumPy's order (the hazard the GPU
conformance run found), a ``finish`` that declines (None) keeps the in-order rounds, and an
in-order ``finish`` gives ``np.add.at``'s bits. CuPy's own finish (``meshembed_array_api.native``) runs in the
GPU conformance run (scripts/gpu_check.sh)."""

from __future__ import annotations

import array_api_compat.numpy as cnp
import numpy as np

from meshembed_array_api import kernels


class TreeScan:
    """``array_api_compat.numpy`` with a Hillis-Steele (log-step, tree-order) cumulative_sum."""

    def __getattr__(self, name):
        return getattr(cnp, name)

    def cumulative_sum(self, x, axis=None, include_initial=False, **kw):
        if include_initial or x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
            return cnp.cumulative_sum(x, axis=axis, include_initial=include_initial, **kw)
        y, k = x.copy(), 1
        while k < y.shape[0]:
            z = y.copy()
            z[k:] = y[k:] + y[:-k]
            y, k = z, 2 * k
        return y


def _add_at(ids, values):
    uids = np.unique(ids)
    out = np.zeros((uids.size,) + values.shape[1:], values.dtype)
    np.add.at(out, np.searchsorted(uids, ids), values)
    return uids, out


def _in_order(xp, acc, svals, starts, counts):
    """An in-order ``finish``: ``((acc[i] + row) + row) + ...``, as CuPy's kernel adds."""
    out = []
    for i, (s, c) in enumerate(zip(starts, counts)):
        total = acc[i]
        for row in svals[int(s) : int(s) + int(c)]:
            total = total + row
        out.append(total)
    return np.stack(out)


def test_tree_scan_leaves_numpy_order_and_finish_restores_it():
    ids = np.zeros(4, np.int64)
    values = np.array([[1e8], [1.0], [-1e8], [1.0]], np.float32)  # in order: 1; pairwise: 0
    want = _add_at(ids, values)[1]
    assert want[0, 0] == 1.0
    _, tree = kernels.segment_sum(TreeScan(), ids, values)
    assert tree[0, 0] != want[0, 0]  # the hazard: a tree scan's own association
    for finish in (_in_order, lambda *a: None):
        _, got = kernels.segment_sum(TreeScan(), ids, values, finish)
        np.testing.assert_array_equal(got, want)


def test_zipf_batches_bit_identical_to_add_at_with_in_order_finish():
    rng = np.random.default_rng(3)
    for _ in range(5):
        ids = np.minimum(rng.zipf(1.2, 400), 60).astype(np.int64)
        values = rng.standard_normal((400, 5)).astype(np.float32) * np.float32(1e3) ** rng.integers(-1, 2, (400, 1))
        uids, want = _add_at(ids, values)
        for finish in (_in_order, lambda *a: None):
            got_ids, got = kernels.segment_sum(TreeScan(), ids, values, finish)
            np.testing.assert_array_equal(got_ids, uids)
            np.testing.assert_array_equal(got, want)
        dense = kernels.segment_sum_to(TreeScan(), values, ids, 61, _in_order)
        np.testing.assert_array_equal(dense[uids], want)
