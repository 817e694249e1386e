"""Issue #31 items 1, 14-16 and issue #35 items 10, 12, 13 (the config, me.tpu and CLI parts):
each a meshembed error naming the argument with state unchanged, or the behaviour a user of
the anchor library expects."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

import meshembed as me
from meshembed.config import (
    SGD,
    Adagrad,
    DynamicLearningRate,
    EmbeddingConfig,
    FeatureConfig,
    FrequencyAwareAdagrad,
    MDLAdagradLight,
    TableConfig,
)

E = me.tpu


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshembed.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


# -- #31.1: a huge dynamic learning-rate tag ------------------------------------------------
@pytest.mark.parametrize("tag", [2**31 - 1, 2**16])
def test_a_huge_dynamic_tag_is_a_config_error_at_once(tag):
    with pytest.raises(me.ConfigError, match=r"Invalid `tag`.*Received: tag=" + str(tag)):
        DynamicLearningRate(tag)
    with pytest.raises(me.ConfigError, match="`tag`"):  # as a step counter, and read from a proto
        FrequencyAwareAdagrad(0.1, step_counter=DynamicLearningRate(tag))
    msg = me.tpu.TPUEmbeddingConfiguration()
    t = msg.table_descriptor.add(name="t", vocabulary_size=8, dimension=2)
    t.optimization_parameters.learning_rate.dynamic.tag = tag
    t.optimization_parameters.stochastic_gradient_descent.SetInParent()
    msg.feature_descriptor.add(name="f", table_id=0, input_shape=[4])
    msg.mode = msg.TRAINING
    with pytest.raises(me.ConfigError, match="`tag`"):
        EmbeddingConfig.from_proto(msg.SerializeToString())


def test_a_tag_gap_is_reported_without_a_range_up_to_the_largest_tag():
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(me.ConfigError, match=r"tag 1 is unused.*learning_rate=DynamicLearningRate\(tag=65535\)"):
        EmbeddingConfig(tables=[TableConfig("a", 8, 2, SGD(DynamicLearningRate(0))),
                                TableConfig("b", 8, 2, SGD(DynamicLearningRate(65535)))],
                        features=[FeatureConfig("a", (4,)), FeatureConfig("b", (4,))])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - start < 1.0 and peak < 1 << 20


# -- #31.14: me.tpu arguments ---------------------------------------------------------------
def _tpu(optimizer=None, name="t"):
    table = E.TableConfig(10, 4, name=name, optimizer=optimizer)
    return E.TPUEmbedding({"a": E.FeatureConfig(table)}, E.SGD(0.1)), table


@pytest.mark.parametrize("training", ["False", "True", 0.0, None])
def test_tpu_enqueue_refuses_a_training_flag_that_is_not_a_bool(training):
    emb, table = _tpu()
    with pytest.raises(me.InputError, match=r"Invalid `training`\. Expected a bool.*Received: training="):
        emb.enqueue({"a": np.arange(4)}, training=training)
    assert not emb.built  # nothing built, nothing queued
    emb.enqueue({"a": np.arange(4)}, training=np.bool_(False))  # a NumPy bool is a bool
    emb.dequeue()


def test_tpu_enqueue_refuses_a_string_training_flag_on_a_built_object_with_nothing_queued():
    emb, table = _tpu()
    emb.build(4)
    before = emb.embedding_tables[table].copy()
    with pytest.raises(me.InputError, match="`training`"):
        emb.enqueue({"a": np.arange(4)}, training="False")
    with pytest.raises(me.StateError):  # nothing was queued
        emb.apply_gradients({"a": np.ones((4, 4), np.float32)})
    np.testing.assert_array_equal(emb.embedding_tables[table], before)


def test_tpu_feature_config_keys_that_collide_are_config_errors():
    f = E.FeatureConfig(E.TableConfig(10, 4, name="t"))
    g = E.FeatureConfig(E.TableConfig(10, 4, name="u"))
    with pytest.raises(me.ConfigError, match=r"Invalid `feature_config`.*sort.*keys \[1, '1'\]"):
        E.TPUEmbedding({1: f, "1": f}, E.SGD(0.1))
    with pytest.raises(me.ConfigError, match=r"Invalid `feature_config` at path 'a/b'.*one feature per path"):
        E.TPUEmbedding({"a/b": f, "a": {"b": g}}, E.SGD(0.1))
    with pytest.raises(me.ConfigError, match="feature_config"):
        E.TPUEmbeddingForServing({1: f, "1": g})


@pytest.mark.parametrize("bad, words", [
    (np.full((10, 4), "x"), r"Expected real numbers.*dtype=<U1"),
    (np.full((10, 4), True), r"Expected real numbers.*dtype=bool"),
    (np.full((10, 4), 1 + 2j), r"Expected real numbers.*dtype=complex"),
    (np.where(np.eye(10, 4) > 0, np.nan, 0.0), r"Expected finite.*NaN/Inf.*row 0"),
    (np.full((10, 4), 1e39), r"Expected finite"),  # past float32: inf
])
def test_serving_refuses_string_and_nonfinite_tables_and_changes_nothing(bad, words):
    table = E.TableConfig(10, 4, name="t")
    fc = {"a": E.FeatureConfig(table)}
    serving = E.TPUEmbeddingForServing(fc, E.SGD(0.1))
    before = serving.embedding_tables[table].copy()
    with pytest.raises(me.InputError, match=r"table 't'.*" + words):
        serving.load_from({"t": bad})
    np.testing.assert_array_equal(serving.embedding_tables[table], before)
    with pytest.raises(me.InputError, match="table 't'"):
        E.serving_embedding_lookup({"a": np.arange(3)}, None, {table: bad}, fc)


def test_serving_lookup_refuses_nan_rows_it_looks_up_sparse_and_dense():
    table = E.TableConfig(10, 4, name="t")
    fc = {"a": E.FeatureConfig(table), "b": E.FeatureConfig(table)}
    values = np.ones((10, 4), np.float32)
    values[7] = np.nan
    ok = E.serving_embedding_lookup({"a": np.arange(3)}, None, {table: values}, fc)
    assert np.isfinite(ok["a"]).all()  # row 7 is not looked up: only the rows read are checked
    with pytest.raises(me.InputError, match=r"table 't'.*row\(s\) \[7\]"):
        E.serving_embedding_lookup({"a": np.array([1, 7])}, None, {table: values}, fc)
    with pytest.raises(me.InputError, match=r"row\(s\) \[7\]"):
        E.serving_embedding_lookup({"b": me.RaggedIds.from_lists([[1, 7], [2]])}, None, {table: values}, fc)


# -- #31.15: optimizers that cannot train, table dtypes -------------------------------------
def _engine_config(opt):
    return EmbeddingConfig(tables=[TableConfig("t", 10, 4, opt)], features=[FeatureConfig("t", (4,), name="f")])


def test_frequency_aware_adagrad_without_step_counter_is_refused_when_the_engine_is_built():
    cfg = _engine_config(FrequencyAwareAdagrad(0.1))  # the spec is data: it builds and round-trips
    assert EmbeddingConfig.from_proto(cfg.to_proto()) == cfg
    words = r"Invalid `step_counter` for FrequencyAwareAdagrad optimizer of table 't'.*Fix:.*step_counter=None"
    with pytest.raises(me.ConfigError, match=words):
        me.TPUEmbedding(cfg, backend="numpy")  # at construction, not an AttributeError at the step
    with pytest.raises(me.ConfigError, match=words):
        E.TPUEmbedding({"a": E.FeatureConfig(E.TableConfig(10, 4, name="t"))}, E.FrequencyAwareAdagrad(0.1))
    ok = _engine_config(FrequencyAwareAdagrad(0.1, step_counter=lambda: 3.0))
    emb = me.TPUEmbedding(ok, backend="numpy")
    emb.enqueue([np.arange(4)])
    emb.dequeue()
    emb.apply_gradients([np.ones((4, 4), np.float32)])


def test_mdl_adagrad_light_round_trips_and_me_tpu_refuses_to_train_it_at_construction():
    cfg = _engine_config(MDLAdagradLight(0.1, l2=0.5))
    assert EmbeddingConfig.from_proto(cfg.to_proto()) == cfg  # TF configs carry it
    table = E.TableConfig(10, 4, name="t", optimizer=E.MDLAdagradLight(0.1))
    with pytest.raises(me.ConfigError, match=r"Invalid `optimizer` for table 't'.*MDLAdagradLight has no public "
                                             r"update formula.*Fix:"):
        E.TPUEmbedding({"a": E.FeatureConfig(table)})
    serving = E.TPUEmbeddingForServing({"a": E.FeatureConfig(table)})  # serving never updates
    assert serving({"a": np.arange(3)})["a"].shape == (3, 4)


@pytest.mark.parametrize("dtype", ["int32", np.int32, "float64", "bfloat16"])
def test_table_dtype_other_than_float32_is_refused(dtype):
    with pytest.raises(me.ConfigError, match=r"Invalid `dtype` for table 't'.*'float32'.*Received: dtype="):
        TableConfig("t", 10, 4, dtype=dtype)
    with pytest.raises(me.ConfigError, match=r"Invalid `dtype` for TableConfig.*float32.*Received: dtype="):
        E.TableConfig(10, 4, dtype=dtype)
    assert TableConfig("t", 10, 4, dtype=np.float32).dtype == "float32"
    assert E.TableConfig(10, 4, dtype=np.dtype("float32")).dtype == "float32"


# -- #31.16: meshembed conformance --backends -----------------------------------------------
def test_conformance_with_an_unknown_backend_exits_nonzero_naming_the_available_ones():
    proc = _cli("conformance", "--backends", "numpyy,numpy")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "numpyy: unknown backend" in proc.stderr and "Backends available here: numpy" in proc.stderr
    assert "Traceback" not in proc.stderr and "| test group" not in proc.stdout
    proc = _cli("conformance", "--backends", "torch-ranks")  # known, but only inside a rank group
    assert proc.returncode == 2 and "torch-ranks: Backend 'torch-ranks' is unavailable here" in proc.stderr


def test_every_skip_in_the_conformance_report_carries_its_reason(tmp_path):
    out = tmp_path / "r.json"
    proc = _cli("conformance", "--backends", "numpy", "-k", "user_defined_program_with_wrong_arity",
                "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cell = json.loads(out.read_text())["rows"]["test_user_defined_program_with_wrong_arity_is_a_config_error"]["numpy"]
    assert cell["outcome"] == "skipped" and "jax backend runs HLO" in cell["message"]
    assert "| skip [1] |" in proc.stdout and "\n[1] only the jax backend runs HLO" in proc.stdout


def test_report_numbers_each_distinct_skip_and_xfail_reason():
    from meshembed.conformance_report import Cell, Report

    report = Report(backends=["a", "b"], rows={
        "t1": {"a": Cell("skipped", message="no GPU"), "b": Cell("xfailed", message="known gap")},
        "t2": {"a": Cell("skipped", message="no GPU"), "b": Cell("passed")}})
    text = report.markdown()
    assert "| t1 | skip [1] | xfail [2] |" in text and "| t2 | skip [1] | pass |" in text
    assert "[1] no GPU\n[2] known gap" in text


# -- #35.10 / #35.12: callable and schedule learning rates, serving, IndexedSlices ------------
def _train(emb, steps, ids=np.array([1, 1, 2, 3])):
    for _ in range(steps):
        emb.enqueue({"a": ids})
        emb.dequeue()
        emb.apply_gradients({"a": np.ones((4, 4), np.float32)})


def test_tpu_checkpoint_with_a_callable_learning_rate_restores_through_me_tpu(tmp_path):
    table = E.TableConfig(10, 4, name="t", optimizer=E.Adagrad(lambda: 0.1))
    fc = {"a": E.FeatureConfig(table)}
    emb = E.TPUEmbedding(fc)
    _train(emb, 2)
    path = emb.save(tmp_path / "ck")
    again = E.TPUEmbedding(fc)
    again.build(4)
    again.restore(path)  # nothing to pass: the callable is this object's own
    assert again.engine.step == 2
    for key in ("parameters", "accumulators"):
        np.testing.assert_array_equal(again.variables[table][key], emb.variables[table][key])
    _train(again, 1)
    _train(emb, 1)
    np.testing.assert_array_equal(again.embedding_tables[table], emb.embedding_tables[table])
    serving = E.TPUEmbeddingForServing(fc)
    serving.load_from(path)
    saved = me.TPUEmbedding.restore(path, backend="numpy", learning_rates=[lambda: 0.1])  # as its error says
    np.testing.assert_array_equal(serving.embedding_tables[table], saved.embedding_tables["t"])


class _Halving:
    """A learning-rate schedule in Keras' shape: called with the step."""

    def __call__(self, step):
        return 0.5 ** step


