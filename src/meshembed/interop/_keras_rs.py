"""keras-rs (``keras_rs.layers.TableConfig`` / ``FeatureConfig`` + a Keras optimizer) <->
meshembed. keras and keras_rs are imported only inside the functions (extra [interop]).

keras-rs itself runs a table two ways: on TPU its SparseCore path converts the Keras
optimizer to a jax-tpu-embedding spec (TPU semantics: no Adagrad epsilon, no Adam bias
correction, lazy rows); elsewhere it trains a Keras embedding with the Keras optimizer
(dense rules). The gap report names where the two, and meshembed, differ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshembed.config import EmbeddingConfig, FeatureConfig, TableConfig
from meshembed.config.common import parsing_proto
from meshembed.config.optimizers import FTRL, SGD, Adagrad, Adam, DynamicLearningRate, Momentum
from meshembed.embedding.initializers import Constant, TruncatedNormal
from meshembed.errors import ConfigError, InputError
from meshembed.interop._gaps import Translation, _Gaps
from meshembed.interop._torchrec import Uniform

__all__ = ["from_keras_rs", "keras_rs_arrays", "load_keras_rs_arrays", "to_keras_rs"]

_KERAS_RS_DEFAULTS = {"placement": "auto", "max_ids_per_partition": 256, "max_unique_ids_per_partition": 256}


def _f32(value: Any) -> float:
    """A Keras variable's float32 value as the shortest decimal that is that float32."""
    return float(str(np.float32(value)))


# --------------------------------------------------------------------- initializers
def initializer_from_keras(init: Any, dim: int, table: str, gaps: _Gaps) -> Any:
    import keras

    if isinstance(init, str):
        init = keras.initializers.get(init)
    cfg = init.get_config() if hasattr(init, "get_config") else {}
    if isinstance(init, keras.initializers.TruncatedNormal):
        std = float(cfg["stddev"])
        return None if cfg["mean"] == 0 and math.isclose(std, 1 / math.sqrt(dim), rel_tol=1e-7) else \
            TruncatedNormal(mean=float(cfg["mean"]), stddev=std)
    if isinstance(init, keras.initializers.Zeros):
        return Constant(0.0)
    if isinstance(init, keras.initializers.Ones):
        return Constant(1.0)
    if isinstance(init, keras.initializers.Constant):
        return Constant(float(cfg["value"]))
    if isinstance(init, keras.initializers.RandomUniform):
        return Uniform(float(cfg["minval"]), float(cfg["maxval"]))
    gaps.add("initializer", f"{type(init).__name__}{cfg or ''} has no meshembed initializer (keras-rs' default is "
             "VarianceScaling(mode='fan_out'))", "meshembed's default TruncatedNormal(stddev=1/sqrt(dim)); "
             "import trained rows with import_table_arrays", table)
    return None


def initializer_to_keras(init: Any, dim: int, table: str, gaps: _Gaps) -> Any:
    import keras

    if init is None or (isinstance(init, TruncatedNormal) and init.stddev is None):
        mean = 0.0 if init is None else init.mean
        return keras.initializers.TruncatedNormal(mean=mean, stddev=1 / math.sqrt(dim))
    if isinstance(init, TruncatedNormal):
        return keras.initializers.TruncatedNormal(mean=init.mean, stddev=init.stddev)
    if isinstance(init, Constant):
        return keras.initializers.Constant(init.value)
    if isinstance(init, Uniform):
        return keras.initializers.RandomUniform(init.minval, init.maxval)
    gaps.add("initializer", f"{init!r} has no Keras initializer", "keras-rs' default VarianceScaling(fan_out)",
             table)
    return keras.initializers.VarianceScaling(mode="fan_out")


