"""A tiny ``tf.nest``: flatten / pack nested dicts, lists, tuples and namedtuples.

Dicts (any Mapping) flatten in sorted-key order and lists/tuples in position order, as
``tf.nest.flatten`` does, so a structure flattened here lines up with TensorFlow's. Paths are
``tf.nest.flatten_with_joined_string_paths``' (keys and indices joined by ``/``).

Matching a value against a config is *config-driven*: containers must agree down to the
config's leaves, and whatever sits at a leaf position is taken whole (a list of ids there is
one feature's input, not more structure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from meshembed.errors import InputError

__all__ = ["flatten_with_paths", "match", "pack", "is_container"]


def is_container(x: Any) -> bool:
    return isinstance(x, (Mapping, list, tuple))


def _sorted_keys(m: Mapping) -> list:
    try:
        return sorted(m)
    except TypeError as exc:
        raise InputError(f"Invalid nested structure: dict keys must be sortable (tf.nest sorts them). "
                         f"Received keys {list(m)!r}") from exc


def _children(x: Any) -> list[tuple[Any, Any]]:
    """``(path label, child)``: sorted keys, namedtuple field names (as tf.nest), or indices."""
    if isinstance(x, Mapping):
        return [(k, x[k]) for k in _sorted_keys(x)]
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return list(zip(x._fields, x))
    return list(enumerate(x))


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def flatten_with_paths(structure: Any, is_leaf: Callable[[Any], bool] = lambda x: not is_container(x),
                       path: str = "") -> list[tuple[str, Any]]:
    """``[(joined_path, leaf), ...]`` in ``tf.nest.flatten`` order."""
    if is_leaf(structure):
        return [(path, structure)]
    out: list[tuple[str, Any]] = []
    for key, child in _children(structure):
        out.extend(flatten_with_paths(child, is_leaf, _join(path, key)))
    return out


def _kind(x: Any) -> str:
    return "a dict" if isinstance(x, Mapping) else f"a {type(x).__name__}"


def match(config: Any, value: Any, what: str, is_config_leaf: Callable[[Any], bool], path: str = "") -> list[Any]:
    """The leaves of ``value`` in the flattened order of ``config``; raises InputError naming
    the first path where ``value``'s structure differs from ``config``'s."""
    if is_config_leaf(config):
        return [value]
    where = f"`{what}` at path '{path}'" if path else f"`{what}`"
    if isinstance(config, Mapping):
        if not isinstance(value, Mapping):
            raise InputError(
                f"Invalid {where}: expected a dict with keys {_sorted_keys(config)!r} (the structure of "
                f"feature_config). Received: {_kind(value)}. Fix: pass the same nest as feature_config "
                "(a positional list would pair features by position, not by name).")
        missing = [k for k in _sorted_keys(config) if k not in value]
        unknown = [k for k in value if k not in config]
        if missing or unknown:
            first = _join(path, (missing or unknown)[0])
            raise InputError(
                f"Invalid {where}: its keys differ from feature_config's at path '{first}'. "
                f"Expected keys {_sorted_keys(config)!r}. Missing: {missing!r}; unknown: {unknown!r}.")
    else:
        if isinstance(value, Mapping) or not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
            raise InputError(
                f"Invalid {where}: expected {_kind(config)} of {len(config)} entries (the structure of "
                f"feature_config). Received: {_kind(value)}.")
        if len(value) != len(config):
            raise InputError(
                f"Invalid {where}: expected {len(config)} entries, as in feature_config. "
                f"Received: {len(value)} entries.")
    out: list[Any] = []
    for i, (key, child) in enumerate(_children(config)):
        sub = value[key] if isinstance(config, Mapping) else value[i]
        out.extend(match(child, sub, what, is_config_leaf, _join(path, key)))
    return out


def pack(structure: Any, flat: Sequence[Any], is_leaf: Callable[[Any], bool]) -> Any:
    """``tf.nest.pack_sequence_as``: ``flat`` put back into ``structure``'s shape."""
    it = iter(flat)

    def build(node: Any) -> Any:
        if is_leaf(node):
            return next(it)
        if isinstance(node, Mapping):
            items = {k: build(node[k]) for k in _sorted_keys(node)}
            ordered = {k: items[k] for k in node}  # keep the config's own key order
            try:
                return type(node)(ordered)
            except TypeError:
                return ordered
        items = [build(child) for child in node]
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*items)
        return type(node)(items)

    return build(structure)
