"""Proto I/O of EmbeddingConfig: golden bytes, text, paths, unknown fields, combiners."""

from __future__ import annotations

import pathlib

import pytest

from meshembed._proto import optimization_parameters_pb2 as opt_pb2
from meshembed._proto import tpu_embedding_configuration_pb2 as cfg_pb2
from meshembed.config import (
    SGD,
    Adagrad,
    DynamicLearningRate,
    EmbeddingConfig,
    FeatureConfig,
    QuantizationConfig,
    SpmdSharding,
    TableConfig,
)
from meshembed.errors import ConfigError

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "conformance" / "golden" / "tpu_config"
PB_FILES = sorted(GOLDEN.glob("*/*.pb"))
# Text format can't hold TF's HloModuleProto message as our bytes field (see proto_io).
TEXT_UNSUPPORTED = {"optimizer_user_defined_program"}


def _id(p: pathlib.Path) -> str:
    return f"{p.parent.name}/{p.stem}"


def test_golden_configs_are_present():
    assert len(PB_FILES) >= 31


@pytest.mark.parametrize("path", PB_FILES, ids=_id)
def test_golden_bytes_round_trip(path):
    raw = path.read_bytes()
    cfg = EmbeddingConfig.from_proto(raw)
    assert cfg.to_proto() == raw
    assert EmbeddingConfig.from_proto(path) == cfg
    assert EmbeddingConfig.from_proto(str(path)) == cfg
    hash(cfg)


@pytest.mark.parametrize("path", PB_FILES, ids=_id)
def test_golden_text_round_trip(path):
    raw = path.read_bytes()
    cfg = EmbeddingConfig.from_proto(raw)
    again = EmbeddingConfig.from_proto(cfg.to_text())
    assert again == cfg
    assert again.to_proto() == raw
    if path.stem not in TEXT_UNSUPPORTED:
        text_path = path.with_suffix(".pbtxt")
        assert EmbeddingConfig.from_proto(text_path).to_proto() == raw
        assert EmbeddingConfig.from_proto(text_path.read_text()).to_proto() == raw


def test_golden_semantics_spot_checks():
    cfg = EmbeddingConfig.from_proto(GOLDEN / "manual" / "learning_rates_constant_and_dynamic.pb")
    assert [t.optimizer.learning_rate for t in cfg.tables] == [
        0.05, DynamicLearningRate(0), DynamicLearningRate(1), DynamicLearningRate(0)]
    assert cfg.num_dynamic_inputs == 2
    assert cfg.tables[0].optimizer.use_gradient_accumulation is None  # UNSPECIFIED kept
    assert cfg.tables[0].num_features == 1  # kept as given (TF's hand-built configs carry it)
    seq = EmbeddingConfig.from_proto(GOLDEN / "tf2_api" / "sequence_output_shape_multi_host.pb")
    assert seq.output_shapes == ((8, 5, 8), (4, 8, 8), (8, 4))
    assert seq.filled_num_features == (9, 1)
    upper = EmbeddingConfig.from_proto(GOLDEN / "manual" / "clip_weights_upper_only.pb")
    lo, hi = upper.tables[0].optimizer.clipping_limits()
    assert lo == float("-inf") and hi > 0
    mod = EmbeddingConfig.from_proto(GOLDEN / "manual" / "sharding_mod_training.pb")
    assert mod.sharding_strategy == "mod"
    inference = EmbeddingConfig.from_proto(GOLDEN / "manual" / "sharding_div_default_inference.pb")
    assert inference.mode == "inference"
    udp = EmbeddingConfig.from_proto(GOLDEN / "manual" / "optimizer_user_defined_program.pb")
    assert udp.tables[0].optimizer.program.endswith(b"user_defined_update_program")
    faa = EmbeddingConfig.from_proto(GOLDEN / "manual" / "optimizer_frequency_aware_adagrad.pb")
    assert faa.tables[0].optimizer.step_counter == DynamicLearningRate(3)
    assert faa.num_dynamic_inputs == 4


def _with_unknown(msg, number: int, payload: bytes = b"\x07") -> None:
    """Append a varint field `number` the schema does not know."""
    key = (number << 3) | 0
    out = bytearray()
    while True:
        b = key & 0x7F
        key >>= 7
        out.append(b | (0x80 if key else 0))
        if not key:
            break
    msg.MergeFromString(bytes(out) + payload)


