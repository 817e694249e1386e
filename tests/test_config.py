"""Typed config: the optimizer spec contract, TF2 names and defaults, engine helpers."""

from __future__ import annotations

import dataclasses
import math

import pytest

import meshembed as me
from meshembed._proto import optimization_parameters_pb2 as opt_pb2
from meshembed.config import (
    FTRL,
    OPTIMIZER_CLASSES,
    SGD,
    Adadelta,
    Adagrad,
    AdagradMomentum,
    Adam,
    Assign,
    BoundedAdagrad,
    CenteredRMSProp,
    DynamicLearningRate,
    EmbeddingConfig,
    FeatureConfig,
    FrequencyAwareAdagrad,
    FrequencyEstimator,
    Lion,
    MDLAdagradLight,
    Momentum,
    OnlineYogi,
    OptimizerSpec,
    ProximalAdagrad,
    ProximalYogi,
    QuantizationConfig,
    RMSProp,
    TableConfig,
    UserDefinedProgram,
)

# spec §2.6
SLOTS = {
    "adagrad": ("accumulators",),
    "adagrad_momentum": ("accumulators", "momenta"),
    "bounded_adagrad": ("accumulators",),
    "frequency_aware_adagrad": ("accumulators", "counters"),
    "stochastic_gradient_descent": (),
    "ftrl": ("accumulators", "linears"),
    "adam": ("momenta", "velocities"),
    "momentum": ("momenta",),
    "lion": ("momenta",),
    "rms_prop": ("ms", "mom"),
    "centered_rms_prop": ("ms", "mom", "mg"),
    "mdl_adagrad_light": ("accumulators", "weights", "benefits"),
    "adadelta": ("accumulators", "updates"),
    "proximal_adagrad": ("accumulators",),
    "online_yogi": ("vs", "linears"),
    "proximal_yogi": ("v", "m"),
    "frequency_estimator": ("last_hit_step",),
    "user_defined_program": (),
    "assign": (),
}


def _instance(cls):
    if cls is FrequencyEstimator:
        return cls(DynamicLearningRate(0))
    return cls()


def test_every_oneof_member_has_a_spec_class():
    oneof = opt_pb2.OptimizationParameters.DESCRIPTOR.oneofs_by_name["parameters"]
    assert set(OPTIMIZER_CLASSES) == {f.name for f in oneof.fields} == set(SLOTS)
    exported = {name for name in me.config.__all__ if isinstance(getattr(me.config, name), type)
                and issubclass(getattr(me.config, name), OptimizerSpec) and name != "OptimizerSpec"}
    from meshembed.config.rowwise import ROW_WISE_CLASSES  # the extensions with no proto form

    assert exported == {cls.__name__ for cls in (*OPTIMIZER_CLASSES.values(), *ROW_WISE_CLASSES.values())}
    assert not set(ROW_WISE_CLASSES) & set(OPTIMIZER_CLASSES)


