from meshembed._proto import optimization_parameters_pb2 as _optimization_parameters_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TPUEmbeddingConfiguration(_message.Message):
    __slots__ = ("table_descriptor", "mode", "batch_size_per_tensor_core", "num_hosts", "num_tensor_cores", "sharding_strategy", "pipeline_execution_with_tensor_core", "profile_data_directory", "feature_descriptor", "spmd_sharding")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[TPUEmbeddingConfiguration.Mode]
        INFERENCE: _ClassVar[TPUEmbeddingConfiguration.Mode]
        TRAINING: _ClassVar[TPUEmbeddingConfiguration.Mode]
        BACKWARD_PASS_ONLY: _ClassVar[TPUEmbeddingConfiguration.Mode]
    UNSPECIFIED: TPUEmbeddingConfiguration.Mode
    INFERENCE: TPUEmbeddingConfiguration.Mode
    TRAINING: TPUEmbeddingConfiguration.Mode
    BACKWARD_PASS_ONLY: TPUEmbeddingConfiguration.Mode
    class ShardingStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DIV_DEFAULT: _ClassVar[TPUEmbeddingConfiguration.ShardingStrategy]
        MOD: _ClassVar[TPUEmbeddingConfiguration.ShardingStrategy]
    DIV_DEFAULT: TPUEmbeddingConfiguration.ShardingStrategy
    MOD: TPUEmbeddingConfiguration.ShardingStrategy
    class TableDescriptor(_message.Message):
        __slots__ = ("name", "vocabulary_size", "dimension", "num_features", "optimization_parameters")
        NAME_FIELD_NUMBER: _ClassVar[int]
        VOCABULARY_SIZE_FIELD_NUMBER: _ClassVar[int]
        DIMENSION_FIELD_NUMBER: _ClassVar[int]
        NUM_FEATURES_FIELD_NUMBER: _ClassVar[int]
        OPTIMIZATION_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        name: str
        vocabulary_size: int
        dimension: int
        num_features: int
        optimization_parameters: _optimization_parameters_pb2.OptimizationParameters
        def __init__(self, name: _Optional[str] = ..., vocabulary_size: _Optional[int] = ..., dimension: _Optional[int] = ..., num_features: _Optional[int] = ..., optimization_parameters: _Optional[_Union[_optimization_parameters_pb2.OptimizationParameters, _Mapping]] = ...) -> None: ...
    class FeatureDescriptor(_message.Message):
        __slots__ = ("name", "table_id", "input_shape")
        NAME_FIELD_NUMBER: _ClassVar[int]
        TABLE_ID_FIELD_NUMBER: _ClassVar[int]
        INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
        name: str
        table_id: int
        input_shape: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, name: _Optional[str] = ..., table_id: _Optional[int] = ..., input_shape: _Optional[_Iterable[int]] = ...) -> None: ...
    class SpmdSharding(_message.Message):
        __slots__ = ("enabled", "num_cores_per_replica", "use_manual_partitioning", "use_shardy_partitioner")
        ENABLED_FIELD_NUMBER: _ClassVar[int]
        NUM_CORES_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
        USE_MANUAL_PARTITIONING_FIELD_NUMBER: _ClassVar[int]
        USE_SHARDY_PARTITIONER_FIELD_NUMBER: _ClassVar[int]
        enabled: bool
        num_cores_per_replica: int
        use_manual_partitioning: bool
        use_shardy_partitioner: bool
        def __init__(self, enabled: _Optional[bool] = ..., num_cores_per_replica: _Optional[int] = ..., use_manual_partitioning: _Optional[bool] = ..., use_shardy_partitioner: _Optional[bool] = ...) -> None: ...
    TABLE_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_PER_TENSOR_CORE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSOR_CORES_FIELD_NUMBER: _ClassVar[int]
    SHARDING_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_EXECUTION_WITH_TENSOR_CORE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_DATA_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    SPMD_SHARDING_FIELD_NUMBER: _ClassVar[int]
    table_descriptor: _containers.RepeatedCompositeFieldContainer[TPUEmbeddingConfiguration.TableDescriptor]
    mode: TPUEmbeddingConfiguration.Mode
    batch_size_per_tensor_core: int
    num_hosts: int
    num_tensor_cores: int
    sharding_strategy: TPUEmbeddingConfiguration.ShardingStrategy
    pipeline_execution_with_tensor_core: bool
    profile_data_directory: str
    feature_descriptor: _containers.RepeatedCompositeFieldContainer[TPUEmbeddingConfiguration.FeatureDescriptor]
    spmd_sharding: TPUEmbeddingConfiguration.SpmdSharding
    def __init__(self, table_descriptor: _Optional[_Iterable[_Union[TPUEmbeddingConfiguration.TableDescriptor, _Mapping]]] = ..., mode: _Optional[_Union[TPUEmbeddingConfiguration.Mode, str]] = ..., batch_size_per_tensor_core: _Optional[int] = ..., num_hosts: _Optional[int] = ..., num_tensor_cores: _Optional[int] = ..., sharding_strategy: _Optional[_Union[TPUEmbeddingConfiguration.ShardingStrategy, str]] = ..., pipeline_execution_with_tensor_core: _Optional[bool] = ..., profile_data_directory: _Optional[str] = ..., feature_descriptor: _Optional[_Iterable[_Union[TPUEmbeddingConfiguration.FeatureDescriptor, _Mapping]]] = ..., spmd_sharding: _Optional[_Union[TPUEmbeddingConfiguration.SpmdSharding, _Mapping]] = ...) -> None: ...

class TPUEmbeddingError(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
