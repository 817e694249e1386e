"""meshembed configs against TensorFlow's own messages and TF2's embedding API.

The golden rebuilds need no TensorFlow; the rest skip cleanly without it.
"""

from __future__ import annotations

import pathlib

import pytest

from meshembed.config import (
    FTRL,
    SGD,
    Adadelta,
    Adagrad,
    AdagradMomentum,
    Adam,
    DynamicLearningRate,
    EmbeddingConfig,
    FeatureConfig,
    FrequencyAwareAdagrad,
    Lion,
    QuantizationConfig,
    SpmdSharding,
    TableConfig,
)

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "conformance" / "golden" / "tpu_config"
TF_REASON = "tensorflow-cpu (extra [tf-interop]) is needed to compare with TensorFlow's messages"


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow", reason=TF_REASON)


@pytest.fixture(scope="module")
def tf_cfg_pb2(tf):
    from tensorflow.core.protobuf.tpu import tpu_embedding_configuration_pb2

    return tpu_embedding_configuration_pb2


# ---------------------------------------------------------------------------- TF2-API golden configs
def _lr_d13():
    return 0.1


def _lr_d2():
    return 0.2


def _rebuild_tf2_api(name: str) -> EmbeddingConfig:
    """The Python spelling of each tf2_api golden config (see the .pbtxt comments)."""
    if name == "sgd_single":
        t = TableConfig("table_0", 1000, 16, SGD(0.1))
        return EmbeddingConfig([t], [FeatureConfig(t, (16,), name="feature_0")], num_tensor_cores=8)
    if name == "dynamic_learning_rates":
        tables = [TableConfig("d1", 10, 2, SGD(_lr_d13)), TableConfig("d2", 20, 2, Adagrad(_lr_d2)),
                  TableConfig("d3", 30, 2, SGD(_lr_d13)), TableConfig("d4", 40, 2, SGD(0.3))]
        return EmbeddingConfig(tables, [FeatureConfig(t, 16) for t in tables], num_tensor_cores=8)
    if name == "ftrl_all_options":
        opt = FTRL(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1,
                   multiply_linear_by_learning_rate=True, allow_zero_accumulator=True)
        t = TableConfig("t_ftrl", 300, 8, opt)
        return EmbeddingConfig([t], [FeatureConfig(t, 16)], num_tensor_cores=8)
    if name == "adagrad_shared_table_plus_adam_override":
        user = TableConfig("t_user", 64, 8)
        item = TableConfig("t_item", 1000, 4, Adam(0.01))
        features = {"f_user": FeatureConfig(user, 16), "f_item": FeatureConfig(item, 16),
                    "f_user_friends": FeatureConfig(user, 16)}
        return EmbeddingConfig(features=features, optimizer=Adagrad(0.05), num_tensor_cores=8)
    if name == "sequence_output_shape_multi_host":
        seq = TableConfig("t_seq", 100, 8, SGD())
        tiny = TableConfig("t_tiny", 1, 4, SGD())  # padded to num_hosts like TF2
        features = [FeatureConfig(seq, (8,), name="seq", max_sequence_length=5),
                    FeatureConfig(seq, (4, 8), name="shaped"), FeatureConfig(tiny, (8,), name="tiny")]
        return EmbeddingConfig(features=features, num_hosts=4, num_tensor_cores=32)
    raise KeyError(name)


TF2_API = sorted(p.stem for p in (GOLDEN / "tf2_api").glob("*.pb"))


@pytest.mark.parametrize("name", TF2_API)
def test_python_spelling_reproduces_tf2_api_bytes(name):
    cfg = _rebuild_tf2_api(name)
    assert cfg.to_proto() == (GOLDEN / "tf2_api" / f"{name}.pb").read_bytes()


# ---------------------------------------------------------------------------- TF's own messages
def _python_configs():
    yield "tf2_single", _rebuild_tf2_api("sgd_single")
    yield "dynamic", _rebuild_tf2_api("dynamic_learning_rates")
    yield "everything", EmbeddingConfig(
        tables=[TableConfig("a", 100, 8, Adam(DynamicLearningRate(0), lazy_adam=False, clipvalue=(None, 2.0),
                                               clip_weight_min=-3.0, weight_decay_factor=0.01,
                                               multiply_weight_decay_factor_by_learning_rate=True,
                                               low_dimensional_packing_status="disabled",
                                               hot_id_replication="migration_only"),
                            quantization=QuantizationConfig(16, -1.0, 1.0)),
                TableConfig("b", 50, 4, FrequencyAwareAdagrad(
                    0.5, max_lr_multiplier=2.0, step_counter=DynamicLearningRate(1),
                    use_gradient_accumulation=None)),
                TableConfig("c", 70, 2, AdagradMomentum(0.1, momentum=0.9, use_nesterov=True)),
                TableConfig("d", 30, 2, Lion(0.1, use_non_lazy_lion=True)),
                TableConfig("e", 30, 2, Adadelta(0.1, rho=0.9, epsilon=1e-6, use_gradient_accumulation=False))],
        features=[FeatureConfig("a", (16,), name="fa"), FeatureConfig("b", (16, 3), name="fb"),
                  FeatureConfig("c", (8, 2, 2)), FeatureConfig("d", 32), FeatureConfig("e", 16)],
        mode="backward_pass_only", sharding_strategy="mod", num_hosts=2, num_tensor_cores=16,
        pipeline_execution_with_tensor_core=True, profile_data_directory="gs://bucket/profile",
        spmd_sharding=SpmdSharding(True, 2, use_manual_partitioning=True))
    yield "legacy", EmbeddingConfig(
        tables=[TableConfig("a", 100, 8, SGD(0.1), num_features=2), TableConfig("b", 10, 4, SGD(0.2), num_features=1)],
        batch_size_per_tensor_core=16)


