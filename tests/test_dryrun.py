"""``me.tpu.dry_run`` and ``meshembed dryrun``: hand-made batches whose counts and drops are
known by construction, an independent loop-by-loop replay of the published algorithm on
random batches, TF's ``compute_sparse_core_stats`` where its kernels run, and the id-dropping
simulation in training."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import batch as batches
from meshembed.embedding import dryrun as D
from meshembed.embedding.id_dropping import drop_from_inputs, drop_ids, simulate_id_dropping
from meshembed.embedding.layout import build_layout
from meshembed.errors import ConfigError, InputError

R = me.RaggedIds.from_lists


def cfg(b=8, combiner="sum", vocab=64, seq=None, two=False, optimizer=None):
    opt = optimizer or me.embedding.SGD(learning_rate=0.5)
    feats = [me.FeatureConfig("t", (b,), name="a")]
    if two:
        feats.append(me.FeatureConfig("t", (b,), name="b"))
    if seq:
        feats.append(me.FeatureConfig("t", (b, seq), name="s"))
    return me.EmbeddingConfig(tables=[me.TableConfig("t", vocab, 4, optimizer=opt, combiner=combiner)], features=feats)


def drops(report):
    return [(d["feature"], d["sample"], d["position"], d["id"], d["reason"]) for d in report.dropped]


# -- known by construction ----------------------------------------------------------------------
def test_unique_limit_drops_the_largest_ids_of_a_partition_in_order():
    # 8 samples on 4 SparseCores: core 0 gets samples 0 and 1, every id a multiple of 4 -> partition 0.
    ids = R([[0, 4, 8, 12, 16], [4, 4, 20], [1], [2], [3], [5], [6], [7]])
    r = me.tpu.dry_run(cfg(), {"a": ids}, "v5p", limits={"max_ids_per_partition": 3,
                                                          "max_unique_ids_per_partition": 2}, allow_id_dropping=True)
    t = r.table("t")
    # core 0, partition 0 after dedup: 0 4 4(sample 1) 8 12 16 20 = 7 ids, 6 distinct (the second 4 of sample 1 merged)
    assert t["observed"] == {"max_ids_per_partition": 7, "max_unique_ids_per_partition": 6}
    assert t["ids"] == {"input": 14, "after_dedup": 13}
    assert t["partitions"][0] == {"partition": 0, "max_ids": 7, "max_unique_ids": 6, "total_ids": 7}
    # kept: 0, 4 (two samples); id 8 is the third distinct id: it and every later id go
    assert drops(r) == [("a", 0, 2, 8, "max_unique_ids_per_partition"), ("a", 0, 3, 12, "max_unique_ids_per_partition"),
                        ("a", 0, 4, 16, "max_unique_ids_per_partition"), ("a", 1, 2, 20, "max_unique_ids_per_partition")]
    assert [(d["chip"], d["core"], d["partition"]) for d in r.dropped] == [(0, 0, 0)] * 4
    assert t["status"] == "drops" and t["dropped_ids"] == 4
    assert list(r.drops[0]) == [0] and r.drops[0][0].tolist() == [2, 3, 4, 7]
    assert t["suggested_limits"]["max_ids_per_partition"] == 7
    assert t["suggested_limits"]["max_unique_ids_per_partition"] == 6


def test_ids_limit_counts_one_id_per_sample_and_drops_later_samples_with_their_duplicates():
    # core 0 (samples 0, 1) and core 1 (2, 3) of 2 v6e chips (4 partitions): id 8 there, others elsewhere.
    ids = R([[8, 8], [8], [8, 8, 8], [8], [1], [2], [3], [5]])
    r = me.tpu.dry_run(cfg(), [{"a": ids}], "v6e", chips=2, limits={"max_ids_per_partition": 1},
                       allow_id_dropping=True)
    # each core sends one id per sample to partition 0: 2 ids, 1 distinct; the second sample goes,
    # with all of its copies (sample 2's three 8s are one merged id)
    assert r.table("t")["observed"] == {"max_ids_per_partition": 2, "max_unique_ids_per_partition": 1}
    assert drops(r) == [("a", 1, 0, 8, "max_ids_per_partition"), ("a", 3, 0, 8, "max_ids_per_partition")]
    r2 = me.tpu.dry_run(cfg(), [{"a": R([[8], [8], [8, 8, 8], [1], [2], [3], [5], [6]])}], "v6e", chips=2,
                        limits={"max_ids_per_partition": 1}, allow_id_dropping=True)
    assert drops(r2) == [("a", 1, 0, 8, "max_ids_per_partition")]  # sample 2 is on core 1, alone there
    r3 = me.tpu.dry_run(cfg(), [{"a": R([[8], [8, 8, 8], [1], [2], [3], [5], [6], [7]])}], "v6e", chips=2,
                        limits={"max_ids_per_partition": 1}, allow_id_dropping=True)
    assert drops(r3) == [("a", 1, 0, 8, "max_ids_per_partition"), ("a", 1, 1, 8, "max_ids_per_partition"),
                         ("a", 1, 2, 8, "max_ids_per_partition")]  # a dropped id takes its duplicates along


def test_features_of_one_table_share_partitions_ordered_by_id_then_feature():
    a = R([[4], [], [], [], [], [], [], []])
    b = R([[0, 4], [], [], [], [], [], [], []])
    r = me.tpu.dry_run(cfg(two=True), {"a": a, "b": b}, "v5p", limits={"max_ids_per_partition": 2},
                       allow_id_dropping=True)
    # partition 0 of core 0: id 0 (b), id 4 (a), id 4 (b): the third goes
    assert drops(r) == [("b", 0, 1, 4, "max_ids_per_partition")]


def test_sequence_features_report_sample_and_position_and_never_merge_positions():
    seq = np.zeros((8, 3), np.int64)  # id 0 at every position: one id per (sample, position) row
    pooled = np.array([1, 2, 3, 5, 6, 7, 9, 10])  # never in partition 0
    r = me.tpu.dry_run(cfg(seq=3), {"a": pooled, "s": seq}, "v5p",
                       limits={"max_ids_per_partition": 4}, allow_id_dropping=True)
    # each core holds 6 rows of the sequence (2 samples x 3 positions), all id 0: its last 2 rows go
    assert r.table("t")["observed"]["max_ids_per_partition"] == 6
    assert drops(r) == [("s", s, p, 0, "max_ids_per_partition") for s in (1, 3, 5, 7) for p in (1, 2)]
    assert [d["core"] for d in r.dropped] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_without_id_dropping_an_overflow_is_an_error_and_nothing_is_listed():
    ids = R([[0, 4, 8], [], [], [], [], [], [], []])
    r = me.tpu.dry_run(cfg(), {"a": ids}, "v4", limits={"max_unique_ids_per_partition": 2})
    assert r.table("t")["status"] == "error" and r.table("t")["over_limit"] == {"ids": False, "unique_ids": True}
    assert r.dropped == [] and r.drops == [{}]
    ok = me.tpu.dry_run(cfg(), {"a": ids}, "v4")
    assert ok.table("t")["status"] == "ok"


def test_tensorflow_algorithm_drops_at_the_padded_chip_buffer_and_fails_on_partition_limits():
    ids = R([[0, 4, 8, 12, 16], [4, 4, 20], [1], [2], [3], [5], [6], [7]])
    r = me.tpu.dry_run(cfg(), {"a": ids}, "v5p", algorithm="tensorflow", allow_id_dropping=True,
                       limits={"max_ids_per_chip_per_sample": 1})
    # buffer 1 x 8 rows = 8 slots: core 0's partition 0 (7 ids, padded to 8) fills it; the rest goes,
    # in packing order: core 1 partitions 1, 2; core 2 partitions 1, 3; core 3 partitions 2, 3
    assert [(d["sample"], d["id"], d["core"], d["partition"]) for d in r.dropped] == [
        (2, 1, 1, 1), (3, 2, 1, 2), (5, 5, 2, 1), (4, 3, 2, 3), (6, 6, 3, 2), (7, 7, 3, 3)]
    assert {d["reason"] for d in r.dropped} == {"max_ids_per_chip_per_sample"}
    t = r.table("t")
    assert t["csr"]["allocated_entries_per_chip"] == 8 and t["csr"]["required_entries_per_chip"] == 56
    assert t["suggested_limits"]["max_ids_per_chip_per_sample"] == 7
    err = me.tpu.dry_run(cfg(), {"a": ids}, "v5p", algorithm="tensorflow", allow_id_dropping=True,
                         limits={"max_ids_per_partition": 5})
    assert err.table("t")["status"] == "error" and err.dropped == []  # TF fails the op, whatever the flag


def test_csr_buffer_padding_and_hbm_figures():
    ids = R([[0, 4, 8, 12, 16], [4, 4, 20], [1], [2], [3], [5], [6], [7]])
    t = me.tpu.dry_run(cfg(), {"a": ids}, "v5p", limits={"max_ids_per_partition": 3}).table("t")
    # cores hold 7+0+0+0, 0+1+1+0, 0+1+0+1, 0+0+1+1 ids: 7 partitions padded to 8 slots each
    assert t["padding"]["ids"] == 13 and t["padding"]["padded_slots"] == 56
    assert t["padding"]["overhead"] == pytest.approx(1 - 13 / 56)
    assert t["csr"]["required_entries_per_chip"] == 4 * 16  # the fullest core needs 16, each core gets as much
    assert t["csr"]["allocated_entries_per_chip"] == 8 * 4 * 4  # round8(3) x cores x partitions
    assert t["csr"]["row_pointers_per_chip"] == 8 * 4
    hbm = t["hbm_bytes_per_chip"]
    assert hbm["tables_and_slots"] == 64 * 8 * 4  # dim 4 padded to 8 floats, SGD has no slot
    assert hbm["total"] == sum(v for k, v in hbm.items() if k not in ("total", "fraction_of_hbm"))
    assert hbm["fraction_of_hbm"] == pytest.approx(hbm["total"] / (95 * 2**30))


def test_tensorcore_era_counts_with_the_configs_placement_and_no_limits():
    c = cfg(vocab=16)
    c = me.EmbeddingConfig(tables=c.tables, features=c.features, sharding_strategy="div")
    ids = R([[0, 1, 15], [2], [3], [4], [5], [6], [7], [8]])
    r = me.tpu.dry_run(c, {"a": ids}, "v3")  # 1 chip x 2 TensorCores: div rows 0-7 | 8-15
    t = r.table("t")
    assert r.data["topology"]["partitions"] == 2 and t["limits"]["max_ids_per_partition"] is None
    assert [p["max_ids"] for p in t["partitions"]] == [5, 1]  # core 0: 0 1 2 3 4 | 15; core 1: 5 6 7 | 8
    assert [p["total_ids"] for p in t["partitions"]] == [8, 2]
    assert t["status"] == "ok"
    with pytest.raises(ConfigError, match="SparseCore"):
        me.tpu.dry_run(c, {"a": ids}, "v3", algorithm="tensorflow")


def test_bad_topologies_and_batches_are_refused():
    with pytest.raises(ConfigError, match="power of two"):
        me.tpu.dry_run(cfg(b=12), {"a": np.arange(12)}, "v5p", chips=3)
    with pytest.raises(ConfigError, match="Expected one of"):
        me.tpu.dry_run(cfg(), {"a": np.arange(8)}, "v9")
    with pytest.raises(InputError, match="split evenly"):
        me.tpu.dry_run(cfg(b=6), {"a": np.arange(6)}, "v5p")
    with pytest.raises(ConfigError, match="unknown tables"):
        me.tpu.dry_run(cfg(), {"a": np.arange(8)}, limits={"nope": {"max_ids_per_partition": 1}})
    with pytest.raises(InputError, match="no batch"):
        me.tpu.dry_run(cfg(), [])


# -- an independent replay, one id at a time ----------------------------------------------------
def replay(layout, batch, partitions, max_ids, max_unique):
    """The OpenXLA sparsecore.md steps and jax-tpu-embedding's dropping loop, written as loops."""
    groups: dict[tuple[int, int], list] = {}
    for f in layout.features:
        d = batch.features[f.index]
        rows = d.num_slots // partitions
        seen = set()
        for k, (i, s) in enumerate(zip(d.ids.tolist(), d.slots.tolist())):
            key = (f.index, s, i)
            groups.setdefault((s // rows, i % partitions), []).append((i, f.index, s, k, key in seen))
            seen.add(key)
    counts, dropped = {}, []
    for g in sorted(groups):
        n = u = 0
        last_id, fate = None, {}
        for i, f, s, k, dup in sorted(groups[g]):
            if dup:
                if fate[(f, s, i)]:
                    dropped.append((f, k))
                continue
            if i != last_id:
                u += 1
                last_id = i
            n += 1
            fate[(f, s, i)] = n > max_ids or u > max_unique
            if fate[(f, s, i)]:
                dropped.append((f, k))
        counts[g] = (n, u)
    return counts, sorted(dropped)


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_plan_matches_a_loop_replay(seed):
    rng = np.random.default_rng(seed)
    chips, spc = [(1, 4), (2, 2), (4, 4)][seed % 3]
    b = 16 * chips
    c = cfg(b=b, seq=2, two=True, vocab=40)
    rows = lambda: R([list(rng.integers(0, 40, int(k))) for k in rng.integers(0, 6, b)])  # noqa: E731
    layout = build_layout(c)
    batch = batches.prepare(layout, {"a": rows(), "b": rows(), "s": rng.integers(0, 8, (b, 2))})
    max_ids, max_unique = int(rng.integers(2, 8)), int(rng.integers(1, 6))
    topo = D.resolve_topology("v5p", chips, spc)
    r = D.analyze(layout, [batch], topo, limits=D.Limits(max_ids, max_unique), allow_id_dropping=True)
    counts, dropped = replay(layout, batch, topo.partitions, max_ids, max_unique)
    t = r.table("t")
    assert t["observed"]["max_ids_per_partition"] == max(n for n, _ in counts.values())
    assert t["observed"]["max_unique_ids_per_partition"] == max(u for _, u in counts.values())
    plan = D.plan_drops(layout, batch, topo, {"t": D.Limits(max_ids, max_unique)})
    assert sorted((f, int(k)) for f, ks in plan.items() for k in ks) == dropped
    assert len(r.dropped) == len(dropped)


# -- TensorFlow ---------------------------------------------------------------------------------
def test_counts_agree_with_tensorflows_compute_sparse_core_stats():
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.tpu import tpu_embedding_v3 as v3

    E = tf.tpu.experimental.embedding
    table = E.TableConfig(vocabulary_size=64, dim=8, name="t", combiner="sum")
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 64, int(k))) for k in rng.integers(1, 6, 16)]
    ragged = tf.ragged.constant(rows, dtype=tf.int64)
    try:
        ids, uniq = v3.TPUEmbeddingV2.compute_sparse_core_stats(
            {"a": ragged}, {"a": E.FeatureConfig(table, output_shape=[16])}, num_tpu_chips=1, num_sc_per_chip=4,
            optimizer=E.SGD(0.1))
    except tf.errors.NotFoundError as exc:  # tensorflow-cpu registers no kernel for these ops
        pytest.skip(f"TF's SparseCore preprocessing kernels are not registered here (docs/dryrun.md): "
                    f"{str(exc).splitlines()[0][:120]}")
    ours = me.tpu.dry_run(cfg(b=16), {"a": R(rows)}, "v5p").table("t")["observed"]
    assert (int(ids["t"]), int(uniq["t"])) == (ours["max_ids_per_partition"], ours["max_unique_ids_per_partition"])