# --------------------------------------------------------------------- optimizers
def optimizer_from_keras(opt: Any, table: str | None, gaps: _Gaps) -> Any:
    import keras

    if isinstance(opt, str):
        opt = keras.optimizers.get(opt)
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise ConfigError(f"Invalid optimizer {opt!r}{f' for table {table!r}' if table else ''}. Expected a Keras "
                          "optimizer (SGD, Adagrad, Adam, Ftrl) or its name.")
    c = opt.get_config()
    if not isinstance(c["learning_rate"], (int, float)):
        raise ConfigError(f"Table {table!r}: a Keras learning-rate schedule has no TPU form. Expected a float "
                          "learning_rate (pass a meshembed DynamicLearningRate and feed the schedule's value).")
    lr = _f32(c["learning_rate"])
    shared: dict[str, Any] = {}
    if c.get("clipvalue") is not None:
        shared["clipvalue"] = float(c["clipvalue"])
    for name in ("clipnorm", "global_clipnorm", "loss_scale_factor", "gradient_accumulation_steps"):
        if c.get(name) is not None:
            gaps.add(f"optimizer.{name}", f"{name}={c[name]} has no TPU embedding option", "dropped", table)
    if c.get("use_ema"):
        gaps.add("optimizer.use_ema", "Keras keeps an EMA of the weights", "dropped", table)
    if c.get("weight_decay"):
        shared.update(weight_decay_factor=float(c["weight_decay"]), multiply_weight_decay_factor_by_learning_rate=True)
        gaps.add("optimizer.weight_decay", "Keras decays every row each step", "weight_decay_factor × lr, "
                 "applied only to the rows looked up (TPU is lazy)", table)
    squares = (keras.optimizers.Adagrad, keras.optimizers.Adam, keras.optimizers.Ftrl)
    if isinstance(opt, squares) and keras.backend.backend() == "tensorflow":
        gaps.add("optimizer.duplicates", "on the TensorFlow Keras backend keras-rs' table gradient reaches the "
                 "optimizer as IndexedSlices, one slice per id occurrence, and its squared-gradient slot adds each "
                 "occurrence's g² (Σg²); TPU squares the row's summed gradient ((Σg)²)", "TPU rule (duplicates "
                 "summed first, as keras-rs' SparseCore path and Keras on JAX/torch)", table)
    with parsing_proto():  # Keras' values (epsilon=0, ...) are in the engine's domain
        if isinstance(opt, keras.optimizers.SGD):
            if c["momentum"] == 0 and not c["nesterov"]:
                return SGD(lr, **shared)
            gaps.add("optimizer.momentum", "keras-rs' SparseCore path refuses SGD momentum", "TPU Momentum: the same "
                     "rule for a constant learning rate; Keras' velocity = -lr × TPU's momenta", table)
            return Momentum(lr, momentum=float(c["momentum"]), use_nesterov=bool(c["nesterov"]), **shared)
        if isinstance(opt, keras.optimizers.Adagrad):
            if c["epsilon"]:
                gaps.add("optimizer.epsilon", f"Keras divides by sqrt(acc + epsilon) (epsilon={c['epsilon']:g}); TPU "
                         "Adagrad (and keras-rs on SparseCore) has none", "dropped", table)
            return Adagrad(lr, initial_accumulator_value=float(c["initial_accumulator_value"]), **shared)
        if isinstance(opt, keras.optimizers.Adam):
            if c["amsgrad"]:
                raise ConfigError(f"Table {table!r}: Adam(amsgrad=True) has no TPU form. Expected amsgrad=False.")
            gaps.add("optimizer.bias_correction", "Keras scales lr by sqrt(1-beta_2^t)/(1-beta_1^t); TPU Adam has no "
                     "bias correction", "dropped; feed that lr through a DynamicLearningRate for Keras' numbers",
                     table)
            gaps.add("optimizer.lazy", "Keras' Adam moves every row each step (moments decay)", "lazy_adam=False: "
                     "every row updated, as Keras (keras-rs' SparseCore path is lazy)", table)
            return Adam(lr, beta_1=float(c["beta_1"]), beta_2=float(c["beta_2"]), epsilon=float(c["epsilon"]),
                        lazy_adam=False, sum_inside_sqrt=False, **shared)
        if isinstance(opt, keras.optimizers.Ftrl):
            gaps.add("optimizer.lazy", "Keras' dense Ftrl recomputes every row from its linear slot each step (a row "
                     "never looked up, linear 0, becomes 0); TPU FTRL moves looked-up rows only", "lazy, as TPU "
                     "(and keras-rs' SparseCore path)", table)
            if c["l2_shrinkage_regularization_strength"]:
                gaps.add("optimizer.l2_shrinkage_regularization_strength", "no TPU FTRL field", "dropped", table)
            return FTRL(lr, learning_rate_power=float(c["learning_rate_power"]),
                        l1_regularization_strength=float(c["l1_regularization_strength"]),
                        l2_regularization_strength=float(c["l2_regularization_strength"]), beta=float(c["beta"]),
                        initial_accumulator_value=float(c["initial_accumulator_value"]), **shared)
    raise ConfigError(f"Table {table!r}: Keras {type(opt).__name__} has no keras-rs/TPU translation. Expected SGD, "
                      "Adagrad, Adam or Ftrl (the optimizers keras-rs supports).")


