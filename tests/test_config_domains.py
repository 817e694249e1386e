"""Hyper-parameter domains of the optimizer specs, and the config-level range errors.

The expected ranges are written out here, apart from the code's own tables, so a wrong range
in optimizers.py fails a row. Python-built specs are checked at construction; specs read from
a proto parse (TF's runtime takes any value) and are refused when an engine is built.
"""

from __future__ import annotations

import ast
import math
import pathlib

import numpy as np
import pytest

import meshembed as me
from meshembed.config import (
    FTRL,
    OPTIMIZER_CLASSES,
    SGD,
    Adadelta,
    Adagrad,
    AdagradMomentum,
    Adam,
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
    ProximalAdagrad,
    ProximalYogi,
    RMSProp,
    SpmdSharding,
    TableConfig,
)
from meshembed.config.common import parsing_proto
from meshembed.config.proto_io import optimizer_from_message, optimizer_to_message
from meshembed.errors import ConfigError

INF = math.inf


def up(x: float) -> float:
    """The next float32 above x (the proto stores float32, so this is "just outside")."""
    return float(str(np.nextafter(np.float32(x), np.float32(INF))))  # shortest decimal, as specs store it


def down(x: float) -> float:
    return float(str(np.nextafter(np.float32(x), np.float32(-INF))))