def test_tensorflows_sparse_core_embedding_config_gives_the_limits():
    tf = pytest.importorskip("tensorflow")
    sc = tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig(
        max_ids_per_table={"t": 1}, max_unique_ids_per_table={"t": 5}, allow_id_dropping=True)
    r = me.tpu.dry_run(cfg(), {"a": R([[8], [8], [1], [2], [3], [5], [6], [7]])}, "v5p", limits=sc)
    assert r.data["allow_id_dropping"] is True
    assert r.table("t")["limits"] == {"max_ids_per_partition": 1, "max_unique_ids_per_partition": 5,
                                      "max_ids_per_chip_per_sample": 64}
    assert drops(r) == [("a", 1, 0, 8, "max_ids_per_partition")]


# -- config and batch forms, JSON ---------------------------------------------------------------
def test_every_config_form_gives_the_same_report(tmp_path):
    E = me.tpu
    ids = R([[0, 4, 8], [1], [2], [3], [5], [6], [7], [9]])
    nest = {"a": E.FeatureConfig(E.TableConfig(64, 4, combiner="sum", name="t"))}
    c = cfg()
    path = tmp_path / "cfg.pbtxt"
    path.write_text(c.to_text())
    np.savez(tmp_path / "b0.npz", **{"a:values": ids.values, "a:row_splits": ids.row_splits})
    reports = [me.tpu.dry_run(x, {"a": ids}, limits={"max_ids_per_partition": 2}, allow_id_dropping=True)
               for x in (nest, c, c.to_proto(), path)]
    reports.append(me.tpu.dry_run(c, [tmp_path / "b0.npz"], limits={"max_ids_per_partition": 2},
                                  allow_id_dropping=True))
    first = reports[0].to_dict()
    for r in reports[1:]:
        assert r.to_dict()["tables"][0]["partitions"] == first["tables"][0]["partitions"]
        assert r.dropped == first["dropped"]


