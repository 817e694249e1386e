"""Typed config <-> ``meshembed.tpu.TPUEmbeddingConfiguration`` (wire-identical to TF's).

Lossless by construction: every field has a typed home, and fields this proto version does
not know are kept as raw wire bytes (``unknown_fields``) on the object that owns them
(config, table, feature, optimizer) and merged back on write. Presence is kept where the
wire format has it: learning rate absent / ``constant: 0`` / ``dynamic {}`` (tag 0),
each clipping side, the quantization and hot-id submessages, gradient accumulation
UNSPECIFIED (None) versus ENABLED (True).

This module knows the config's parts (tables, features, optimizer specs) but not the
EmbeddingConfig class: embedding.py imports it, never the other way round.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from google.protobuf import message as pb_message
from google.protobuf import text_format

from meshembed._proto import optimization_parameters_pb2 as opt_pb2
from meshembed._proto import tpu_embedding_configuration_pb2 as cfg_pb2
from meshembed.config.common import f32, invalid, located, parsing_proto
from meshembed.config.optimizers import (
    HOT_ID_STATUS,
    OPTIMIZER_CLASSES,
    PACKING_STATUS,
    DynamicLearningRate,
    FrequencyAwareAdagrad,
    OptimizerSpec,
    QuantizationConfig,
    is_custom,
)
from meshembed.config.rowwise import has_proto_form
from meshembed.config.tables import FeatureConfig, SpmdSharding, TableConfig
from meshembed.errors import ConfigError

__all__ = [
    "MODES", "SHARDING_STRATEGIES", "CombinersArg", "ConfigParts", "config_kwargs_from_message",
    "config_to_message", "optimizer_from_message", "optimizer_to_message", "read_message", "residual_bytes",
]

#: Enum names <-> proto numbers of TPUEmbeddingConfiguration.Mode / ShardingStrategy.
MODES = {"unspecified": 0, "inference": 1, "training": 2, "backward_pass_only": 3}
SHARDING_STRATEGIES = {"div": 0, "mod": 1}

CombinersArg = str | Sequence[str] | Mapping[str, str] | None


class ConfigParts(Protocol):
    """What ``config_to_message`` reads of a config (an EmbeddingConfig has all of it)."""

    tables: Sequence[TableConfig]
    features: Sequence[FeatureConfig]
    mode: str
    sharding_strategy: str
    num_hosts: int
    num_tensor_cores: int
    batch_size_per_tensor_core: int
    pipeline_execution_with_tensor_core: bool
    profile_data_directory: str
    spmd_sharding: SpmdSharding | None
    unknown_fields: bytes

TEXT_SUFFIXES = (".pbtxt", ".textproto", ".txt", ".prototxt")
BINARY_SUFFIXES = (".pb", ".bin", ".binpb")
_ACCUMULATION = {None: 0, True: 1, False: 2}
_ACCUMULATION_BACK = {0: None, 1: True, 2: False}


# ---------------------------------------------------------------------------- unknown fields
def residual_bytes(msg: pb_message.Message, skip: Sequence[str] = ()) -> bytes:
    """Wire bytes of the unknown fields of ``msg`` and of its singular submessages, nested
    under the same known fields, so ``MergeFromString`` puts them back where they were.
    Fields named in ``skip`` (handled by another owner) are left out."""
    out = _residual(msg, frozenset(skip))
    return out.SerializeToString(deterministic=True) if out is not None else b""


def _residual(msg: pb_message.Message, skip: frozenset[str] = frozenset()) -> pb_message.Message | None:
    unknown_only = type(msg)()
    unknown_only.CopyFrom(msg)
    for fd in msg.DESCRIPTOR.fields:
        unknown_only.ClearField(fd.name)
    out = type(msg)()
    out.MergeFromString(unknown_only.SerializeToString())
    found = bool(out.ByteSize())
    for fd, value in msg.ListFields():
        if fd.name in skip or fd.message_type is None or _is_repeated(fd):
            continue
        sub = _residual(value)
        if sub is not None:
            getattr(out, fd.name).CopyFrom(sub)
            found = True
    return out if found else None


def _is_repeated(fd: Any) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return fd.label == fd.LABEL_REPEATED


# ---------------------------------------------------------------------------- typed -> proto
def _no_proto_form(opt: Any, where: str) -> ConfigError:
    """The error for serializing a CustomOptimizer: it has no proto algorithm."""
    place = f" for {where}" if where else ""
    return ConfigError(
        f"Invalid `optimizer`{place}. Expected an optimizer with a TPUEmbeddingConfiguration form "
        f"(a proto optimizer spec: me.embedding.SGD, Adagrad, Adam, ...) to serialize the config. "
        f"Received: optimizer=CustomOptimizer(name={getattr(opt, 'name', 'custom')!r}), a Python-level "
        "optimizer with no TPUEmbeddingConfiguration form (no proto algorithm and no Load/Retrieve "
        "op, like TF2's CustomOptimizer). The engine runs it; to_proto()/to_text() cannot write it. "
        "Fix: give this table a proto optimizer spec if the config must be serialized")


def _row_wise_refused(opt: Any, where: str) -> ConfigError:
    """The error for serializing a row-wise optimizer: the proto has no field for it."""
    place = f" for {where}" if where else ""
    return ConfigError(
        f"Invalid `optimizer`{place}. Expected an optimizer with a TPUEmbeddingConfiguration form to "
        f"serialize the config for TensorFlow. Received: {type(opt).__name__}, a meshembed row-wise extension "
        "(one second-moment value per row, as fbgemm's TBE optimizers) that the proto's `parameters` oneof "
        "cannot carry, so this config must stay meshembed-side: the engines, checkpoints (save/restore) "
        "and me.torch / me.jax run it; to_proto()/to_text() cannot write it. Fix: use me.embedding.Adagrad "
        "or Adam for this table if the config must go to TensorFlow")


def _refuse_unserializable(opt: Any, where: str) -> None:
    if is_custom(opt):
        raise _no_proto_form(opt, where)
    if not has_proto_form(opt):
        raise _row_wise_refused(opt, where)


def config_to_message(cfg: ConfigParts) -> cfg_pb2.TPUEmbeddingConfiguration:
    for t in cfg.tables:
        if t.optimizer is not None:
            _refuse_unserializable(t.optimizer, f"table '{t.name}'")
    msg = cfg_pb2.TPUEmbeddingConfiguration()
    for t in cfg.tables:
        td = msg.table_descriptor.add()
        td.name = t.name
        td.vocabulary_size = t.vocabulary_size
        td.dimension = t.dimension
        td.num_features = t.num_features
        if t.optimizer is not None:
            td.optimization_parameters.CopyFrom(optimizer_to_message(t.optimizer))
        if t.unknown_fields:
            td.MergeFromString(t.unknown_fields)
    msg.mode = MODES[cfg.mode]
    msg.batch_size_per_tensor_core = cfg.batch_size_per_tensor_core
    msg.num_hosts = cfg.num_hosts
    msg.num_tensor_cores = cfg.num_tensor_cores
    msg.sharding_strategy = SHARDING_STRATEGIES[cfg.sharding_strategy]
    msg.pipeline_execution_with_tensor_core = cfg.pipeline_execution_with_tensor_core
    msg.profile_data_directory = cfg.profile_data_directory
    index = {t.name: i for i, t in enumerate(cfg.tables)}
    for f in cfg.features:
        fd = msg.feature_descriptor.add()
        fd.name = f.name or ""
        fd.table_id = index[f.table_name]
        fd.input_shape.extend(f.input_shape)
        if f.unknown_fields:
            fd.MergeFromString(f.unknown_fields)
    s = cfg.spmd_sharding
    if s is not None:
        msg.spmd_sharding.SetInParent()
        msg.spmd_sharding.enabled = s.enabled
        msg.spmd_sharding.num_cores_per_replica = s.num_cores_per_replica
        msg.spmd_sharding.use_manual_partitioning = s.use_manual_partitioning
        msg.spmd_sharding.use_shardy_partitioner = s.use_shardy_partitioner
        if s.unknown_fields:
            msg.spmd_sharding.MergeFromString(s.unknown_fields)
    if cfg.unknown_fields:
        msg.MergeFromString(cfg.unknown_fields)
    return msg


def _set_limits(limits: opt_pb2.ClippingLimits, lower: float | None, upper: float | None) -> None:
    limits.SetInParent()
    if lower is not None:
        limits.lower.value = lower
    if upper is not None:
        limits.upper.value = upper


def optimizer_to_message(opt: OptimizerSpec) -> opt_pb2.OptimizationParameters:
    """One table's OptimizationParameters (a ConfigError for a CustomOptimizer or a row-wise one)."""
    _refuse_unserializable(opt, "")
    msg = opt_pb2.OptimizationParameters()
    lr = opt.learning_rate
    if isinstance(lr, DynamicLearningRate):
        msg.learning_rate.dynamic.SetInParent()
        msg.learning_rate.dynamic.tag = lr.tag
    elif callable(lr):
        raise ConfigError(
            "Invalid `learning_rate`. Expected a float or DynamicLearningRate to serialize. Received: a "
            "callable; put the table in an EmbeddingConfig, which assigns callables dynamic tags")
    elif lr is not None:
        msg.learning_rate.constant = lr
    if opt.clip_weight_min is not None or opt.clip_weight_max is not None:
        _set_limits(msg.clipping_limits, opt.clip_weight_min, opt.clip_weight_max)
    grad_limits = opt.clipvalue
    if grad_limits is not None:
        lo, hi = grad_limits if isinstance(grad_limits, tuple) else (-grad_limits, grad_limits)
        _set_limits(msg.gradient_clipping_limits, lo, hi)
    if opt.weight_decay_factor:
        msg.weight_decay_factor = opt.weight_decay_factor
    if opt.multiply_weight_decay_factor_by_learning_rate:
        msg.multiply_weight_decay_factor_by_learning_rate = True
    q = opt.simulated_quantization
    if q is not None:
        msg.simulated_quantization.SetInParent()
        msg.simulated_quantization.enabled = q.enabled
        msg.simulated_quantization.num_buckets = q.num_buckets
        if q.lower is not None or q.upper is not None:
            _set_limits(msg.simulated_quantization.clipping_limits, q.lower, q.upper)
    msg.gradient_accumulation_status = _ACCUMULATION[opt.use_gradient_accumulation]
    msg.low_dimensional_packing_status = PACKING_STATUS[opt.low_dimensional_packing_status]
    if opt.hot_id_replication is not None:
        msg.hot_id_replication_configuration.SetInParent()
        msg.hot_id_replication_configuration.status = HOT_ID_STATUS[opt.hot_id_replication]
    params = getattr(msg, opt.algorithm)
    params.SetInParent()
    for name, value in opt.hyperparameters().items():
        if value or not isinstance(value, bytes):
            setattr(params, name, value)
    if isinstance(opt, FrequencyAwareAdagrad) and isinstance(opt.step_counter, DynamicLearningRate):
        params.step_counter.SetInParent()
        params.step_counter.tag = opt.step_counter.tag
    if opt.unknown_fields:
        msg.MergeFromString(opt.unknown_fields)
    return msg


