"""EmbeddingConfig: the typed mirror of ``tensorflow.tpu.TPUEmbeddingConfiguration``.

Every proto field has a typed attribute; ``from_proto`` / ``to_proto`` / ``to_text`` convert
losslessly (unknown fields included). Two layouts exist (spec §1.5, gotcha 6):

* ``per_feature`` — ``features`` given: one Recv/Send tensor per feature, shape
  ``input_shape + [dim]``;
* ``per_table`` (legacy) — no features, every table has ``num_features`` and the config a
  ``batch_size_per_tensor_core``: one tensor per table, ``[B * num_features_t, dim_t]``.

The config keeps the layout it was given; ``effective_features``,
``filled_batch_size_per_tensor_core`` and ``filled_num_features`` expose TF's filled-in view.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from meshembed.config import proto_io
from meshembed.config.common import as_bool, as_enum, as_int, invalid, located, parsing_proto, tf2_checks_enabled
from meshembed.config.optimizers import OPTIMIZER_TYPES, DynamicLearningRate, OptimizerSpec
from meshembed.config.proto_io import MODES, SHARDING_STRATEGIES, CombinersArg
from meshembed.config.tables import FeatureConfig, SpmdSharding, TableConfig
from meshembed.config.validation import derived_geometry, validate
from meshembed.errors import ConfigError
from meshembed.math.custom import CustomOptimizer

__all__ = ["MODES", "SHARDING_STRATEGIES", "EmbeddingConfig"]

_MODE_ALIASES = {"train": "training"}
_SHARDING_ALIASES = {"div_default": "div"}


@dataclass(frozen=True)
class EmbeddingConfig:
    """Tables, features and system settings of one TPU-embedding setup.

    Args:
      tables: TableConfigs in table-id order. May be empty when every feature carries its
        TableConfig: tables are then taken in order of first appearance (as TF2 does).
      features: FeatureConfigs in Recv/Send order, or a mapping name -> FeatureConfig
        (ordered by sorted key, like TF2's ``nest.flatten``). Empty = legacy layout.
      mode: "training" | "inference" | "backward_pass_only" ("unspecified" is rejected, as TF
        rejects it when the system is configured).
      sharding_strategy: "div" (DIV_DEFAULT) or "mod" — how rows are split over hosts.
      num_hosts, num_tensor_cores, batch_size_per_tensor_core,
      pipeline_execution_with_tensor_core, profile_data_directory, spmd_sharding: the proto
        fields of the same names (``spmd_sharding=None`` leaves the submessage out).
      optimizer: default for tables whose optimizer is None (TF2's global optimizer).

    A callable learning rate (TF2 style) becomes ``DynamicLearningRate(tag)``: callables get
    tags in table order, first seen first, after any explicit tags; ``learning_rate_fns[tag]``
    keeps them for the engine. Like TF2, a vocabulary smaller than ``num_hosts`` is padded to
    ``num_hosts`` so every host shard is non-empty (configs read from a proto are kept as is).
    """

    tables: Sequence[TableConfig] = ()
    features: Sequence[FeatureConfig] | Mapping[str, FeatureConfig] = ()
    mode: str | int = "training"
    sharding_strategy: str | int = "div"
    num_hosts: int = 1
    num_tensor_cores: int = 1
    batch_size_per_tensor_core: int = 0
    pipeline_execution_with_tensor_core: bool = False
    profile_data_directory: str = ""
    spmd_sharding: SpmdSharding | None = None
    optimizer: OptimizerSpec | CustomOptimizer | None = field(default=None, compare=False)
    _: KW_ONLY
    unknown_fields: bytes = field(default=b"", repr=False)
    learning_rate_fns: tuple[Callable[[], float] | None, ...] = field(
        init=False, default=(), compare=False, repr=False)
    # The keys of a dict of ``features``, in the order given (``features`` is stored sorted by
    # key): the engine returns activations as a dict with these keys. Not in the proto.
    feature_keys: tuple[Any, ...] = field(init=False, default=(), compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        where = "EmbeddingConfig"
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("mode", as_enum("mode", self.mode, MODES, where, _MODE_ALIASES))
        if self.mode == "unspecified":
            raise invalid("mode", where, "one of {'training', 'inference', 'backward_pass_only'} "
                          "(TF rejects UNSPECIFIED when the system is configured)", self.mode)
        set_("sharding_strategy", as_enum("sharding_strategy", self.sharding_strategy,
                                          SHARDING_STRATEGIES, where, _SHARDING_ALIASES))
        set_("num_hosts", as_int("num_hosts", self.num_hosts, where, minimum=1))
        set_("num_tensor_cores", as_int("num_tensor_cores", self.num_tensor_cores, where, minimum=1))
        set_("batch_size_per_tensor_core",
             as_int("batch_size_per_tensor_core", self.batch_size_per_tensor_core, where, minimum=0))
        set_("pipeline_execution_with_tensor_core",
             as_bool("pipeline_execution_with_tensor_core", self.pipeline_execution_with_tensor_core, where))
        if not isinstance(self.profile_data_directory, str):
            raise invalid("profile_data_directory", where, "a string", self.profile_data_directory)
        if self.spmd_sharding is not None and not isinstance(self.spmd_sharding, SpmdSharding):
            raise invalid("spmd_sharding", where, "a SpmdSharding or None", self.spmd_sharding)
        if self.optimizer is not None and not isinstance(self.optimizer, OPTIMIZER_TYPES):
            raise invalid("optimizer", where, "an optimizer spec, a CustomOptimizer or None", self.optimizer)

        if isinstance(self.features, Mapping):
            set_("feature_keys", tuple(self.features))
        features = self._feature_tuple(self.features)
        tables = self._resolve_tables(tuple(self.tables), features)
        tables = tuple(self._fill_table(t) for t in tables)
        tables, fns = _assign_dynamic_tags(tables)
        set_("tables", tables)
        set_("features", tuple(f if isinstance(f.table, str) else dataclasses.replace(f, table=f.table.name)
                               for f in features))
        set_("learning_rate_fns", fns)
        validate(self.tables, self.features, num_hosts=self.num_hosts,
                 batch_size_per_tensor_core=self.batch_size_per_tensor_core)

    @staticmethod
    def _feature_tuple(features: Any) -> tuple[FeatureConfig, ...]:
        if isinstance(features, Mapping):
            items = []
            for key in sorted(features):
                f = features[key]
                if isinstance(f, FeatureConfig) and f.name is None:
                    f = dataclasses.replace(f, name=str(key))
                items.append(f)
            features = items
        elif isinstance(features, FeatureConfig):
            features = (features,)
        out = tuple(features)
        for f in out:
            if not isinstance(f, FeatureConfig):
                raise invalid("features", "EmbeddingConfig", "FeatureConfig objects", f)
        return out

    @staticmethod
    def _resolve_tables(tables: tuple[TableConfig, ...], features: tuple[FeatureConfig, ...]) -> tuple[TableConfig, ...]:
        for t in tables:
            if not isinstance(t, TableConfig):
                raise invalid("tables", "EmbeddingConfig", "TableConfig objects", t)
        by_name = {t.name: t for t in tables}
        derived = not tables
        out = list(tables)
        for f in features:
            if isinstance(f.table, TableConfig):
                known = by_name.get(f.table.name)
                if known is None and derived:
                    by_name[f.table.name] = f.table
                    out.append(f.table)
                elif known is None:
                    raise invalid("table", f.where, f"one of the configured tables {sorted(by_name)}", f.table.name)
                elif known != f.table:
                    raise invalid("table", f.where,
                                  f"the TableConfig named '{f.table.name}' given in `tables` (a different "
                                  "table has the same name)", f.table)
        return tuple(out)

    def _fill_table(self, t: TableConfig) -> TableConfig:
        changes: dict[str, Any] = {}
        if t.optimizer is None and self.optimizer is not None:
            changes["optimizer"] = self.optimizer
        if tf2_checks_enabled() and t.vocabulary_size < self.num_hosts:
            changes["vocabulary_size"] = self.num_hosts
        return t.replace(**changes) if changes else t

    # ------------------------------------------------------------------ proto I/O
    @classmethod
    def from_proto(cls, data: bytes | str | os.PathLike[str], combiners: CombinersArg = None) -> EmbeddingConfig:
        """Read a TPUEmbeddingConfiguration: serialized bytes, a text-format str, or a path
        (``.pb`` binary, ``.pbtxt``/``.textproto``/``.txt`` text; other suffixes: binary).

        Combiners are not in the proto. ``combiners`` may be one name for every table, a
        sequence in table order, or a mapping table name -> combiner. Default: "mean" for
        every table, TF2's TableConfig default (the raw enqueue op's empty list means "sum";
        pass ``combiners="sum"`` to read a config the way that op does).
        """
        kwargs = proto_io.config_kwargs_from_message(proto_io.read_message(data), combiners)
        with parsing_proto():
            return cls(**kwargs)

    def to_proto(self) -> bytes:
        """Deterministic serialization; TensorFlow's TPUEmbeddingConfiguration parses it."""
        return proto_io.config_to_message(self).SerializeToString(deterministic=True)

    def to_text(self) -> str:
        """Text format, as TF's ``text_format.MessageToString`` writes it."""
        from google.protobuf import text_format

        return text_format.MessageToString(proto_io.config_to_message(self))

    def to_message(self) -> Any:
        """The ``meshembed.tpu.TPUEmbeddingConfiguration`` message (generated class)."""
        return proto_io.config_to_message(self)

    def check_domains(self) -> None:
        """ConfigError naming the table if an optimizer hyper-parameter is outside its domain.

        Specs built in Python were checked when built; this is for configs read from a proto,
        which parse whatever TF's runtime takes (the engine calls it before training)."""
        for t in self.tables:
            if isinstance(t.optimizer, OptimizerSpec):
                t.optimizer.check_domain(table=t.name)

    # ------------------------------------------------------------------ engine helpers
    @property
    def layout(self) -> str:
        """"per_feature" (feature descriptors) or "per_table" (legacy num_features layout)."""
        return "per_feature" if self.features else "per_table"

    def table_id(self, name: str) -> int:
        """Index of table ``name`` (its id in the proto and in Load/Retrieve ops)."""
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise invalid("table_name", "EmbeddingConfig", f"one of {[t.name for t in self.tables]}", name)

    def table(self, key: int | str) -> TableConfig:
        """A table by id or name."""
        if isinstance(key, str):
            return self.tables[self.table_id(key)]
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(self.tables):
            raise invalid("table_id", "EmbeddingConfig", f"an integer in [0, {len(self.tables)})", key)
        return self.tables[key]

    def table_of(self, feature: int | str | FeatureConfig) -> TableConfig:
        """The table a feature (index, name or FeatureConfig) looks up."""
        if isinstance(feature, FeatureConfig):
            return self.table(feature.table_name)
        if isinstance(feature, str):
            for f in self.features:
                if f.name == feature:
                    return self.table(f.table_name)
            raise invalid("feature", "EmbeddingConfig", f"one of {[f.name for f in self.features]}", feature)
        feats = self.effective_features
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < len(feats):
            raise invalid("feature", "EmbeddingConfig", f"an integer in [0, {len(feats)})", feature)
        return self.table(feats[feature].table_name)

    def table_id_of(self, feature: int | str | FeatureConfig) -> int:
        return self.table_id(self.table_of(feature).name)

    @property
    def filled_batch_size_per_tensor_core(self) -> int:
        """``batch_size_per_tensor_core`` as TF fills it in (gcd of feature sizes)."""
        if not self.features:
            return self.batch_size_per_tensor_core
        return derived_geometry(self.features, self.tables)[0]

    @property
    def filled_num_features(self) -> tuple[int, ...]:
        """Per-table ``num_features`` as TF fills it in."""
        if not self.features:
            return tuple(t.num_features for t in self.tables)
        return derived_geometry(self.features, self.tables)[1]

    @property
    def effective_features(self) -> tuple[FeatureConfig, ...]:
        """The features TF's fill-in rule produces: the given ones, or in the legacy layout
        one per table with ``input_shape = [batch_size_per_tensor_core * num_features_t]``."""
        if self.features:
            return tuple(self.features)
        b = self.batch_size_per_tensor_core
        return tuple(FeatureConfig(t.name, (b * t.num_features,), name=t.name) for t in self.tables)

    @property
    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each Recv output / Send input, in order (spec §3.2)."""
        return tuple(f.input_shape + (self.table(f.table_name).dimension,) for f in self.effective_features)

    @property
    def num_outputs(self) -> int:
        return len(self.output_shapes)

    @property
    def combiners(self) -> tuple[str, ...]:
        """Per-table combiner, table order (what TF2 passes to the enqueue op)."""
        return tuple(t.combiner for t in self.tables)

    @property
    def dynamic_tags(self) -> tuple[int, ...]:
        """Sorted distinct tags of all dynamic inputs (learning rates and step counters)."""
        return tuple(sorted(_tags(self.tables)))

    @property
    def num_dynamic_inputs(self) -> int:
        """Length of SendTPUEmbeddingGradients' ``learning_rates``: max tag + 1 (tags are
        contiguous from 0 for learning rates, so this is their distinct count there)."""
        tags = self.dynamic_tags
        return tags[-1] + 1 if tags else 0

    def evaluate_learning_rates(self) -> tuple[float, ...]:
        """Call the TF2-style learning-rate callables: the ``learning_rates`` list to send.

        Raises ConfigError when a tag has no callable (the caller must supply values)."""
        values = []
        for tag in range(self.num_dynamic_inputs):
            fn = self.learning_rate_fns[tag] if tag < len(self.learning_rate_fns) else None
            if fn is None:
                raise ConfigError(
                    f"Invalid call for dynamic input tag {tag}. Expected a callable learning rate for "
                    f"every tag. Received: tag {tag} was given as DynamicLearningRate; pass "
                    "learning_rates explicitly")
            values.append(float(fn()))
        return tuple(values)

    @property
    def num_shards(self) -> int:
        """Host shards Load/Retrieve work on (``num_hosts``)."""
        return self.num_hosts

    def replace(self, **changes: Any) -> EmbeddingConfig:
        """A copy with ``changes``; learning-rate callables carry over while their tags remain."""
        new = dataclasses.replace(self, **changes)
        if "features" not in changes and self.feature_keys:
            object.__setattr__(new, "feature_keys", self.feature_keys)
        if self.learning_rate_fns and not new.learning_rate_fns \
                and new.num_dynamic_inputs >= len(self.learning_rate_fns):
            object.__setattr__(new, "learning_rate_fns", self.learning_rate_fns)
        return new


def _tags(tables: Sequence[TableConfig]) -> set[int]:
    """The DynamicLearningRate tags the tables' optimizers use (learning rates, step counters)."""
    tags: set[int] = set()
    for t in tables:
        opt = t.optimizer
        if opt is None:
            continue
        if isinstance(opt.learning_rate, DynamicLearningRate):
            tags.add(opt.learning_rate.tag)
        tags.update(d.tag for d in opt.dynamic_inputs())
    return tags


