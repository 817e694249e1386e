"""Checkpoints never delete data they did not write, and restore verifies everything it reads.

Each refused call is checked three ways: the error type and message (naming the path, file
or field), the files under the test directory byte for byte (nothing touched), and the
engine (tables, slots, step and the pending batch: its next step equals a twin's)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshembed as me
from conformance.test_engine import assert_same_state, batch, config, run, snapshot
from meshembed.embedding import checkpoint

BACKENDS = ["numpy", "torch", "jax"]


def _need(name: str) -> None:
    if name not in me.available_backends():
        pytest.skip(f"{name} backend not available")


def tree(root: pathlib.Path) -> dict:
    """Every entry under ``root`` (links not followed): kind and content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = pathlib.Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def state(emb) -> tuple:
    return (snapshot(emb), emb.step, emb.seed, emb.config.to_proto(), [t.combiner for t in emb.layout.tables])


def assert_same(a: tuple, b: tuple) -> None:
    assert_same_state(a[0], b[0])
    assert set(a[0]) == set(b[0]) and all(set(a[0][t]) == set(b[0][t]) for t in a[0])
    assert a[1:] == b[1:]


def adadelta_config():
    return config(me.embedding.Adadelta(0.5, rho=0.9, epsilon=1e-6))


def engine(backend: str = "numpy", steps: int = 1):
    emb = me.TPUEmbedding(adadelta_config(), backend=backend, num_shards=1, seed=5)
    run(emb, steps=steps)
    return emb


def rewrite_manifest(ckpt: pathlib.Path, edit, rechecksum: bool = True) -> None:
    """Edit manifest.json; with ``rechecksum`` its own checksum is made to match again, so
    the edit reaches the field-by-field checks."""
    m = json.loads((ckpt / "manifest.json").read_text())
    edit(m)
    if rechecksum:
        body = {k: v for k, v in m.items() if k != "manifest_sha256"}
        m["manifest_sha256"] = hashlib.sha256(checkpoint._canonical(body)).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))