# (class, attribute, just inside, just outside, words the message must carry, tf2_only)
# tf2_only rows are TF2-Python strictness (e.g. Adam epsilon > 0): a proto may carry them.
UNIT = "[0, 1]"
HALF_OPEN = "[0, 1)"
NONNEG = ">= 0"
POS = "> 0"
ROWS = [
    (Adadelta, "rho", 1.0, up(1.0), UNIT, False),
    (Adadelta, "rho", 0.0, down(0.0), UNIT, False),
    (Adadelta, "epsilon", 0.0, down(0.0), NONNEG, False),
    (Adadelta, "epsilon", 1e30, INF, NONNEG, False),
    (Adadelta, "initial_accumulator", 0.0, down(0.0), NONNEG, False),
    (Adadelta, "initial_update", 0.0, down(0.0), NONNEG, False),
    (Adam, "beta_1", down(1.0), 1.0, HALF_OPEN, False),
    (Adam, "beta_1", 0.0, down(0.0), HALF_OPEN, False),
    (Adam, "beta_2", down(1.0), 1.0, HALF_OPEN, False),
    (Adam, "beta_2", 0.0, down(0.0), HALF_OPEN, False),
    (Adam, "epsilon", 1e30, INF, NONNEG, False),
    (Adam, "epsilon", up(0.0), 0.0, POS, True),
    (FTRL, "learning_rate_power", 0.0, up(0.0), "<= 0", False),
    (FTRL, "l1_regularization_strength", 0.0, down(0.0), NONNEG, False),
    (FTRL, "l2_regularization_strength", 0.0, down(0.0), NONNEG, False),
    (FTRL, "beta", 0.0, down(0.0), NONNEG, False),
    (FTRL, "initial_accumulator_value", up(0.0), 0.0, POS, True),
    (FTRL, "initial_accumulator_value", 1.0, down(0.0), NONNEG, False),
    (FTRL, "initial_linear_value", -5.0, -INF, "finite", False),
    (Adagrad, "initial_accumulator_value", up(0.0), 0.0, POS, True),
    (Adagrad, "initial_accumulator_value", 1.0, down(0.0), NONNEG, False),
    (AdagradMomentum, "momentum", 1.0, up(1.0), UNIT, False),
    (AdagradMomentum, "momentum", 0.0, down(0.0), UNIT, False),
    (AdagradMomentum, "beta2", 1.0, up(1.0), UNIT, False),
    (AdagradMomentum, "beta2", 0.0, down(0.0), UNIT, False),
    (AdagradMomentum, "exponent", up(0.0), 0.0, POS, False),
    (AdagradMomentum, "epsilon", up(0.0), 0.0, POS, True),
    (AdagradMomentum, "epsilon", 1.0, down(0.0), NONNEG, False),
    (BoundedAdagrad, "max_var_update", 0.0, down(0.0), NONNEG, False),
    (BoundedAdagrad, "max_accumulator", 0.0, down(0.0), NONNEG, False),
    (BoundedAdagrad, "initial_accumulator_value", 0.0, down(0.0), NONNEG, False),
    (FrequencyAwareAdagrad, "l1_regularization_strength", 0.0, down(0.0), NONNEG, False),
    (FrequencyAwareAdagrad, "l2_regularization_strength", 0.0, down(0.0), NONNEG, False),
    (FrequencyAwareAdagrad, "max_lr_multiplier", 0.0, down(0.0), NONNEG, False),
    (FrequencyAwareAdagrad, "accumulator_decay", 1.0, up(1.0), UNIT, False),
    (FrequencyAwareAdagrad, "accumulator_decay", 0.0, down(0.0), UNIT, False),
    (FrequencyAwareAdagrad, "initial_accumulator_value", 0.0, down(0.0), NONNEG, False),
    (FrequencyAwareAdagrad, "probability_exponent", -3.0, INF, "finite", False),
    (Momentum, "momentum", 1.0, up(1.0), UNIT, False),
    (Momentum, "momentum", 0.0, down(0.0), UNIT, False),
    (Lion, "beta1", 1.0, up(1.0), UNIT, False),
    (Lion, "beta1", 0.0, down(0.0), UNIT, False),
    (Lion, "beta2", 1.0, up(1.0), UNIT, False),
    (Lion, "beta2", 0.0, down(0.0), UNIT, False),
    (RMSProp, "rho", 1.0, up(1.0), UNIT, False),
    (RMSProp, "rho", 0.0, down(0.0), UNIT, False),
    (RMSProp, "momentum", 1.0, up(1.0), UNIT, False),
    (RMSProp, "epsilon", 0.0, down(0.0), NONNEG, False),
    (CenteredRMSProp, "rho", 1.0, up(1.0), UNIT, False),
    (CenteredRMSProp, "momentum", 0.0, down(0.0), UNIT, False),
    (CenteredRMSProp, "epsilon", 0.0, down(0.0), NONNEG, False),
    (MDLAdagradLight, "l2", 0.0, down(0.0), NONNEG, False),
    (MDLAdagradLight, "initial_accumulator", 0.0, down(0.0), NONNEG, False),
    (MDLAdagradLight, "lr_power", -0.5, INF, "finite", False),
    (ProximalAdagrad, "l1", 0.0, down(0.0), NONNEG, False),
    (ProximalAdagrad, "l2", 0.0, down(0.0), NONNEG, False),
    (ProximalAdagrad, "initial_accumulator_value", up(0.0), 0.0, POS, True),
    (OnlineYogi, "l1", 0.0, down(0.0), NONNEG, False),
    (OnlineYogi, "l2", 0.0, down(0.0), NONNEG, False),
    (OnlineYogi, "beta2", down(1.0), 1.0, HALF_OPEN, False),
    (OnlineYogi, "initial_accumulator_value", 0.0, down(0.0), NONNEG, False),
    (ProximalYogi, "l1", 0.0, down(0.0), NONNEG, False),
    (ProximalYogi, "l2", 0.0, down(0.0), NONNEG, False),
    (ProximalYogi, "beta1", down(1.0), 1.0, HALF_OPEN, False),
    (ProximalYogi, "beta2", 0.0, down(0.0), HALF_OPEN, False),
    (ProximalYogi, "epsilon", up(0.0), 0.0, POS, True),
    (ProximalYogi, "initial_accumulator_value", 0.0, down(0.0), NONNEG, False),
    (FrequencyEstimator, "tau", 1.0, up(1.0), UNIT, False),
    (FrequencyEstimator, "tau", 0.0, down(0.0), UNIT, False),
    (FrequencyEstimator, "max_delta", 0.0, down(0.0), NONNEG, False),
    (FrequencyEstimator, "outlier_threshold", 0.0, down(0.0), NONNEG, False),
    (FrequencyEstimator, "weight_exponent", 2.0, -INF, "finite", False),
]
_ids = [f"{c.__name__}.{f}={o}" for c, f, _i, o, _w, _t in ROWS]


@pytest.mark.parametrize(("cls", "field", "inside", "outside", "words", "tf2_only"), ROWS, ids=_ids)
def test_python_spec_inside_passes_outside_is_refused(cls, field, inside, outside, words, tf2_only):
    spec = cls(0.1, **{field: inside})
    assert getattr(spec, field) == inside
    with pytest.raises(ConfigError) as err:
        cls(0.1, **{field: outside})
    msg = str(err.value)
    assert f"Invalid `{field}` for {cls.__name__} optimizer" in msg
    assert words in msg and f"Received: {field}=" in msg


@pytest.mark.parametrize(("cls", "field", "inside", "outside", "words", "tf2_only"), ROWS, ids=_ids)
def test_parsed_spec_is_checked_when_the_engine_asks(cls, field, inside, outside, words, tf2_only):
    """A proto value is never refused while parsing; check_domain (the engine's call) refuses
    the out-of-domain ones and names the table. TF2-only strictness is no domain error."""
    with parsing_proto():
        spec = cls(0.1, **{field: outside})
    if any(attr == field for _p, attr in cls._fields):  # a proto field: it survives the wire
        again = optimizer_from_message(optimizer_to_message(spec))
        assert getattr(again, field) == outside
    if tf2_only:
        spec.check_domain(table="user")
        return
    with pytest.raises(ConfigError) as err:
        spec.check_domain(table="user")
    msg = str(err.value)
    assert f"Invalid `{field}`" in msg and "table 'user'" in msg and words in msg