def optimizer_to_keras(spec: Any, table: str, gaps: _Gaps) -> Any:
    import keras

    lr = spec.learning_rate
    if isinstance(lr, DynamicLearningRate) or callable(lr) or lr is None:
        raise ConfigError(f"Table {table!r}: a dynamic learning rate has no Keras float form. Expected a float "
                          "(or build a keras.optimizers.schedules schedule yourself).")
    kw: dict[str, Any] = {"learning_rate": float(lr)}
    clip = spec.clipvalue
    if clip is not None:
        lo, hi = (-clip, clip) if isinstance(clip, (int, float)) else clip
        if lo is not None and hi is not None and lo == -hi:
            kw["clipvalue"] = float(hi)
        else:
            gaps.add("optimizer.clipvalue", f"clipvalue={clip!r} is asymmetric; Keras clips to ±c", "dropped", table)
    if spec.weight_decay_factor:
        if spec.multiply_weight_decay_factor_by_learning_rate:
            kw["weight_decay"] = float(spec.weight_decay_factor)
            gaps.add("optimizer.weight_decay_factor", "TPU decays only looked-up rows", "Keras weight_decay "
                     "(decays every row each step)", table)
        else:
            gaps.add("optimizer.weight_decay_factor", "decay not scaled by the learning rate", "dropped", table)
    for name in ("clip_weight_min", "clip_weight_max", "simulated_quantization"):
        if getattr(spec, name) is not None:
            gaps.add(f"optimizer.{name}", f"{name}={getattr(spec, name)!r} has no Keras option", "dropped", table)
    algo = spec.algorithm
    if algo == "stochastic_gradient_descent":
        return keras.optimizers.SGD(**kw)
    if algo == "momentum":
        gaps.add("optimizer.momentum", "keras-rs' SparseCore path refuses SGD momentum", "Keras SGD(momentum) "
                 "(the same rule on keras-rs' Keras path)", table)
        return keras.optimizers.SGD(momentum=spec.momentum, nesterov=spec.use_nesterov, **kw)
    if algo == "adagrad":
        gaps.add("optimizer.epsilon", "TPU Adagrad has no epsilon; keras-rs accepts only Keras' epsilon=1e-7 (added "
                 "under the root on its Keras path)", "epsilon=1e-7", table)
        return keras.optimizers.Adagrad(initial_accumulator_value=spec.initial_accumulator_value, epsilon=1e-7, **kw)
    if algo == "adam":
        gaps.add("optimizer.bias_correction", "Keras Adam applies bias correction; TPU Adam does not", "Keras Adam "
                 "with its bias correction", table)
        if spec.sum_inside_sqrt:
            gaps.add("optimizer.sum_inside_sqrt", "TPU adds epsilon² under the root; Keras adds epsilon outside",
                     "epsilon outside the root", table)
        if spec.lazy_adam:
            gaps.add("optimizer.lazy", "TPU lazy Adam moves only looked-up rows", "Keras moves every row", table)
        return keras.optimizers.Adam(beta_1=spec.beta_1, beta_2=spec.beta_2, epsilon=spec.epsilon, **kw)
    if algo == "ftrl":
        for name, default in (("multiply_linear_by_learning_rate", False), ("allow_zero_accumulator", False),
                              ("initial_linear_value", 0.0)):
            if getattr(spec, name) != default:
                gaps.add(f"optimizer.{name}", f"{name}={getattr(spec, name)} has no Keras Ftrl field", "dropped", table)
        return keras.optimizers.Ftrl(learning_rate_power=spec.learning_rate_power,
                                     initial_accumulator_value=spec.initial_accumulator_value,
                                     l1_regularization_strength=spec.l1_regularization_strength,
                                     l2_regularization_strength=spec.l2_regularization_strength, beta=spec.beta, **kw)
    raise ConfigError(f"Table {table!r}: optimizer {type(spec).__name__} has no keras-rs form. Expected SGD, Momentum, "
                      "Adagrad, Adam or FTRL.")