def _assign_dynamic_tags(tables: tuple[TableConfig, ...]) -> tuple[tuple[TableConfig, ...], tuple[Any, ...]]:
    """Turn callable learning rates / step counters into DynamicLearningRate tags (spec §5.3)."""
    explicit = _tags(tables)
    next_tag = max(explicit) + 1 if explicit else 0
    fn_tags: dict[int, int] = {}  # id(fn) -> tag
    fns: dict[int, Callable[[], float]] = {}

    def tag_of(fn: Callable[[], float]) -> DynamicLearningRate:
        nonlocal next_tag
        if id(fn) not in fn_tags:
            fn_tags[id(fn)] = next_tag
            fns[next_tag] = fn
            next_tag += 1
        return DynamicLearningRate(fn_tags[id(fn)])

    out = []
    for t in tables:
        opt = t.optimizer
        if opt is not None:
            changes: dict[str, Any] = {}
            if callable(opt.learning_rate) and not isinstance(opt.learning_rate, DynamicLearningRate):
                changes["learning_rate"] = tag_of(opt.learning_rate)
            sc = getattr(opt, "step_counter", None)
            if callable(sc) and not isinstance(sc, DynamicLearningRate):
                changes["step_counter"] = tag_of(sc)
            if changes:
                with located(f"table '{t.name}'"):
                    t = t.replace(optimizer=opt.replace(**changes))
        out.append(t)
    table_fns = tuple(fns.get(i) for i in range(next_tag)) if fns else ()
    return tuple(out), table_fns
