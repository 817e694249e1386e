"""MOD/DIV placement: the spec's worked examples and a property-tested round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshembed.sharding import Placement, shard, unshard


def test_spec_examples_v13_n5():
    mod = Placement(13, 5, "mod")
    div = Placement(13, 5, "div")
    assert [list(mod.global_ids(s)) for s in range(5)] == [[0, 5, 10], [1, 6, 11], [2, 7, 12], [3, 8], [4, 9]]
    assert [list(div.global_ids(s)) for s in range(5)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]
    assert mod.shard_sizes == div.shard_sizes == (3, 3, 3, 2, 2)


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(1, 300), shards=st.integers(1, 17), strategy=st.sampled_from(["mod", "div"]))
def test_shard_unshard_round_trip(vocab, shards, strategy):
    if shards > vocab:
        with pytest.raises(ValueError, match="non-empty"):
            Placement(vocab, shards, strategy)
        return
    p = Placement(vocab, shards, strategy)
    table = np.arange(vocab * 2, dtype=np.float64).reshape(vocab, 2)
    parts = shard(table, p)
    assert [len(x) for x in parts] == list(p.shard_sizes)
    assert sum(p.shard_sizes) == vocab
    np.testing.assert_array_equal(unshard(parts, p), table)
    ids = np.arange(vocab)
    owner, local = p.owner(ids), p.local_row(ids)
    for s in range(shards):  # owner/local_row agree with the shard contents
        np.testing.assert_array_equal(parts[s][local[owner == s]], table[ids[owner == s]])
    # the first V % n shards hold one extra row
    q, r = divmod(vocab, shards)
    assert p.shard_sizes == tuple(q + (s < r) for s in range(shards))


def test_invalid_strategy_message():
    with pytest.raises(ValueError, match=r"Invalid `strategy`. Expected one of \('mod', 'div'\). Received: strategy='hash'"):
        Placement(10, 2, "hash")
