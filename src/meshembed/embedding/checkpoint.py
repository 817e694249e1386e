"""Checkpoints: pickle-free, atomic, verified, independent of backend and shard count.

A checkpoint is a directory::

    manifest.json   format, version, step, seed, tables (shapes, combiners, array keys),
                    sha256 and size of every other file, and ``manifest_sha256``: the sha256
                    of the manifest's own canonical JSON without that field
    config.pb       the TPUEmbeddingConfiguration bytes
    arrays.npz      the *logical* [V, D] float32 arrays: t<i>.parameters, t<i>.<slot> (no pickles;
                    a row-wise optimizer's per-row slot is [V, 1])

Arrays are stored unsharded, so a checkpoint written with 2 shards on NumPy restores into
8 shards on JAX.

Saving never deletes or moves anything it did not write: ``path`` may be missing, an empty
directory or a meshembed checkpoint (a directory holding only the three files, as regular
files, with our manifest); anything else (another directory, a file, a symbolic link, ``.``, a
path under a regular file) is a CheckpointError and nothing is touched. The new checkpoint is
written into a sibling ``<name>.tmp-<tag>`` and renamed into place; an existing checkpoint is
first renamed to ``<name>.old-<tag>`` and removed after, so a crash at any point leaves a
complete checkpoint at ``path`` or at ``path.old-<tag>`` (which :func:`restore` falls back to
when ``path`` is missing). Both siblings carry a marker file, ``.meshembed-save``: JSON naming
meshembed, the path saved, the directory's own name, a random token and the pid. Only a
directory whose marker names it and ``path``, holding nothing but files a save writes, counts
as a leftover: the next successful save of ``path`` removes it (its known files, then the
directory). A name alone proves nothing: a user's ``model.old-20261204`` is never touched.

Restoring verifies everything before building an engine: the manifest schema field by field,
its own checksum, the checksum and size of every file, that config.pb parses and matches the
manifest's tables, and that every table and slot of the config is in arrays.npz with its
shape and dtype (read from each array's header before any array is loaded), and that its
values are ones the optimizer can continue from: no NaN/Inf unless ``allow_nonfinite=True``,
and no negative value in a slot the update takes a root or power of (Adagrad's accumulators,
Adam's velocities, RMSProp's ``ms``, ...). ``save`` refuses the same values, so it never writes
what ``restore`` would refuse (NaN/Inf are saved only from an engine created with
``allow_nonfinite=True``). Any failure is a CheckpointError naming the file, table and field;
running out of memory is one too, stating the bytes the tables need.

Several processes (torch.distributed ranks): every process gathers the tables, only the
backend's writer (``Backend.is_writer``: rank 0) writes, then all meet at ``Backend.barrier``;
``path`` is one checkpoint shared by every rank (a shared file system when the ranks run on
several hosts). :func:`restore` reads it on every process.

A table with a ``CustomOptimizer`` cannot be checkpointed: the config is stored as
TPUEmbeddingConfiguration bytes, which have no form for a Python-level optimizer. ``save``
raises a ConfigError before writing anything. Learning-rate callables cannot be stored
either: the manifest records which tags had one, and ``restore`` asks for them again.

A row-wise optimizer (``RowWiseAdagrad``, ``RowWiseAdam``: no proto form either) is
checkpointed: config.pb holds an SGD with the table's learning rate in its place, and the
table's manifest entry ``row_wise`` the spec (class and fields), put back on restore.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import pathlib
import re
import stat
import uuid
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy as np

from meshembed.config.optimizers import is_custom
from meshembed.config.rowwise import has_proto_form, row_wise_from_json, row_wise_to_json, slot_width
from meshembed.embedding.combiners import COMBINERS
from meshembed.errors import CheckpointError, ConfigError, InputError, MeshembedError, StateError

FORMAT = "meshembed.tpu_embedding.checkpoint"
VERSION = 2
FILES = ("arrays.npz", "config.pb", "manifest.json")
MARKER = ".meshembed-save"  # in every directory a save sets aside (temporary or old copy): ours to remove
_MARKER_MAX = 8192
_NAME_MAX = 240  # bytes of a sibling's name before ".tmp-<8 hex>": within the usual 255-byte limit
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIX = ("Fix: the checkpoint was changed or damaged after it was written; restore it from an intact "
        "copy, or use an earlier checkpoint.")
# Slots the update takes a root or a power of (they accumulate squares): no training reaches a
# negative value there, and restoring one would turn the next step into NaN.
NON_NEGATIVE_SLOTS: dict[str, tuple[str, ...]] = {
    "adagrad": ("accumulators",), "adagrad_momentum": ("accumulators",), "bounded_adagrad": ("accumulators",),
    "frequency_aware_adagrad": ("accumulators",), "proximal_adagrad": ("accumulators",),
    "mdl_adagrad_light": ("accumulators",), "ftrl": ("accumulators",), "adam": ("velocities",),
    "rms_prop": ("ms",), "centered_rms_prop": ("ms",), "adadelta": ("accumulators", "updates"),
    "online_yogi": ("vs",), "proximal_yogi": ("v",),
    "row_wise_adagrad": ("accumulators",), "row_wise_adam": ("velocities",),
}


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


def _stem(name: str) -> str:
    """``name`` cut so that its siblings' names fit the file system's name limit (the marker,
    not the name, says which path a sibling belongs to)."""
    while len(os.fsencode(name)) > _NAME_MAX:
        name = name[:-1]
    return name


def _sibling(path: pathlib.Path, kind: str, tag: str) -> pathlib.Path:
    return path.with_name(f"{_stem(path.name)}.{kind}-{tag}")


def _write_marker(directory: pathlib.Path, path: pathlib.Path, kind: str, name: str, token: str) -> None:
    """Mark ``directory`` (to be named ``name``) as set aside by this save of ``path``: one
    small write, never through a link, fsynced."""
    body = {"meshembed": FORMAT, "for": path.name, "kind": kind, "dir": name, "token": token, "pid": os.getpid()}
    fd = os.open(directory / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _marker(directory: pathlib.Path) -> dict | None:
    """The marker a save wrote in ``directory`` (a regular file with our JSON), else None."""
    file = directory / MARKER
    try:
        st = os.lstat(file)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MARKER_MAX:
            return None
        body = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(body, dict) and body.get("meshembed") == FORMAT and all(
        isinstance(body.get(k), str) for k in ("for", "kind", "dir"))
    return body if ok else None


def _entries(directory: pathlib.Path) -> dict[str, bool] | None:
    """``{name: is a regular file}`` of a real directory (not a link), else None."""
    try:
        if directory.is_symlink() or not directory.is_dir():
            return None
        return {e.name: e.is_file(follow_symlinks=False) for e in os.scandir(directory)}
    except OSError:
        return None


def _has_our_manifest(directory: pathlib.Path) -> bool:
    try:
        manifest = json.loads((directory / "manifest.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _is_leftover(directory: pathlib.Path, path: pathlib.Path) -> bool:
    """``directory`` was set aside by a save of ``path`` and left behind: its marker names
    ``path`` and the directory itself (a copy under another name is not ours), and it holds
    nothing but regular files a save writes."""
    entries = _entries(directory)
    if entries is None or not set(entries) <= {*FILES, MARKER} or not all(entries.values()):
        return False
    m = _marker(directory)
    return m is not None and m["for"] == path.name and m["dir"] == directory.name


def _remove_ours(directory: pathlib.Path) -> None:
    """Remove a directory a save set aside: only its known files, the big one first and the
    marker last (an interrupted removal stays recognisable), then the directory if empty."""
    for name in ("arrays.npz", "config.pb", "manifest.json", MARKER):
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


def _candidates(path: pathlib.Path) -> list[pathlib.Path]:
    """Siblings named like a save's temporary or old directory of ``path`` (ours or not)."""
    pattern = re.compile(re.escape(_stem(path.name)) + r"\.(tmp|old)-[0-9a-f]{8}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return [path.parent / n for n in sorted(names) if pattern.fullmatch(n)]


def _leftovers(path: pathlib.Path) -> list[pathlib.Path]:
    """The siblings of ``path`` an earlier save of it set aside and left behind (by marker)."""
    return [p for p in _candidates(path) if _is_leftover(p, path)]


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


# Low-precision tables (docs/low_precision.md): each array is stored in its storage dtype,
# never widened: bfloat16 as its 16-bit patterns (uint16: NumPy has no bfloat16), float16 as
# float16. The table entry's optional `precision` (Precision.to_json) says which is which and
# keeps the rounding and seed; `dtype` is the parameters' storage dtype.
_FILE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16)}


