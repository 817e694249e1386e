"""Checkpoints: pickle-free, atomic, independent of backend and shard count.

A checkpoint is a directory::

    manifest.json   format, step, table list with shapes and slot names, checksums
    config.pb       the TPUEmbeddingConfiguration bytes (also base64 in the manifest)
    arrays.npz      the *logical* [V, D] arrays: t<i>.parameters, t<i>.<slot> (no pickles)

Arrays are stored unsharded, so a checkpoint written with 2 shards on NumPy restores into
8 shards on JAX. Writing goes to a temporary sibling directory that is renamed into place;
an existing checkpoint is first renamed aside and removed only after the new one is in
place, so a crash at any point leaves a complete checkpoint at ``path`` or at ``path.old-*``
(which :func:`restore` falls back to).

Several processes (torch.distributed ranks): every process gathers the tables, only the
backend's writer (``Backend.is_writer``: rank 0) writes, then all meet at ``Backend.barrier``;
``path`` is one checkpoint shared by every rank (a shared file system when the ranks run on
several hosts). :func:`restore` reads it on every process.

A table with a ``CustomOptimizer`` cannot be checkpointed: the config is stored as
TPUEmbeddingConfiguration bytes, which have no form for a Python-level optimizer. ``save``
raises a ConfigError before writing anything.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import shutil
import uuid
from typing import Any

import numpy as np

from meshembed.errors import ConfigError, InputError, StateError

FORMAT = "meshembed.tpu_embedding.checkpoint"
VERSION = 1


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
            "vocabulary_size": t.vocabulary_size,
            "dimension": t.dimension,
            "algorithm": t.optimizer.algorithm,
            "combiner": t.combiner,  # not part of TPUEmbeddingConfiguration: kept here
            "arrays": keys,
        })
    return config_bytes, arrays, tables


def write_contents(engine: Any, directory: pathlib.Path,
                   collected: tuple[bytes, dict[str, np.ndarray], list[dict]] | None = None) -> None:
    """Write the three checkpoint files into an (empty, temporary) directory
    (``collected``: what :func:`collect` returned, else it is called here)."""
    config_bytes, arrays, tables = collect(engine) if collected is None else collected
    with open(directory / "arrays.npz", "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    _write_file(directory / "config.pb", config_bytes)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(engine.step),
        "seed": int(engine.seed),
        "saved_with": {"backend": engine.backend.name, "num_shards": engine.num_shards},
        "config_base64": base64.b64encode(config_bytes).decode("ascii"),
        "tables": tables,
        "sha256": {"arrays.npz": _sha256(directory / "arrays.npz"), "config.pb": hashlib.sha256(config_bytes).hexdigest()},
    }
    _write_file(directory / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())


def check_saveable(engine: Any) -> None:
    """ConfigError naming the table and the fix when the config has no proto form."""
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


def save(engine: Any, path: Any) -> pathlib.Path:
    """Atomically write ``engine``'s checkpoint to the directory ``path``.

    On a multi-process backend every process calls this: all take part in gathering the
    tables (a collective), only the writer process (``backend.is_writer``, rank 0 under
    torch.distributed) writes ``path``, and all wait for it at ``backend.barrier`` — so when
    ``save`` returns on any process the checkpoint is complete, and if the writer failed every
    process raises."""
    check_saveable(engine)
    backend = engine.backend
    path = pathlib.Path(path)
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


def _write_atomically(engine: Any, path: pathlib.Path, collected: tuple) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = path.with_name(f"{path.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        write_contents(engine, tmp, collected)
        _fsync_dir(tmp)
        old = None
        if path.exists():
            old = path.with_name(f"{path.name}.old-{tag}")
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _locate(path: pathlib.Path) -> pathlib.Path:
    """``path`` itself, or the previous checkpoint left aside by an interrupted save."""
    if (path / "manifest.json").exists():
        return path
    olds = sorted(path.parent.glob(f"{path.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in olds:
        if (old / "manifest.json").exists():
            return old
    raise InputError(f"No checkpoint at {str(path)!r}: manifest.json is missing.")


def read(path: Any) -> tuple[dict, bytes, dict[str, np.ndarray]]:
    """(manifest, config bytes, arrays) of a checkpoint, with format and checksum checks."""
    where = _locate(pathlib.Path(path))
    manifest = json.loads((where / "manifest.json").read_text())
    if manifest.get("format") != FORMAT or int(manifest.get("version", 0)) > VERSION:
        raise InputError(
            f"Invalid checkpoint at {str(where)!r}: format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this meshembed reads {FORMAT!r} up to version {VERSION}."
        )
    sums = manifest.get("sha256", {})
    if sums.get("arrays.npz") and _sha256(where / "arrays.npz") != sums["arrays.npz"]:
        raise InputError(f"Corrupt checkpoint at {str(where)!r}: arrays.npz does not match its checksum.")
    config_path = where / "config.pb"
    config_bytes = config_path.read_bytes() if config_path.exists() else base64.b64decode(manifest["config_base64"])
    with np.load(where / "arrays.npz", allow_pickle=False) as npz:
        arrays = {k: np.array(npz[k]) for k in npz.files}
    return manifest, config_bytes, arrays


def restore(cls: Any, path: Any, backend: Any = None, num_shards: int | None = None, mesh: Any = None) -> Any:
    """Build a ``cls`` engine from the checkpoint at ``path`` and load every table and slot."""
    from meshembed.config import EmbeddingConfig

    manifest, config_bytes, arrays = read(path)
    # The proto has no combiners (TF passes them to the enqueue op); the manifest keeps them.
    # A checkpoint written before it did reads as the proto's default ("mean").
    combiners = {t["name"]: t["combiner"] for t in manifest["tables"] if t.get("combiner")}
    config = EmbeddingConfig.from_proto(config_bytes, combiners=combiners or None)
    engine = cls(config, backend=backend, num_shards=num_shards, mesh=mesh, seed=manifest.get("seed", 0),
                 initializers={t["name"]: "zeros" for t in manifest["tables"]})
    for entry in manifest["tables"]:
        values = {name: arrays[key] for name, key in entry["arrays"].items()}
        params = values.pop("parameters")
        engine.load_parameters(entry["name"], params, **values)
    engine.step = int(manifest["step"])
    return engine
