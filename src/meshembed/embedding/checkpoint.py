"""Checkpoints: pickle-free, atomic, verified, independent of backend and shard count.

A checkpoint is a directory::

    manifest.json   format, version, step, seed, tables (shapes, combiners, array keys),
                    sha256 and size of every other file, and ``manifest_sha256``: the sha256
                    of the manifest's own canonical JSON without that field
    config.pb       the TPUEmbeddingConfiguration bytes
    arrays.npz      the *logical* [V, D] float32 arrays: t<i>.parameters, t<i>.<slot> (no pickles)

Arrays are stored unsharded, so a checkpoint written with 2 shards on NumPy restores into
8 shards on JAX.

Saving never deletes data it did not write: ``path`` may be missing, an empty directory or a
meshembed checkpoint (a directory holding only the three files, with our manifest); anything
else (another directory, a file, a symbolic link, ``.``, a path under a regular file) is a
CheckpointError and nothing is touched. The new checkpoint is written into a sibling
``<name>.tmp-<tag>`` (marked as ours by its first file, ``.meshembed-partial``) and renamed
into place; an existing checkpoint is first renamed to ``<name>.old-<tag>`` and removed
after, so a crash at any point leaves a complete checkpoint at ``path`` or at
``path.old-*`` (which :func:`restore` falls back to when ``path`` is missing). Siblings a
crashed save left behind are removed by the next successful save of the same path, only
those named and marked as ours, and only the files we write.

Restoring verifies everything before building an engine: the manifest schema field by field,
its own checksum, the checksum and size of every file, that config.pb parses and matches the
manifest's tables, and that every table and slot of the config is in arrays.npz with its
shape and dtype. Any failure is a CheckpointError naming the file and the field.

Several processes (torch.distributed ranks): every process gathers the tables, only the
backend's writer (``Backend.is_writer``: rank 0) writes, then all meet at ``Backend.barrier``;
``path`` is one checkpoint shared by every rank (a shared file system when the ranks run on
several hosts). :func:`restore` reads it on every process.

A table with a ``CustomOptimizer`` cannot be checkpointed: the config is stored as
TPUEmbeddingConfiguration bytes, which have no form for a Python-level optimizer. ``save``
raises a ConfigError before writing anything. Learning-rate callables cannot be stored
either: the manifest records which tags had one, and ``restore`` asks for them again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import pathlib
import re
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy as np

from meshembed.embedding.combiners import COMBINERS
from meshembed.errors import CheckpointError, ConfigError, InputError, MeshembedError, StateError

FORMAT = "meshembed.tpu_embedding.checkpoint"
VERSION = 2
FILES = ("arrays.npz", "config.pb", "manifest.json")
PARTIAL = ".meshembed-partial"  # first file of a temporary directory: ours until manifest.json exists
_PARTIAL_BYTES = f"{FORMAT} (incomplete)\n".encode()
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIX = ("Fix: the checkpoint was changed or damaged after it was written; restore it from an intact "
        "copy, or use an earlier checkpoint.")


# ----------------------------------------------------------------------------- files
def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(body: Mapping[str, Any]) -> bytes:
    """The bytes ``manifest_sha256`` is computed over (key order and spacing fixed)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _sibling(path: pathlib.Path, kind: str, tag: str) -> pathlib.Path:
    return path.with_name(f"{path.name}.{kind}-{tag}")


def _is_ours(directory: pathlib.Path, allow_partial: bool = False) -> bool:
    """A real directory holding only files a save writes, marked by our manifest (or, for a
    temporary directory, by the partial marker). An empty directory is not ours."""
    try:
        if directory.is_symlink() or not directory.is_dir():
            return False
        entries = set(os.listdir(directory))
    except OSError:
        return False
    allowed = set(FILES) | ({PARTIAL} if allow_partial else set())
    if not entries or not entries <= allowed:
        return False
    if "manifest.json" in entries:
        try:
            manifest = json.loads((directory / "manifest.json").read_bytes())
            if isinstance(manifest, dict) and manifest.get("format") == FORMAT:
                return True
        except (OSError, ValueError):
            pass
    if allow_partial and PARTIAL in entries:
        try:  # a save killed while writing the marker leaves a prefix of it
            return _PARTIAL_BYTES.startswith((directory / PARTIAL).read_bytes())
        except OSError:
            return False
    return False