def test_the_table_above_covers_every_bounded_field():
    """Every range the code declares is pinned by a row here (a new one needs a row)."""
    pinned = {(c, f) for c, f, *_ in ROWS}
    for cls in OPTIMIZER_CLASSES.values():
        spec = cls(DynamicLearningRate(0))
        for attr, domain in spec.domain_fields().items():
            bounded = math.isfinite(domain.lo) or math.isfinite(domain.hi)
            if bounded:
                assert (cls, attr) in pinned, f"{cls.__name__}.{attr} has a range but no row"


@pytest.mark.parametrize("cls", sorted(OPTIMIZER_CLASSES.values(), key=lambda c: c.algorithm),
                         ids=lambda c: c.__name__)
def test_every_float_hyperparameter_is_finite(cls):
    spec = cls(DynamicLearningRate(0))
    for attr in spec.domain_fields():
        for bad in (INF, -INF, 1e39):
            with pytest.raises(ConfigError, match=f"`{attr}`"):
                cls(DynamicLearningRate(0), **{attr: bad})
        with pytest.raises(ConfigError, match=f"`{attr}`.*not NaN"):
            cls(DynamicLearningRate(0), **{attr: math.nan})


@pytest.mark.parametrize("cls", sorted(OPTIMIZER_CLASSES.values(), key=lambda c: c.algorithm),
                         ids=lambda c: c.__name__)
def test_shared_options_have_domains_on_every_optimizer(cls):
    for lr in (1e39, INF, -INF):
        with pytest.raises(ConfigError, match="`learning_rate`"):
            cls(lr)
    assert cls(3.0e38).learning_rate == pytest.approx(3.0e38, rel=1e-6)
    if cls.supports_weight_decay:
        assert cls(0.1, weight_decay_factor=0.0).weight_decay_factor == 0.0
        with pytest.raises(ConfigError, match="`weight_decay_factor`.*>= 0"):
            cls(0.1, weight_decay_factor=down(0.0))
    with pytest.raises(ConfigError, match="`clip_weight_min`"):
        cls(0.1, clip_weight_min=up(1.0), clip_weight_max=1.0)
    assert cls(0.1, clip_weight_min=1.0, clip_weight_max=1.0).clipping_limits() == (1.0, 1.0)
    with pytest.raises(ConfigError, match="`clipvalue`"):
        cls(0.1, clipvalue=(up(1.0), 1.0))


def test_float32_overflow_in_a_table_optimizer_names_the_value():
    with pytest.raises(ConfigError, match=r"`learning_rate`.*float32.*Received: learning_rate=1e\+39"):
        TableConfig("user", 10, 4, SGD(1e39))
    from meshembed.math.custom import CustomOptimizer

    opt = CustomOptimizer(lambda xp, p, g, lr: (p - lr * g,), learning_rate=1e39)
    with pytest.raises(ConfigError, match="`learning_rate` for table 'user'"):
        TableConfig("user", 10, 4, opt)


def _config(**opt):
    return EmbeddingConfig([TableConfig("user", 8, 2, Adadelta(0.1, **opt))], [FeatureConfig("user", (4,), name="u")])


def test_proto_with_rho_7_parses_and_the_engine_refuses_it():
    with parsing_proto():
        data = _config(rho=7.0).to_proto()
    cfg = EmbeddingConfig.from_proto(data)  # a config TF's runtime would take still loads
    assert cfg.tables[0].optimizer.rho == 7.0 and cfg.to_proto() == data
    with pytest.raises(ConfigError, match=r"`rho` for Adadelta optimizer of table 'user'.*\[0, 1\].*rho=7"):
        cfg.check_domains()
    with pytest.raises(ConfigError, match=r"`rho`.*table 'user'"):
        me.TPUEmbedding(cfg, backend="numpy")
    with pytest.raises(ConfigError, match=r"`rho`.*table 'user'"):
        me.ops.configure_tpu_embedding(data, backend="numpy")


def test_engine_takes_proto_values_only_tf2_python_refuses():
    """`adam {}` (epsilon 0, the proto's zero default) is what TF's runtime accepts: it builds."""
    with parsing_proto():
        data = EmbeddingConfig([TableConfig("t", 8, 2, Adam(0.1, epsilon=0.0))],
                               [FeatureConfig("t", (4,), name="f")]).to_proto()
    cfg = EmbeddingConfig.from_proto(data)
    cfg.check_domains()
    emb = me.TPUEmbedding(cfg, backend="numpy")
    assert emb.retrieve_parameters("t")["parameters"].shape == (8, 2)