# --------------------------------------------------------------------- configs
def _features(feature_config: Any) -> list[Any]:
    if isinstance(feature_config, Mapping):
        return [feature_config[k] for k in sorted(feature_config)]  # keras.tree.flatten order
    if isinstance(feature_config, Sequence) and not isinstance(feature_config, (str, bytes)):
        return list(feature_config)
    return [feature_config]


def from_keras_rs(feature_configs: Any, *, strict: bool = False) -> Translation:
    """keras-rs ``FeatureConfig`` (a list, dict or one) -> ``(EmbeddingConfig, gaps)``.

    A feature's meshembed ``input_shape`` is its ``output_shape`` without the embedding
    dimension: ``(B, D)`` pooled, ``(B, M, D)`` a sequence.
    """
    import keras_rs

    gaps = _Gaps("keras-rs -> meshembed", strict)
    tables: dict[str, TableConfig] = {}
    seen: dict[str, Any] = {}
    features = []
    for f in _features(feature_configs):
        if not isinstance(f, keras_rs.layers.FeatureConfig):
            raise ConfigError(f"Invalid feature {f!r}. Expected keras_rs.layers.FeatureConfig.")
        t = f.table
        if t.name in seen and seen[t.name] is not t and seen[t.name] != t:
            raise ConfigError(f"Two different keras-rs tables are named {t.name!r}. Expected unique table names.")
        if t.name not in tables:
            seen[t.name] = t
            for name, default in _KERAS_RS_DEFAULTS.items():
                if getattr(t, name) != default:
                    gaps.add(name, f"{name}={getattr(t, name)!r} sizes SparseCore buffers / placement",
                             "no meshembed meaning: dropped", t.name)
            spec = optimizer_from_keras(t.optimizer, t.name, gaps)
            init = initializer_from_keras(t.initializer, t.embedding_dim, t.name, gaps)
            tables[t.name] = TableConfig(name=t.name, vocabulary_size=t.vocabulary_size, dimension=t.embedding_dim,
                                         optimizer=spec, combiner=t.combiner, initializer=init)
        out, inp = tuple(f.output_shape), tuple(f.input_shape)
        if len(out) not in (2, 3) or out[-1] != t.embedding_dim:
            raise ConfigError(f"Feature {f.name!r}: output_shape {out} is not (batch, {t.embedding_dim}) or "
                              f"(batch, seq, {t.embedding_dim}).")
        if len(out) == 2 and len(inp) == 2 and inp[1] != 1:
            gaps.add("input_shape", f"keras-rs drops a sample's ids beyond input_shape[1]={inp[1]}",
                     "not enforced: meshembed pools every id", f.name)
        features.append(FeatureConfig(table=t.name, input_shape=out[:-1], name=f.name))
    return gaps.finish(EmbeddingConfig(tables=list(tables.values()), features=features))


