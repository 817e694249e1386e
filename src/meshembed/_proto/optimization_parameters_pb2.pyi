from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClippingLimits(_message.Message):
    __slots__ = ("lower", "upper")
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    lower: _wrappers_pb2.FloatValue
    upper: _wrappers_pb2.FloatValue
    def __init__(self, lower: _Optional[_Union[_wrappers_pb2.FloatValue, _Mapping]] = ..., upper: _Optional[_Union[_wrappers_pb2.FloatValue, _Mapping]] = ...) -> None: ...

class SimulatedQuantization(_message.Message):
    __slots__ = ("enabled", "clipping_limits", "num_buckets")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CLIPPING_LIMITS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    clipping_limits: ClippingLimits
    num_buckets: int
    def __init__(self, enabled: _Optional[bool] = ..., clipping_limits: _Optional[_Union[ClippingLimits, _Mapping]] = ..., num_buckets: _Optional[int] = ...) -> None: ...

class OptimizerDynamicInput(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: int
    def __init__(self, tag: _Optional[int] = ...) -> None: ...

class LearningRate(_message.Message):
    __slots__ = ("constant", "dynamic")
    CONSTANT_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    constant: float
    dynamic: OptimizerDynamicInput
    def __init__(self, constant: _Optional[float] = ..., dynamic: _Optional[_Union[OptimizerDynamicInput, _Mapping]] = ...) -> None: ...

class AdagradParameters(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdagradMomentumParameters(_message.Message):
    __slots__ = ("momentum", "use_nesterov", "exponent", "beta2", "epsilon")
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    USE_NESTEROV_FIELD_NUMBER: _ClassVar[int]
    EXPONENT_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    momentum: float
    use_nesterov: bool
    exponent: float
    beta2: float
    epsilon: float
    def __init__(self, momentum: _Optional[float] = ..., use_nesterov: _Optional[bool] = ..., exponent: _Optional[float] = ..., beta2: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class BoundedAdagradParameters(_message.Message):
    __slots__ = ("update_accumulator_first", "max_var_update", "max_accumulator")
    UPDATE_ACCUMULATOR_FIRST_FIELD_NUMBER: _ClassVar[int]
    MAX_VAR_UPDATE_FIELD_NUMBER: _ClassVar[int]
    MAX_ACCUMULATOR_FIELD_NUMBER: _ClassVar[int]
    update_accumulator_first: bool
    max_var_update: float
    max_accumulator: float
    def __init__(self, update_accumulator_first: _Optional[bool] = ..., max_var_update: _Optional[float] = ..., max_accumulator: _Optional[float] = ...) -> None: ...

class FrequencyAwareAdagradParameters(_message.Message):
    __slots__ = ("l1_regularization_strength", "l2_regularization_strength", "probability_exponent", "max_lr_multiplier", "accumulator_decay", "initial_accumulator_value", "step_counter")
    L1_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    L2_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    MAX_LR_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATOR_DECAY_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    STEP_COUNTER_FIELD_NUMBER: _ClassVar[int]
    l1_regularization_strength: float
    l2_regularization_strength: float
    probability_exponent: float
    max_lr_multiplier: float
    accumulator_decay: float
    initial_accumulator_value: float
    step_counter: OptimizerDynamicInput
    def __init__(self, l1_regularization_strength: _Optional[float] = ..., l2_regularization_strength: _Optional[float] = ..., probability_exponent: _Optional[float] = ..., max_lr_multiplier: _Optional[float] = ..., accumulator_decay: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., step_counter: _Optional[_Union[OptimizerDynamicInput, _Mapping]] = ...) -> None: ...

class StochasticGradientDescentParameters(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FtrlParameters(_message.Message):
    __slots__ = ("l1", "l2", "lr_power", "beta", "multiply_linear_by_lr", "allow_zero_accumulator")
    L1_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    LR_POWER_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    MULTIPLY_LINEAR_BY_LR_FIELD_NUMBER: _ClassVar[int]
    ALLOW_ZERO_ACCUMULATOR_FIELD_NUMBER: _ClassVar[int]
    l1: float
    l2: float
    lr_power: float
    beta: float
    multiply_linear_by_lr: bool
    allow_zero_accumulator: bool
    def __init__(self, l1: _Optional[float] = ..., l2: _Optional[float] = ..., lr_power: _Optional[float] = ..., beta: _Optional[float] = ..., multiply_linear_by_lr: _Optional[bool] = ..., allow_zero_accumulator: _Optional[bool] = ...) -> None: ...

class AdamParameters(_message.Message):
    __slots__ = ("beta1", "beta2", "epsilon", "use_non_lazy_adam", "use_sum_inside_sqrt")
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    USE_NON_LAZY_ADAM_FIELD_NUMBER: _ClassVar[int]
    USE_SUM_INSIDE_SQRT_FIELD_NUMBER: _ClassVar[int]
    beta1: float
    beta2: float
    epsilon: float
    use_non_lazy_adam: bool
    use_sum_inside_sqrt: bool
    def __init__(self, beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., epsilon: _Optional[float] = ..., use_non_lazy_adam: _Optional[bool] = ..., use_sum_inside_sqrt: _Optional[bool] = ...) -> None: ...

class MomentumParameters(_message.Message):
    __slots__ = ("momentum", "use_nesterov")
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    USE_NESTEROV_FIELD_NUMBER: _ClassVar[int]
    momentum: float
    use_nesterov: bool
    def __init__(self, momentum: _Optional[float] = ..., use_nesterov: _Optional[bool] = ...) -> None: ...

class LionParameters(_message.Message):
    __slots__ = ("beta1", "beta2", "use_non_lazy_lion")
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    USE_NON_LAZY_LION_FIELD_NUMBER: _ClassVar[int]
    beta1: float
    beta2: float
    use_non_lazy_lion: bool
    def __init__(self, beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., use_non_lazy_lion: _Optional[bool] = ...) -> None: ...

class RmsPropParameters(_message.Message):
    __slots__ = ("rho", "momentum", "epsilon")
    RHO_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    rho: float
    momentum: float
    epsilon: float
    def __init__(self, rho: _Optional[float] = ..., momentum: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class CenteredRmsPropParameters(_message.Message):
    __slots__ = ("rho", "momentum", "epsilon")
    RHO_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    rho: float
    momentum: float
    epsilon: float
    def __init__(self, rho: _Optional[float] = ..., momentum: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class MdlAdagradLightParameters(_message.Message):
    __slots__ = ("l2", "lr_power", "min_servable_mdl_benefit", "mdl_mix_in_margin", "mdl_benefit_rampup_coeff", "mdl_min_weight", "benefit_revisit_scale", "max_event_benefit", "max_total_benefit", "mdl_hard_limit", "hard_limit_min_benefit", "mdl_regularize")
    L2_FIELD_NUMBER: _ClassVar[int]
    LR_POWER_FIELD_NUMBER: _ClassVar[int]
    MIN_SERVABLE_MDL_BENEFIT_FIELD_NUMBER: _ClassVar[int]
    MDL_MIX_IN_MARGIN_FIELD_NUMBER: _ClassVar[int]
    MDL_BENEFIT_RAMPUP_COEFF_FIELD_NUMBER: _ClassVar[int]
    MDL_MIN_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BENEFIT_REVISIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENT_BENEFIT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_BENEFIT_FIELD_NUMBER: _ClassVar[int]
    MDL_HARD_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HARD_LIMIT_MIN_BENEFIT_FIELD_NUMBER: _ClassVar[int]
    MDL_REGULARIZE_FIELD_NUMBER: _ClassVar[int]
    l2: float
    lr_power: float
    min_servable_mdl_benefit: float
    mdl_mix_in_margin: float
    mdl_benefit_rampup_coeff: float
    mdl_min_weight: float
    benefit_revisit_scale: float
    max_event_benefit: float
    max_total_benefit: float
    mdl_hard_limit: float
    hard_limit_min_benefit: bool
    mdl_regularize: bool
    def __init__(self, l2: _Optional[float] = ..., lr_power: _Optional[float] = ..., min_servable_mdl_benefit: _Optional[float] = ..., mdl_mix_in_margin: _Optional[float] = ..., mdl_benefit_rampup_coeff: _Optional[float] = ..., mdl_min_weight: _Optional[float] = ..., benefit_revisit_scale: _Optional[float] = ..., max_event_benefit: _Optional[float] = ..., max_total_benefit: _Optional[float] = ..., mdl_hard_limit: _Optional[float] = ..., hard_limit_min_benefit: _Optional[bool] = ..., mdl_regularize: _Optional[bool] = ...) -> None: ...

class AdadeltaParameters(_message.Message):
    __slots__ = ("rho", "epsilon")
    RHO_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    rho: float
    epsilon: float
    def __init__(self, rho: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class ProximalAdagradParameters(_message.Message):
    __slots__ = ("l1", "l2")
    L1_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    l1: float
    l2: float
    def __init__(self, l1: _Optional[float] = ..., l2: _Optional[float] = ...) -> None: ...

class OnlineYogiParameters(_message.Message):
    __slots__ = ("l1", "l2", "beta2")
    L1_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    l1: float
    l2: float
    beta2: float
    def __init__(self, l1: _Optional[float] = ..., l2: _Optional[float] = ..., beta2: _Optional[float] = ...) -> None: ...

class ProximalYogiParameters(_message.Message):
    __slots__ = ("l1", "l2", "beta1", "beta2", "epsilon")
    L1_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    l1: float
    l2: float
    beta1: float
    beta2: float
    epsilon: float
    def __init__(self, l1: _Optional[float] = ..., l2: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class FrequencyEstimatorParameters(_message.Message):
    __slots__ = ("tau", "max_delta", "outlier_threshold", "weight_exponent")
    TAU_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTA_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    tau: float
    max_delta: float
    outlier_threshold: float
    weight_exponent: float
    def __init__(self, tau: _Optional[float] = ..., max_delta: _Optional[float] = ..., outlier_threshold: _Optional[float] = ..., weight_exponent: _Optional[float] = ...) -> None: ...

class UserDefinedProgramParameters(_message.Message):
    __slots__ = ("program",)
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    program: bytes
    def __init__(self, program: _Optional[bytes] = ...) -> None: ...

class AssignParameters(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GradientAccumulationStatus(_message.Message):
    __slots__ = ()
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[GradientAccumulationStatus.Status]
        ENABLED: _ClassVar[GradientAccumulationStatus.Status]
        DISABLED: _ClassVar[GradientAccumulationStatus.Status]
    UNSPECIFIED: GradientAccumulationStatus.Status
    ENABLED: GradientAccumulationStatus.Status
    DISABLED: GradientAccumulationStatus.Status
    def __init__(self) -> None: ...

class LowDimensionalPackingStatus(_message.Message):
    __slots__ = ()
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[LowDimensionalPackingStatus.Status]
        ENABLED: _ClassVar[LowDimensionalPackingStatus.Status]
        DISABLED: _ClassVar[LowDimensionalPackingStatus.Status]
    UNSPECIFIED: LowDimensionalPackingStatus.Status
    ENABLED: LowDimensionalPackingStatus.Status
    DISABLED: LowDimensionalPackingStatus.Status
    def __init__(self) -> None: ...

class HotIdReplicationConfiguration(_message.Message):
    __slots__ = ("status",)
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[HotIdReplicationConfiguration.Status]
        ENABLED: _ClassVar[HotIdReplicationConfiguration.Status]
        DISABLED: _ClassVar[HotIdReplicationConfiguration.Status]
        MIGRATION_ONLY: _ClassVar[HotIdReplicationConfiguration.Status]
    UNSPECIFIED: HotIdReplicationConfiguration.Status
    ENABLED: HotIdReplicationConfiguration.Status
    DISABLED: HotIdReplicationConfiguration.Status
    MIGRATION_ONLY: HotIdReplicationConfiguration.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: HotIdReplicationConfiguration.Status
    def __init__(self, status: _Optional[_Union[HotIdReplicationConfiguration.Status, str]] = ...) -> None: ...

class OptimizationParameters(_message.Message):
    __slots__ = ("learning_rate", "clipping_limits", "gradient_clipping_limits", "weight_decay_factor", "multiply_weight_decay_factor_by_learning_rate", "simulated_quantization", "gradient_accumulation_status", "low_dimensional_packing_status", "hot_id_replication_configuration", "adagrad", "adagrad_momentum", "bounded_adagrad", "frequency_aware_adagrad", "stochastic_gradient_descent", "ftrl", "adam", "momentum", "lion", "rms_prop", "centered_rms_prop", "mdl_adagrad_light", "adadelta", "proximal_adagrad", "online_yogi", "proximal_yogi", "frequency_estimator", "user_defined_program", "assign")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    CLIPPING_LIMITS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CLIPPING_LIMITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MULTIPLY_WEIGHT_DECAY_FACTOR_BY_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STATUS_FIELD_NUMBER: _ClassVar[int]
    LOW_DIMENSIONAL_PACKING_STATUS_FIELD_NUMBER: _ClassVar[int]
    HOT_ID_REPLICATION_CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_AWARE_ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_GRADIENT_DESCENT_FIELD_NUMBER: _ClassVar[int]
    FTRL_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    LION_FIELD_NUMBER: _ClassVar[int]
    RMS_PROP_FIELD_NUMBER: _ClassVar[int]
    CENTERED_RMS_PROP_FIELD_NUMBER: _ClassVar[int]
    MDL_ADAGRAD_LIGHT_FIELD_NUMBER: _ClassVar[int]
    ADADELTA_FIELD_NUMBER: _ClassVar[int]
    PROXIMAL_ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    ONLINE_YOGI_FIELD_NUMBER: _ClassVar[int]
    PROXIMAL_YOGI_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    USER_DEFINED_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    learning_rate: LearningRate
    clipping_limits: ClippingLimits
    gradient_clipping_limits: ClippingLimits
    weight_decay_factor: float
    multiply_weight_decay_factor_by_learning_rate: bool
    simulated_quantization: SimulatedQuantization
    gradient_accumulation_status: GradientAccumulationStatus.Status
    low_dimensional_packing_status: LowDimensionalPackingStatus.Status
    hot_id_replication_configuration: HotIdReplicationConfiguration
    adagrad: AdagradParameters
    adagrad_momentum: AdagradMomentumParameters
    bounded_adagrad: BoundedAdagradParameters
    frequency_aware_adagrad: FrequencyAwareAdagradParameters
    stochastic_gradient_descent: StochasticGradientDescentParameters
    ftrl: FtrlParameters
    adam: AdamParameters
    momentum: MomentumParameters
    lion: LionParameters
    rms_prop: RmsPropParameters
    centered_rms_prop: CenteredRmsPropParameters
    mdl_adagrad_light: MdlAdagradLightParameters
    adadelta: AdadeltaParameters
    proximal_adagrad: ProximalAdagradParameters
    online_yogi: OnlineYogiParameters
    proximal_yogi: ProximalYogiParameters
    frequency_estimator: FrequencyEstimatorParameters
    user_defined_program: UserDefinedProgramParameters
    assign: AssignParameters
    def __init__(self, learning_rate: _Optional[_Union[LearningRate, _Mapping]] = ..., clipping_limits: _Optional[_Union[ClippingLimits, _Mapping]] = ..., gradient_clipping_limits: _Optional[_Union[ClippingLimits, _Mapping]] = ..., weight_decay_factor: _Optional[float] = ..., multiply_weight_decay_factor_by_learning_rate: _Optional[bool] = ..., simulated_quantization: _Optional[_Union[SimulatedQuantization, _Mapping]] = ..., gradient_accumulation_status: _Optional[_Union[GradientAccumulationStatus.Status, str]] = ..., low_dimensional_packing_status: _Optional[_Union[LowDimensionalPackingStatus.Status, str]] = ..., hot_id_replication_configuration: _Optional[_Union[HotIdReplicationConfiguration, _Mapping]] = ..., adagrad: _Optional[_Union[AdagradParameters, _Mapping]] = ..., adagrad_momentum: _Optional[_Union[AdagradMomentumParameters, _Mapping]] = ..., bounded_adagrad: _Optional[_Union[BoundedAdagradParameters, _Mapping]] = ..., frequency_aware_adagrad: _Optional[_Union[FrequencyAwareAdagradParameters, _Mapping]] = ..., stochastic_gradient_descent: _Optional[_Union[StochasticGradientDescentParameters, _Mapping]] = ..., ftrl: _Optional[_Union[FtrlParameters, _Mapping]] = ..., adam: _Optional[_Union[AdamParameters, _Mapping]] = ..., momentum: _Optional[_Union[MomentumParameters, _Mapping]] = ..., lion: _Optional[_Union[LionParameters, _Mapping]] = ..., rms_prop: _Optional[_Union[RmsPropParameters, _Mapping]] = ..., centered_rms_prop: _Optional[_Union[CenteredRmsPropParameters, _Mapping]] = ..., mdl_adagrad_light: _Optional[_Union[MdlAdagradLightParameters, _Mapping]] = ..., adadelta: _Optional[_Union[AdadeltaParameters, _Mapping]] = ..., proximal_adagrad: _Optional[_Union[ProximalAdagradParameters, _Mapping]] = ..., online_yogi: _Optional[_Union[OnlineYogiParameters, _Mapping]] = ..., proximal_yogi: _Optional[_Union[ProximalYogiParameters, _Mapping]] = ..., frequency_estimator: _Optional[_Union[FrequencyEstimatorParameters, _Mapping]] = ..., user_defined_program: _Optional[_Union[UserDefinedProgramParameters, _Mapping]] = ..., assign: _Optional[_Union[AssignParameters, _Mapping]] = ...) -> None: ...

class StateVariableSpecification(_message.Message):
    __slots__ = ("name", "user_defined", "fill_with_constant")
    class UserDefined(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class FillWithConstant(_message.Message):
        __slots__ = ("initial_value",)
        INITIAL_VALUE_FIELD_NUMBER: _ClassVar[int]
        initial_value: float
        def __init__(self, initial_value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    USER_DEFINED_FIELD_NUMBER: _ClassVar[int]
    FILL_WITH_CONSTANT_FIELD_NUMBER: _ClassVar[int]
    name: str
    user_defined: StateVariableSpecification.UserDefined
    fill_with_constant: StateVariableSpecification.FillWithConstant
    def __init__(self, name: _Optional[str] = ..., user_defined: _Optional[_Union[StateVariableSpecification.UserDefined, _Mapping]] = ..., fill_with_constant: _Optional[_Union[StateVariableSpecification.FillWithConstant, _Mapping]] = ...) -> None: ...