def rewrite_arrays(ckpt: pathlib.Path, edit) -> None:
    """Edit arrays.npz and update every checksum, so only the array checks can catch it."""
    with np.load(ckpt / "arrays.npz") as npz:
        arrays = {k: np.array(npz[k]) for k in npz.files}
    edit(arrays)
    with open(ckpt / "arrays.npz", "wb") as fh:
        np.savez(fh, **arrays)
    data = (ckpt / "arrays.npz").read_bytes()

    def fix(m):
        m["files"]["arrays.npz"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    rewrite_manifest(ckpt, fix)


# ------------------------------------------------------------------------------- save: refusals
def _dir_with_logs(tmp):
    (tmp / "exp" / "logs").mkdir(parents=True)
    (tmp / "exp" / "logs" / "run.txt").write_text("epoch 1")
    (tmp / "exp" / "notes.txt").write_text("keep me")
    return tmp / "exp", r"a directory holding files a meshembed checkpoint does not have \(\['logs', 'notes.txt'\]\)"


def _regular_file(tmp):
    (tmp / "model.bin").write_bytes(b"\x00weights")
    return tmp / "model.bin", "it is a regular file"


def _dot(tmp):
    (tmp / "work").mkdir()
    (tmp / "work" / "data.csv").write_text("1,2")
    os.chdir(tmp / "work")
    return ".", "current, parent or root directory"


def _dotdot(tmp):
    (tmp / "work").mkdir()
    return str(tmp / "work" / ".."), "current, parent or root directory"


def _cwd_absolute(tmp):
    (tmp / "work").mkdir()
    os.chdir(tmp / "work")
    return str(tmp / "work"), "current, parent or root directory"


def _under_file(tmp):
    (tmp / "file.txt").write_text("x")
    return tmp / "file.txt" / "ckpt", "a parent of it is a regular file"


def _deep_under_file(tmp):
    (tmp / "file.txt").write_text("x")
    return tmp / "file.txt" / "a" / "b", "a parent of it is a regular file"


def _symlink_loop(tmp):
    os.symlink("loop", tmp / "loop")
    return tmp / "loop", r"symbolic link \(to 'loop'\)"


def _symlink_loop_parent(tmp):
    os.symlink("loop", tmp / "loop")
    return tmp / "loop" / "ckpt", "parent directories cannot be resolved"


def _broken_link_parent(tmp):
    os.symlink("nowhere", tmp / "dangling")
    return tmp / "dangling" / "ckpt", "broken symbolic link"


def _link_to_checkpoint(tmp):
    engine().save(tmp / "real")
    os.symlink("real", tmp / "link")
    return tmp / "link", "symbolic link"


def _checkpoint_plus_user_file(tmp):
    engine().save(tmp / "ckpt")
    (tmp / "ckpt" / "README").write_text("my notes")
    return tmp / "ckpt", r"does not have \(\['README'\]\)"


def _foreign_manifest(tmp):
    (tmp / "other").mkdir()
    (tmp / "other" / "manifest.json").write_text(json.dumps({"format": "someone.else"}))
    return tmp / "other", "manifest.json does not mark it as a meshembed checkpoint"


def _garbage_manifest(tmp):
    (tmp / "other").mkdir()
    (tmp / "other" / "manifest.json").write_bytes(b"\xff{not json")
    (tmp / "other" / "arrays.npz").write_bytes(b"user data")
    return tmp / "other", "manifest.json does not mark it as a meshembed checkpoint"


REFUSALS = [_dir_with_logs, _regular_file, _dot, _dotdot, _cwd_absolute, _under_file, _deep_under_file,
            _symlink_loop, _symlink_loop_parent, _broken_link_parent, _link_to_checkpoint,
            _checkpoint_plus_user_file, _foreign_manifest, _garbage_manifest]


def _refused_save_leaves_everything(tmp_path, backend, setup):
    emb, twin = engine(backend), engine(backend)
    where, message = setup(tmp_path)
    feats, weights = batch(7)
    for e in (emb, twin):  # a pending, dequeued batch: kept across the refused save
        e.enqueue(feats, weights)
        acts = e.dequeue()
    before_files, before_state = tree(tmp_path), state(emb)
    with pytest.raises(me.CheckpointError, match=message) as info:
        emb.save(where)
    assert repr(str(where)) in str(info.value) and "Nothing was touched" in str(info.value)
    assert tree(tmp_path) == before_files
    assert_same(state(emb), before_state)
    grads = [emb.backend.to_numpy(a) * 0.5 for a in acts]
    emb.apply_gradients(grads)
    twin.apply_gradients(grads)
    assert_same(state(emb), state(twin))
    good = emb.save(tmp_path / "fresh")
    assert_same(state(me.TPUEmbedding.restore(good)), state(twin))


@pytest.mark.parametrize("setup", REFUSALS, ids=lambda f: f.__name__.strip("_"))
def test_save_refuses_what_is_not_a_checkpoint_and_touches_nothing(tmp_path, monkeypatch, setup):
    monkeypatch.chdir(tmp_path)
    _refused_save_leaves_everything(tmp_path, "numpy", setup)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("setup", [_dir_with_logs, _symlink_loop], ids=lambda f: f.__name__.strip("_"))
def test_save_refusal_on_other_backends(tmp_path, monkeypatch, backend, setup):
    _need(backend)
    monkeypatch.chdir(tmp_path)
    _refused_save_leaves_everything(tmp_path, backend, setup)


def test_save_refuses_a_path_that_is_not_a_path(tmp_path):
    emb = engine()
    with pytest.raises(me.CheckpointError, match="expected a str or os.PathLike. Received: int"):
        emb.save(123)


def test_save_writes_new_paths_empty_directories_and_replaces_checkpoints(tmp_path):
    emb = engine()
    emb.save(tmp_path / "a" / "b" / "ckpt")  # missing parents are created
    (tmp_path / "empty").mkdir()
    emb.save(tmp_path / "empty")  # an empty directory holds nothing to lose
    first = state(emb)
    run(emb, steps=1, start=1)
    emb.save(tmp_path / "empty")  # a checkpoint is replaced
    assert_same(state(me.TPUEmbedding.restore(tmp_path / "empty")), state(emb))
    assert_same(state(me.TPUEmbedding.restore(tmp_path / "a" / "b" / "ckpt")), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "empty"]
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["arrays.npz", "config.pb", "manifest.json"]


# ------------------------------------------------------------------------------- crashes (SIGKILL)
class _Killed(BaseException):
    """The process died here: nothing after it runs (not even except/finally clean-up)."""


@contextlib.contextmanager
def killed_at(k: int):
    """Every file-system step of a save counts; from step ``k`` on, the process is dead.
    A write that dies leaves half its bytes, as a SIGKILL during a write does."""
    calls = [0]
    real = {"write": checkpoint._write_file, "savez": np.savez, "replace": os.replace,
            "unlink": os.unlink, "rmdir": os.rmdir, "marker": checkpoint._write_marker}

    def dies() -> bool:
        calls[0] += 1
        return calls[0] >= k

    def write(path, data):
        if dies():
            pathlib.Path(path).write_bytes(data[: len(data) // 2])
            raise _Killed
        return real["write"](path, data)

    def savez(fh, **arrays):
        if dies():
            import io

            buf = io.BytesIO()
            real["savez"](buf, **arrays)
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            fh.flush()
            raise _Killed
        return real["savez"](fh, **arrays)

    def plain(name):
        def call(*args, **kwargs):
            if dies():
                raise _Killed
            return real[name](*args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "_write_file", write)
        mp.setattr(checkpoint.np, "savez", savez)
        mp.setattr(checkpoint, "_write_marker", plain("marker"))  # one small write: all or nothing
        for name in ("replace", "unlink", "rmdir"):
            mp.setattr(checkpoint.os, name, plain(name))
        yield calls


def _decoys(tmp: pathlib.Path) -> None:
    """Siblings a save must never remove: wrong names, user files, links, other paths."""
    good = tmp / "ckpt"
    shutil.copytree(good, tmp / "ckpt.tmp-zzzzzzzz")  # not our tag format
    shutil.copytree(good, tmp / "ckpt.tmp-0123abcd5")  # tag too long
    shutil.copytree(good, tmp / "other.old-0123abcd")  # another checkpoint's leftover
    shutil.copytree(good, tmp / "ckpt.tmp-0123abcd")
    (tmp / "ckpt.tmp-0123abcd" / "mine.txt").write_text("user file")  # holds a file we never write
    (tmp / "ckpt.old-4567cdef").mkdir()
    (tmp / "ckpt.old-4567cdef" / "data.csv").write_text("1,2")  # no marker at all
    shutil.copytree(good, tmp / "target")
    os.symlink("target", tmp / "ckpt.old-89abcdef")  # a link: never followed into
    (tmp / "ckpt.tmp-fedcba98").write_bytes(b"a file, not a directory")


def test_crash_at_every_step_of_save_loses_nothing_and_next_save_cleans_up(tmp_path):
    emb = engine()
    emb.save(tmp_path / "ckpt")
    a = state(emb)
    _decoys(tmp_path)
    decoys = {k: v for k, v in tree(tmp_path).items() if not k.startswith("ckpt/") and k != "ckpt"}
    run(emb, steps=1, start=1)
    b = state(emb)
    k, crashes = 1, 0
    while True:
        with killed_at(k):
            try:
                emb.save(tmp_path / "ckpt")
                finished = True
            except _Killed:
                finished = False
        if finished:
            break
        crashes += 1
        # a complete checkpoint, old or new, is always there (at ckpt, or ckpt.old-* between the renames)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = state(me.TPUEmbedding.restore(tmp_path / "ckpt"))
        assert got[1] in (a[1], b[1])
        assert_same(got, a if got[1] == a[1] else b)
        k += 1
    assert crashes >= 8  # every write, rename and removal was a crash point
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.") and n not in {d.split("/")[0] for d in decoys}]
    # The save that finished removed what the crashed ones left, except empty directories: a kill
    # between mkdir and the marker's write, or between the marker's removal and rmdir, leaves one
    # that cannot be told from a user's (docs/checkpoints.md).
    assert all(os.listdir(tmp_path / n) == [] for n in leftovers), {n: os.listdir(tmp_path / n) for n in leftovers}
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("ckpt/") and k not in ["ckpt", *leftovers]} == decoys
    assert_same(state(me.TPUEmbedding.restore(tmp_path / "ckpt")), b)


def _set_aside(tmp: pathlib.Path, name: str, kind: str, files: dict[str, bytes]) -> pathlib.Path:
    """A directory as a killed save of ``tmp / "ckpt"`` leaves it: ``files`` and the marker."""
    d = tmp / name
    d.mkdir()
    for f, data in files.items():
        (d / f).write_bytes(data)
    checkpoint._write_marker(d, tmp / "ckpt", kind, name, "0" * 32)
    return d


def test_leftovers_of_crashed_saves_are_removed_by_the_next_save(tmp_path):
    """The states a SIGKILL leaves, made by hand: a half-written temporary directory (the marker
    and a torn arrays.npz), a complete one never renamed, an old checkpoint never removed and
    one half removed (its arrays.npz already gone). Only what carries its own marker goes."""
    emb = engine()
    emb.save(tmp_path / "ckpt")
    good = {f: (tmp_path / "ckpt" / f).read_bytes() for f in checkpoint.FILES}
    _set_aside(tmp_path, "ckpt.tmp-00000001", "tmp", {"arrays.npz": good["arrays.npz"][:100]})
    _set_aside(tmp_path, "ckpt.tmp-00000002", "tmp", good)
    _set_aside(tmp_path, "ckpt.old-00000003", "old", good)
    _set_aside(tmp_path, "ckpt.old-00000004", "old", {k: v for k, v in good.items() if k != "arrays.npz"})
    kept = {}
    shutil.copytree(tmp_path / "ckpt.old-00000003", tmp_path / "ckpt.old-00000005")  # a copy: marker names another dir
    (tmp_path / "ckpt.tmp-00000006").mkdir()  # empty: nothing says it is ours
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt.old-00000007")  # no marker (a user's copy)
    fake = tmp_path / "ckpt.tmp-00000008"  # a marker with other content is not ours
    fake.mkdir()
    (fake / checkpoint.MARKER).write_bytes(b"something else")
    d = _set_aside(tmp_path, "ckpt.tmp-00000009", "tmp", good)
    (d / "notes.txt").write_text("mine")  # a file we never write: the directory is not only ours
    d = _set_aside(tmp_path, "ckpt.old-0000000a", "old", {"config.pb": good["config.pb"]})
    (d / "arrays.npz").mkdir()  # a directory named like our file
    (d / "arrays.npz" / "data.bin").write_bytes(b"user data")
    other = tmp_path / "other.old-0000000b"  # a leftover of another path
    other.mkdir()
    checkpoint._write_marker(other, tmp_path / "other", "old", other.name, "1" * 32)
    for n in ("ckpt.old-00000005", "ckpt.tmp-00000006", "ckpt.old-00000007", "ckpt.tmp-00000008",
              "ckpt.tmp-00000009", "ckpt.old-0000000a", "other.old-0000000b"):
        kept.update({f"{n}/{k}" if k else n: v for k, v in tree(tmp_path / n).items()} | {n: ("dir",)})
    emb.save(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *{k.split("/")[0] for k in kept}])
    assert {k: v for k, v in tree(tmp_path).items() if k.split("/")[0] != "ckpt"} == kept


# ------------------------------------------------------------------------------- restore: verification
@pytest.fixture
def saved(tmp_path):
    emb = engine(steps=2)
    path = emb.save(tmp_path / "ckpt")
    return path, state(emb)


def _refused_restore(path: pathlib.Path, message: str, backend: str = "numpy") -> str:
    before = tree(path.parent)
    with pytest.raises(me.CheckpointError, match=message) as info:
        me.TPUEmbedding.restore(path, backend=backend)
    assert tree(path.parent) == before
    return str(info.value)


def _set_step(m):
    m["step"] = 99


def _del_step(m):
    del m["step"]


def _bool_step(m):
    m["step"] = True


def _swap_slots(m):
    arrays = m["tables"][0]["arrays"]
    arrays["accumulators"], arrays["updates"] = arrays["updates"], arrays["accumulators"]


def _drop_table(m):
    m["tables"].pop(0)


def _drop_table_renumbered(m):
    m["tables"].pop(0)
    m["tables"][0]["arrays"] = {k: v.replace("t1.", "t0.") for k, v in m["tables"][0]["arrays"].items()}


def _drop_slot(m):
    del m["tables"][1]["arrays"]["updates"]


def _unknown_field(m):
    m["extra"] = 1


def _bad_sha(m):
    m["files"]["config.pb"]["sha256"] = "XYZ"


def _wrong_dimension(m):
    m["tables"][1]["dimension"] = 5


def _bad_combiner(m):
    m["tables"][0]["combiner"] = "max"


def _future_version(m):
    m["version"] = 99


def _string_version(m):
    m["version"] = "2"


def _other_format(m):
    m["format"] = "someone.else"


def _tag_out_of_range(m):
    m["learning_rate_callables"] = [{"tag": 3, "name": "f", "tables": ["a"]}]


MANIFEST_EDITS = [
    (_set_step, False, r"manifest.json does not match its checksum \(field `manifest_sha256`\)"),
    (_swap_slots, False, r"manifest.json does not match its checksum"),
    (_drop_table, False, r"manifest.json does not match its checksum"),
    (_set_step, True, None),  # an edit that re-computes the checksum is not detectable: see the docs
    (_del_step, True, r"manifest.json has no field `step`"),
    (_bool_step, True, r"manifest.json field `step`: expected an integer >= 0. Received: True"),
    (_swap_slots, True, r"manifest.json field `tables\[0\].arrays.accumulators`: expected 't0.accumulators'"),
    (_drop_table, True, r"manifest.json field `tables\[0\].arrays.accumulators`: expected 't0.accumulators'. "
                        r"Received: 't1.accumulators'"),
    (_drop_table_renumbered, True, r"manifest.json field `tables` lists \['b'\], but config.pb has tables \['a', 'b'\]"),
    (_drop_slot, True, r"manifest.json field `tables\[1\].arrays` has \['accumulators', 'parameters'\]"),
    (_unknown_field, True, r"manifest.json has an unknown field `extra`"),
    (_bad_sha, True, r"manifest.json field `files.config.pb.sha256`: expected 64 lowercase hex digits"),
    (_wrong_dimension, True, r"manifest.json field `tables\[1\].dimension` is 5, but config.pb has 2"),
    (_bad_combiner, True, r"manifest.json field `tables\[0\].combiner`: expected one of"),
    (_future_version, True, r"field `version` is 99; .*Fix: restore it with the newer meshembed"),
    (_string_version, True, r"field `version` is '2'"),
    (_other_format, True, r"manifest.json field `format`: expected 'meshembed.tpu_embedding.checkpoint'"),
    (_tag_out_of_range, True, r"field `learning_rate_callables\[0\].tag` is 3, but config.pb has 0 dynamic"),
]


@pytest.mark.parametrize("edit,rechecksum,message", MANIFEST_EDITS,
                         ids=[f"{e.__name__.strip('_')}-{'rechecksummed' if r else 'raw'}" for e, r, _ in MANIFEST_EDITS])
def test_restore_verifies_the_manifest_field_by_field(saved, edit, rechecksum, message):
    path, original = saved
    rewrite_manifest(path, edit, rechecksum)
    if message is None:
        assert me.TPUEmbedding.restore(path).step == 99
        return
    _refused_restore(path, message)


@pytest.mark.parametrize("content,message", [
    (b"{\"format\": ", r"manifest.json is not valid UTF-8 JSON \(JSONDecodeError"),
    (b"\xff\xfe", r"manifest.json is not valid UTF-8 JSON \(UnicodeDecodeError"),
    (b"[1, 2]", r"manifest.json is not a JSON object. Received: list"),
    (b"{\"format\": \"meshembed.tpu_embedding.checkpoint\", \"version\": 2, \"step\": NaN}", r"is not valid UTF-8 JSON"),
    (b"", r"manifest.json is not valid UTF-8 JSON"),
])
def test_restore_refuses_malformed_manifest(saved, content, message):
    path, _ = saved
    (path / "manifest.json").write_bytes(content)
    _refused_restore(path, message)


def test_restore_refuses_missing_and_damaged_files(saved, tmp_path):
    path, _ = saved
    os.rename(path / "arrays.npz", tmp_path / "moved.npz")
    _refused_restore(path, r"arrays.npz is missing \(listed in manifest.json field `files.arrays.npz`\)")
    os.rename(tmp_path / "moved.npz", path / "arrays.npz")
    size = (path / "config.pb").stat().st_size
    with open(path / "config.pb", "ab") as fh:
        fh.write(b"\x00")
    _refused_restore(path, rf"config.pb has {size + 1} bytes, not the {size} of manifest.json field `files.config.pb.size`")
    os.unlink(path / "manifest.json")
    _refused_restore(path, r"No checkpoint at .*manifest.json is missing")
    _refused_restore(tmp_path / "nothing", r"No checkpoint at .*nothing.*does not exist")


def test_restore_refuses_a_config_pb_from_another_checkpoint(saved, tmp_path):
    path, _ = saved
    other = me.TPUEmbedding(config(me.embedding.Adadelta(0.05, rho=0.5, epsilon=1e-6)), num_shards=1, seed=5)
    other.save(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "config.pb", path / "config.pb")
    _refused_restore(path, r"config.pb does not match its checksum \(manifest.json field `files.config.pb.sha256`\)")


@pytest.mark.parametrize("edit,message", [
    (lambda a: a.pop("t1.updates"), r"arrays.npz does not hold the arrays .*missing: \['t1.updates'\], unexpected: \[\]"),
    (lambda a: a.update(extra=np.zeros(2, np.float32)), r"arrays.npz does not hold .*missing: \[\], unexpected: \['extra'\]"),
    (lambda a: a.update({"t0.parameters": a["t0.parameters"][:5]}), r"array 't0.parameters' .* shape \(5, 3\); expected float32 \(13, 3\)"),
    (lambda a: a.update({"t1.updates": a["t1.updates"].astype(np.float64)}), r"array 't1.updates' .* dtype float64"),
])
def test_restore_checks_every_array_against_the_config(saved, edit, message):
    path, _ = saved
    rewrite_arrays(path, edit)
    _refused_restore(path, message)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verification_happens_before_any_backend_work(saved, backend):
    _need(backend)
    path, original = saved
    assert_same(state(me.TPUEmbedding.restore(path, backend=backend)), original)
    data = bytearray((path / "arrays.npz").read_bytes())
    data[len(data) // 2] ^= 0x10
    (path / "arrays.npz").write_bytes(bytes(data))
    _refused_restore(path, r"arrays.npz does not match its checksum", backend=backend)


# ------------------------------------------------------------------------------- version 1 manifests
def _as_version_1(path: pathlib.Path, with_combiner: bool = True) -> None:
    """Rewrite a checkpoint's manifest the way the previous meshembed wrote it."""
    import base64

    m = json.loads((path / "manifest.json").read_text())
    config_bytes = (path / "config.pb").read_bytes()
    tables = [{k: v for k, v in t.items() if k != "dtype" and (with_combiner or k != "combiner")} for t in m["tables"]]
    old = {"format": m["format"], "version": 1, "step": m["step"], "seed": m["seed"], "saved_with": m["saved_with"],
           "config_base64": base64.b64encode(config_bytes).decode("ascii"), "tables": tables,
           "sha256": {n: m["files"][n]["sha256"] for n in ("arrays.npz", "config.pb")}}
    (path / "manifest.json").write_text(json.dumps(old, indent=1, sort_keys=True))


def test_version_1_checkpoints_are_read_with_what_they_can_verify(saved):
    path, original = saved
    _as_version_1(path)
    with pytest.warns(UserWarning, match="version-1 manifest.*cannot be verified. Save it again"):
        assert_same(state(me.TPUEmbedding.restore(path)), original)
    data = bytearray((path / "config.pb").read_bytes())
    data[-1] ^= 0x01
    (path / "config.pb").write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _refused_restore(path, r"config.pb does not match its checksum")


def test_version_1_without_checksums_is_refused(saved):
    path, _ = saved
    _as_version_1(path)
    m = json.loads((path / "manifest.json").read_text())
    del m["sha256"]
    (path / "manifest.json").write_text(json.dumps(m))
    _refused_restore(path, r"manifest.json has no field `sha256`")


def test_version_1_without_combiners_reads_the_proto_default(tmp_path):
    cfg = config()
    tables = [me.TableConfig("a", 13, 3, optimizer=me.embedding.Adagrad(0.1), combiner="mean"),
              me.TableConfig("b", 7, 2, optimizer=me.embedding.Adagrad(0.1), combiner="mean")]
    emb = me.TPUEmbedding(me.EmbeddingConfig(tables=tables, features=cfg.features), num_shards=1)
    run(emb, steps=1)
    path = emb.save(tmp_path / "ckpt")
    _as_version_1(path, with_combiner=False)
    with pytest.warns(UserWarning, match="version-1"):
        assert_same(state(me.TPUEmbedding.restore(path)), state(emb))


# ------------------------------------------------------------------------------- learning-rate callables
def lr_a():
    return 0.25


def _callable_config():
    tables = [me.TableConfig("a", 13, 3, optimizer=me.embedding.Adagrad(lr_a), combiner="mean"),
              me.TableConfig("b", 7, 2, optimizer=me.embedding.Adagrad(0.1), combiner="sqrtn")]
    return me.EmbeddingConfig(tables=tables, features=config().features)


def test_restore_asks_for_the_learning_rate_callable_it_cannot_store(tmp_path):
    emb = me.TPUEmbedding(_callable_config(), num_shards=1)
    run(emb, steps=1)
    path = emb.save(tmp_path / "ckpt")
    before = tree(tmp_path)
    with pytest.raises(me.InputError, match=r"tag 0: lr_a \(tables \['a'\]\).*learning_rates=\[lr_a\]"):
        me.TPUEmbedding.restore(path)
    for bad, message in [([], r"expected 1 entries"), ([lr_a, lr_a], r"expected 1 entries"),
                         ([0.25], r"`learning_rates\[0\]`: expected a callable"), ({1: lr_a}, r"exactly the dynamic tags \[0\]"),
                         ({True: lr_a}, r"exactly the dynamic tags"), (lr_a, r"Received: function"), ("x", "Received: str")]:
        with pytest.raises(me.InputError, match=message):
            me.TPUEmbedding.restore(path, learning_rates=bad)
    assert tree(tmp_path) == before
    run(emb, steps=1, start=1)
    for given in ([lr_a], {0: lr_a}):
        restored = me.TPUEmbedding.restore(path, learning_rates=given)
        run(restored, steps=1, start=1)  # apply_gradients() without learning_rates= evaluates lr_a
        assert_same(state(restored), state(emb))
    explicit = me.TPUEmbedding.restore(path, learning_rates=[None])  # values passed every step instead
    feats, weights = batch(1)
    explicit.enqueue(feats, weights)
    acts = explicit.dequeue()
    explicit.apply_gradients([explicit.backend.to_numpy(a) * 0.5 + 0.1 for a in acts], learning_rates=[0.25])
    assert_same(state(explicit), state(emb))


def test_learning_rates_for_a_config_without_dynamic_tags(saved):
    path, original = saved
    assert_same(state(me.TPUEmbedding.restore(path, learning_rates=[])), original)
    with pytest.raises(me.InputError, match="0 dynamic tag"):
        me.TPUEmbedding.restore(path, learning_rates=[lr_a])


# ------------------------------------------------------------------------------- byte flips
def _tiny(tmp: pathlib.Path) -> tuple[pathlib.Path, tuple]:
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", 5, 2, optimizer=me.embedding.Adadelta(lr_a, rho=0.9, epsilon=1e-6), combiner="sum")],
        features=[me.FeatureConfig("t", (2,), name="f")])
    emb = me.TPUEmbedding(cfg, num_shards=1, seed=3)
    emb.enqueue([np.array([1, 3])])
    emb.dequeue()
    emb.apply_gradients([np.full((2, 2), 0.5, np.float32)])
    return emb.save(tmp / "ckpt"), state(emb)


def _restore_or_refuse(path: pathlib.Path, original: tuple) -> bool:
    """CheckpointError (True) or exactly the saved state (False); anything else fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = me.TPUEmbedding.restore(path, learning_rates=[lr_a])
    except me.CheckpointError:
        return True
    assert_same(state(restored), original)
    return False


def test_every_byte_flip_of_every_file_is_refused_or_harmless(tmp_path):
    """One flip per byte of each file (all 8 bits for config.pb, as the issue's 864 flips)."""
    path, original = _tiny(tmp_path)
    refused = total = 0
    sizes = {name: (path / name).stat().st_size for name in checkpoint.FILES}
    for name in checkpoint.FILES:
        data = (path / name).read_bytes()
        bits = range(8) if name == "config.pb" else [None]
        try:
            for i in range(len(data)):
                for bit in bits:
                    flipped = bytearray(data)
                    flipped[i] ^= 1 << (i % 8 if bit is None else bit)
                    (path / name).write_bytes(bytes(flipped))
                    refused += _restore_or_refuse(path, original)
                    total += 1
        finally:
            (path / name).write_bytes(data)
    assert total == 8 * sizes["config.pb"] + sizes["arrays.npz"] + sizes["manifest.json"]
    assert refused == total  # here no flip happens to be harmless: each is caught


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(checkpoint.FILES), where=st.floats(0, 1, exclude_max=True),
       mask=st.integers(1, 255), count=st.integers(1, 3))
def test_random_corruptions_are_refused_or_harmless(tmp_path_factory, name, where, mask, count):
    tmp = tmp_path_factory.mktemp("flip")
    path, original = _tiny(tmp)
    data = bytearray((path / name).read_bytes())
    for j in range(count):
        data[(int(where * len(data)) + 7 * j) % len(data)] ^= mask
    (path / name).write_bytes(bytes(data))
    assert _restore_or_refuse(path, original)


# ------------------------------------------------------------------------------- a real SIGKILL
_CHILD = """
import sys
import meshembed as me
cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 100_000, 16, optimizer=me.embedding.Adadelta(0.1, rho=0.9, epsilon=1e-6))],
                         features=[me.FeatureConfig("t", (4,), name="f")])
emb = me.TPUEmbedding(cfg, num_shards=1, seed=11)
emb.save(sys.argv[1])
print("ready", flush=True)
while True:
    emb.save(sys.argv[1])
"""


@pytest.mark.slow
def test_sigkill_during_saves_keeps_a_checkpoint_and_the_next_save_cleans_up(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "ckpt"
    rng = np.random.default_rng(0)
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(float(rng.uniform(0.05, 0.6)))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kill may have come between the two renames
        emb = me.TPUEmbedding.restore(path)
    fresh = me.TPUEmbedding(emb.config, num_shards=1, seed=11)
    assert_same(state(emb), state(fresh))
    left = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert all(n.startswith(("ckpt.tmp-", "ckpt.old-")) for n in left)
    emb.save(path)
    after = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert all(os.listdir(tmp_path / n) == [] for n in after), left  # at most empty ones (see the docs)