def test_duplicate_feature_names_are_refused():
    t = TableConfig("user", 8, 2, SGD(0.1))
    with pytest.raises(ConfigError, match=r"`name` for feature 'x'.*unique feature name.*Received: name='x'"):
        EmbeddingConfig([t], [FeatureConfig("user", (4,), name="x"), FeatureConfig("user", (2,), name="x")])
    ok = EmbeddingConfig([t], [FeatureConfig("user", (4,), name="x"), FeatureConfig("user", (2,))])
    msg = ok.to_message()
    msg.feature_descriptor[1].name = "x"
    with pytest.raises(ConfigError, match="unique feature name"):
        EmbeddingConfig.from_proto(msg.SerializeToString())


def test_non_utf8_pbtxt_is_a_config_error(tmp_path):
    path = tmp_path / "bad.pbtxt"
    path.write_bytes(b'table_descriptor { name: "\xff\xfe" }\n')
    with pytest.raises(ConfigError, match=r"bad\.pbtxt.*not UTF-8.*byte \d+"):
        EmbeddingConfig.from_proto(path)


@pytest.mark.parametrize(("build", "arg"), [
    (lambda: TableConfig("t", 2**70, 2), "vocabulary_size"),
    (lambda: TableConfig("t", 2**63, 2), "vocabulary_size"),
    (lambda: TableConfig("t", 8, 2**31), "dimension"),
    (lambda: TableConfig("t", 8, 2, num_features=2**31), "num_features"),
    (lambda: FeatureConfig("t", (2**31,)), "input_shape"),
    (lambda: FeatureConfig("t", (4,), max_sequence_length=2**31), "max_sequence_length"),
    (lambda: EmbeddingConfig([TableConfig("t", 8, 2, SGD())], [FeatureConfig("t", (4,))], num_hosts=2**31),
     "num_hosts"),
    (lambda: EmbeddingConfig([TableConfig("t", 8, 2, SGD())], [FeatureConfig("t", (4,))],
                             num_tensor_cores=2**31), "num_tensor_cores"),
    (lambda: SpmdSharding(True, 2**31), "num_cores_per_replica"),
    (lambda: DynamicLearningRate(2**31), "tag"),
])
def test_out_of_range_integers_fail_at_construction(build, arg):
    with pytest.raises(ConfigError, match=f"`{arg}`.*(<= |, 2147483647])"):
        build()


def test_largest_int64_vocabulary_serializes():
    cfg = EmbeddingConfig([TableConfig("t", 2**63 - 1, 2, SGD())], [FeatureConfig("t", (4,))])
    assert EmbeddingConfig.from_proto(cfg.to_proto()).tables[0].vocabulary_size == 2**63 - 1


def test_slot_initial_values_after_the_family_refactor():
    assert Adagrad(0.1, initial_accumulator_value=0.5).slot_initial_values() == (0.5,)
    assert BoundedAdagrad(0.1, initial_accumulator_value=0.25).slot_initial_values() == (0.25,)
    assert ProximalAdagrad(0.1).slot_initial_values() == (0.1,)
    assert FrequencyAwareAdagrad(0.1, initial_accumulator_value=0.5).slot_initial_values() == (0.5, 0.0)
    assert FTRL(0.1, initial_linear_value=0.25).slot_initial_values() == (0.1, 0.25)
    assert OnlineYogi().slot_initial_values() == (1e-6, 0.0)
    assert ProximalYogi().slot_initial_values() == (1e-6, 0.0)
    assert Adadelta(initial_accumulator=0.5, initial_update=0.25).slot_initial_values() == (0.5, 0.25)
    assert MDLAdagradLight(initial_weight=-1.0).slot_initial_values() == (0.0, -1.0, 0.0)
    assert Adam().slot_initial_values() == (0.0, 0.0) and SGD().slot_initial_values() == ()
    assert Adagrad(0.1, initial_accumulator_value=np.float64(0.5)).initial_accumulator_value == 0.5


CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "src" / "meshembed" / "config"


@pytest.mark.parametrize("module", ["validation.py", "proto_io.py", "tables.py", "optimizers.py", "common.py"])
def test_config_modules_below_embedding_do_not_import_it(module):
    """The former circle embedding.py <-> proto_io.py <-> validation.py stays broken."""
    tree = ast.parse((CONFIG_DIR / module).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert "meshembed.config.embedding" not in imported
