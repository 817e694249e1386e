"""TableConfig, FeatureConfig, SpmdSharding: the per-table and per-feature halves of a config.

Frozen, hashable data. Each validates what it can see alone; checks that need the whole
config (table references, dynamic tags, layouts) live in `validation.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from meshembed.config.common import INT32_MAX, INT64_MAX, as_bool, as_float, as_int, invalid, located, one_of
from meshembed.config.optimizers import (
    LEARNING_RATE,
    OPTIMIZER_TYPES,
    DynamicLearningRate,
    OptimizerSpec,
    QuantizationConfig,
    is_custom,
)
from meshembed.config.precision import Precision
from meshembed.math.custom import CustomOptimizer

__all__ = ["COMBINERS", "DTYPES", "FeatureConfig", "SpmdSharding", "TableConfig"]

COMBINERS = ("sum", "mean", "sqrtn")
#: Table dtypes the engine runs: every table and slot is float32 (an int32 table was accepted
#: and then silently trained as float32).
DTYPES = ("float32",)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table (TF2 ``tf.tpu.experimental.embedding.TableConfig``).

    ``optimizer`` may be None when the EmbeddingConfig supplies a default; it is a proto
    optimizer spec or a ``me.embedding.CustomOptimizer`` (the engine runs it, but a config
    holding one has no proto form: ``to_proto()``/``to_text()`` raise). ``quantization``
    is TF2's ``quantization_config``; it is stored in the optimizer's
    ``simulated_quantization`` (the proto keeps it there), and both attributes always agree.
    ``num_features`` is the legacy per-table feature count (0 with feature descriptors).
    ``initializer`` (a callable ``(shape) -> array`` or None for TF2's truncated normal with
    stddev 1/sqrt(dimension)) and ``combiner`` are not part of the proto.
    """

    name: str
    vocabulary_size: int
    dimension: int
    optimizer: OptimizerSpec | CustomOptimizer | None = None
    combiner: str = "mean"
    initializer: Callable[..., Any] | None = field(default=None, compare=False)
    quantization: QuantizationConfig | None = None
    dtype: str = "float32"
    num_features: int = 0
    _: KW_ONLY
    unknown_fields: bytes = field(default=b"", repr=False)
    #: storage dtypes and rounding of the table and its slots (``me.embedding.Precision``);
    #: None = float32. Not part of the proto: it travels beside it (docs/low_precision.md).
    precision: Precision | None = None
    #: a dynamic vocabulary (``me.embedding.DynamicVocabulary``): feature ids are raw int64 keys
    #: mapped to rows by the engine; None = ids are rows. Not part of the proto: it travels
    #: beside it in the checkpoint manifest (docs/dynamic_vocab.md).
    dynamic: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise invalid("name", "TableConfig", "a non-empty string", self.name)
        where = f"table '{self.name}'"
        object.__setattr__(self, "vocabulary_size", as_int("vocabulary_size", self.vocabulary_size, where,
                                                                   minimum=1, maximum=INT64_MAX))
        object.__setattr__(self, "dimension", as_int("dimension", self.dimension, where, minimum=1))
        object.__setattr__(self, "num_features", as_int("num_features", self.num_features, where, minimum=0))
        if not isinstance(self.combiner, str) or self.combiner.lower() not in COMBINERS:
            raise invalid("combiner", where, f"one of {one_of(COMBINERS)}", self.combiner)
        object.__setattr__(self, "combiner", self.combiner.lower())
        try:
            dtype = np.dtype(self.dtype).name
        except TypeError:
            dtype = str(self.dtype)
        if dtype not in DTYPES:
            raise invalid("dtype", where, f"one of {one_of(DTYPES)} (the engine keeps every table and slot in "
                          "float32; integer and other float tables are not supported). Fix: omit `dtype`",
                          self.dtype)
        object.__setattr__(self, "dtype", dtype)
        if self.initializer is not None and not callable(self.initializer):
            raise invalid("initializer", where, "a callable (shape) -> array, or None", self.initializer)
        if self.optimizer is not None and not isinstance(self.optimizer, OPTIMIZER_TYPES):
            raise invalid("optimizer", where, "an optimizer spec (meshembed.embedding.SGD, Adagrad, ...) "
                          "or a meshembed.embedding.CustomOptimizer", self.optimizer)
        if is_custom(self.optimizer):
            _check_custom(self.optimizer, where)
        if self.quantization is not None and not isinstance(self.quantization, QuantizationConfig):
            raise invalid("quantization", where, "a QuantizationConfig or None", self.quantization)
        self._sync_quantization(where)
        self._check_quantization(where)
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise invalid("precision", where, "a meshembed.embedding.Precision or None", self.precision)
        if self.precision is not None and getattr(self.optimizer, "row_slots", ()):
            raise invalid("precision", where, f"None with {type(self.optimizer).__name__} (16-bit storage of "
                          "row-wise slots is not implemented). Fix: keep this table in float32, or use a "
                          "TPU optimizer (Adagrad, Adam) for a 16-bit table", self.precision)
        if self.dynamic is not None:
            self._check_dynamic(where)

    def _check_dynamic(self, where: str) -> None:
        from meshembed.embedding.dynamic import DynamicVocabulary  # lazy: the spec lives with the engine

        d = self.dynamic
        if not isinstance(d, DynamicVocabulary):
            raise invalid("dynamic", where, "a meshembed.embedding.DynamicVocabulary or None", d)
        if d.capacity is not None and d.capacity != self.vocabulary_size:
            raise invalid("dynamic", where, f"a capacity equal to vocabulary_size ({self.vocabulary_size}): the "
                          "table's rows are the vocabulary's capacity. Fix: pass the same number, or leave "
                          "capacity=None", d)

    def _check_quantization(self, where: str) -> None:
        """An enabled simulated quantization needs finite ``lower < upper`` and at least two
        buckets (spec §2.1: the bucket width is ``(upper - lower) / (num_buckets - 1)``; an
        unset side means ±inf there and every activation would be NaN). TF2's
        ``QuantizationConfig(num_buckets, lower, upper)`` always sets both sides."""
        q = self.quantization
        if q is None or not q.enabled:
            return
        unset = [name for name in ("lower", "upper") if getattr(q, name) is None]
        if unset:
            problem = (f"clipping_limits with both sides set (the {' and '.join(unset)} bound is unset, "
                       "which means ±inf and makes every activation NaN; pass QuantizationConfig("
                       "num_buckets, lower, upper), or enabled=False)")
        elif not (math.isfinite(q.lower) and math.isfinite(q.upper)):
            problem = "finite clipping bounds (an infinite bound makes every activation NaN)"
        elif q.lower >= q.upper:
            problem = f"lower < upper (lower={q.lower} >= upper={q.upper} leaves no bucket width)"
        elif q.num_buckets < 2:
            problem = f"num_buckets >= 2 (num_buckets={q.num_buckets} leaves no bucket width)"
        else:
            return
        raise invalid("simulated_quantization", where, f"an enabled quantization to have {problem}", q)

    def _sync_quantization(self, where: str) -> None:
        opt = self.optimizer
        if opt is None:
            return
        q, oq = self.quantization, opt.simulated_quantization
        if q is not None and oq is not None and q != oq:
            raise invalid("quantization", where,
                          f"the optimizer's simulated_quantization ({oq!r}) or None", q)
        if q is not None and oq is None:
            object.__setattr__(self, "optimizer", opt.replace(simulated_quantization=q))
        elif oq is not None and q is None:
            object.__setattr__(self, "quantization", oq)

    @property
    def dim(self) -> int:
        """TF2's name for ``dimension``."""
        return self.dimension

    def replace(self, **changes: Any) -> TableConfig:
        with located(f"table '{changes.get('name', self.name)}'"):
            return dataclasses.replace(self, **changes)