def to_keras_rs(config: EmbeddingConfig, *, strict: bool = False) -> Translation:
    """``EmbeddingConfig`` -> ``(list of keras_rs.layers.FeatureConfig, gaps)``."""
    import keras_rs

    if not isinstance(config, EmbeddingConfig):
        raise ConfigError(f"Invalid `config`. Expected a meshembed EmbeddingConfig. Received: {type(config).__name__}")
    gaps = _Gaps("meshembed -> keras-rs", strict)
    tables = {}
    for t in config.tables:
        spec = t.optimizer if t.optimizer is not None else config.optimizer
        if spec is None or not hasattr(spec, "hyperparameters"):
            raise ConfigError(f"Table {t.name!r}: optimizer {spec!r} has no keras-rs form.")
        tables[t.name] = keras_rs.layers.TableConfig(
            name=t.name, vocabulary_size=t.vocabulary_size, embedding_dim=t.dimension, combiner=t.combiner,
            optimizer=optimizer_to_keras(spec, t.name, gaps),
            initializer=initializer_to_keras(t.initializer, t.dimension, t.name, gaps))
    features = []
    for i, f in enumerate(config.features):
        t = tables[f.table_name]
        name = f.name or f"{t.name}_feature_{i}"
        if not f.name:
            gaps.add("feature.name", f"feature {i} has no name; keras-rs needs one", f"named {name!r}", t.name)
        features.append(keras_rs.layers.FeatureConfig(name=name, table=t, input_shape=f.input_shape,
                                                      output_shape=(*f.input_shape, t.embedding_dim)))
    return gaps.finish(features)


# --------------------------------------------------------------------- trained state
#: Keras optimizer attribute holding each slot list, by Keras slot name.
KERAS_SLOT_LISTS = {"accumulator": "_accumulators", "momentum": "_momentums", "velocity": "_velocities",
                    "linear": "_linears"}


def _layer_tables(layer: Any) -> dict[str, Any]:
    """``{table name: variable}`` of a built keras-rs DistributedEmbedding off SparseCore."""
    found: dict[str, list[Any]] = {}
    for v in layer.trainable_variables:
        parts = v.path.split("/")
        if len(parts) >= 2:
            found.setdefault(parts[-2], []).append(v)
    if not found or any(len(v) != 1 for v in found.values()):
        raise ConfigError(f"Cannot map keras-rs' layer variables {[v.path for v in layer.trainable_variables]} to "
                          "tables. Expected a built DistributedEmbedding off SparseCore (one '<table>/embeddings' each).")
    return {k: v[0] for k, v in found.items()}


def _slots_of(optimizer: Any, variable: Any) -> dict[str, Any]:
    if optimizer is None:
        return {}
    index = optimizer._get_variable_index(variable)
    return {name: getattr(optimizer, attr)[index] for name, attr in KERAS_SLOT_LISTS.items()
            if getattr(optimizer, attr, None)}


def keras_rs_arrays(layer: Any, optimizer: Any = None) -> dict[str, dict[str, np.ndarray]]:
    """A keras-rs layer's tables and (built) Keras optimizer slots as
    ``{table: {"parameters": ..., "accumulator" | "momentum" | ...: ...}}``, the form
    ``import_table_arrays(engine, arrays, source="keras_rs")`` takes. ``optimizer`` is one
    Keras optimizer (the model's, as keras-rs trains tables off SparseCore) or a
    ``{table: optimizer}`` mapping."""
    out = {}
    for table, var in _layer_tables(layer).items():
        opt = optimizer.get(table) if isinstance(optimizer, Mapping) else optimizer
        out[table] = {"parameters": np.asarray(var), **{k: np.asarray(v) for k, v in _slots_of(opt, var).items()}}
    return out


def load_keras_rs_arrays(layer: Any, arrays: Mapping[str, Mapping[str, Any]], optimizer: Any = None) -> None:
    """The inverse of ``keras_rs_arrays``: assign tables and slots (every shape checked first)."""
    tables = _layer_tables(layer)
    plan = []
    for table, slots in arrays.items():
        if table not in tables:
            raise InputError(f"Unknown table {table!r}. Expected one of {sorted(tables)}.")
        opt = optimizer.get(table) if isinstance(optimizer, Mapping) else optimizer
        targets = {"parameters": tables[table], **_slots_of(opt, tables[table])}
        for key, value in slots.items():
            if key not in targets:
                raise InputError(f"Table {table!r}: no Keras variable for {key!r}. Expected one of {sorted(targets)}.")
            value = np.asarray(value, np.float32)
            if value.shape != tuple(targets[key].shape):
                raise InputError(f"Table {table!r}: {key} has shape {value.shape}, Keras' {tuple(targets[key].shape)}.")
            plan.append((targets[key], value))
    for var, value in plan:
        var.assign(value)