def test_json_follows_the_documented_schema():
    r = me.tpu.dry_run(cfg(), [{"a": np.arange(8)}, {"a": np.arange(8) * 4}], "v6e", chips=2)
    data = json.loads(r.to_json())
    assert data["schema"] == "meshembed.dryrun/1" and data["num_batches"] == 2
    assert set(data) == {"schema", "topology", "algorithm", "allow_id_dropping", "num_batches", "tables", "dropped",
                         "assumptions"}
    assert set(data["topology"]) == {"name", "chips", "sparse_cores_per_chip", "tensor_cores_per_chip",
                                     "hbm_bytes_per_chip", "source", "partitions"}
    t = data["tables"][0]
    assert set(t) == {"name", "vocabulary_size", "dimension", "features", "limits", "status", "over_limit", "ids",
                      "dropped_ids", "observed", "partitions", "csr", "padding", "hbm_bytes_per_chip",
                      "suggested_limits"}
    assert len(t["partitions"]) == 4 and t["partitions"][0]["max_ids"] == 2  # ids 0 and 4 of batch 1, core 0
    text = r.render(use_rich=False)
    assert "meshembed dry run: v6e, 2 chip(s)" in text and "suggested limits" in text


# -- simulating the drops in training -----------------------------------------------------------
def test_simulate_id_dropping_removes_exactly_the_planned_ids_and_keeps_gains():
    c = cfg(combiner="mean")
    layout = build_layout(c)
    ids = R([[0, 4, 8, 12, 16], [4, 4, 20], [1], [2], [3], [5], [6], [7]])
    batch = batches.prepare(layout, [ids])
    out = simulate_id_dropping(batch, "v5p", limits={"max_unique_ids_per_partition": 2})
    assert out.features[0].ids.tolist() == [0, 4, 4, 4, 1, 2, 3, 5, 6, 7]
    np.testing.assert_array_equal(out.features[0].scale[:4], np.float32([1 / 5, 1 / 5, 1 / 3, 1 / 3]))  # w/Σw before the drop
    assert batch.features[0].ids.shape == (14,)  # pure: the input batch is unchanged
    assert drop_ids(batch, {}) is batch


