"""Invalid configs raise ConfigError naming the table or feature at fault and the fix."""

from __future__ import annotations

import pytest

from meshembed.config import (
    SGD,
    Adagrad,
    Adam,
    Assign,
    DynamicLearningRate,
    EmbeddingConfig,
    FeatureConfig,
    MDLAdagradLight,
    QuantizationConfig,
    TableConfig,
    UserDefinedProgram,
)
from meshembed.errors import ConfigError


def _t(name="user", vocab=100, dim=8, opt=None, **kw):
    return TableConfig(name, vocab, dim, Adagrad(0.1) if opt is None else opt, **kw)


def _f(table="user", shape=(32,), name="user_id", **kw):
    return FeatureConfig(table, shape, name=name, **kw)


def _python_cases():
    yield "vocabulary_size", "table 'user'", lambda: _t(vocab=0)
    yield "dimension", "table 'user'", lambda: _t(dim=-1)
    yield "combiner", "table 'user'", lambda: _t(combiner="max")
    yield "dtype", "table 'user'", lambda: _t(dtype="float64")
    yield "name", "table 'user'", lambda: EmbeddingConfig(tables=[_t(), _t()], features=[_f()])
    yield "config for table 'item'", "table 'item'", lambda: EmbeddingConfig(
        tables=[_t(), _t("item")], features=[_f()])
    yield "table", "feature 'orphan'", lambda: EmbeddingConfig(tables=[_t()], features=[_f(), _f("nope", name="orphan")])
    yield "optimizer", "table 'user'", lambda: EmbeddingConfig(
        tables=[TableConfig("user", 10, 2)], features=[_f()])
    yield "input_shape", "feature 'user_id'", lambda: _f(shape=())
    yield "input_shape", "feature 'user_id'", lambda: _f(shape=(32, 0))
    yield "max_sequence_length", "feature 'user_id'", lambda: _f(shape=(32, 5), max_sequence_length=4)
    yield "learning_rate", "table 'user'", lambda: EmbeddingConfig(
        tables=[_t(opt=SGD(DynamicLearningRate(1)))], features=[_f()])
    yield "num_features", "table 'user'", lambda: EmbeddingConfig(tables=[_t(num_features=3)], features=[_f()])
    yield "batch_size_per_tensor_core", "0 when features are given", lambda: EmbeddingConfig(
        tables=[_t()], features=[_f()], batch_size_per_tensor_core=7)
    yield "num_features", "table 'user'", lambda: EmbeddingConfig(tables=[_t()], batch_size_per_tensor_core=8)
    yield "mode", "TF rejects UNSPECIFIED", lambda: EmbeddingConfig(tables=[_t()], features=[_f()], mode="unspecified")
    yield "table", "feature 'user_id'", lambda: EmbeddingConfig(
        tables=[_t()], features=[FeatureConfig(_t(vocab=5), 4, name="user_id")])
    yield "quantization", "table 'user'", lambda: _t(
        opt=SGD(simulated_quantization=QuantizationConfig(4, 0, 1)), quantization=QuantizationConfig(8, 0, 1))
    # an enabled simulated quantization needs both bounds (spec §2.1: unset = ±inf -> NaN)
    yield "simulated_quantization", "table 'user'", lambda: _t(quantization=QuantizationConfig(8, -1.0, None))
    yield "simulated_quantization", "table 'user'", lambda: _t(
        opt=SGD(simulated_quantization=QuantizationConfig(8, None, 1.0)))
    yield "simulated_quantization", "table 'user'", lambda: _t(quantization=QuantizationConfig(8, None, None))
    yield "simulated_quantization", "table 'user'", lambda: _t(quantization=QuantizationConfig(8, 0.5, 0.5))
    yield "simulated_quantization", "table 'user'", lambda: _t(quantization=QuantizationConfig(8, float("-inf"), 1.0))
    yield "simulated_quantization", "table 'user'", lambda: EmbeddingConfig(
        tables=[TableConfig("user", 10, 2, quantization=QuantizationConfig(8, -1.0, None))], features=[_f()],
        optimizer=SGD(0.1))


CFG_HEAD = 'mode: TRAINING num_hosts: 1 num_tensor_cores: 1 '