def test_unknown_fields_survive_at_every_level():
    raw = (GOLDEN / "manual" / "optimizer_adam.pb").read_bytes()
    msg = cfg_pb2.TPUEmbeddingConfiguration.FromString(raw)
    _with_unknown(msg, 100)
    _with_unknown(msg.table_descriptor[0], 101)
    _with_unknown(msg.table_descriptor[0].optimization_parameters, 102)
    _with_unknown(msg.table_descriptor[0].optimization_parameters.adam, 103)
    _with_unknown(msg.table_descriptor[0].optimization_parameters.learning_rate, 104)
    _with_unknown(msg.feature_descriptor[0], 105)
    msg.spmd_sharding.enabled = True
    msg.spmd_sharding.num_cores_per_replica = 2
    _with_unknown(msg.spmd_sharding, 106)
    data = msg.SerializeToString(deterministic=True)
    cfg = EmbeddingConfig.from_proto(data)
    assert cfg.unknown_fields and cfg.tables[0].unknown_fields and cfg.features[0].unknown_fields
    out = cfg.to_proto()
    back = cfg_pb2.TPUEmbeddingConfiguration.FromString(out)
    assert back == msg
    assert out == data
    # unknown fields travel with their owner when the typed config is edited
    edited = cfg.replace(num_hosts=1, mode="inference")
    back = cfg_pb2.TPUEmbeddingConfiguration.FromString(edited.to_proto())
    assert back.mode == cfg_pb2.TPUEmbeddingConfiguration.INFERENCE
    assert back.table_descriptor[0].optimization_parameters.adam.SerializeToString().endswith(b"\x07")


def test_presence_is_kept():
    text = """
      table_descriptor { name: "t" vocabulary_size: 10 dimension: 2
        optimization_parameters {
          stochastic_gradient_descent {}
          learning_rate { constant: 0 }
          gradient_clipping_limits { upper { value: 0 } }
          simulated_quantization { enabled: false num_buckets: 8 clipping_limits { lower { value: -1 } } }
          hot_id_replication_configuration {}
          low_dimensional_packing_status: DISABLED
        } }
      mode: BACKWARD_PASS_ONLY num_hosts: 1 num_tensor_cores: 1
      feature_descriptor { input_shape: 4 }
      spmd_sharding {}
    """
    cfg = EmbeddingConfig.from_proto(text)
    opt = cfg.tables[0].optimizer
    assert opt.learning_rate == 0.0
    assert opt.gradient_clipping_limits() == (float("-inf"), 0.0)
    assert opt.simulated_quantization == QuantizationConfig(8, -1.0, None, enabled=False)
    assert opt.hot_id_replication == "unspecified"
    assert opt.low_dimensional_packing_status == "disabled"
    assert cfg.spmd_sharding == SpmdSharding()
    assert cfg.mode == "backward_pass_only"
    from google.protobuf import text_format

    expected = text_format.Parse(text, cfg_pb2.TPUEmbeddingConfiguration())
    assert cfg.to_proto() == expected.SerializeToString(deterministic=True)


def test_combiners_argument():
    raw = (GOLDEN / "tf2_api" / "adagrad_shared_table_plus_adam_override.pb").read_bytes()
    assert EmbeddingConfig.from_proto(raw).combiners == ("mean", "mean")
    assert EmbeddingConfig.from_proto(raw, combiners="sum").combiners == ("sum", "sum")
    assert EmbeddingConfig.from_proto(raw, combiners=["sqrtn", "sum"]).combiners == ("sqrtn", "sum")
    assert EmbeddingConfig.from_proto(raw, combiners={"t_user": "sum"}).combiners == ("mean", "sum")
    with pytest.raises(ConfigError, match="one combiner per table"):
        EmbeddingConfig.from_proto(raw, combiners=["sum"])
    with pytest.raises(ConfigError, match="combiner"):
        EmbeddingConfig.from_proto(raw, combiners="max")