def test_a_schedule_as_a_tpu_learning_rate_is_called_with_the_step_and_resumes_after_restore(tmp_path):
    table = E.TableConfig(10, 4, name="t", optimizer=E.SGD(_Halving()), initializer=lambda shape: np.zeros(shape))
    fc = {"a": E.FeatureConfig(table)}
    emb = E.TPUEmbedding(fc)
    _train(emb, 2, ids=np.array([1, 2, 3, 4]))
    np.testing.assert_allclose(emb.embedding_tables[table][1], -(1.0 + 0.5), rtol=1e-7)  # steps 0 and 1
    path = emb.save(tmp_path / "ck")
    again = E.TPUEmbedding(fc)
    again.build(4)
    again.restore(path)
    _train(again, 1, ids=np.array([1, 2, 3, 4]))
    np.testing.assert_allclose(again.embedding_tables[table][1], -(1.0 + 0.5 + 0.25), rtol=1e-7)  # step 2
    with pytest.raises(me.ConfigError, match=r"Invalid `learning_rate` for SGD optimizer.*callable taking no "
                                             r"arguments.*Fix:.*lambda: schedule\(step\)"):
        SGD(_Halving())  # the engine's own specs have no step to call it with


def test_a_keras_schedule_as_a_tpu_learning_rate():
    keras = pytest.importorskip("keras", reason="keras 3 for a real LearningRateSchedule")
    schedule = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=4)
    table = E.TableConfig(10, 4, name="t", optimizer=E.SGD(schedule), initializer=lambda shape: np.zeros(shape))
    emb = E.TPUEmbedding({"a": E.FeatureConfig(table)})
    _train(emb, 3, ids=np.array([1, 2, 3, 4]))
    expected = -sum(float(schedule(k)) for k in range(3))
    np.testing.assert_allclose(emb.embedding_tables[table][1], expected, rtol=1e-6)