PY_CONFIGS = list(_python_configs())


@pytest.mark.parametrize("name, cfg", PY_CONFIGS, ids=[n for n, _ in PY_CONFIGS])
def test_tensorflow_parses_our_bytes_to_an_equal_message(name, cfg, tf_cfg_pb2):
    from google.protobuf import text_format

    data = cfg.to_proto()
    theirs = tf_cfg_pb2.TPUEmbeddingConfiguration.FromString(data)
    # the same content written through TF's own text parser: field names and values agree
    expected = text_format.Parse(cfg.to_text(), tf_cfg_pb2.TPUEmbeddingConfiguration())
    assert theirs == expected
    assert theirs.SerializeToString(deterministic=True) == data
    assert EmbeddingConfig.from_proto(theirs.SerializeToString(deterministic=True)) == cfg


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*/*.pbtxt")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_tf_and_meshembed_read_the_same_text(path, tf_cfg_pb2):
    from google.protobuf import text_format

    if path.stem == "optimizer_user_defined_program":
        pytest.skip("program is an HloModuleProto message in TF's text format, bytes in ours")
    theirs = text_format.Parse(path.read_text(), tf_cfg_pb2.TPUEmbeddingConfiguration())
    ours = EmbeddingConfig.from_proto(path)
    assert ours.to_proto() == theirs.SerializeToString(deterministic=True)


# ---------------------------------------------------------------------------- TF2's own builder
def _tf2_pairs(E):
    """(our spec, TF2 optimizer, quantization) — TF2 needs low_dimensional_packing_status as an
    int under protobuf 7 (spec §5.2), hence `ldp=0`."""
    ldp = {"low_dimensional_packing_status": 0}
    yield SGD(0.1), E.SGD(0.1, **ldp), None
    yield (Adagrad(0.1, clipvalue=2.0, clip_weight_min=-1.0, weight_decay_factor=0.01,
                   multiply_weight_decay_factor_by_learning_rate=True),
           E.Adagrad(0.1, clipvalue=2.0, clip_weight_min=-1.0, weight_decay_factor=0.01,
                     multiply_weight_decay_factor_by_learning_rate=True, **ldp), None)
    yield (AdagradMomentum(0.2, momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.99, epsilon=1e-8),
           E.AdagradMomentum(0.2, momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.99, epsilon=1e-8, **ldp),
           None)
    yield (FTRL(0.1, learning_rate_power=-0.25, l1_regularization_strength=0.5, beta=0.2,
                multiply_linear_by_learning_rate=True),
           E.FTRL(0.1, learning_rate_power=-0.25, l1_regularization_strength=0.5, beta=0.2,
                  multiply_linear_by_learning_rate=True, **ldp), None)
    yield (Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, lazy_adam=False, sum_inside_sqrt=False,
                clipvalue=(None, 3.0), clip_weight_max=5.0),
           E.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, lazy_adam=False, sum_inside_sqrt=False,
                  clipvalue=(None, 3.0), clip_weight_max=5.0, **ldp), None)
    yield Adam(0.01, use_gradient_accumulation=False), E.Adam(0.01, use_gradient_accumulation=False, **ldp), None
    yield (SGD(0.1), E.SGD(0.1, **ldp), (QuantizationConfig(8, -2.0, 2.0), E.QuantizationConfig(8, -2.0, 2.0)))


def test_table_descriptors_match_tf2_builder(tf, tf_cfg_pb2):
    E = tf.tpu.experimental.embedding
    for ours, theirs, quant in _tf2_pairs(E):
        their_table = E.TableConfig(vocabulary_size=3, dim=4, optimizer=theirs, name="t",
                                    quantization_config=quant[1] if quant else None)
        desc = tf_cfg_pb2.TPUEmbeddingConfiguration.TableDescriptor()
        their_table._set_table_descriptor(desc, 4, {})
        cfg = EmbeddingConfig(tables=[TableConfig("t", 3, 4, ours, quantization=quant[0] if quant else None)],
                              features=[FeatureConfig("t", 8)], num_hosts=4)
        mine = cfg.to_message().table_descriptor[0]
        assert mine.SerializeToString(deterministic=True) == desc.SerializeToString(deterministic=True), ours


def test_callable_learning_rate_matches_tf2_builder(tf, tf_cfg_pb2):
    E = tf.tpu.experimental.embedding

    def lr():
        return 0.3

    theirs = E.TableConfig(vocabulary_size=10, dim=2, optimizer=E.SGD(lr, low_dimensional_packing_status=0), name="t")
    desc = tf_cfg_pb2.TPUEmbeddingConfiguration.TableDescriptor()
    theirs._set_table_descriptor(desc, 1, {lr: 0})
    cfg = EmbeddingConfig(tables=[TableConfig("t", 10, 2, SGD(lr))], features=[FeatureConfig("t", 4)])
    assert cfg.to_message().table_descriptor[0].SerializeToString(deterministic=True) == \
        desc.SerializeToString(deterministic=True)
    assert cfg.evaluate_learning_rates() == (0.3,)