def test_to_proto_is_deterministic_and_typed_fields_cover_the_proto():
    cfg = EmbeddingConfig(
        tables=[TableConfig("t", 10, 2, Adagrad(0.1, hot_id_replication="enabled"))],
        features=[FeatureConfig("t", (4,), name="f")],
        mode="inference", sharding_strategy="mod", num_hosts=2, num_tensor_cores=4,
        pipeline_execution_with_tensor_core=True, profile_data_directory="/tmp/prof",
        spmd_sharding=SpmdSharding(True, 2, True, True))
    assert cfg.to_proto() == cfg.to_proto()
    msg = cfg.to_message()
    set_fields = {fd.name for fd, _ in msg.ListFields()}
    assert set_fields == {f.name for f in cfg_pb2.TPUEmbeddingConfiguration.DESCRIPTOR.fields} - {
        "batch_size_per_tensor_core"}
    assert EmbeddingConfig.from_proto(cfg.to_proto()) == cfg


def test_path_inputs(tmp_path):
    cfg = EmbeddingConfig(tables=[TableConfig("t", 10, 2, SGD())], features=[FeatureConfig("t", 4)])
    (tmp_path / "c.pb").write_bytes(cfg.to_proto())
    (tmp_path / "c.pbtxt").write_text(cfg.to_text())
    assert EmbeddingConfig.from_proto(tmp_path / "c.pb") == cfg
    assert EmbeddingConfig.from_proto(str(tmp_path / "c.pbtxt")) == cfg
    with pytest.raises(ConfigError, match="readable config file"):
        EmbeddingConfig.from_proto(tmp_path / "missing.pb")


def test_optimization_parameters_message_round_trip_all_algorithms():
    from meshembed.config import OPTIMIZER_CLASSES
    from meshembed.config.proto_io import optimizer_from_message, optimizer_to_message

    for name, cls in OPTIMIZER_CLASSES.items():
        spec = cls(DynamicLearningRate(0)) if name == "frequency_estimator" else cls(0.25)
        msg = optimizer_to_message(spec)
        assert msg.WhichOneof("parameters") == name
        assert optimizer_from_message(opt_pb2.OptimizationParameters.FromString(msg.SerializeToString())) == spec


# ---------------------------------------------------------------------------- property: round trip
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from meshembed.config import OPTIMIZER_CLASSES  # noqa: E402

_floats = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def _optimizers(draw):
    cls = draw(st.sampled_from(sorted(OPTIMIZER_CLASSES.values(), key=lambda c: c.algorithm)))
    lr = draw(st.one_of(st.floats(0.125, 1, width=32), st.builds(DynamicLearningRate, st.just(0))))
    kw = {"use_gradient_accumulation": draw(st.sampled_from([True, None]))}
    if draw(st.booleans()):
        kw["clip_weight_min"], kw["clip_weight_max"] = -5.0, draw(st.floats(0, 5, width=32))
    if draw(st.booleans()):
        kw["clipvalue"] = draw(st.floats(0.5, 5, width=32))
    if draw(st.booleans()) and cls.algorithm != "mdl_adagrad_light":
        kw["weight_decay_factor"] = draw(st.floats(0.125, 0.5, width=32))
    for proto_name, attr in cls._fields:
        if proto_name in cls._bool_fields:
            kw[attr] = draw(st.booleans())
        elif draw(st.booleans()):
            kw[attr] = draw(_floats)
    from meshembed.config.common import parsing_proto

    with parsing_proto():  # arbitrary values, as a proto may carry them
        return cls(lr, **kw)


@settings(max_examples=60, deadline=None)
@given(opts=st.lists(_optimizers(), min_size=1, max_size=3),
       shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=4),
       strategy=st.sampled_from(["div", "mod"]))
def test_random_configs_round_trip(opts, shapes, strategy):
    tables = [TableConfig(f"t{i}", 16, 2 + i, opt) for i, opt in enumerate(opts)]
    features = [FeatureConfig(f"t{i % len(tables)}", tuple(s), name=f"f{i}") for i, s in enumerate(shapes)]
    features += [FeatureConfig(t.name, (4,)) for t in tables[len(shapes):]]
    cfg = EmbeddingConfig(tables, features, sharding_strategy=strategy, num_hosts=2)
    data = cfg.to_proto()
    again = EmbeddingConfig.from_proto(data)
    assert again == cfg
    assert again.to_proto() == data
    assert EmbeddingConfig.from_proto(cfg.to_text()).to_proto() == data