def test_tpu_embedding_without_optimizer_serves_and_restores_but_refuses_to_train(tmp_path):
    trained = E.TableConfig(10, 4, name="t", optimizer=E.Adagrad(0.1))
    source = E.TPUEmbedding({"a": E.FeatureConfig(trained)})
    _train(source, 2)
    path = source.save(tmp_path / "ck")
    table = E.TableConfig(10, 4, name="t")
    emb = E.TPUEmbedding({"a": E.FeatureConfig(table)}, optimizer=None)  # as TF allows off TPU
    emb.build(4)
    emb.restore(path)  # parameters only: a table without optimizer has no slots
    np.testing.assert_array_equal(emb.embedding_tables[table], source.embedding_tables[trained])
    emb.enqueue({"a": np.array([1, 2, 3, 4])}, training=False)
    np.testing.assert_array_equal(emb.dequeue()["a"], source.embedding_tables[trained][[1, 2, 3, 4]])
    with pytest.raises(me.ConfigError, match=r"Invalid `training`.*table 't' has no optimizer.*Fix:.*"
                                             r"Received: training=True"):
        emb.enqueue({"a": np.arange(4)})
    with pytest.raises(me.ConfigError, match=r"Cannot apply gradients: table 't' has no optimizer"):
        emb.apply_gradients({"a": np.ones((4, 4), np.float32)})
    with pytest.raises(me.ConfigError, match=r"Invalid `optimizer` for table 't'.*Received: optimizer=None"):
        emb.engine  # noqa: B018 - its stand-in SGD(0) must not be trained through another front end
    np.testing.assert_array_equal(emb.embedding_tables[table], source.embedding_tables[trained])


