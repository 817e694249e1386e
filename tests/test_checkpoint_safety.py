"""Checkpoints never touch what the library did not write, never hold values restore refuses,
and fail with a meshembed error (not OSError, RecursionError or MemoryError) — issue #31,
items 3, 10 and 11.

Each refusal is checked for its message (naming the table, slot or file and the fix) and for
leaving the files under the test directory and the engine unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import warnings

import numpy as np
import pytest

import meshembed as me
from conformance.test_engine import run, snapshot
from meshembed.embedding import checkpoint
from tests.test_checkpoint_integrity import assert_same, engine, rewrite_arrays, rewrite_manifest, state, tree


def _one_table(optimizer, name: str = "t", allow_nonfinite: bool = False) -> me.TPUEmbedding:
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name, 6, 2, optimizer=optimizer)],
                             features=[me.FeatureConfig(name, (2,), name="f")])
    return me.TPUEmbedding(cfg, backend="numpy", num_shards=1, allow_nonfinite=allow_nonfinite)


def _refused_save(emb, path: pathlib.Path, message: str) -> str:
    root = path.parent
    before_files, before_state = tree(root), state(emb)
    with pytest.raises(me.CheckpointError, match=message) as info:
        emb.save(path)
    assert tree(root) == before_files
    assert_same(state(emb), before_state)
    return str(info.value)


# ------------------------------------------------------------------------------- item 3: what save may touch
def test_save_keeps_user_directories_named_like_its_leftovers(tmp_path):
    """A name says nothing: copies, backups and empty directories named `<name>.old-<8 hex>` or
    `<name>.tmp-<8 hex>` are the user's, and survive every save of the path."""
    emb = engine()
    emb.save(tmp_path / "model")
    emb.save(tmp_path / "run")
    shutil.copytree(tmp_path / "model", tmp_path / "model.old-20261204")  # a dated backup
    shutil.copytree(tmp_path / "run", tmp_path / "run.tmp-cafebabe")
    (tmp_path / "model.tmp-00000000").mkdir()  # empty
    (tmp_path / "model.old-12345678").mkdir()
    (tmp_path / "model.old-12345678" / "manifest.json").write_bytes((tmp_path / "model" / "manifest.json").read_bytes())
    before = {k: v for k, v in tree(tmp_path).items() if k.split("/")[0] not in ("model", "run")}
    run(emb, steps=1, start=1)
    emb.save(tmp_path / "model")
    emb.save(tmp_path / "run")
    assert {k: v for k, v in tree(tmp_path).items() if k.split("/")[0] not in ("model", "run")} == before
    assert_same(state(me.TPUEmbedding.restore(tmp_path / "model")), state(emb))


@pytest.mark.parametrize("name", checkpoint.FILES)
def test_save_refuses_a_checkpoint_holding_a_directory_named_like_its_file(tmp_path, name):
    """`arrays.npz/` (a user's directory) inside a checkpoint: save would move it away."""
    emb = engine()
    emb.save(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / name
    target.unlink()
    target.mkdir()
    (target / "data.bin").write_bytes(b"user data")
    message = rf"its '{name}' is a directory or link, not the file a meshembed checkpoint has"
    text = _refused_save(emb, tmp_path / "ckpt", message)
    assert "Nothing was touched" in text


def test_save_refuses_a_checkpoint_holding_a_foreign_marker_file(tmp_path):
    emb = engine()
    emb.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / checkpoint.MARKER).write_text("my own notes")
    _refused_save(emb, tmp_path / "ckpt", r"does not have \(\['.meshembed-save'\]\)")