@pytest.mark.parametrize("algorithm", sorted(SLOTS))
def test_spec_contract(algorithm):
    cls = OPTIMIZER_CLASSES[algorithm]
    spec = _instance(cls)
    assert cls.algorithm == algorithm
    assert spec.slot_names == SLOTS[algorithm]
    assert len(spec.slot_initial_values()) == len(spec.slot_names)
    params = opt_pb2.OptimizationParameters.DESCRIPTOR.fields_by_name[algorithm].message_type
    scalar_fields = {f.name for f in params.fields if f.message_type is None}
    assert set(spec.hyperparameters()) == scalar_fields
    assert dataclasses.is_dataclass(spec)
    hash(spec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.learning_rate = 1.0  # type: ignore[misc]


def test_tf2_defaults_and_names():
    adam = Adam()
    assert (adam.learning_rate, adam.beta_1, adam.beta_2, adam.epsilon, adam.lazy_adam, adam.sum_inside_sqrt) == \
        (0.001, 0.9, 0.999, 1e-07, True, True)
    assert adam.hyperparameters() == {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-07,
                                      "use_non_lazy_adam": False, "use_sum_inside_sqrt": True}
    assert SGD().learning_rate == 0.01
    assert Adagrad().slot_initial_values() == (0.1,)
    assert Adagrad(initial_accumulator_value=0.5).slot_initial_values() == (0.5,)
    ftrl = FTRL(learning_rate=0.1, learning_rate_power=-0.25, l1_regularization_strength=0.01,
                l2_regularization_strength=0.02, beta=0.1, multiply_linear_by_learning_rate=True)
    assert ftrl.hyperparameters() == {"l1": 0.01, "l2": 0.02, "lr_power": -0.25, "beta": 0.1,
                                      "multiply_linear_by_lr": True, "allow_zero_accumulator": False}
    assert ftrl.slot_initial_values() == (0.1, 0.0)
    am = AdagradMomentum(0.1, momentum=0.9, use_nesterov=True)
    assert am.hyperparameters() == {"momentum": 0.9, "use_nesterov": True, "exponent": 2.0, "beta2": 1.0,
                                    "epsilon": 1e-10}
    assert Adadelta(learning_rate=0.1, rho=0.95, epsilon=1e-6).hyperparameters() == {"rho": 0.95, "epsilon": 1e-6}
    assert Lion(0.1, beta1=0.8, beta2=0.9, use_non_lazy_lion=True).hyperparameters() == \
        {"beta1": 0.8, "beta2": 0.9, "use_non_lazy_lion": True}


def test_slot_initial_values_follow_v1_conventions():
    assert ProximalAdagrad().slot_initial_values() == (0.1,)
    assert ProximalYogi().slot_initial_values() == (1e-06, 0.0)
    assert RMSProp().slot_initial_values() == (0.0, 0.0)
    assert CenteredRMSProp().slot_initial_values() == (0.0, 0.0, 0.0)
    assert Momentum().slot_initial_values() == (0.0,)
    assert FrequencyAwareAdagrad(initial_accumulator_value=0.3).slot_initial_values() == (0.3, 0.0)
    assert Adadelta(initial_accumulator=0.2).slot_initial_values() == (0.2, 0.0)
    assert MDLAdagradLight().slot_initial_values() == (0.0, 0.0, 0.0)
    assert BoundedAdagrad().slot_initial_values() == (0.1,)
    assert OnlineYogi().slot_initial_values() == (1e-06, 0.0)


def test_user_defined_program_keeps_bytes_and_names_slots():
    udp = UserDefinedProgram(0.1, program=b"\n\x03hlo", num_slots=2)
    assert udp.program == b"\n\x03hlo"
    assert udp.slot_names == ("Slot_0", "Slot_1")
    assert udp.slot_initial_values() == (0.0, 0.0)


def test_clipping_limits():
    assert SGD().clipping_limits() is None
    assert SGD().gradient_clipping_limits() is None
    assert SGD(clip_weight_max=2.0).clipping_limits() == (-math.inf, 2.0)
    assert SGD(clipvalue=(None, 3.0)).gradient_clipping_limits() == (-math.inf, 3.0)
    assert SGD(clipvalue=[-1, None]).gradient_clipping_limits() == (-1.0, math.inf)
    assert SGD(clipvalue=0.5).gradient_clipping_limits() == (-0.5, 0.5)


def test_shared_options_normalise():
    spec = Adagrad(low_dimensional_packing_status=True, hot_id_replication="MIGRATION_ONLY")
    assert spec.low_dimensional_packing_status == "enabled"
    assert spec.hot_id_replication == "migration_only"
    assert Adagrad(low_dimensional_packing_status=2).low_dimensional_packing_status == "disabled"
    assert Adagrad(learning_rate=1).learning_rate == 1.0
    assert Adagrad(0.1) == Adagrad(learning_rate=0.1)
    assert hash(Adagrad(0.1)) == hash(Adagrad(learning_rate=0.1))
    assert Adagrad(0.1).gradient_accumulation_enabled
    assert Adagrad(0.1, use_gradient_accumulation=None).gradient_accumulation_enabled


def test_quantization_lives_on_table_and_optimizer():
    q = QuantizationConfig(num_buckets=256, lower=-1.0, upper=1.0)
    t = TableConfig("t", 10, 4, SGD(0.1), quantization=q)
    assert t.optimizer.simulated_quantization == q
    t2 = TableConfig("t", 10, 4, SGD(0.1, simulated_quantization=q))
    assert t2.quantization == q and t2 == t


def _cfg(**kw):
    tables = kw.pop("tables", [TableConfig("user", 100, 8, Adagrad(0.1)), TableConfig("item", 50, 4, SGD(0.5))])
    features = kw.pop("features", [FeatureConfig("user", (32,), name="user_id"),
                                   FeatureConfig("item", (32,), name="item_id"),
                                   FeatureConfig("user", (32, 5), name="recent_users")])
    return EmbeddingConfig(tables=tables, features=features, **kw)


def test_embedding_config_helpers():
    cfg = _cfg(sharding_strategy="mod", num_hosts=2, num_tensor_cores=8)
    assert cfg.layout == "per_feature"
    assert cfg.table_id("item") == 1
    assert cfg.table_of("recent_users").name == "user"
    assert cfg.table_of(1).name == "item"
    assert cfg.output_shapes == ((32, 8), (32, 4), (32, 5, 8))
    assert cfg.features[2].is_sequence and cfg.features[2].max_sequence_length == 5
    assert cfg.filled_batch_size_per_tensor_core == 32
    assert cfg.filled_num_features == (6, 1)
    assert cfg.num_dynamic_inputs == 0
    assert cfg.combiners == ("mean", "mean")
    assert cfg.sharding_strategy == "mod" and cfg.mode == "training"
    hash(cfg)
    assert EmbeddingConfig.from_proto(cfg.to_proto()) == cfg


def test_tf2_max_sequence_length_spelling():
    f = FeatureConfig("t", (16,), max_sequence_length=5)
    assert f.input_shape == (16, 5)
    assert f == FeatureConfig("t", (16, 5))


def test_tables_derived_from_features_in_first_seen_order():
    user = TableConfig("user", 100, 8, Adagrad(0.1))
    item = TableConfig("item", 50, 4)
    cfg = EmbeddingConfig(features=[FeatureConfig(item, 8), FeatureConfig(user, 8), FeatureConfig(item, 8)],
                          optimizer=SGD(0.2))
    assert [t.name for t in cfg.tables] == ["item", "user"]
    assert cfg.tables[0].optimizer == SGD(0.2)
    assert cfg.tables[1].optimizer == Adagrad(0.1)
    assert all(isinstance(f.table, str) for f in cfg.features)


def test_features_mapping_is_sorted_by_key():
    t = TableConfig("t", 10, 2, SGD())
    cfg = EmbeddingConfig(tables=[t], features={"b": FeatureConfig("t", 4), "a": FeatureConfig("t", 4)})
    assert [f.name for f in cfg.features] == ["a", "b"]


def test_callable_learning_rates_become_tags_in_table_order():
    def lr_a():
        return 0.1

    def lr_b():
        return 0.2

    tables = [TableConfig("d1", 10, 2, SGD(lr_a)), TableConfig("d2", 20, 2, Adagrad(lr_b)),
              TableConfig("d3", 30, 2, SGD(lr_a)), TableConfig("d4", 40, 2, SGD(0.3))]
    cfg = EmbeddingConfig(tables=tables, features=[FeatureConfig(t.name, 16) for t in tables])
    assert [t.optimizer.learning_rate for t in cfg.tables[:3]] == [
        DynamicLearningRate(0), DynamicLearningRate(1), DynamicLearningRate(0)]
    assert cfg.learning_rate_fns == (lr_a, lr_b)
    assert cfg.num_dynamic_inputs == 2
    assert cfg.evaluate_learning_rates() == (0.1, 0.2)
    assert cfg.replace(num_hosts=2).learning_rate_fns == (lr_a, lr_b)
    assert EmbeddingConfig.from_proto(cfg.to_proto()) == cfg


def test_step_counter_counts_as_a_dynamic_input():
    t = TableConfig("t", 10, 2, FrequencyAwareAdagrad(DynamicLearningRate(0), step_counter=DynamicLearningRate(1)))
    cfg = EmbeddingConfig(tables=[t], features=[FeatureConfig("t", 4)])
    assert cfg.dynamic_tags == (0, 1)
    assert cfg.num_dynamic_inputs == 2


def test_legacy_layout_fill_in():
    tables = [TableConfig("a", 10, 4, SGD(), num_features=2), TableConfig("b", 10, 8, SGD(), num_features=1)]
    cfg = EmbeddingConfig(tables=tables, batch_size_per_tensor_core=16)
    assert cfg.layout == "per_table"
    assert cfg.features == ()
    assert cfg.output_shapes == ((32, 4), (16, 8))
    assert [f.input_shape for f in cfg.effective_features] == [(32,), (16,)]
    assert cfg.table_of(1).name == "b"
    again = EmbeddingConfig.from_proto(cfg.to_proto())
    assert again == cfg and again.layout == "per_table"


def test_vocabulary_padded_to_num_hosts_like_tf2():
    cfg = EmbeddingConfig(tables=[TableConfig("tiny", 1, 4, SGD())], features=[FeatureConfig("tiny", 8)], num_hosts=4)
    assert cfg.tables[0].vocabulary_size == 4


def test_public_lazy_exports():
    assert me.EmbeddingConfig is EmbeddingConfig
    assert me.TableConfig is TableConfig and me.FeatureConfig is FeatureConfig
    assert Assign().slot_names == ()


# -- CustomOptimizer: accepted by the config, no proto form -----------------------------------
def _velocity(xp, params, grads, slots, *, lr, decay):
    v = decay * slots.velocity + grads
    return params - lr * v, type(slots)(v)


def _custom(**kw):
    kw.setdefault("hyperparameters", {"decay": 0.7})
    return me.embedding.CustomOptimizer(_velocity, ("velocity",), (0.5,), **kw)


def test_custom_optimizer_is_accepted_by_table_and_embedding_config():
    opt = _custom(learning_rate=0.1)
    t = TableConfig("user", 10, 4, opt)
    assert t.optimizer is opt and t.optimizer.slot_names == ("velocity",)
    assert t.optimizer.slot_initial_values() == (0.5,) and t.optimizer.hyperparameters() == {"decay": 0.7}
    # as the EmbeddingConfig default, next to a proto optimizer
    cfg = EmbeddingConfig(tables=[TableConfig("user", 10, 4), TableConfig("item", 10, 4, SGD(0.1))],
                          features=[FeatureConfig("user", 4), FeatureConfig("item", 4)], optimizer=opt)
    assert cfg.tables[0].optimizer == opt and cfg.num_dynamic_inputs == 0


def test_custom_optimizer_options_flow_through_the_config():
    q = QuantizationConfig(8, -1.0, 1.0)
    t = TableConfig("user", 10, 4, _custom(), quantization=q)
    assert t.optimizer.simulated_quantization == q and t.optimizer.hyperparameters() == {"decay": 0.7}
    assert t.optimizer.update_fn is _velocity
    assert TableConfig("user", 10, 4, _custom(simulated_quantization=q)).quantization == q

    def lr():
        return 0.25

    cfg = EmbeddingConfig(tables=[TableConfig("user", 10, 4, _custom(learning_rate=lr))],
                          features=[FeatureConfig("user", 4)])
    assert cfg.tables[0].optimizer.learning_rate == DynamicLearningRate(0)
    assert cfg.tables[0].optimizer.update_fn is _velocity
    assert cfg.learning_rate_fns == (lr,) and cfg.evaluate_learning_rates() == (0.25,)
    # a hyper-parameter given as a DynamicLearningRate is a dynamic input, like step_counter
    dyn = _custom(learning_rate=DynamicLearningRate(0), hyperparameters={"decay": DynamicLearningRate(1)})
    cfg = EmbeddingConfig(tables=[TableConfig("user", 10, 4, dyn)], features=[FeatureConfig("user", 4)])
    assert cfg.dynamic_tags == (0, 1) and cfg.num_dynamic_inputs == 2


@pytest.mark.parametrize("kw, arg", [
    (dict(learning_rate="fast"), "learning_rate"),
    (dict(simulated_quantization=(8, -1.0, 1.0)), "simulated_quantization"),
    (dict(clip_weight_min=1.0, clip_weight_max=0.0), "clip_weight_min"),
])
def test_custom_optimizer_bad_options_name_the_table(kw, arg):
    with pytest.raises(me.ConfigError, match=f"Invalid `{arg}` for table 'user'"):
        TableConfig("user", 10, 4, _custom(**kw))


def test_config_with_custom_optimizer_has_no_proto_form():
    cfg = EmbeddingConfig(tables=[TableConfig("ok", 10, 4, SGD(0.1)), TableConfig("user", 10, 4, _custom())],
                          features=[FeatureConfig("ok", 4), FeatureConfig("user", 4)])
    for write in (cfg.to_proto, cfg.to_text, cfg.to_message):
        with pytest.raises(me.ConfigError) as info:
            write()
        msg = str(info.value)
        assert "table 'user'" in msg and "Python-level optimizer" in msg, msg
        assert "no TPUEmbeddingConfiguration form" in msg and "Fix:" in msg, msg
    from meshembed.config.proto_io import optimizer_to_message

    with pytest.raises(me.ConfigError, match="Python-level optimizer"):
        optimizer_to_message(_custom())