def test_tf_indexed_slices_gradients_are_accepted_by_me_tpu():
    tf = pytest.importorskip("tensorflow", reason="tensorflow-cpu (extra [tf-interop])")
    results = []
    for sparse in (True, False):
        table = E.TableConfig(10, 4, name="t", optimizer=E.SGD(0.1))
        emb = E.TPUEmbedding({"a": E.FeatureConfig(table)})
        emb.enqueue({"a": tf.constant([1, 2, 3, 4])})
        emb.dequeue()
        dense = np.zeros((4, 4), np.float32)
        dense[[0, 2]] = 1.0
        grad = tf.IndexedSlices(tf.ones((2, 4)), tf.constant([0, 2]), tf.constant([4, 4])) if sparse else dense
        emb.apply_gradients({"a": grad})
        results.append(emb.embedding_tables[table])
    np.testing.assert_array_equal(results[0], results[1])


# -- #35.13: meshembed conformance --config / --against -------------------------------------
def _user_config(path):
    cfg = EmbeddingConfig(
        tables=[TableConfig("user", 40, 8, Adagrad(DynamicLearningRate(0))),
                TableConfig("item", 30, 4, me.embedding.Adam(0.01))],
        features=[FeatureConfig("user", (6,), name="u"), FeatureConfig("item", (6, 3), name="seq")])
    path.write_bytes(cfg.to_proto())
    return path