def _check_custom(opt: CustomOptimizer, where: str) -> None:
    """What OptimizerSpec checks for itself, for a CustomOptimizer (it lives in
    meshembed.math and raises plain TypeError/ValueError for its own arguments)."""
    lr = opt.learning_rate
    if lr is not None and not isinstance(lr, DynamicLearningRate) and not callable(lr):
        LEARNING_RATE.check("learning_rate", as_float("learning_rate", lr, where), where)
    sq = opt.simulated_quantization
    if sq is not None and not isinstance(sq, QuantizationConfig):
        raise invalid("simulated_quantization", where, "a QuantizationConfig or None", sq)
    lo, hi = opt.clip_weight_min, opt.clip_weight_max
    if lo is not None and hi is not None and lo > hi:
        raise invalid("clip_weight_min", where, f"a value <= clip_weight_max ({hi})", lo)


@dataclass(frozen=True)
class FeatureConfig:
    """One input feature (one Recv output in the per-feature layout).

    ``table`` is a table name or a TableConfig. ``input_shape`` is the proto's
    ``FeatureDescriptor.input_shape``: the activation shape without the embedding dimension
    (``(B,)`` for one vector per sample). Rank 2 ``(B, M)`` is a sequence feature: output
    ``[B, M, dim]``, positions >= M dropped, missing positions zero. ``max_sequence_length``
    M > 0 with a rank-1 shape ``(B,)`` is TF2's spelling of the same and becomes ``(B, M)``;
    for rank 2 it always equals ``input_shape[1]``.
    """

    table: str | TableConfig
    input_shape: tuple[int, ...]
    name: str | None = None
    max_sequence_length: int = 0
    _: KW_ONLY
    unknown_fields: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        where = self.where
        if not isinstance(self.table, (str, TableConfig)) or self.table == "":
            raise invalid("table", where, "a table name or a TableConfig", self.table)
        if self.name is not None and not isinstance(self.name, str):
            raise invalid("name", where, "a string or None", self.name)
        if self.name == "":
            object.__setattr__(self, "name", None)
        shape = self.input_shape
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (Sequence, np.ndarray)) or isinstance(shape, str):
            raise invalid("input_shape", where, "a non-empty tuple of integers > 0", self.input_shape)
        shape = tuple(shape)
        if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 < d <= INT32_MAX
                            for d in shape):
            raise invalid("input_shape", where,
                          f"a non-empty tuple of integers in [1, {INT32_MAX}] (the proto's int32)", self.input_shape)
        shape = tuple(int(d) for d in shape)
        m = as_int("max_sequence_length", self.max_sequence_length, where, minimum=0)
        if m and len(shape) == 1:
            shape = (shape[0], m)
        elif len(shape) == 2:
            if m and m != shape[1]:
                raise invalid("max_sequence_length", where,
                              f"0 or input_shape[1] ({shape[1]}) for input_shape={shape}", m)
            m = shape[1]
        elif m:
            raise invalid("max_sequence_length", where,
                          f"0 for an input_shape of rank {len(shape)} (sequence features have rank 2)", m)
        object.__setattr__(self, "input_shape", shape)
        object.__setattr__(self, "max_sequence_length", m)

    @property
    def where(self) -> str:
        return f"feature '{self.name}'" if self.name else "feature"

    @property
    def table_name(self) -> str:
        return self.table if isinstance(self.table, str) else self.table.name

    @property
    def is_sequence(self) -> bool:
        return len(self.input_shape) == 2

    @property
    def output_shape(self) -> tuple[int, ...]:
        """TF2's name: the activation shape without the embedding dimension."""
        return self.input_shape

    @property
    def num_ids_per_core(self) -> int:
        """``prod(input_shape)``: output slots this feature has per TensorCore."""
        return math.prod(self.input_shape)

    def replace(self, **changes: Any) -> FeatureConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SpmdSharding:
    """``TPUEmbeddingConfiguration.SpmdSharding``: model parallelism on the TensorCore."""

    enabled: bool = False
    num_cores_per_replica: int = 0
    use_manual_partitioning: bool = False
    use_shardy_partitioner: bool = False
    _: KW_ONLY
    unknown_fields: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        where = "spmd_sharding"
        for name in ("enabled", "use_manual_partitioning", "use_shardy_partitioner"):
            object.__setattr__(self, name, as_bool(name, getattr(self, name), where))
        n = as_int("num_cores_per_replica", self.num_cores_per_replica, where, minimum=0)
        if self.enabled and n < 1:
            raise invalid("num_cores_per_replica", where, "an integer > 0 when SPMD is enabled", n)
        object.__setattr__(self, "num_cores_per_replica", n)