def _entry_dtypes(entry: Mapping[str, Any]) -> dict[str, str]:
    """Each array's storage dtype, by name, from a manifest table entry."""
    found = entry.get("precision")
    if found is None:
        return {name: "float32" for name in entry["arrays"]}
    from meshembed.config.precision import Precision

    p = Precision.from_json(found)
    return {name: p.parameters if name == "parameters" else p.slot_dtype(name) for name in entry["arrays"]}


def _to_file(values: np.ndarray, dtype: str) -> np.ndarray:
    """Exact float32 values of a ``dtype`` array -> the array written (its storage form)."""
    from meshembed.embedding import precision

    if dtype == "float32":
        return np.ascontiguousarray(values, dtype=np.float32)
    return precision.to_storage(values, dtype).view(_FILE_DTYPES[dtype])  # exact: the values are representable


def _from_file(arr: np.ndarray, dtype: str) -> np.ndarray:
    """An array as written -> its exact float32 values."""
    from meshembed.embedding import precision

    if dtype == "float32":
        return arr
    return precision.from_storage(np.ascontiguousarray(arr).view(np.int16), dtype)


def collect(engine: Any) -> tuple[bytes, dict[str, np.ndarray], list[dict]]:
    """(config bytes, logical arrays, table entries) of ``engine``.

    Collective on a multi-process backend (``retrieve_parameters`` unshards every table), so
    every process calls it, in the same order, whether or not it writes."""
    config_bytes = _proto_bytes(engine.config)
    arrays: dict[str, np.ndarray] = {}
    tables = []
    for t in engine.layout.tables:
        values = engine.retrieve_parameters(t.name)
        p = getattr(t, "precision", None)
        dtypes = dict(zip(values, p.dtypes(tuple(values)[1:]))) if p is not None else {}
        keys = {}
        for name, arr in values.items():
            key = f"t{t.index}.{name}"
            arrays[key] = _to_file(arr, dtypes.get(name, "float32"))
            keys[name] = key
        tables.append({
            "name": t.name,
            "vocabulary_size": int(t.vocabulary_size),
            "dimension": int(t.dimension),
            "algorithm": t.optimizer.algorithm,
            "combiner": t.combiner,  # not part of TPUEmbeddingConfiguration: kept here
            "dtype": dtypes.get("parameters", "float32"),
            "arrays": keys,
            # the proto extension (docs/low_precision.md): storage dtypes, rounding, seed
            **({"precision": p.to_json()} if p is not None else {}),
            # a row-wise optimizer (no proto form): its spec; config.pb holds an SGD stand-in with its lr
            **({"row_wise": row_wise_to_json(t.optimizer)} if not has_proto_form(t.optimizer) else {}),
        })
        _collect_dynamic(engine, t, arrays, tables[-1])
    return config_bytes, arrays, tables