def test_conformance_runs_the_suite_checks_on_a_users_config(tmp_path):
    out = tmp_path / "r.json"
    proc = _cli("conformance", "--config", str(_user_config(tmp_path / "my_config.pb")), "--backends", "numpy",
                "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {"config[activations:u]", "config[activations:seq]", "config[user:accumulators]",
            "config[item:velocities]"} <= set(rows)
    assert rows["config[activations:u]"]["numpy"]["outcome"] == "passed"
    assert rows["config[activations:u]"]["numpy"]["reference"] is not None  # checked against the transcription


_BROKEN = """
import sys, numpy as np
from meshembed.backend import registry
from meshembed_numpy import NumpyBackend

class Broken(NumpyBackend):
    name = "broken"
    def gather(self, table, ids):  # off by one row
        return super().gather(table, (np.asarray(ids) + 1) % table.shape[0])

registry.register_backend("broken", Broken)
from meshembed.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_conformance_config_run_finds_a_broken_backend(tmp_path):
    path = _user_config(tmp_path / "my_config.pb")
    proc = subprocess.run([sys.executable, "-c", _BROKEN, "conformance", "--config", str(path),
                           "--backends", "numpy,broken"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| config[activations:u]"))
    assert row.split("|")[2].strip().startswith("pass") and row.split("|")[3].strip().startswith("FAIL")


def test_conformance_config_that_is_invalid_is_a_message_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\xff\xff\xff")
    proc = _cli("conformance", "--config", str(bad), "--backends", "numpy")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--config {bad}: Invalid `data`" in proc.stderr and "TPUEmbeddingConfiguration" in proc.stderr


def test_conformance_against_torchrec_without_the_interop_extra_says_how_to_install_it():
    import importlib.util

    if importlib.util.find_spec("torchrec") is not None:
        pytest.skip("torchrec is installed here")
    proc = _cli("conformance", "--against", "torchrec")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "make test-interop" in proc.stderr and "torchrec" in proc.stderr


def test_conformance_report_has_no_dtype_comparison_warnings():
    pytest.importorskip("array_api_strict")
    # NumPy first: its dtypes in meshembed.variable's memo are what array_api_strict's get compared with
    proc = _cli("conformance", "--backends", "numpy,array_api_strict", "-k", "dense_trajectory_matches_golden")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| test_dense_trajectory" in proc.stdout
    assert "comparing a array_api_strict dtype" not in proc.stdout + proc.stderr