def _table(name="t", vocab=10, opt="stochastic_gradient_descent {} learning_rate { constant: 0.1 }"):
    return f'table_descriptor {{ name: "{name}" vocabulary_size: {vocab} dimension: 4 optimization_parameters {{ {opt} }} }} '


def _feature(table_id=0, name="f", shape="input_shape: 8"):
    return f'feature_descriptor {{ name: "{name}" table_id: {table_id} {shape} }} '


def _proto_cases():
    yield "table_id", "feature 'f'", _table() + CFG_HEAD + _feature(table_id=3)
    yield "no optimization algorithm", "table 't'", _table(opt="learning_rate { constant: 0.1 }") + CFG_HEAD + _feature()
    yield "clipvalue", "table 't'", _table(opt="adagrad {} gradient_clipping_limits { upper { value: 1 } } "
                                           "gradient_accumulation_status: DISABLED") + CFG_HEAD + _feature()
    yield "lazy_adam", "table 't'", _table(opt="adam { use_non_lazy_adam: true } "
                                          "gradient_accumulation_status: DISABLED") + CFG_HEAD + _feature()
    yield "use_gradient_accumulation", "table 't'", _table(opt="assign {} gradient_accumulation_status: DISABLED") \
        + CFG_HEAD + _feature()
    yield "weight_decay_factor", "table 't'", _table(opt="mdl_adagrad_light {} weight_decay_factor: 0.1") \
        + CFG_HEAD + _feature()
    yield "vocabulary_size", "table 't'", _table(vocab=0) + CFG_HEAD + _feature()
    yield "vocabulary_size", "table 't'", _table(vocab=2) + "mode: TRAINING num_hosts: 4 num_tensor_cores: 4 " + _feature()
    yield "name", "table 't'", _table() + _table() + CFG_HEAD + _feature()
    yield "mode", "UNSPECIFIED", _table() + "num_hosts: 1 num_tensor_cores: 1 " + _feature()
    yield "input_shape", "feature 'f'", _table() + CFG_HEAD + _feature(shape="")
    yield "input_shape", "feature 'f'", _table() + CFG_HEAD + _feature(shape="input_shape: 8 input_shape: -1")
    yield "learning_rate", "table 'b'", (
        _table("a", opt="adagrad {} learning_rate { dynamic {} }")
        + _table("b", opt="adagrad {} learning_rate { dynamic { tag: 2 } }")
        + CFG_HEAD + _feature(0) + _feature(1, name="g"))
    yield "num_features", "table 't'", _table() + "batch_size_per_tensor_core: 8 " + CFG_HEAD
    yield "num_features", "table 't'", _table().replace("dimension: 4", "dimension: 4 num_features: 2") \
        + CFG_HEAD + _feature()
    yield "num_hosts", "EmbeddingConfig", _table() + "mode: TRAINING num_tensor_cores: 1 " + _feature()
    for quant in _BAD_QUANTIZATION:
        yield "simulated_quantization", "table 't'", _table(opt=_SGD + quant) + CFG_HEAD + _feature()
    yield "lower", "table 't'", _table(opt=_SGD + _quant(8, "lower { value: 2 } upper { value: 1 }")) \
        + CFG_HEAD + _feature()


_SGD = "stochastic_gradient_descent {} learning_rate { constant: 0.1 } "


def _quant(buckets, limits=None, enabled="true"):
    clip = "" if limits is None else f"clipping_limits {{ {limits} }}"
    return f"simulated_quantization {{ enabled: {enabled} num_buckets: {buckets} {clip} }} "


_BOTH = "lower { value: -1 } upper { value: 1 }"
_BAD_QUANTIZATION = (
    _quant(8, "lower { value: -1 }"),
    _quant(8, "upper { value: 1 }"),
    _quant(8, ""),
    _quant(8),
    _quant(8, "lower { value: 1 } upper { value: 1 }"),
    _quant(1, _BOTH),
    _quant(0, _BOTH),
)


PY = list(_python_cases())
PROTO = list(_proto_cases())


@pytest.mark.parametrize("arg, where, build", PY, ids=[f"py-{i}-{c[0].split()[0]}" for i, c in enumerate(PY)])
def test_python_config_errors(arg, where, build):
    with pytest.raises(ConfigError) as info:
        build()
    msg = str(info.value)
    assert arg in msg and where in msg, msg
    assert "Expected" in msg and "Received" in msg, msg