def test_restore_does_not_pick_a_users_old_copy(tmp_path):
    emb = engine()
    emb.save(tmp_path / "m")
    os.rename(tmp_path / "m", tmp_path / "m.old-20261204")
    before = tree(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "restoring m.old-..." warning either
        with pytest.raises(me.CheckpointError, match=r"No checkpoint at '.*/m': the path does not exist\. "
                                                     r"\['m.old-20261204'\] next to it is not marked .*pass its path"):
            me.TPUEmbedding.restore(tmp_path / "m")
    assert tree(tmp_path) == before
    assert_same(state(me.TPUEmbedding.restore(tmp_path / "m.old-20261204")), state(emb))


def test_restore_recovers_the_marked_copy_of_an_interrupted_save_and_says_so(tmp_path, monkeypatch):
    emb = engine()
    emb.save(tmp_path / "m")
    saved = state(emb)
    real, calls = os.replace, []

    def replace(a, b):  # the first rename (m -> m.old-*) works, then the power is cut
        calls.append(a)
        if len(calls) > 1:
            raise OSError("power cut")
        return real(a, b)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    run(emb, steps=1, start=1)
    with pytest.raises(OSError, match="power cut"):
        emb.save(tmp_path / "m")
    monkeypatch.undo()
    left = [n for n in os.listdir(tmp_path) if n.startswith("m.old-")]
    assert len(left) == 1 and not (tmp_path / "m").exists()
    marker = json.loads((tmp_path / left[0] / checkpoint.MARKER).read_text())
    assert marker["meshembed"] == checkpoint.FORMAT and marker["dir"] == left[0] and marker["for"] == "m"
    assert marker["pid"] == os.getpid() and len(marker["token"]) == 32
    shutil.copytree(tmp_path / left[0], tmp_path / "m.old-00000000")  # a copy: its marker names another dir
    with pytest.warns(UserWarning, match=rf"restoring .*{left[0]}.*interrupted .*marker"):
        assert_same(state(me.TPUEmbedding.restore(tmp_path / "m")), saved)
    emb.save(tmp_path / "m")
    assert sorted(os.listdir(tmp_path)) == ["m", "m.old-00000000"]


# ------------------------------------------------------------------------------- item 10: values
def _nan_engine(allow: bool) -> me.TPUEmbedding:
    emb = _one_table(me.embedding.Adagrad(0.1), allow_nonfinite=allow)
    params = np.ones((6, 2), np.float32)
    params[3, 1] = np.nan
    acc = np.full((6, 2), 0.1, np.float32)
    acc[4, 0] = np.inf
    emb.load_parameters("t", params, accumulators=acc, allow_nonfinite=True)
    return emb


def test_nan_table_is_refused_at_save_naming_table_slot_and_fix(tmp_path):
    emb = _nan_engine(allow=False)
    text = _refused_save(emb, tmp_path / "ckpt", r"table 't' `parameters` holds nan \(first at row 3, column 1\)")
    assert "Nothing was written" in text and "allow_nonfinite=True" in text
    assert not (tmp_path / "ckpt").exists()


def test_engine_allowing_nonfinite_saves_and_restores_its_nan_tables(tmp_path):
    emb = _nan_engine(allow=True)
    path = emb.save(tmp_path / "ckpt")
    before = tree(tmp_path)
    with pytest.raises(me.CheckpointError, match=r"array 't0.parameters' \(table 't', `parameters`\) holds nan "
                                                 r"\(first at row 3, column 1\).*restore it with `allow_nonfinite=True`"):
        checkpoint.restore(me.TPUEmbedding, path)
    with pytest.raises(me.InputError, match="allow_nonfinite"):
        checkpoint.restore(me.TPUEmbedding, path, allow_nonfinite="yes")
    assert tree(tmp_path) == before
    back = checkpoint.restore(me.TPUEmbedding, path, allow_nonfinite=True)
    assert back.allow_nonfinite
    for name, arr in emb.retrieve_parameters("t").items():
        np.testing.assert_array_equal(back.retrieve_parameters("t")[name], arr)  # NaN == NaN here


NON_NEGATIVE = [
    (me.embedding.Adagrad(0.1), "accumulators"),
    (me.embedding.Adadelta(0.1, rho=0.9, epsilon=1e-6), "accumulators"),
    (me.embedding.Adadelta(0.1, rho=0.9, epsilon=1e-6), "updates"),
    (me.embedding.RMSProp(0.1), "ms"),
    (me.embedding.CenteredRMSProp(0.1), "ms"),
    (me.embedding.Adam(0.1), "velocities"),
    (me.embedding.FTRL(0.1), "accumulators"),
    (me.embedding.ProximalAdagrad(0.1), "accumulators"),
    (me.embedding.ProximalYogi(0.1), "v"),
]


@pytest.mark.parametrize("optimizer,slot", NON_NEGATIVE, ids=[f"{type(o).__name__}-{s}" for o, s in NON_NEGATIVE])
def test_negative_or_nan_slot_is_refused_at_load(tmp_path, optimizer, slot):
    emb = _one_table(optimizer)
    key = f"t0.{slot}"
    negative = rf"but the {optimizer.algorithm} update needs `{slot}` >= 0"
    for value, allow, message in [(-0.5, False, rf"holds -0.5 \(first at row 2, column 1\), {negative}"),
                                  (np.nan, False, r"holds nan \(first at row 2, column 1\): NaN/Inf"),
                                  (-np.inf, True, rf"holds -inf \(first at row 2, column 1\), {negative}")]:
        def edit(arrays, value=value):
            arrays[key] = arrays[key].copy()
            arrays[key][2, 1] = value

        path = emb.save(tmp_path / "ckpt")  # replaces the edited one of the previous round
        rewrite_arrays(path, edit)
        before = tree(tmp_path)
        with pytest.raises(me.CheckpointError, match=rf"array '{key}' \(table 't', `{slot}`\) {message}"):
            checkpoint.restore(me.TPUEmbedding, path, allow_nonfinite=allow)
        assert tree(tmp_path) == before


def test_negative_slot_is_refused_at_save(tmp_path):
    emb = _one_table(me.embedding.Adadelta(0.1, rho=0.9, epsilon=1e-6))
    updates = np.zeros((6, 2), np.float32)
    updates[5, 0] = -1.0
    emb.load_parameters("t", updates=updates)
    text = _refused_save(emb, tmp_path / "ckpt", r"table 't' `updates` holds -1.0 \(first at row 5, column 0\), "
                                                 r"but the adadelta update needs `updates` >= 0")
    assert "Nothing was written" in text and "load_parameters('t'" in text


def test_slots_that_may_be_negative_round_trip(tmp_path):
    """Momenta, FTRL's linears, centered RMSProp's mg: any sign is a state training reaches."""
    for optimizer, slots in [(me.embedding.FTRL(0.1), ("linears",)), (me.embedding.Adam(0.1), ("momenta",)),
                             (me.embedding.CenteredRMSProp(0.1), ("mom", "mg"))]:
        emb = _one_table(optimizer)
        emb.load_parameters("t", -np.ones((6, 2), np.float32), **{s: -np.ones((6, 2), np.float32) for s in slots})
        path = emb.save(tmp_path / optimizer.algorithm)
        assert_same(state(me.TPUEmbedding.restore(path)), state(emb))


@pytest.mark.parametrize("opening,closing", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_manifest_is_a_checkpoint_error(tmp_path, opening, closing):
    emb = engine()
    path = emb.save(tmp_path / "ckpt")
    (path / "manifest.json").write_text(opening * 100_000 + "1" + closing * 100_000)
    before = tree(tmp_path)
    with pytest.raises(me.CheckpointError, match=r"manifest.json is nested too deeply"):
        me.TPUEmbedding.restore(path)
    assert tree(tmp_path) == before
    _refused_save(emb, path, r"manifest.json does not mark it as a meshembed checkpoint")


def test_250_character_names(tmp_path):
    """A table name of 250 characters, and a checkpoint directory name of 250 and of 255 (the
    usual limit): the siblings a save writes next to it must still fit."""
    name = "x" * 250
    emb = _one_table(me.embedding.Adagrad(0.1), name=name)
    path = emb.save(tmp_path / "ckpt")
    assert me.TPUEmbedding.restore(path).table_names == [name]
    for n in (250, 255):
        long = tmp_path / ("c" * n)
        emb.save(long)
        emb.save(long)  # replacing it sets the old one aside under a bounded name
        assert_same(state(me.TPUEmbedding.restore(long)), state(emb))
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", "c" * 250, "c" * 255])


@pytest.mark.parametrize("mode,message", [(0, "UNSPECIFIED"), (7, "Received: mode=7"), (-1, "Received: mode=-1")])
def test_mode_in_a_saved_config_is_validated(tmp_path, mode, message):
    from meshembed.config.proto_io import read_message

    emb = engine()
    path = emb.save(tmp_path / "ckpt")
    msg = read_message((path / "config.pb").read_bytes())
    msg.mode = mode
    data = msg.SerializeToString()
    (path / "config.pb").write_bytes(data)

    def fix(m):
        m["files"]["config.pb"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    rewrite_manifest(path, fix)
    with pytest.raises(me.CheckpointError, match=rf"config.pb is not a TPUEmbeddingConfiguration .*`mode`.*{message}"):
        me.TPUEmbedding.restore(path)


def test_a_lying_array_header_is_refused_before_any_allocation(tmp_path):
    """An .npy header claiming 2**40 rows: refused from the header, never allocated."""
    import io
    import zipfile

    emb = engine()
    path = emb.save(tmp_path / "ckpt")
    with zipfile.ZipFile(path / "arrays.npz") as z:
        members = {n: z.read(n) for n in z.namelist()}
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**40, 3)})
    members["t0.parameters.npy"] = b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + b"\x00" * 16
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    data = buf.getvalue()
    (path / "arrays.npz").write_bytes(data)
    rewrite_manifest(path, lambda m: m["files"].update({"arrays.npz": {"sha256": hashlib.sha256(data).hexdigest(),
                                                                       "size": len(data)}}))
    with pytest.raises(me.CheckpointError, match=r"array 't0.parameters' .* shape \(1099511627776, 3\); "
                                                 r"expected float32 \(13, 3\)"):
        me.TPUEmbedding.restore(path)