def test_training_on_a_dropped_batch_equals_training_without_those_ids():
    c = cfg(combiner="sum")
    ids = R([[0, 4, 8, 12, 16], [4, 4, 20], [1], [2], [3], [5], [6], [7]])
    lim = {"max_unique_ids_per_partition": 2}
    emb = me.TPUEmbedding(c, backend="numpy", num_shards=2, seed=1)
    emb.enqueue_batch(simulate_id_dropping(batches.prepare(emb.layout, [ids]), "v5p", limits=lim))
    emb.dequeue()
    emb.apply_gradients([np.ones((8, 4), np.float32)])
    ref = me.TPUEmbedding(c, backend="numpy", num_shards=2, seed=1)
    ref.enqueue([R([[0, 4], [4, 4], [1], [2], [3], [5], [6], [7]])])
    ref.dequeue()
    ref.apply_gradients([np.ones((8, 4), np.float32)])
    np.testing.assert_array_equal(emb.embedding_tables["t"], ref.embedding_tables["t"])
    feats, weights = drop_from_inputs(emb.layout, {"a": ids}, None, "v5p", limits=lim)
    assert weights is None and set(feats) == {"a"}
    assert batches.prepare(emb.layout, feats).features[0].ids.tolist() == [0, 4, 4, 4, 1, 2, 3, 5, 6, 7]