def _proto_bytes(config: Any) -> bytes:
    """config.pb: the config's proto, a row-wise table's optimizer replaced by an SGD with the
    same learning rate (a constant or its dynamic tag); the manifest's ``row_wise`` entry
    holds the spec itself and :func:`_config_and_layout` puts it back."""
    from meshembed.config import SGD

    if all(has_proto_form(t.optimizer) or is_custom(t.optimizer) for t in config.tables):
        return config.to_proto()
    tables = tuple(t.replace(optimizer=SGD(t.optimizer.learning_rate)) if not has_proto_form(t.optimizer)
                   and not is_custom(t.optimizer) else t for t in config.tables)
    return config.replace(tables=tables).to_proto()


def _with_row_wise(where: pathlib.Path, config: Any, entries: list) -> Any:
    """``config`` (from config.pb) with each manifest ``row_wise`` spec in its table."""
    found = {t["name"]: t["row_wise"] for t in entries if "row_wise" in t}
    if not found:
        return config
    tables = []
    for t in config.tables:
        if t.name in found:
            try:
                entry = found[t.name]
                t = t.replace(optimizer=row_wise_from_json(entry, learning_rate=t.optimizer.learning_rate))
            except (MeshembedError, ValueError, TypeError, KeyError) as exc:
                raise _bad(where, "manifest.json", f"field `tables[].row_wise` of table {t.name!r} is not a "
                           f"row-wise optimizer ({exc})") from None
        tables.append(t)
    return config.replace(tables=tuple(tables))


# -- dynamic vocabularies (embedding/dynamic.py): extra arrays and a manifest entry per table ----
def _collect_dynamic(engine: Any, t: Any, arrays: dict[str, np.ndarray], entry: dict) -> None:
    """A dynamic table's vocabulary: its state arrays ``t<i>.dynamic.<name>`` in arrays.npz and
    ``tables[i].dynamic`` (spec, initializer, array keys) in the manifest."""
    from meshembed.embedding import dynamic

    vocab = getattr(engine, "vocabularies", {}).get(t.name)
    if vocab is None:
        return
    keys = {}
    for name, arr in vocab.to_arrays().items():
        keys[name] = f"t{t.index}.dynamic.{name}"
        arrays[keys[name]] = arr
    entry["dynamic"] = {"spec": dynamic.spec_to_json(vocab.spec),
                        "initializer": dynamic.initializer_to_json(engine.dynamic_initializers[t.name]),
                        "arrays": keys}


