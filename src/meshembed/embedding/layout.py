"""The engine's flat view of an EmbeddingConfig: tables and features by index, dynamic tags.

Kept apart from the engine so the engine never depends on how the config classes spell
things; this is the one place that reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshembed.errors import ConfigError


@dataclass(frozen=True)
class TableSpec:
    index: int
    name: str
    vocabulary_size: int
    dimension: int
    optimizer: Any
    combiner: str
    initializer: Any = None
    #: the table's ``me.embedding.Precision`` (None: float32 everywhere; docs/low_precision.md)
    precision: Any = None


@dataclass(frozen=True)
class FeatureSpec:
    index: int
    name: str
    table: int
    output_shape: tuple[int, ...]


def _is_dynamic(value: Any) -> bool:
    return hasattr(value, "tag") and not isinstance(value, (int, float, bool))


def _strategy(config: Any) -> str:
    raw = getattr(config, "sharding_strategy", "div")
    name = getattr(raw, "name", raw)
    name = str(name).lower()
    if name in ("mod", "1"):
        return "mod"
    if name in ("div", "div_default", "0", ""):
        return "div"
    raise ConfigError(f"Invalid `sharding_strategy`. Expected one of ['div', 'mod']. Received: {raw!r}")


def _mode(config: Any) -> str:
    raw = getattr(config, "mode", "training")
    name = str(getattr(raw, "name", raw)).lower()
    return {"inference": "inference", "backward_pass_only": "backward_pass_only"}.get(name, "training")


@dataclass(frozen=True)
class Layout:
    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    strategy: str
    mode: str
    num_dynamic_inputs: int
    per_table_layout: bool  # legacy Recv/Send: one tensor per table, not per feature
    #: a dict of features (EmbeddingConfig(features={...})): its keys, in the order given;
    #: inputs and outputs are then dicts with these keys, never lists matched by position
    keys: tuple[Any, ...] = ()
    #: TF2 learning-rate callables per dynamic tag (None where the tag has none)
    learning_rate_fns: tuple[Any, ...] = field(default=(), compare=False)

    def table(self, key: Any) -> TableSpec:
        """A table by name or index, with a precise error."""
        if isinstance(key, TableSpec):
            return key
        if isinstance(key, int) and not isinstance(key, bool):
            if 0 <= key < len(self.tables):
                return self.tables[key]
        else:
            for t in self.tables:
                if t.name == key:
                    return t
        raise ConfigError(
            f"Invalid `table`. Expected one of {[t.name for t in self.tables]}. Received: table={key!r}"
        )

    def features_of(self, table: TableSpec) -> list[FeatureSpec]:
        return [f for f in self.features if f.table == table.index]


def _dynamic_tags(tables: tuple[TableSpec, ...]) -> int:
    tags: set[int] = set()
    for t in tables:
        opt = t.optimizer
        values = [getattr(opt, "learning_rate", None), *getattr(opt, "dynamic_inputs", tuple)()]
        tags.update(int(v.tag) for v in values if v is not None and _is_dynamic(v))
    return max(tags) + 1 if tags else 0


def _check_quantization(name: str, optimizer: Any) -> None:
    """EmbeddingConfig rejects these already; this covers duck-typed configs (spec §2.1:
    an enabled quantization with an unset or infinite bound gives NaN activations)."""
    q = getattr(optimizer, "simulated_quantization", None)
    if q is None or not getattr(q, "enabled", True):
        return
    lo, hi, n = q.lower, q.upper, q.num_buckets
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi or n < 2:
        raise ConfigError(
            f"Invalid `simulated_quantization` for table {name!r}. Expected finite lower < upper "
            "clipping bounds and num_buckets >= 2 when enabled (an unset bound means ±inf and "
            f"makes every activation NaN). Received: simulated_quantization={q!r}"
        )


def load_config(config: Any) -> Any:
    """An EmbeddingConfig (or any object with ``tables``/``features``) or proto input."""
    if hasattr(config, "tables"):
        return config
    from meshembed.config import EmbeddingConfig

    if isinstance(config, (bytes, bytearray, str)) or hasattr(config, "__fspath__"):
        return EmbeddingConfig.from_proto(config)
    raise ConfigError(
        "Invalid `config`. Expected a me.EmbeddingConfig, serialized TPUEmbeddingConfiguration "
        f"bytes, text format or a path. Received: {type(config).__name__}"
    )


def build_layout(config: Any) -> Layout:
    """Read tables and features (in config order) from an EmbeddingConfig."""
    tables = []
    for i, t in enumerate(config.tables):
        if getattr(t, "optimizer", None) is None:
            raise ConfigError(
                f"Table {t.name!r} has no optimizer. Fix: set `optimizer=` on its TableConfig or a "
                "default `optimizer=` on the EmbeddingConfig (e.g. me.embedding.SGD(0.1))."
            )
        _check_quantization(t.name, t.optimizer)
        check_domain = getattr(t.optimizer, "check_domain", None)
        if check_domain is not None:  # specs read from a proto are checked here, not when parsed
            check_domain(table=t.name)
        combiner = str(getattr(t, "combiner", "mean") or "mean").lower()
        tables.append(
            TableSpec(
                index=i,
                name=t.name,
                vocabulary_size=int(t.vocabulary_size),
                dimension=int(getattr(t, "dimension", getattr(t, "dim", 0))),
                optimizer=t.optimizer,
                combiner=combiner,
                initializer=getattr(t, "initializer", None),
                precision=getattr(t, "precision", None),
            )
        )
    names = {t.name: t.index for t in tables}
    features = []
    raw_features = list(getattr(config, "features", ()) or ())
    per_table = not raw_features
    if per_table and hasattr(config, "effective_features"):
        raw_features = list(config.effective_features)  # TF's fill-in rule, spec §1.5
    if not raw_features:
        # Legacy configuration (spec §1.5): one pseudo-feature per table of shape [B * nf].
        batch = int(getattr(config, "batch_size_per_tensor_core", 0) or 0)
        for t, raw in zip(tables, config.tables):
            nf = int(getattr(raw, "num_features", 0) or 0)
            if batch <= 0 or nf <= 0:
                raise ConfigError(
                    f"Table {t.name!r} has no features. Fix: add a FeatureConfig for it, or set "
                    "`batch_size_per_tensor_core` and the table's `num_features` (legacy layout)."
                )
            features.append(FeatureSpec(t.index, t.name, t.index, (batch * nf,)))
    else:
        for i, f in enumerate(raw_features):
            key = getattr(f, "table_name", None) or getattr(f.table, "name", f.table)
            if isinstance(key, int) and not isinstance(key, bool):
                tid = key
            elif key in names:
                tid = names[key]
            else:
                raise ConfigError(f"Feature {getattr(f, 'name', i)!r} refers to unknown table {key!r}.")
            shape = tuple(int(d) for d in getattr(f, "input_shape", getattr(f, "output_shape", ())))
            name = getattr(f, "name", None) or f"feature_{i}"
            features.append(FeatureSpec(i, name, tid, shape))
    seen: dict[str, int] = {}
    for f in features:  # a dict-keyed gradient would otherwise reach two features
        if f.name in seen:
            raise ConfigError(
                f"Duplicate feature name {f.name!r} (features {seen[f.name]} and {f.index}). Fix: give "
                "every FeatureConfig a unique `name`; gradients and ids are matched to features by name."
            )
        seen[f.name] = f.index
    tables_t = tuple(tables)
    return Layout(
        tables=tables_t,
        features=tuple(features),
        strategy=_strategy(config),
        mode=_mode(config),
        num_dynamic_inputs=int(getattr(config, "num_dynamic_inputs", None) or _dynamic_tags(tables_t)),
        per_table_layout=per_table,
        keys=tuple(getattr(config, "feature_keys", ()) or ()),
        learning_rate_fns=tuple(getattr(config, "learning_rate_fns", ()) or ()),
    )