def test_drop_from_inputs_warns_when_mean_would_renormalise():
    c = cfg(combiner="mean")
    layout = build_layout(c)
    ids = R([[0, 4, 8], [1], [2], [3], [5], [6], [7], [9]])
    with pytest.warns(UserWarning, match="renormalise"):
        drop_from_inputs(layout, [ids], None, "v5p", limits={"max_unique_ids_per_partition": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drop_from_inputs(layout, [ids], None, "v5p")  # nothing dropped: nothing to warn about


# -- the command --------------------------------------------------------------------------------
def test_the_command_reads_npz_batches_and_writes_json(tmp_path, capsys):
    from meshembed import dryrun_cli

    c = cfg()
    (tmp_path / "c.pb").write_bytes(c.to_proto())
    ids = R([[0, 4, 8, 12, 16], [4, 4, 20], [1], [2], [3], [5], [6], [7]])
    np.savez(tmp_path / "b.npz", **{"a:values": ids.values, "a:row_splits": ids.row_splits})
    import argparse

    parser = argparse.ArgumentParser(prog="meshembed")
    dryrun_cli.add_parser(parser.add_subparsers(dest="command"))
    help_text = parser._subparsers._group_actions[0].choices["dryrun"].format_help()
    assert "NAME:row_splits" in help_text and "meshembed.dryrun/1" in help_text and "Exit status" in help_text
    args = parser.parse_args(["dryrun", str(tmp_path / "b.npz"), "--config", str(tmp_path / "c.pb"),
                              "--limits", '{"max_unique_ids_per_partition": 2}', "--allow-id-dropping", "--plain",
                              "--json", str(tmp_path / "r.json")])
    assert dryrun_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "dropped ids (4" in out and "max_unique_ids_per_partition" in out
    assert len(json.loads((tmp_path / "r.json").read_text())["dropped"]) == 4
    args = parser.parse_args(["dryrun", str(tmp_path / "b.npz"), "--config", str(tmp_path / "c.pb"),
                              "--limits", '{"max_unique_ids_per_partition": 2}', "--json", "-"])
    assert dryrun_cli.main(args) == 1  # would fail on the TPU
    assert json.loads(capsys.readouterr().out)["tables"][0]["status"] == "error"
    args = parser.parse_args(["dryrun", str(tmp_path / "missing.npz"), "--config", str(tmp_path / "c.pb")])
    assert dryrun_cli.main(args) == 2