def _check_dynamic_entry(where: pathlib.Path, i: int, t: dict) -> None:
    """``tables[i].dynamic``: exactly spec, initializer and the state's array keys."""
    from meshembed.embedding import dynamic

    ctx = f"tables[{i}].dynamic."
    d = _field(where, t, "dynamic", f"tables[{i}].", "dict")
    _exact_keys(where, d, {"spec", "initializer", "arrays"}, ctx)
    try:
        spec = dynamic.spec_from_json(d["spec"])
        dynamic.initializer_from_json(d["initializer"])
    except ConfigError as exc:
        raise _bad(where, "manifest.json", f"field `{ctx}spec`/`{ctx}initializer`: {exc}") from None
    arrays = _field(where, d, "arrays", ctx, "dict")
    want = {n for n in dynamic.STATE_ARRAYS if n != "sketch" or isinstance(spec.admission, dynamic.AfterOccurrences)}
    _exact_keys(where, arrays, want, f"{ctx}arrays.")
    for name, key in arrays.items():
        if key != f"t{i}.dynamic.{name}":
            raise _bad(where, "manifest.json", f"field `{ctx}arrays.{name}`: expected {f't{i}.dynamic.{name}'!r}. "
                       f"Received: {key!r}")


def _dynamic_states(where: Any, manifest: dict, layout: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``{table: DynamicVocabularyState}`` from the verified arrays, every invariant checked."""
    from meshembed.embedding import dynamic

    out = {}
    for t, entry in zip(layout.tables, manifest["tables"]):
        d = entry.get("dynamic")
        if d is None:
            continue
        spec = dynamic.spec_from_json(d["spec"])
        try:
            out[t.name] = dynamic.DynamicVocabularyState.from_arrays(
                spec, t.vocabulary_size, {name: arrays[key] for name, key in d["arrays"].items()})
        except ValueError as exc:
            raise dynamic.checkpoint_error(where, t.name, exc) from None
    return out


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
    extra = [e for e in entries if e not in FILES and not (e == MARKER and _marker_for(path))]
    if extra:
        raise refuse(f"it is a directory holding files a meshembed checkpoint does not have ({extra[:5]}"
                     f"{' ...' if len(extra) > 5 else ''}), and save replaces the whole directory")
    kinds = _entries(path) or {}
    odd = [e for e in entries if not kinds.get(e, False)]
    if odd:
        raise refuse(f"its {odd[0]!r} is a directory or link, not the file a meshembed checkpoint has, and "
                     "save replaces the whole directory")
    if not _has_our_manifest(path):
        raise refuse("it is a directory whose manifest.json does not mark it as a meshembed checkpoint")
    return path


def _marker_for(path: pathlib.Path) -> bool:
    """``path`` holds the marker of a save of ``path`` (left by a save killed mid-rename)."""
    m = _marker(path)
    return m is not None and m["for"] == path.name


def _nbytes(tables: Sequence[Any]) -> int:
    """Bytes of every table's float32 parameters and slots, unsharded."""
    return sum(4 * int(t.vocabulary_size) * sum(slot_width(t.optimizer, name, t.dimension)
                                                for name in ("parameters", *t.optimizer.slot_names)) for t in tables)


def _out_of_memory(what: str, where: Any, tables: Sequence[Any], nothing: str) -> CheckpointError:
    n = _nbytes(tables)
    return CheckpointError(
        f"{what} {str(where)!r} ran out of memory: the {len(tables)} table(s) with their slots take {n} bytes "
        f"({n / 2**30:.3g} GiB) as float32 [vocabulary_size, dimension] arrays, held in host memory at once, "
        f"and that allocation failed (MemoryError). {nothing} Fix: free host memory or use a machine with "
        "more; the tables' sizes are in the config (vocabulary_size x dimension x (1 + slots) x 4 bytes).")


def _first(arr: np.ndarray, bad: Callable[[np.ndarray], np.ndarray]) -> tuple[int, int]:
    """(row, column) of the first element where ``bad`` holds, scanning a block of rows at a
    time (no full-size temporary)."""
    rows = max(1, (1 << 20) // max(1, arr.shape[1]))
    for start in range(0, arr.shape[0], rows):
        hit = np.argwhere(bad(arr[start:start + rows]))
        if hit.size:
            return start + int(hit[0][0]), int(hit[0][1])
    return 0, 0


def _value_problem(algorithm: str, slot: str, arr: np.ndarray, allow_nonfinite: bool) -> tuple[bool, str] | None:
    """(is it NaN/Inf, why) ``arr`` cannot be a table's ``slot``, or None. min/max propagate NaN
    and fmin skips it, so no full-size temporary is made for a good array."""
    if not allow_nonfinite and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
        r, c = _first(arr, lambda b: ~np.isfinite(b))
        return True, f"holds {arr[r, c]} (first at row {r}, column {c}): NaN/Inf"
    if slot in NON_NEGATIVE_SLOTS.get(algorithm, ()) and np.fmin.reduce(arr, axis=None) < 0:
        r, c = _first(arr, lambda b: b < 0)
        return False, (f"holds {arr[r, c]} (first at row {r}, column {c}), but the {algorithm} update needs "
                       f"`{slot}` >= 0 (it accumulates squares and takes their root or power)")
    return None


def check_values(engine: Any, path: Any, arrays: Mapping[str, np.ndarray], tables: list[dict]) -> None:
    """CheckpointError, before anything is written, for values ``restore`` would refuse."""
    allow = bool(getattr(engine, "allow_nonfinite", False))
    for entry in tables:
        dtypes = _entry_dtypes(entry)
        for slot, key in entry["arrays"].items():
            problem = _value_problem(entry["algorithm"], slot, _from_file(arrays[key], dtypes[slot]), allow)
            if problem is None:
                continue
            nonfinite, why = problem
            fix = (f"Fix: load finite values with `load_parameters({entry['name']!r}, ...)` (a NaN/Inf usually "
                   "comes from a too-large learning rate or gradient), or create the engine with "
                   "`allow_nonfinite=True` to save NaN/Inf tables (restore them with `allow_nonfinite=True`)."
                   if nonfinite else
                   f"Fix: load `{slot}` >= 0 with `load_parameters({entry['name']!r}, ...)`, e.g. "
                   f"np.maximum({slot}, 0).")
            raise CheckpointError(f"Cannot save a checkpoint to {str(path)!r}: table {entry['name']!r} `{slot}` "
                                  f"{why}. Nothing was written. {fix}")


def save(engine: Any, path: Any) -> pathlib.Path:
    """Atomically write ``engine``'s checkpoint to the directory ``path``.

    On a multi-process backend every process calls this: all take part in gathering the
    tables (a collective), only the writer process (``backend.is_writer``, rank 0 under
    torch.distributed) writes ``path``, and all wait for it at ``backend.barrier`` — so when
    ``save`` returns on any process the checkpoint is complete, and if the writer failed every
    process raises. Every process checks the gathered values (the same on each), so a refusal
    is raised everywhere before anyone waits."""
    check_saveable(engine)
    backend = engine.backend
    path = pathlib.Path(path) if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes) else path
    try:
        collected = collect(engine)  # collective: every process, before anything is written
    except MemoryError:
        raise _out_of_memory("Saving a checkpoint to", path, engine.layout.tables, "Nothing was written.") from None
    check_values(engine, path, collected[1], collected[2])
    error: BaseException | None = None
    if getattr(backend, "is_writer", True):
        try:
            _write_atomically(engine, path, collected)
        except BaseException as exc:  # reported after the barrier, so no process is left waiting
            error = exc
    barrier = getattr(backend, "barrier", None)
    everyone_ok = True if barrier is None else bool(barrier(error is None))
    if isinstance(error, MemoryError):
        raise _out_of_memory("Saving a checkpoint to", path, engine.layout.tables,
                             "The previous checkpoint at that path, if any, is unchanged.") from None
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
    token = uuid.uuid4().hex
    tmp = _sibling(path, "tmp", token[:8])
    tmp.mkdir()
    old = None
    placed = False
    try:
        _write_marker(tmp, path, "tmp", tmp.name, token)  # ours from here on (before: an empty directory)
        write_contents(engine, tmp, collected)
        _fsync_dir(tmp)
        if os.path.lexists(path):
            old = _sibling(path, "old", token[:8])
            _write_marker(path, path, "old", old.name, token)  # the copy set aside is ours to remove
            os.replace(path, old)
        os.replace(tmp, path)
        placed = True
        _unlink_marker(path)  # the new checkpoint: its three files only
        _fsync_dir(path)
        _fsync_dir(path.parent)
    except BaseException:
        if old is not None and not os.path.lexists(path):
            try:  # the second rename failed: put the previous checkpoint back at path
                os.replace(old, path)
            except OSError:
                pass  # restore(path) falls back to path.old-*, whose marker names it
        if (old is not None or placed) and os.path.lexists(path):
            try:
                _unlink_marker(path)
            except OSError:
                pass
        _remove_ours(tmp)
        raise
    if old is not None:
        _remove_ours(old)
    for leftover in _leftovers(path):  # of earlier saves of this path that crashed
        _remove_ours(leftover)


def _unlink_marker(directory: pathlib.Path) -> None:
    try:
        os.unlink(directory / MARKER)
    except FileNotFoundError:
        pass


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
    """``path`` itself, or — only when nothing is at ``path`` — the previous checkpoint a save
    interrupted between its renames set aside (``path.old-*`` with that save's marker), with a
    warning. A directory only named like one is never used."""
    if os.path.lexists(path):
        if not (path / "manifest.json").is_file():
            raise CheckpointError(
                f"No checkpoint at {str(path)!r}: manifest.json is missing. Fix: pass the directory "
                "that TPUEmbedding.save(path) wrote.")
        return path
    olds = [p for p in _leftovers(path) if _marker(p)["kind"] == "old" and (p / "manifest.json").is_file()]
    if not olds:
        others = [p.name for p in _candidates(path) if p.is_dir()]
        note = (f" {others[:3]} next to it {'is' if len(others) == 1 else 'are'} not marked as set aside by a "
                "meshembed save of this path, so restore does not use it: pass its path to restore it."
                if others else "")
        raise CheckpointError(
            f"No checkpoint at {str(path)!r}: the path does not exist.{note} Fix: pass the directory that "
            "TPUEmbedding.save(path) wrote.")
    old = max(olds, key=lambda p: p.stat().st_mtime)
    warnings.warn(
        f"No checkpoint at {str(path)!r}; restoring {str(old)!r}, the previous checkpoint a save "
        f"interrupted between its two renames set aside (its {MARKER} marker says so). The next successful "
        "save of the path removes it.",
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
    except RecursionError:  # nesting no manifest has
        raise _bad(where, "manifest.json", "is nested too deeply to be a meshembed manifest") from None
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
        _exact_keys(where, t, keys, ctx, optional={"dynamic", "precision", "row_wise"} if with_dtype else {"dynamic"})
        if "dynamic" in t:
            _check_dynamic_entry(where, i, t)
        for key, kind in (("name", "str"), ("vocabulary_size", "pos"), ("dimension", "pos"),
                          ("algorithm", "str"), ("combiner", "str"), ("arrays", "dict")):
            _field(where, t, key, ctx, kind)
        parameters = "float32"
        if "precision" in t:  # a low-precision table (docs/low_precision.md)
            try:
                parameters = _entry_dtypes(t)["parameters"]
            except (MeshembedError, TypeError, KeyError) as exc:
                raise _bad(where, "manifest.json", f"field `{ctx}precision` is not a Precision ({exc})") from None
        if with_dtype and t["dtype"] != parameters:
            raise _bad(where, "manifest.json", f"field `{ctx}dtype`: expected {parameters!r}. Received: {t['dtype']!r}")
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
    specs = {i: t["dynamic"]["spec"] for i, t in enumerate(entries) if "dynamic" in t}
    if specs:  # dynamic vocabularies: the proto has no place for them, the manifest keeps them
        from meshembed.embedding import dynamic

        try:
            config = config.replace(tables=tuple(
                t.replace(dynamic=dynamic.spec_from_json(specs[i])) if i in specs else t
                for i, t in enumerate(config.tables)))
        except (ConfigError, IndexError) as exc:
            raise _bad(where, "manifest.json", f"field `tables[].dynamic` does not fit config.pb: {exc}") from None
    config = _with_row_wise(where, config, entries)
    precisions = {t["name"]: t["precision"] for t in entries if "precision" in t}
    if precisions:  # the extension travels in the manifest, beside config.pb
        from meshembed.config.precision import Precision

        config = config.replace(tables=tuple(
            t.replace(precision=Precision.from_json(precisions[t.name])) if t.name in precisions else t
            for t in config.tables))
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


def _npy_header(z: zipfile.ZipFile, member: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from a .npy member's header, without reading its data."""
    with z.open(member) as fh:
        version = np.lib.format.read_magic(fh)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"unsupported .npy format version {version}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fh)
    return shape, dtype


def _load_npy(z: zipfile.ZipFile, member: str) -> np.ndarray:
    with z.open(member) as fh:
        return np.lib.format.read_array(fh, allow_pickle=False)


def _read_arrays(where: pathlib.Path, layout: Any, manifest: dict, allow_nonfinite: bool) -> dict[str, np.ndarray]:
    """The arrays of arrays.npz: every header checked against the config before any data is
    read (a header cannot make us allocate more than the config's tables take), then every
    value (see :func:`_value_problem`)."""
    file = _verify_file(where, "arrays.npz", manifest)
    wanted = {key for entry in manifest["tables"] for key in entry["arrays"].values()}
    dynamic_keys = {key for entry in manifest["tables"] for key in entry.get("dynamic", {}).get("arrays", {}).values()}
    wanted |= dynamic_keys
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(file) as z:
            members = {n[:-4] if n.endswith(".npy") else n: n for n in z.namelist()}
            if set(members) != wanted:
                missing, extra = sorted(wanted - set(members)), sorted(set(members) - wanted)
                raise _bad(where, "arrays.npz", f"does not hold the arrays manifest.json field `tables[].arrays` "
                           f"lists (missing: {missing}, unexpected: {extra})")
            for t, entry in zip(layout.tables, manifest["tables"]):
                try:
                    stored = _entry_dtypes(entry)
                except MeshembedError as exc:
                    raise _bad(where, "manifest.json", f"table {t.name!r}: {exc}") from None
                for name in ("parameters", *t.optimizer.slot_names):
                    key = entry["arrays"][name]
                    shape, dtype = _npy_header(z, members[key])
                    want = _FILE_DTYPES[stored[name]]
                    expected = (t.vocabulary_size, slot_width(t.optimizer, name, t.dimension))  # row-wise: 1 column
                    if dtype != want or shape != expected:
                        raise _bad(where, "arrays.npz", f"array {key!r} (table {t.name!r}, `{name}`) has dtype "
                                   f"{dtype} and shape {shape}; expected {want} {expected}"
                                   + ("" if stored[name] == "float32" else f" ({stored[name]} storage)"))
            for t, entry in zip(layout.tables, manifest["tables"]):
                stored = _entry_dtypes(entry)
                for name in ("parameters", *t.optimizer.slot_names):
                    key = entry["arrays"][name]
                    arrays[key] = _load_npy(z, members[key])
                    problem = _value_problem(t.optimizer.algorithm, name, _from_file(arrays[key], stored[name]),
                                             allow_nonfinite)
                    if problem is not None:
                        raise _bad_values(where, key, t.name, name, *problem)
            for t, entry in zip(layout.tables, manifest["tables"]):  # dynamic vocabularies: their state
                if "dynamic" not in entry:
                    continue
                from meshembed.embedding import dynamic

                expected = dynamic.state_shapes(dynamic.spec_from_json(entry["dynamic"]["spec"]), t.vocabulary_size)
                for name, key in entry["dynamic"]["arrays"].items():
                    shape, dtype = _npy_header(z, members[key])
                    if (shape, dtype) != expected[name]:
                        raise _bad(where, "arrays.npz", f"array {key!r} (table {t.name!r}, dynamic vocabulary "
                                   f"`{name}`) has dtype {dtype} and shape {shape}; expected {expected[name][1]} "
                                   f"{expected[name][0]}")
                    arrays[key] = _load_npy(z, members[key])
    except (CheckpointError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged archive fails in many ways
        raise _bad(where, "arrays.npz", f"cannot be read without pickles ({type(exc).__name__}: {exc})") from None
    return arrays


def _bad_values(where: pathlib.Path, key: str, table: str, slot: str, nonfinite: bool, why: str) -> CheckpointError:
    if nonfinite:
        fix = ("Fix: if it was saved from an engine created with allow_nonfinite=True, restore it with "
               "`allow_nonfinite=True` (meshembed.embedding.checkpoint.restore(TPUEmbedding, path, "
               "allow_nonfinite=True)); otherwise restore an earlier checkpoint.")
    else:
        fix = ("Fix: meshembed never saves such a value, so the file was changed or written by other means; "
               "restore an intact copy, or load repaired arrays (e.g. np.maximum(a, 0)) with load_parameters.")
    return CheckpointError(f"Invalid checkpoint at {str(where)!r}: arrays.npz array {key!r} (table {table!r}, "
                           f"`{slot}`) {why}. Nothing was restored. {fix}")


def _verified(path: Any, allow_nonfinite: bool = False) -> tuple[dict, bytes, Any, Any, dict[str, np.ndarray]]:
    """(manifest, config bytes, config, layout, arrays), every check passed."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise CheckpointError(f"Invalid checkpoint `path`: expected a str or os.PathLike. Received: {type(path).__name__}")
    if not isinstance(allow_nonfinite, bool):
        raise InputError(f"Invalid `allow_nonfinite`: expected True or False. Received: {allow_nonfinite!r}")
    where = _locate(pathlib.Path(path))
    manifest = _read_manifest(where)
    config_bytes = _verify_file(where, "config.pb", manifest).read_bytes()
    config, layout = _config_and_layout(where, manifest, config_bytes)
    try:
        arrays = _read_arrays(where, layout, manifest, allow_nonfinite)
    except MemoryError:
        raise _out_of_memory("Restoring the checkpoint at", where, layout.tables, "Nothing was restored.") from None
    return manifest, config_bytes, config, layout, arrays


def read(path: Any, allow_nonfinite: bool = False) -> tuple[dict, bytes, dict[str, np.ndarray]]:
    """(manifest, config bytes, arrays) of a checkpoint, after every check :func:`restore` makes."""
    manifest, config_bytes, _, _, arrays = _verified(path, allow_nonfinite)
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


def _dynamic_initializers(manifest: dict, given: Any, where: str) -> dict[str, Any]:
    """Each dynamic table's initializer: the manifest's, or ``given[table]`` (needed for a
    callable, which no file can hold)."""
    from meshembed.embedding import dynamic

    given = dict(given or {})
    names = [t["name"] for t in manifest["tables"] if "dynamic" in t]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InputError(f"Invalid `initializers`: {unknown} are not dynamic tables of checkpoint {where!r}; "
                         f"its dynamic tables are {names} (the others' values are all in the checkpoint).")
    out = {}
    for t in manifest["tables"]:
        if "dynamic" not in t:
            continue
        init = given.get(t["name"], dynamic.initializer_from_json(t["dynamic"]["initializer"]))
        if init is None:
            raise InputError(
                f"Checkpoint {where!r}: dynamic table {t['name']!r} initialises the rows of admitted keys with the "
                f"callable {t['dynamic']['initializer']['name']}, which no checkpoint can hold. Fix: pass it "
                f"again: restore(path, initializers={{{t['name']!r}: fn}}).")
        out[t["name"]] = init
    return out


def _with_precision(config: Any, precision: Any, where: str) -> Any:
    """``config`` with the tables ``precision`` names (``{table: Precision or None}``; None =
    float32) stored as it says: restoring into other storage dtypes is asked for, never implied."""
    from meshembed.config.precision import Precision

    names = [t.name for t in config.tables]
    if not isinstance(precision, Mapping) or not all(
            isinstance(k, str) and (v is None or isinstance(v, Precision)) for k, v in precision.items()):
        raise InputError(
            "Invalid `precision`: expected {table_name: me.embedding.Precision or None (float32)} for the tables "
            f"whose storage should change, or 'saved'. Received: {precision!r}")
    unknown = sorted(set(precision) - set(names))
    if unknown:
        raise InputError(f"Invalid `precision`: checkpoint {where!r} has no tables {unknown}. Expected some of {names}.")
    return config.replace(tables=tuple(t.replace(precision=precision[t.name]) if t.name in precision else t
                                       for t in config.tables))


def restore(cls: Any, path: Any, backend: Any = None, num_shards: int | None = None, mesh: Any = None,
            learning_rates: Any = None, allow_nonfinite: bool = False, initializers: Any = None,
            precision: Any = "saved") -> Any:
    """Build a ``cls`` engine from the checkpoint at ``path`` and load every table and slot.

    Everything is verified before the engine is built (see the module docstring).
    ``allow_nonfinite``: accept NaN/Inf values (saved from an engine created with it), and
    build the engine with it. ``precision``: ``"saved"`` (default) restores every table in the
    storage dtypes it was saved in, bit for bit; ``{table: me.embedding.Precision or None}``
    restores those tables into other storage (None: float32): the saved values, exact in
    float32, are rounded to nearest into 16-bit arrays (docs/low_precision.md)."""
    manifest, _, config, layout, arrays = _verified(path, allow_nonfinite)
    if not (isinstance(precision, str) and precision == "saved"):
        config = _with_precision(config, precision, str(path))
    vocabularies = _dynamic_states(path, manifest, layout, arrays)
    inits = _dynamic_initializers(manifest, initializers, str(path))
    fns = _learning_rate_fns(manifest, layout, learning_rates, str(path))
    if fns is not None:
        object.__setattr__(config, "learning_rate_fns", fns)  # as EmbeddingConfig itself sets them
    keys = manifest["feature_keys"]
    if keys:
        if len(keys) != len(config.features):
            raise _bad(pathlib.Path(path), "manifest.json", f"field `feature_keys` has {len(keys)} keys, but "
                       f"config.pb has {len(config.features)} features")
        object.__setattr__(config, "feature_keys", tuple(keys))  # as EmbeddingConfig sets them
    extra = {"allow_nonfinite": True} if allow_nonfinite else {}
    try:
        engine = cls(config, backend=backend, num_shards=num_shards, mesh=mesh, seed=manifest["seed"],
                     initializers={t["name"]: inits.get(t["name"], "zeros") for t in manifest["tables"]}, **extra)
        for entry in manifest["tables"]:
            stored = _entry_dtypes(entry)  # 16-bit arrays: their exact float32 values, then the engine's storage
            values = {name: _from_file(arrays[key], stored[name]) for name, key in entry["arrays"].items()}
            params = values.pop("parameters")
            engine.load_parameters(entry["name"], params, **values)
        for name, vocab in vocabularies.items():
            engine.load_vocabulary(name, vocab)
    except MemoryError:
        raise _out_of_memory("Restoring the checkpoint at", path, layout.tables, "Nothing was restored.") from None
    engine.step = int(manifest["step"])
    return engine