# ---------------------------------------------------------------------------- proto -> typed
def read_message(data: Any) -> cfg_pb2.TPUEmbeddingConfiguration:
    """Parse ``data``, dispatching on its kind: bytes, a message, a path, or text."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _parse_binary(bytes(data), "the given bytes")
    if isinstance(data, pb_message.Message):
        if data.DESCRIPTOR.name != "TPUEmbeddingConfiguration":
            raise invalid("data", "EmbeddingConfig.from_proto", "a TPUEmbeddingConfiguration message",
                          type(data).__name__)
        return _parse_binary(data.SerializeToString(), "the given message")
    if isinstance(data, str) and "\n" not in data and data.strip().endswith(TEXT_SUFFIXES + BINARY_SUFFIXES):
        data = pathlib.Path(data.strip())
    if isinstance(data, os.PathLike):
        path = pathlib.Path(data)
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise ConfigError(f"Invalid `data` for EmbeddingConfig.from_proto. Expected a readable config "
                              f"file. Received: data={str(path)!r} ({err.strerror})") from err
        if path.suffix in TEXT_SUFFIXES:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"Invalid `data` for EmbeddingConfig.from_proto: file {str(path)!r} is not UTF-8 text "
                    f"(byte {err.start}: {raw[err.start:err.start + 1]!r}). Expected a UTF-8 text-format "
                    f"TPUEmbeddingConfiguration; a binary config needs a {'/'.join(BINARY_SUFFIXES)} suffix"
                ) from err
            return _parse_text(text, f"file {str(path)!r}")
        return _parse_binary(raw, f"file {str(path)!r}")
    if isinstance(data, str):
        return _parse_text(data, "the given text")
    raise invalid("data", "EmbeddingConfig.from_proto",
                  "serialized bytes, a text-format str, or a path to a .pb / .pbtxt file", type(data).__name__)


def _parse_binary(raw: bytes, what: str) -> cfg_pb2.TPUEmbeddingConfiguration:
    msg = cfg_pb2.TPUEmbeddingConfiguration()
    try:
        msg.ParseFromString(raw)
    except pb_message.DecodeError as err:
        raise ConfigError(
            f"Invalid `data` for EmbeddingConfig.from_proto: {what} are not a serialized "
            f"TPUEmbeddingConfiguration ({err}). Expected the bytes of SerializeToString(); pass "
            "text format as a str, or a path ending in .pbtxt") from err
    return msg


def _parse_text(text: str, what: str) -> cfg_pb2.TPUEmbeddingConfiguration:
    msg = cfg_pb2.TPUEmbeddingConfiguration()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as err:
        raise ConfigError(
            f"Invalid `data` for EmbeddingConfig.from_proto: {what} is not a text-format "
            f"TPUEmbeddingConfiguration ({err}). Expected text format (pass serialized bytes as "
            "bytes, or a path ending in .pb). UserDefinedProgram.program is bytes here: write it as "
            "an escaped string") from err
    return msg


def _combiner_list(combiners: CombinersArg, names: list[str]) -> list[str]:
    if combiners is None:
        return ["mean"] * len(names)
    if isinstance(combiners, str):
        return [combiners] * len(names)
    if isinstance(combiners, Mapping):
        unknown = set(combiners) - set(names)
        if unknown:
            raise invalid("combiners", "EmbeddingConfig.from_proto", f"keys among the table names {names}",
                          sorted(unknown))
        return [combiners.get(n, "mean") for n in names]
    combiners = list(combiners)
    if len(combiners) != len(names):
        raise invalid("combiners", "EmbeddingConfig.from_proto",
                      f"one combiner per table ({len(names)}) in table order", combiners)
    return combiners


def config_kwargs_from_message(msg: cfg_pb2.TPUEmbeddingConfiguration,
                               combiners: CombinersArg = None) -> dict[str, Any]:
    """EmbeddingConfig keyword arguments of a parsed message: typed tables and features, the
    layout it uses and its unknown fields. Build the config under ``parsing_proto()``."""
    names = [td.name for td in msg.table_descriptor]
    combs = _combiner_list(combiners, names)
    with parsing_proto():
        tables = []
        for i, td in enumerate(msg.table_descriptor):
            where = f"table '{td.name}'" if td.name else f"table #{i}"
            with located(where):
                opt = None
                if td.HasField("optimization_parameters"):
                    opt = optimizer_from_message(td.optimization_parameters)
                tables.append(TableConfig(
                    name=td.name, vocabulary_size=td.vocabulary_size, dimension=td.dimension,
                    optimizer=opt, combiner=combs[i], num_features=td.num_features,
                    unknown_fields=residual_bytes(td, skip=("optimization_parameters",))))
        features = []
        for i, fd in enumerate(msg.feature_descriptor):
            where = f"feature '{fd.name}'" if fd.name else f"feature #{i}"
            if not 0 <= fd.table_id < len(tables):
                raise invalid("table_id", where, f"an integer in [0, {len(tables)}) (one per table_descriptor)",
                              fd.table_id)
            with located(where):
                features.append(FeatureConfig(
                    table=tables[fd.table_id].name, input_shape=tuple(fd.input_shape), name=fd.name or None,
                    unknown_fields=residual_bytes(fd)))
        spmd = None
        if msg.HasField("spmd_sharding"):
            s = msg.spmd_sharding
            spmd = SpmdSharding(s.enabled, s.num_cores_per_replica, s.use_manual_partitioning,
                                s.use_shardy_partitioner, unknown_fields=residual_bytes(s))
    return dict(
        tables=tables, features=features,
        mode=msg.mode, sharding_strategy=msg.sharding_strategy, num_hosts=msg.num_hosts,
        num_tensor_cores=msg.num_tensor_cores, batch_size_per_tensor_core=msg.batch_size_per_tensor_core,
        pipeline_execution_with_tensor_core=msg.pipeline_execution_with_tensor_core,
        profile_data_directory=msg.profile_data_directory, spmd_sharding=spmd,
        unknown_fields=residual_bytes(msg, skip=("table_descriptor", "feature_descriptor", "spmd_sharding")))


def _limits_of(msg: opt_pb2.ClippingLimits) -> tuple[float | None, float | None]:
    lo = f32(msg.lower.value) if msg.HasField("lower") else None
    hi = f32(msg.upper.value) if msg.HasField("upper") else None
    return lo, hi


def optimizer_from_message(msg: opt_pb2.OptimizationParameters) -> OptimizerSpec:
    """The spec object of one OptimizationParameters (a ConfigError if no algorithm is set)."""
    algorithm = msg.WhichOneof("parameters")
    if algorithm is None:
        raise ConfigError("Invalid `optimization_parameters`. Expected one optimizer of the `parameters` "
                          "oneof (no optimization algorithm specified). Received: none set")
    cls = OPTIMIZER_CLASSES[algorithm]
    params = getattr(msg, algorithm)
    kwargs: dict[str, Any] = {}
    which_lr = msg.learning_rate.WhichOneof("learning_rate") if msg.HasField("learning_rate") else None
    if which_lr == "dynamic":
        kwargs["learning_rate"] = DynamicLearningRate(msg.learning_rate.dynamic.tag)
    elif which_lr == "constant":
        kwargs["learning_rate"] = f32(msg.learning_rate.constant)
    else:
        kwargs["learning_rate"] = None
    if msg.HasField("clipping_limits"):
        kwargs["clip_weight_min"], kwargs["clip_weight_max"] = _limits_of(msg.clipping_limits)
    if msg.HasField("gradient_clipping_limits"):
        lo, hi = _limits_of(msg.gradient_clipping_limits)
        kwargs["clipvalue"] = hi if lo is not None and hi is not None and lo == -hi and hi >= 0 else (lo, hi)
    kwargs["weight_decay_factor"] = f32(msg.weight_decay_factor) if msg.weight_decay_factor else None
    kwargs["multiply_weight_decay_factor_by_learning_rate"] = (
        True if msg.multiply_weight_decay_factor_by_learning_rate else None)
    if msg.HasField("simulated_quantization"):
        q = msg.simulated_quantization
        lo, hi = _limits_of(q.clipping_limits)
        kwargs["simulated_quantization"] = QuantizationConfig(q.num_buckets, lo, hi, enabled=q.enabled)
    status = msg.gradient_accumulation_status
    if status not in _ACCUMULATION_BACK:
        raise invalid("gradient_accumulation_status", "", "one of UNSPECIFIED, ENABLED, DISABLED", status)
    kwargs["use_gradient_accumulation"] = _ACCUMULATION_BACK[status]
    kwargs["low_dimensional_packing_status"] = msg.low_dimensional_packing_status
    if msg.HasField("hot_id_replication_configuration"):
        kwargs["hot_id_replication"] = msg.hot_id_replication_configuration.status
    values = {fd.name: value for fd, value in params.ListFields()}
    hp = {}
    for proto_name, _attr in cls._fields:
        v = values.get(proto_name, getattr(params, proto_name))
        hp[proto_name] = v if isinstance(v, bool) else f32(v)
    if algorithm == "adam":
        hp["use_non_lazy_adam"] = params.use_non_lazy_adam
        hp["use_sum_inside_sqrt"] = params.use_sum_inside_sqrt
    kwargs.update(cls._kwargs_from_hyperparameters(hp))
    if algorithm == "frequency_aware_adagrad" and params.HasField("step_counter"):
        kwargs["step_counter"] = DynamicLearningRate(params.step_counter.tag)
    if algorithm == "user_defined_program":
        kwargs["program"] = params.program
    kwargs["unknown_fields"] = residual_bytes(msg)
    with parsing_proto():
        return cls(**kwargs)
