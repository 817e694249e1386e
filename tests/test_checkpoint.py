"""Checkpoints: pickle-free files, atomic writes (a failure mid-write keeps the previous
checkpoint), and restore into another shard count / backend continuing identically."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import checkpoint
from conformance.test_engine import assert_same_state, config, run, snapshot


def test_restore_into_other_shard_count_continues_identically(tmp_path):
    straight = me.TPUEmbedding(config(me.embedding.Adadelta(0.5, rho=0.9, epsilon=1e-6), strategy="mod"),
                               num_shards=2, seed=7)
    run(straight, steps=4)
    first = me.TPUEmbedding(config(me.embedding.Adadelta(0.5, rho=0.9, epsilon=1e-6), strategy="mod"),
                            num_shards=2, seed=7)
    run(first, steps=2)
    first.save(tmp_path / "ckpt")
    resumed = me.TPUEmbedding.restore(tmp_path / "ckpt", num_shards=3)
    assert resumed.num_shards == 3 and resumed.step == 2
    run(resumed, steps=2, start=2)
    assert_same_state(snapshot(straight), snapshot(resumed))


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_restore_on_another_backend(tmp_path, name):
    if name not in me.available_backends():
        pytest.skip(f"{name} backend not available")
    emb = me.TPUEmbedding(config(), num_shards=1)
    run(emb, steps=2)
    emb.save(tmp_path / "ckpt")
    other = me.TPUEmbedding.restore(tmp_path / "ckpt", backend=name, num_shards=2)
    assert other.backend.name == name
    assert_same_state(snapshot(emb), snapshot(other))


def test_restore_keeps_each_tables_combiner(tmp_path):
    """The proto has no combiner field (TF passes combiners to the enqueue op), so the
    manifest keeps them: a "sum" table must not come back as the proto default "mean"."""
    cfg = config()
    tables = [me.TableConfig("a", 13, 3, optimizer=me.embedding.Adagrad(0.1), combiner="sum"),
              me.TableConfig("b", 7, 2, optimizer=me.embedding.Adagrad(0.1), combiner="sqrtn")]
    cfg = me.EmbeddingConfig(tables=tables, features=cfg.features, sharding_strategy="div")
    emb = me.TPUEmbedding(cfg)
    run(emb, steps=1)
    emb.save(tmp_path / "ckpt")
    restored = me.TPUEmbedding.restore(tmp_path / "ckpt")
    assert [t.combiner for t in restored.config.tables] == ["sum", "sqrtn"]
    run(emb, steps=1, start=1)
    run(restored, steps=1, start=1)
    assert_same_state(snapshot(emb), snapshot(restored))


def test_files_are_pickle_free_and_self_describing(tmp_path):
    emb = me.TPUEmbedding(config())
    run(emb, steps=1)
    path = emb.save(tmp_path / "ckpt") or tmp_path / "ckpt"
    assert sorted(p.name for p in path.iterdir()) == ["arrays.npz", "config.pb", "manifest.json"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and [t["name"] for t in manifest["tables"]] == ["a", "b"]
    assert (path / "config.pb").read_bytes() == emb.config.to_proto()
    with zipfile.ZipFile(path / "arrays.npz") as z:
        assert all(n.endswith(".npy") for n in z.namelist())
    with np.load(path / "arrays.npz", allow_pickle=False) as npz:
        assert set(npz.files) == {"t0.parameters", "t0.accumulators", "t1.parameters", "t1.accumulators"}
    assert me.EmbeddingConfig.from_proto((path / "config.pb").read_bytes()).to_proto() == emb.config.to_proto()


def test_failure_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    emb = me.TPUEmbedding(config())
    run(emb, steps=1)
    emb.save(tmp_path / "ckpt")
    saved = snapshot(emb)
    run(emb, steps=1, start=1)

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(checkpoint, "_write_file", crash)
    with pytest.raises(OSError, match="injected"):
        emb.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # temp dir cleaned up
    restored = me.TPUEmbedding.restore(tmp_path / "ckpt")
    assert restored.step == 1
    assert_same_state(saved, snapshot(restored))


def _fail_renames_from(monkeypatch, n: int, why: str, only: bool = False) -> None:
    """Make save's ``n``-th rename raise OSError(why) (and every later one, unless ``only``)."""
    real_replace = checkpoint.os.replace
    calls = []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == n or (len(calls) > n and not only):
            raise OSError(f"{why} (injected)")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)


def test_crash_between_renames_falls_back_to_previous(tmp_path, monkeypatch):
    emb = me.TPUEmbedding(config())
    emb.save(tmp_path / "ckpt")
    saved = snapshot(emb)
    run(emb, steps=1)
    _fail_renames_from(monkeypatch, 2, "power cut")  # old moved aside, new not yet in place
    with pytest.raises(OSError, match="power cut"):
        emb.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert not (tmp_path / "ckpt").exists()
    with pytest.warns(UserWarning, match=r"restoring .*ckpt\.old-"):
        restored = me.TPUEmbedding.restore(tmp_path / "ckpt")
    assert_same_state(saved, snapshot(restored))
    emb.save(tmp_path / "ckpt")  # the next good save removes the copy left aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_corrupt_checkpoint_is_refused(tmp_path):
    emb = me.TPUEmbedding(config())
    emb.save(tmp_path / "ckpt")
    data = bytearray((tmp_path / "ckpt" / "arrays.npz").read_bytes())
    data[-30] ^= 0xFF
    (tmp_path / "ckpt" / "arrays.npz").write_bytes(bytes(data))
    with pytest.raises(me.CheckpointError, match=r"arrays\.npz does not match its checksum"):
        me.TPUEmbedding.restore(tmp_path / "ckpt")
    with pytest.raises(me.CheckpointError, match="No checkpoint"):
        me.TPUEmbedding.restore(tmp_path / "missing")


def test_failed_second_rename_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    emb = me.TPUEmbedding(config())
    emb.save(tmp_path / "ckpt")
    saved = snapshot(emb)
    run(emb, steps=1)
    _fail_renames_from(monkeypatch, 2, "rename failed", only=True)  # e.g. EXDEV, EBUSY
    with pytest.raises(OSError, match="rename failed"):
        emb.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_same_state(saved, snapshot(me.TPUEmbedding.restore(tmp_path / "ckpt")))


def test_dict_config_restores_as_a_dict_in_the_given_key_order(tmp_path):
    """config.pb cannot hold a features dict's keys; the manifest does, so a restored engine
    still returns activations by key (a positional list could be unpacked in another order)."""
    import meshembed as me

    table = me.TableConfig(name="t", vocabulary_size=8, dimension=2,
                           optimizer=me.embedding.SGD(learning_rate=0.1))
    features = {"user": me.FeatureConfig(table="t", input_shape=(2,)),
                "item": me.FeatureConfig(table="t", input_shape=(2,))}
    emb = me.TPUEmbedding(me.EmbeddingConfig(tables=[table], features=features), backend="numpy")
    emb.save(tmp_path / "ckpt")
    back = me.TPUEmbedding.restore(tmp_path / "ckpt", backend="numpy")
    batch = {"user": np.array([1, 2]), "item": np.array([3, 4])}
    for engine in (emb, back):
        engine.enqueue(batch)
    acts, restored = emb.dequeue(), back.dequeue()
    assert list(restored) == ["user", "item"]
    for key in acts:
        np.testing.assert_array_equal(restored[key], acts[key])
