"""Whole-config checks: what TF's runtime (PopulateMissingFieldsInTPUEmbeddingConfig, the
configure op, the optimizer utils) rejects, reported with the table or feature at fault.

Single-object checks live with the objects (tables.py, optimizers.py). This module takes
the config's parts, not the EmbeddingConfig, so it sits below embedding.py (no import circle).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshembed.config.common import invalid
from meshembed.config.optimizers import DynamicLearningRate
from meshembed.config.tables import FeatureConfig, TableConfig
from meshembed.errors import ConfigError

__all__ = ["derived_geometry", "validate"]


def derived_geometry(features: Sequence[FeatureConfig], tables: Sequence[TableConfig]) -> tuple[int, tuple[int, ...]]:
    """TF's fill-in rule for feature descriptors (spec §1.5):
    ``batch_size_per_tensor_core = gcd_f prod(input_shape_f)`` and
    ``num_features_t = Σ_{f on t} prod(input_shape_f) / batch_size_per_tensor_core``."""
    sizes = [f.num_ids_per_core for f in features]
    batch = 0
    for s in sizes:
        batch = math.gcd(batch, s)
    index = {t.name: i for i, t in enumerate(tables)}
    counts = [0] * len(tables)
    for f, s in zip(features, sizes):
        counts[index[f.table_name]] += s // batch
    return batch, tuple(counts)


def validate(tables: Sequence[TableConfig], features: Sequence[FeatureConfig], *, num_hosts: int,
             batch_size_per_tensor_core: int) -> None:
    """Raise ConfigError for the first problem found; the message names table/feature and fix."""
    _check_tables(tables, num_hosts)
    if features:
        _check_feature_layout(tables, features, batch_size_per_tensor_core)
    else:
        _check_legacy_layout(tables, batch_size_per_tensor_core)
    _check_dynamic_tags(tables)


def _check_tables(tables: Sequence[TableConfig], num_hosts: int) -> None:
    if not tables:
        raise invalid("tables", "EmbeddingConfig", "at least one TableConfig", tables)
    seen: set[str] = set()
    for t in tables:
        if t.name in seen:
            raise invalid("name", f"table '{t.name}'",
                          "a unique table name (Load/Retrieve ops find tables by name)", t.name)
        seen.add(t.name)
        if t.optimizer is None:
            raise invalid("optimizer", f"table '{t.name}'",
                          "an optimizer spec (no optimization algorithm specified; give the table an "
                          "optimizer or pass EmbeddingConfig(optimizer=...))", None)
        if t.vocabulary_size < num_hosts:
            raise invalid("vocabulary_size", f"table '{t.name}'",
                          f"an integer >= num_hosts ({num_hosts}) so every host shard is non-empty",
                          t.vocabulary_size)


def _check_feature_layout(tables: Sequence[TableConfig], features: Sequence[FeatureConfig],
                          batch_size_per_tensor_core: int) -> None:
    names = {t.name for t in tables}
    used: set[str] = set()
    feature_names: set[str] = set()
    for f in features:
        if f.table_name not in names:
            raise invalid("table", f.where, f"one of the configured tables {sorted(names)}", f.table_name)
        used.add(f.table_name)
        # Features are found by name (a dict-keyed enqueue, the TF2 nest paths): a repeated
        # name would feed, and train on, the same gradient twice.
        if f.name is not None:
            if f.name in feature_names:
                raise invalid("name", f.where, "a unique feature name (enqueue, dequeue and gradients are "
                              "keyed by it; rename one of the features)", f.name)
            feature_names.add(f.name)
    for t in tables:
        if t.name not in used:
            raise ConfigError(
                f"Invalid config for table '{t.name}'. Expected at least one feature that looks it up "
                f"(TF rejects tables without features). Received: no FeatureConfig with table='{t.name}'")
    batch, counts = derived_geometry(features, tables)
    # TF requires 0 here; a value equal to the derived one is accepted because TF's own
    # hand-built configs carry it and it cannot change behaviour.
    if batch_size_per_tensor_core not in (0, batch):
        raise invalid("batch_size_per_tensor_core", "EmbeddingConfig",
                      f"0 when features are given (it is derived: {batch})", batch_size_per_tensor_core)
    for t, n in zip(tables, counts):
        if t.num_features not in (0, n):
            raise invalid("num_features", f"table '{t.name}'",
                          f"0 when features are given (it is derived: {n})", t.num_features)


def _check_legacy_layout(tables: Sequence[TableConfig], batch_size_per_tensor_core: int) -> None:
    if batch_size_per_tensor_core < 1:
        raise invalid("batch_size_per_tensor_core", "EmbeddingConfig",
                      "an integer > 0 when no features are given (legacy per-table layout), or give "
                      "`features`", batch_size_per_tensor_core)
    for t in tables:
        if t.num_features < 1:
            raise invalid("num_features", f"table '{t.name}'",
                          "an integer > 0 when no features are given (legacy per-table layout), or give "
                          "`features`", t.num_features)


def _check_dynamic_tags(tables: Sequence[TableConfig]) -> None:
    """Learning-rate tags must be 0..K-1 without gaps (spec §2.1). Other dynamic inputs
    (step counters) only need tag >= 0: TF's own configs use them standalone."""
    lr_tags: dict[int, str] = {}
    for t in tables:
        lr = t.optimizer.learning_rate if t.optimizer is not None else None
        if isinstance(lr, DynamicLearningRate):
            lr_tags.setdefault(lr.tag, t.name)
    if lr_tags and sorted(lr_tags) != list(range(len(lr_tags))):
        # the first gap lies below len(lr_tags): never build a range up to the largest tag
        missing = next(i for i in range(len(lr_tags) + 1) if i not in lr_tags)
        tag = max(lr_tags)
        raise invalid("learning_rate", f"table '{lr_tags[tag]}'",
                      f"dynamic learning-rate tags used contiguously from 0 (tag {missing} is unused; "
                      f"renumber the tags 0..{len(lr_tags) - 1})", DynamicLearningRate(tag))