def _remove_ours(directory: pathlib.Path) -> None:
    """Remove a directory this module wrote: only its known files, the big one first and the
    marker last (an interrupted removal stays recognisable), then the directory if empty."""
    for name in ("arrays.npz", "config.pb", PARTIAL, "manifest.json"):
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass
        except OSError:
            return
    try:
        os.rmdir(directory)
    except OSError:
        pass


def _leftovers(path: pathlib.Path) -> list[pathlib.Path]:
    """``<name>.tmp-<tag>`` / ``<name>.old-<tag>`` siblings of ``path`` that a save wrote."""
    pattern = re.compile(re.escape(path.name) + r"\.(tmp|old)-[0-9a-f]{8}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        m = pattern.fullmatch(name)
        if m and (_is_ours(path.parent / name, allow_partial=m.group(1) == "tmp") or _is_empty_dir(path.parent / name)):
            out.append(path.parent / name)  # (an empty one: a save killed before its first write)
    return out


def _is_empty_dir(directory: pathlib.Path) -> bool:
    try:
        return not directory.is_symlink() and directory.is_dir() and not os.listdir(directory)
    except OSError:
        return False


# ----------------------------------------------------------------------------- save
def _dynamic_tags_of(table: Any) -> set[int]:
    opt = table.optimizer
    found = [getattr(opt, "learning_rate", None), *getattr(opt, "dynamic_inputs", lambda: ())()]
    return {int(v.tag) for v in found if hasattr(v, "tag") and not isinstance(v, (int, float))}


def _callable_entries(config: Any) -> list[dict]:
    """Tags whose value came from a callable (kept in ``config.learning_rate_fns``, which no
    file can hold): restore asks for them again."""
    out = []
    for tag, fn in enumerate(getattr(config, "learning_rate_fns", ()) or ()):
        if fn is not None:
            out.append({
                "tag": tag,
                "name": str(getattr(fn, "__qualname__", type(fn).__name__)),
                "tables": [t.name for t in config.tables if tag in _dynamic_tags_of(t)],
            })
    return out


def collect(engine: Any) -> tuple[bytes, dict[str, np.ndarray], list[dict]]:
    """(config bytes, logical arrays, table entries) of ``engine``.

    Collective on a multi-process backend (``retrieve_parameters`` unshards every table), so
    every process calls it, in the same order, whether or not it writes."""
    config_bytes = engine.config.to_proto()
    arrays: dict[str, np.ndarray] = {}
    tables = []
    for t in engine.layout.tables:
        values = engine.retrieve_parameters(t.name)
        keys = {}
        for name, arr in values.items():
            key = f"t{t.index}.{name}"
            arrays[key] = np.ascontiguousarray(arr, dtype=np.float32)
            keys[name] = key
        tables.append({
            "name": t.name,
            "vocabulary_size": int(t.vocabulary_size),
            "dimension": int(t.dimension),
            "algorithm": t.optimizer.algorithm,
            "combiner": t.combiner,  # not part of TPUEmbeddingConfiguration: kept here
            "dtype": "float32",
            "arrays": keys,
        })
    return config_bytes, arrays, tables


def write_contents(engine: Any, directory: pathlib.Path,
                   collected: tuple[bytes, dict[str, np.ndarray], list[dict]] | None = None) -> None:
    """Write the three checkpoint files into an (empty, temporary) directory
    (``collected``: what :func:`collect` returned, else it is called here)."""
    directory = pathlib.Path(directory)
    config_bytes, arrays, tables = collect(engine) if collected is None else collected
    with open(directory / "arrays.npz", "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    _write_file(directory / "config.pb", config_bytes)
    files = {name: {"sha256": _sha256(directory / name), "size": (directory / name).stat().st_size}
             for name in ("arrays.npz", "config.pb")}
    body = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(engine.step),
        "seed": int(engine.seed),
        "saved_with": {"backend": str(engine.backend.name), "num_shards": int(engine.num_shards)},
        "tables": tables,
        "learning_rate_callables": _callable_entries(engine.config),
        # A dict of features: its keys in the order given (config.pb has no place for them), so a
        # restored engine still returns activations by key, never as a positional list.
        "feature_keys": list(engine.config.feature_keys),
        "files": files,
    }
    manifest = dict(body, manifest_sha256=hashlib.sha256(_canonical(body)).hexdigest())
    _write_file(directory / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())


def check_saveable(engine: Any) -> None:
    """ConfigError naming the table and the fix when the config has no proto form."""
    keys = engine.config.feature_keys
    if not all(isinstance(k, str) for k in keys):
        raise ConfigError(
            "Cannot save a checkpoint of a config whose `features` dict has non-string keys "
            f"({[k for k in keys if not isinstance(k, str)][:3]!r}): the manifest stores the keys as JSON "
            "strings. Nothing was written. Fix: key the features dict by strings (e.g. the feature names).")
    for t in engine.layout.tables:
        if getattr(t.optimizer, "algorithm", None) == "custom":
            raise ConfigError(
                f"Cannot save a checkpoint of table {t.name!r}: its optimizer is a CustomOptimizer, a "
                "Python-level optimizer with no TPUEmbeddingConfiguration form, and a checkpoint "
                "stores the config as TPUEmbeddingConfiguration bytes (config.pb). Nothing was "
                f"written. Fix: keep the table's state with `retrieve_parameters({t.name!r})` and "
                f"load it with `load_parameters({t.name!r}, parameters, **slots)` into an engine "
                "built from the same EmbeddingConfig, or use a proto optimizer spec "
                "(me.embedding.SGD, Adagrad, ...) for the table to use save()/restore()."
            )


def check_target(path: Any) -> pathlib.Path:
    """``path`` as a Path if a save may write it; else CheckpointError, nothing touched.

    Allowed: nothing there (missing parents are created), an empty directory, or a meshembed
    checkpoint directory (only the files a save writes, with our manifest)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise CheckpointError(
            f"Invalid checkpoint `path`: expected a str or os.PathLike. Received: {type(path).__name__}")
    path = pathlib.Path(path)
    where = str(path)
    fix_new = f"Fix: save to a new directory inside it, e.g. {str(path / 'ckpt')!r}, or remove it yourself."

    def refuse(why: str, fix: str = fix_new) -> CheckpointError:
        return CheckpointError(f"Cannot save a checkpoint to {where!r}: {why}. Nothing was touched. {fix}")

    if path.name in ("", ".", "..") or os.path.realpath(path) == os.path.realpath(os.getcwd()):
        raise refuse("it is the current, parent or root directory, which save would have to replace")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise refuse("a parent of it is a regular file, not a directory",
                     "Fix: choose a path whose parents are directories (or do not exist yet).") from None
    except OSError as exc:  # e.g. ELOOP: a symbolic-link loop among its parents
        raise refuse(f"its parent directories cannot be resolved ({exc.strerror or exc})",
                     "Fix: remove the symbolic-link loop or choose another path.") from None
    if st is None:
        parent = path.parent
        if parent.is_symlink() and not parent.exists():
            raise refuse(f"its parent {str(parent)!r} is a broken symbolic link",
                         "Fix: repair the link or choose another path.")
        return path
    if os.path.islink(path):
        target = os.readlink(path)
        raise refuse(f"it is a symbolic link (to {target!r}); save does not replace or follow links",
                     "Fix: save to the link's target directly, or remove the link.")
    if not os.path.isdir(path):
        kind = "a regular file" if os.path.isfile(path) else "not a directory"
        raise refuse(f"it is {kind}, not a meshembed checkpoint directory",
                     "Fix: save to another path, or move the file away yourself.")
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        raise refuse(f"its contents cannot be listed ({exc.strerror or exc})",
                     "Fix: check its permissions or choose another path.") from None
    if not entries:
        return path
    extra = [e for e in entries if e not in FILES]
    if extra:
        raise refuse(f"it is a directory holding files a meshembed checkpoint does not have ({extra[:5]}"
                     f"{' ...' if len(extra) > 5 else ''}), and save replaces the whole directory")
    if not _is_ours(path):
        raise refuse("it is a directory whose manifest.json does not mark it as a meshembed checkpoint")
    return path


def save(engine: Any, path: Any) -> pathlib.Path:
    """Atomically write ``engine``'s checkpoint to the directory ``path``.

    On a multi-process backend every process calls this: all take part in gathering the
    tables (a collective), only the writer process (``backend.is_writer``, rank 0 under
    torch.distributed) writes ``path``, and all wait for it at ``backend.barrier`` — so when
    ``save`` returns on any process the checkpoint is complete, and if the writer failed every
    process raises."""
    check_saveable(engine)
    backend = engine.backend
    path = pathlib.Path(path) if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes) else path
    collected = collect(engine)  # collective: every process, before anything is written
    error: BaseException | None = None
    if getattr(backend, "is_writer", True):
        try:
            _write_atomically(engine, path, collected)
        except BaseException as exc:  # reported after the barrier, so no process is left waiting
            error = exc
    barrier = getattr(backend, "barrier", None)
    everyone_ok = True if barrier is None else bool(barrier(error is None))
    if error is not None:
        raise error
    if not everyone_ok:
        raise StateError(
            f"Checkpoint {str(path)!r} was not written: the writer process failed (see its error). "
            "The previous checkpoint at that path, if any, is unchanged."
        )
    return path


def _write_atomically(engine: Any, path: Any, collected: tuple) -> None:
    path = check_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise CheckpointError(
            f"Cannot save a checkpoint to {str(path)!r}: a parent of it is not a directory ({exc}). "
            "Nothing was written. Fix: choose a path whose parents are directories.") from None
    tag = uuid.uuid4().hex[:8]
    tmp = _sibling(path, "tmp", tag)
    tmp.mkdir()
    old = None
    try:
        _write_file(tmp / PARTIAL, _PARTIAL_BYTES)
        write_contents(engine, tmp, collected)
        os.unlink(tmp / PARTIAL)  # the manifest marks it from here on
        _fsync_dir(tmp)
        if os.path.lexists(path):
            old = _sibling(path, "old", tag)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if old is not None and not os.path.lexists(path):
            try:  # the second rename failed: put the previous checkpoint back at path
                os.replace(old, path)
            except OSError:
                pass  # restore(path) falls back to path.old-*
        _remove_ours(tmp)
        raise
    if old is not None:
        _remove_ours(old)
    for leftover in _leftovers(path):  # of earlier saves of this path that crashed
        _remove_ours(leftover)


# ----------------------------------------------------------------------------- read + verify
def _bad(where: pathlib.Path, file: str, what: str) -> CheckpointError:
    return CheckpointError(f"Invalid checkpoint at {str(where)!r}: {file} {what}. Nothing was restored. {_FIX}")


def _field(where: pathlib.Path, obj: Any, key: str, ctx: str, kind: str) -> Any:
    """``obj[key]`` checked to be ``kind``: "int" (>= 0, not bool), "pos" (>= 1), "str",
    "hex" (a sha256), "dict", "list"."""
    name = f"{ctx}{key}"
    if not isinstance(obj, dict) or key not in obj:
        raise _bad(where, "manifest.json", f"has no field `{name}`")
    v = obj[key]
    ok = {
        "int": isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "pos": isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "str": isinstance(v, str) and v != "",
        "hex": isinstance(v, str) and _HEX64.fullmatch(v) is not None,
        "dict": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if not ok:
        expected = {"int": "an integer >= 0", "pos": "an integer >= 1", "str": "a non-empty string",
                    "hex": "64 lowercase hex digits (a sha256)", "dict": "an object", "list": "a list"}[kind]
        raise _bad(where, "manifest.json", f"field `{name}`: expected {expected}. Received: {v!r}")
    return v


def _exact_keys(where: pathlib.Path, obj: dict, keys: set[str], ctx: str, optional: set[str] = frozenset()) -> None:
    missing = sorted(keys - set(obj) - set(optional))
    extra = sorted(set(obj) - keys - set(optional))
    if missing:
        raise _bad(where, "manifest.json", f"has no field `{ctx}{missing[0]}`")
    if extra:
        raise _bad(where, "manifest.json", f"has an unknown field `{ctx}{extra[0]}`")


def _locate(path: pathlib.Path) -> pathlib.Path:
    """``path`` itself, or — only when nothing is at ``path`` — the previous checkpoint an
    interrupted save left aside (``path.old-*``), with a warning."""
    if os.path.lexists(path):
        if not (path / "manifest.json").is_file():
            raise CheckpointError(
                f"No checkpoint at {str(path)!r}: manifest.json is missing. Fix: pass the directory "
                "that TPUEmbedding.save(path) wrote.")
        return path
    olds = [p for p in _leftovers(path) if ".old-" in p.name and (p / "manifest.json").is_file()]
    if not olds:
        raise CheckpointError(
            f"No checkpoint at {str(path)!r}: the path does not exist. Fix: pass the directory that "
            "TPUEmbedding.save(path) wrote.")
    old = max(olds, key=lambda p: p.stat().st_mtime)
    warnings.warn(
        f"No checkpoint at {str(path)!r}; restoring {str(old)!r}, the previous checkpoint a save "
        "interrupted between its two renames left aside. The next successful save of the path removes it.",
        stacklevel=5,
    )
    return old


def _read_manifest(where: pathlib.Path) -> dict:
    """The manifest, checked field by field (version 1 is read and normalised to version 2)."""
    try:
        raw = (where / "manifest.json").read_bytes()
        manifest = json.loads(raw.decode("utf-8"), parse_constant=lambda c: _reject_constant(c))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(where, "manifest.json", f"is not valid UTF-8 JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict):
        raise _bad(where, "manifest.json", f"is not a JSON object. Received: {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise _bad(where, "manifest.json", f"field `format`: expected {FORMAT!r}. Received: {manifest.get('format')!r}")
    version = manifest.get("version")
    is_int = isinstance(version, int) and not isinstance(version, bool)
    if not is_int or version not in (1, VERSION):
        newer = is_int and version > VERSION
        raise CheckpointError(
            f"Invalid checkpoint at {str(where)!r}: manifest.json field `version` is {version!r}; this "
            f"meshembed reads versions 1 and {VERSION}. "
            + ("Fix: restore it with the newer meshembed that wrote it." if newer else _FIX))
    if version == 1:
        return _normalise_v1(where, manifest)
    claimed = _field(where, manifest, "manifest_sha256", "", "hex")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    try:
        actual = hashlib.sha256(_canonical(body)).hexdigest()
    except ValueError:
        actual = ""
    if actual != claimed:
        raise _bad(where, "manifest.json", "does not match its checksum (field `manifest_sha256`): a field "
                   "such as `step`, `seed` or `tables` was changed after the checkpoint was written")
    _exact_keys(where, manifest, {"format", "version", "step", "seed", "saved_with", "tables",
                                  "learning_rate_callables", "feature_keys", "files", "manifest_sha256"}, "")
    keys = _field(where, manifest, "feature_keys", "", "list")
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise _bad(where, "manifest.json", f"field `feature_keys`: expected distinct strings. Received: {keys!r}")
    files = _field(where, manifest, "files", "", "dict")
    _exact_keys(where, files, {"arrays.npz", "config.pb"}, "files.")
    for name in ("arrays.npz", "config.pb"):
        entry = _field(where, files, name, "files.", "dict")
        _exact_keys(where, entry, {"sha256", "size"}, f"files.{name}.")
        _field(where, entry, "sha256", f"files.{name}.", "hex")
        _field(where, entry, "size", f"files.{name}.", "int")
    for k, entry in enumerate(_field(where, manifest, "learning_rate_callables", "", "list")):
        ctx = f"learning_rate_callables[{k}]."
        if not isinstance(entry, dict):
            raise _bad(where, "manifest.json", f"field `{ctx[:-1]}`: expected an object. Received: {entry!r}")
        _exact_keys(where, entry, {"tag", "name", "tables"}, ctx)
        _field(where, entry, "tag", ctx, "int")
        _field(where, entry, "name", ctx, "str")
        _field(where, entry, "tables", ctx, "list")
    _check_common(where, manifest, with_dtype=True)
    return manifest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _check_common(where: pathlib.Path, manifest: dict, with_dtype: bool) -> None:
    _field(where, manifest, "step", "", "int")
    seed = manifest.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _bad(where, "manifest.json", f"field `seed`: expected an integer. Received: {seed!r}")
    saved = _field(where, manifest, "saved_with", "", "dict")
    _field(where, saved, "backend", "saved_with.", "str")
    _field(where, saved, "num_shards", "saved_with.", "pos")
    tables = _field(where, manifest, "tables", "", "list")
    keys = {"name", "vocabulary_size", "dimension", "algorithm", "combiner", "arrays"} | ({"dtype"} if with_dtype else set())
    for i, t in enumerate(tables):
        ctx = f"tables[{i}]."
        if not isinstance(t, dict):
            raise _bad(where, "manifest.json", f"field `tables[{i}]`: expected an object. Received: {t!r}")
        _exact_keys(where, t, keys, ctx)
        for key, kind in (("name", "str"), ("vocabulary_size", "pos"), ("dimension", "pos"),
                          ("algorithm", "str"), ("combiner", "str"), ("arrays", "dict")):
            _field(where, t, key, ctx, kind)
        if with_dtype and t["dtype"] != "float32":
            raise _bad(where, "manifest.json", f"field `{ctx}dtype`: expected 'float32'. Received: {t['dtype']!r}")
        for name, key in t["arrays"].items():
            if key != f"t{i}.{name}":  # the key is a function of table index and slot name
                raise _bad(where, "manifest.json", f"field `{ctx}arrays.{name}`: expected {f't{i}.{name}'!r}. "
                           f"Received: {key!r}")


def _normalise_v1(where: pathlib.Path, manifest: dict) -> dict:
    """A version-1 manifest (no checksum of its own) in version-2 form, after checking every
    field it has. Its file checksums are verified as usual; its ``step``, ``seed`` and table
    entries are checked for consistency with config.pb and arrays.npz only."""
    sums = _field(where, manifest, "sha256", "", "dict")
    for name in ("arrays.npz", "config.pb"):
        _field(where, sums, name, "sha256.", "hex")
    encoded = _field(where, manifest, "config_base64", "", "str")
    try:
        copy = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, "manifest.json", "field `config_base64` is not base64") from None
    tables = _field(where, manifest, "tables", "", "list")
    for t in tables:
        if isinstance(t, dict):
            t.setdefault("combiner", "mean")  # written before the manifest kept combiners
    _check_common(where, manifest, with_dtype=False)
    warnings.warn(
        f"Checkpoint {str(where)!r} has a version-1 manifest (written by an earlier meshembed): its "
        "files' checksums are verified, but the manifest has no checksum of its own, so `step` and "
        "`seed` cannot be verified. Save it again to write a version-2 checkpoint.",
        stacklevel=6,
    )
    return {
        "format": FORMAT, "version": 1, "step": manifest["step"], "seed": manifest["seed"],
        "saved_with": manifest["saved_with"], "tables": tables, "learning_rate_callables": [],
        "feature_keys": [], "files": {n: {"sha256": sums[n]} for n in ("arrays.npz", "config.pb")},
        "config_copy": copy,
    }


def _verify_file(where: pathlib.Path, name: str, manifest: dict) -> pathlib.Path:
    file = where / name
    if not file.is_file():
        raise CheckpointError(f"Invalid checkpoint at {str(where)!r}: {name} is missing (listed in manifest.json "
                              f"field `files.{name}`). Nothing was restored. {_FIX}")
    entry = manifest["files"][name]
    if "size" in entry and file.stat().st_size != entry["size"]:
        raise _bad(where, name, f"has {file.stat().st_size} bytes, not the {entry['size']} of manifest.json "
                   f"field `files.{name}.size`")
    if _sha256(file) != entry["sha256"]:
        raise _bad(where, name, f"does not match its checksum (manifest.json field `files.{name}.sha256`)")
    return file


def _config_and_layout(where: pathlib.Path, manifest: dict, config_bytes: bytes) -> tuple[Any, Any]:
    """The config from config.pb, checked against the manifest's tables."""
    from meshembed.config import EmbeddingConfig
    from meshembed.embedding.layout import build_layout

    if "config_copy" in manifest and manifest["config_copy"] != config_bytes:
        raise _bad(where, "config.pb", "differs from manifest.json field `config_base64`")
    entries = manifest["tables"]
    names = [t["name"] for t in entries]
    if len(set(names)) != len(names):
        raise _bad(where, "manifest.json", f"field `tables` names a table twice: {names}")
    for i, t in enumerate(entries):
        if t["combiner"] not in COMBINERS:
            raise _bad(where, "manifest.json", f"field `tables[{i}].combiner`: expected one of {list(COMBINERS)}. "
                       f"Received: {t['combiner']!r}")
    try:
        # The proto has no combiners (TF passes them to the enqueue op); the manifest keeps them.
        config = EmbeddingConfig.from_proto(bytes(config_bytes), combiners={t["name"]: t["combiner"] for t in entries})
    except Exception as exc:  # noqa: BLE001 - any parser failure is a damaged file
        raise _bad(where, "config.pb", f"is not a TPUEmbeddingConfiguration ({type(exc).__name__}: {exc})") from None
    try:
        layout = build_layout(config)
    except MeshembedError as exc:
        raise _bad(where, "config.pb", f"is not a usable config: {exc}") from None
    if [t.name for t in layout.tables] != names:
        raise _bad(where, "manifest.json", f"field `tables` lists {names}, but config.pb has tables "
                   f"{[t.name for t in layout.tables]}")
    for i, (t, entry) in enumerate(zip(layout.tables, entries)):
        expected = {"vocabulary_size": t.vocabulary_size, "dimension": t.dimension,
                    "algorithm": t.optimizer.algorithm, "combiner": t.combiner}
        for key, value in expected.items():
            if entry[key] != value:
                raise _bad(where, "manifest.json", f"field `tables[{i}].{key}` is {entry[key]!r}, but config.pb "
                           f"has {value!r} for table {t.name!r}")
        want = {"parameters", *t.optimizer.slot_names}
        if set(entry["arrays"]) != want:
            raise _bad(where, "manifest.json", f"field `tables[{i}].arrays` has {sorted(entry['arrays'])}, but "
                       f"table {t.name!r} ({type(t.optimizer).__name__}) has {sorted(want)}")
    n = layout.num_dynamic_inputs
    for k, entry in enumerate(manifest["learning_rate_callables"]):
        if entry["tag"] >= n:
            raise _bad(where, "manifest.json", f"field `learning_rate_callables[{k}].tag` is {entry['tag']}, but "
                       f"config.pb has {n} dynamic tag(s)")
    return config, layout


def _read_arrays(where: pathlib.Path, layout: Any, manifest: dict) -> dict[str, np.ndarray]:
    file = _verify_file(where, "arrays.npz", manifest)
    try:
        with np.load(file, allow_pickle=False) as npz:
            stored = set(npz.files)
            arrays = {k: np.array(npz[k]) for k in npz.files}
    except Exception as exc:  # noqa: BLE001 - a damaged archive fails in many ways
        raise _bad(where, "arrays.npz", f"cannot be read without pickles ({type(exc).__name__}: {exc})") from None
    wanted = {key for entry in manifest["tables"] for key in entry["arrays"].values()}
    if stored != wanted:
        missing, extra = sorted(wanted - stored), sorted(stored - wanted)
        raise _bad(where, "arrays.npz", f"does not hold the arrays manifest.json field `tables[].arrays` lists "
                   f"(missing: {missing}, unexpected: {extra})")
    for i, (t, entry) in enumerate(zip(layout.tables, manifest["tables"])):
        for name, key in entry["arrays"].items():
            a = arrays[key]
            if a.dtype != np.float32 or a.shape != (t.vocabulary_size, t.dimension):
                raise _bad(where, "arrays.npz", f"array {key!r} (table {t.name!r}, `{name}`) has dtype {a.dtype} "
                           f"and shape {a.shape}; expected float32 {(t.vocabulary_size, t.dimension)}")
    return arrays


def _verified(path: Any) -> tuple[dict, bytes, Any, Any, dict[str, np.ndarray]]:
    """(manifest, config bytes, config, layout, arrays), every check passed."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise CheckpointError(f"Invalid checkpoint `path`: expected a str or os.PathLike. Received: {type(path).__name__}")
    where = _locate(pathlib.Path(path))
    manifest = _read_manifest(where)
    config_bytes = _verify_file(where, "config.pb", manifest).read_bytes()
    config, layout = _config_and_layout(where, manifest, config_bytes)
    arrays = _read_arrays(where, layout, manifest)
    return manifest, config_bytes, config, layout, arrays


def read(path: Any) -> tuple[dict, bytes, dict[str, np.ndarray]]:
    """(manifest, config bytes, arrays) of a checkpoint, after every check :func:`restore` makes."""
    manifest, config_bytes, _, _, arrays = _verified(path)
    return manifest, config_bytes, arrays


# ----------------------------------------------------------------------------- restore
def _learning_rate_fns(manifest: dict, layout: Any, learning_rates: Any,
                       where: str) -> tuple[Callable[[], float] | None, ...] | None:
    """The callables to put back in the restored config's ``learning_rate_fns``.

    ``learning_rates``: like the callables given to the constructor's config, one per dynamic
    tag (a sequence in tag order or a ``{tag: fn}`` mapping with every tag); ``None`` for a
    tag means its values are passed to ``apply_gradients(learning_rates=...)``."""
    n = layout.num_dynamic_inputs
    saved = manifest["learning_rate_callables"]
    if learning_rates is None:
        if not saved:
            return None
        lines = "; ".join(f"tag {e['tag']}: {e['name']} (tables {e['tables']})" for e in saved)
        names = {e["tag"]: e["name"] for e in saved}
        example = ", ".join(names.get(k, "None") for k in range(n))
        raise InputError(
            f"Checkpoint {where!r} was saved from a config whose learning rate came from a callable ({lines}); "
            "a callable cannot be stored in a checkpoint. Fix: pass it again, one entry per dynamic tag "
            f"in tag order ({n} tag(s)): `TPUEmbedding.restore(path, learning_rates=[{example}])`, or "
            "`learning_rates={tag: fn}`; use None for a tag whose values you pass to "
            "`apply_gradients(learning_rates=...)` yourself."
        )
    if isinstance(learning_rates, Mapping):
        keys = list(learning_rates)
        if any(not isinstance(k, int) or isinstance(k, bool) for k in keys) or set(keys) != set(range(n)):
            raise InputError(
                f"Invalid `learning_rates`: a mapping must have exactly the dynamic tags {list(range(n))} as "
                f"keys. Received keys: {keys!r}")
        values = [learning_rates[k] for k in range(n)]
    elif isinstance(learning_rates, Sequence) and not isinstance(learning_rates, (str, bytes)):
        values = list(learning_rates)
        if len(values) != n:
            raise InputError(
                f"Invalid `learning_rates`: the checkpoint's config has {n} dynamic tag(s), so expected {n} "
                f"entries (a callable or None per tag, in tag order). Received: {len(values)} entries.")
    else:
        raise InputError(
            "Invalid `learning_rates`: expected a sequence with a callable (or None) per dynamic tag, in tag "
            f"order, or a {{tag: callable}} mapping. Received: {type(learning_rates).__name__}")
    for k, fn in enumerate(values):
        if fn is not None and not callable(fn):
            raise InputError(
                f"Invalid `learning_rates[{k}]`: expected a callable returning the learning rate (as given to "
                f"the config), or None to pass values to apply_gradients. Received: {fn!r}")
    return tuple(values)


def restore(cls: Any, path: Any, backend: Any = None, num_shards: int | None = None, mesh: Any = None,
            learning_rates: Any = None) -> Any:
    """Build a ``cls`` engine from the checkpoint at ``path`` and load every table and slot.

    Everything is verified before the engine is built (see the module docstring)."""
    manifest, _, config, layout, arrays = _verified(path)
    fns = _learning_rate_fns(manifest, layout, learning_rates, str(path))
    if fns is not None:
        object.__setattr__(config, "learning_rate_fns", fns)  # as EmbeddingConfig itself sets them
    keys = manifest["feature_keys"]
    if keys:
        if len(keys) != len(config.features):
            raise _bad(pathlib.Path(path), "manifest.json", f"field `feature_keys` has {len(keys)} keys, but "
                       f"config.pb has {len(config.features)} features")
        object.__setattr__(config, "feature_keys", tuple(keys))  # as EmbeddingConfig sets them
    engine = cls(config, backend=backend, num_shards=num_shards, mesh=mesh, seed=manifest["seed"],
                 initializers={t["name"]: "zeros" for t in manifest["tables"]})
    for entry in manifest["tables"]:
        values = {name: arrays[key] for name, key in entry["arrays"].items()}
        params = values.pop("parameters")
        engine.load_parameters(entry["name"], params, **values)
    engine.step = int(manifest["step"])
    return engine