# ------------------------------------------------------------------------------- item 11: memory
def _no_memory(*args, **kwargs):
    raise MemoryError


def _table_bytes(emb) -> int:
    return sum(4 * t.vocabulary_size * t.dimension * (1 + len(t.optimizer.slot_names)) for t in emb.layout.tables)


def test_save_out_of_memory_states_the_bytes(tmp_path, monkeypatch):
    emb = engine()
    emb.save(tmp_path / "ckpt")
    run(emb, steps=1, start=1)
    before, before_state = tree(tmp_path), state(emb)
    monkeypatch.setattr(checkpoint.np, "ascontiguousarray", _no_memory)  # gathering the tables
    with pytest.raises(me.CheckpointError, match=rf"ran out of memory: the 2 table\(s\) with their slots take "
                                                 rf"{_table_bytes(emb)} bytes .*Nothing was written"):
        emb.save(tmp_path / "ckpt")
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint.np, "savez", _no_memory)  # writing them
    with pytest.raises(me.CheckpointError, match=rf"take {_table_bytes(emb)} bytes .*previous checkpoint"):
        emb.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert tree(tmp_path) == before
    assert_same(state(emb), before_state)


@pytest.mark.parametrize("where", ["arrays", "engine"])
def test_restore_out_of_memory_states_the_bytes(tmp_path, monkeypatch, where):
    emb = engine()
    path = emb.save(tmp_path / "ckpt")
    before = tree(tmp_path)
    if where == "arrays":
        monkeypatch.setattr(np.lib.format, "read_array", _no_memory)
    else:
        monkeypatch.setattr(me.TPUEmbedding, "load_parameters", _no_memory)
    with pytest.raises(me.CheckpointError, match=rf"Restoring the checkpoint at .*ran out of memory: the 2 "
                                                 rf"table\(s\) with their slots take {_table_bytes(emb)} bytes "
                                                 r".*Nothing was restored"):
        me.TPUEmbedding.restore(path)
    assert tree(tmp_path) == before
    monkeypatch.undo()
    assert snapshot(me.TPUEmbedding.restore(path)).keys() == snapshot(emb).keys()