@pytest.mark.parametrize("arg, where, text", PROTO, ids=[f"proto-{i}-{c[0].split()[0]}" for i, c in enumerate(PROTO)])
def test_proto_config_errors(arg, where, text):
    with pytest.raises(ConfigError) as info:
        EmbeddingConfig.from_proto(text)
    msg = str(info.value)
    assert arg in msg and where in msg, msg
    assert "Expected" in msg and "Received" in msg, msg


def test_there_are_enough_cases():
    assert len(PY) + len(PROTO) >= 15


def test_keras_voice_exact():
    with pytest.raises(ConfigError) as info:
        TableConfig("user", 0, 8, SGD())
    assert str(info.value) == ("Invalid `vocabulary_size` for table 'user'. Expected an integer > 0. "
                               "Received: vocabulary_size=0")


def test_malformed_bytes_name_the_fix():
    with pytest.raises(ConfigError, match=r"not a serialized TPUEmbeddingConfiguration.*\.pbtxt"):
        EmbeddingConfig.from_proto(b"\xff\xff\xff\xff")
    with pytest.raises(ConfigError, match="not a text-format TPUEmbeddingConfiguration"):
        EmbeddingConfig.from_proto("this is { not a config")


@pytest.mark.parametrize("build, arg", [
    (lambda: Adam(beta_1=1.0), "beta_1"),
    (lambda: Adam(epsilon=0.0), "epsilon"),
    (lambda: Adam(lazy_adam=False, use_gradient_accumulation=False), "lazy_adam"),
    (lambda: Adagrad(initial_accumulator_value=0.0), "initial_accumulator_value"),
    (lambda: SGD(clipvalue=1.0, use_gradient_accumulation=False), "clipvalue"),
    (lambda: SGD(clipvalue=(2.0, 1.0)), "clipvalue"),
    (lambda: SGD(clip_weight_min=2.0, clip_weight_max=1.0), "clip_weight_min"),
    (lambda: Assign(use_gradient_accumulation=False), "use_gradient_accumulation"),
    (lambda: MDLAdagradLight(weight_decay_factor=0.1), "weight_decay_factor"),
    (lambda: UserDefinedProgram(program=b"", num_slots=7), "use_gradient_accumulation"),
    (lambda: SGD(learning_rate="fast"), "learning_rate"),
    (lambda: SGD(hot_id_replication="sometimes"), "hot_id_replication"),
    (lambda: QuantizationConfig(1, 0.0, 1.0), "num_buckets"),
    (lambda: DynamicLearningRate(-1), "tag"),
])
def test_optimizer_argument_errors(build, arg):
    with pytest.raises(ConfigError, match=f"Invalid `{arg}`"):
        build()


def test_quantization_bounds_are_checked_only_when_enabled():
    """Disabled quantization does not run, so a config that only records it may leave
    sides unset; an enabled one with both sides loads and round-trips."""
    for quant in _BAD_QUANTIZATION[:-2] + (_quant(0, _BOTH, enabled="false"),):
        text = _table(opt=_SGD + quant.replace("enabled: true", "enabled: false")) + CFG_HEAD + _feature()
        cfg = EmbeddingConfig.from_proto(text)
        assert cfg.tables[0].quantization.enabled is False
        assert EmbeddingConfig.from_proto(cfg.to_proto()) == cfg
    cfg = EmbeddingConfig.from_proto(_table(opt=_SGD + _quant(8, _BOTH)) + CFG_HEAD + _feature())
    assert cfg.tables[0].quantization == QuantizationConfig(8, -1.0, 1.0)
    assert _t(quantization=QuantizationConfig(8, -1.0, None, enabled=False)).quantization.upper is None


def test_seven_aux_slots_fit_without_accumulation():
    udp = UserDefinedProgram(program=b"", num_slots=7, use_gradient_accumulation=False)
    assert len(udp.slot_names) == 7


def test_proto_values_tf2_would_reject_still_load():
    """TF's runtime takes any proto value; only TF2's Python layer checks ranges."""
    text = _table(opt="adam {} learning_rate { dynamic {} }") + CFG_HEAD + _feature()
    cfg = EmbeddingConfig.from_proto(text)
    assert cfg.tables[0].optimizer.epsilon == 0.0
    assert cfg.tables[0].optimizer.lazy_adam is True
