"""jax-tpu-embedding (``TableSpec`` / ``FeatureSpec`` / ``*OptimizerSpec``) <-> meshembed,
and per-table state arrays (unstacked) of jax-tpu-embedding and keras-rs <-> an engine.

Table stacking is left to the user: translate unstacked specs, and unstack arrays with
jax-tpu-embedding's own utilities before ``import_table_arrays``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshembed.config import EmbeddingConfig, FeatureConfig, TableConfig
from meshembed.config.common import parsing_proto
from meshembed.config.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, DynamicLearningRate, QuantizationConfig
from meshembed.errors import ConfigError, InputError
from meshembed.interop._gaps import Translation, _Gaps
from meshembed.interop._keras_rs import _features
from meshembed.interop._torchrec import check_finite

__all__ = ["export_table_arrays", "from_jax_tpu_embedding", "import_table_arrays", "to_jax_tpu_embedding"]

_SIZING = {"max_ids_per_partition": 256, "max_unique_ids_per_partition": 256,
           "suggested_coo_buffer_size_per_device": None}


def _lr_from(lr: Any, table: str, gaps: _Gaps) -> Any:
    if not callable(lr):
        return float(np.asarray(lr))
    try:
        takes_step = bool(inspect.signature(lr).parameters)
    except (TypeError, ValueError):
        takes_step = True
    if takes_step:
        raise ConfigError(f"Table {table!r}: a learning-rate callable of the step has no TPU form. Expected a float or "
                          "a callable of no arguments (or use a meshembed DynamicLearningRate and feed it per step).")
    return lr


def optimizer_from_jte(opt: Any, table: str, gaps: _Gaps) -> Any:
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

    lr = _lr_from(opt.learning_rate, table, gaps)
    with parsing_proto():  # jax-tpu-embedding's values (accumulators from 0, ...) are in the engine's domain
        if isinstance(opt, es.SGDOptimizerSpec):
            return SGD(lr)
        if isinstance(opt, es.AdagradOptimizerSpec):
            return Adagrad(lr, initial_accumulator_value=float(opt.initial_accumulator_value))
        if isinstance(opt, es.AdamOptimizerSpec):
            gaps.add("optimizer.bias_correction", "jax-tpu-embedding feeds alpha_t = lr·sqrt(1-beta_2^t)/(1-beta_1^t) "
                     "and epsilon·sqrt(1-beta_2^t); TPU Adam has no bias correction", "dropped; feed that lr "
                     "through a DynamicLearningRate for its numbers", table)
            return Adam(lr, beta_1=float(opt.beta_1), beta_2=float(opt.beta_2), epsilon=float(opt.epsilon),
                        lazy_adam=True, sum_inside_sqrt=False)
        if isinstance(opt, es.AdagradMomentumOptimizerSpec):
            for name in ("initial_accumulator_value", "initial_momentum_value"):
                if float(getattr(opt, name)) != 0.0:
                    gaps.add(f"optimizer.{name}", f"{name}={getattr(opt, name)}; meshembed's AdagradMomentum slots "
                             "start at 0", "started at 0 (load the slots with import_table_arrays)", table)
            return AdagradMomentum(lr, momentum=float(opt.momentum), use_nesterov=bool(opt.use_nesterov),
                                   exponent=float(opt.exponent), beta2=float(opt.beta2), epsilon=float(opt.epsilon))
        if isinstance(opt, es.FTRLOptimizerSpec):
            return FTRL(lr, learning_rate_power=float(opt.learning_rate_power),
                        l1_regularization_strength=float(opt.l1_regularization_strength),
                        l2_regularization_strength=float(opt.l2_regularization_strength), beta=float(opt.beta),
                        initial_accumulator_value=float(opt.initial_accumulator_value),
                        initial_linear_value=float(opt.initial_linear_value),
                        multiply_linear_by_learning_rate=bool(opt.multiply_linear_by_learning_rate))
    raise ConfigError(f"Table {table!r}: {type(opt).__name__} has no meshembed translation. Expected SGD, Adagrad, "
                      "Adam, AdagradMomentum or FTRL OptimizerSpec.")


def optimizer_to_jte(spec: Any, table: str, gaps: _Gaps) -> Any:
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

    lr = spec.learning_rate
    if isinstance(lr, DynamicLearningRate) or lr is None:
        raise ConfigError(f"Table {table!r}: a DynamicLearningRate has no jax-tpu-embedding form. Expected a float or "
                          "a callable.")
    for name in ("clip_weight_min", "clip_weight_max", "clipvalue", "simulated_quantization"):
        if getattr(spec, name) is not None:
            gaps.add(f"optimizer.{name}", f"{name}={getattr(spec, name)!r} has no OptimizerSpec field", "dropped", table)
    if spec.weight_decay_factor:
        gaps.add("optimizer.weight_decay_factor", "no OptimizerSpec field", "dropped", table)
    algo = spec.algorithm
    if algo == "stochastic_gradient_descent":
        return es.SGDOptimizerSpec(learning_rate=lr)
    if algo == "adagrad":
        return es.AdagradOptimizerSpec(learning_rate=lr, initial_accumulator_value=spec.initial_accumulator_value)
    if algo == "adam":
        gaps.add("optimizer.bias_correction", "jax-tpu-embedding's Adam applies bias correction; TPU Adam does not",
                 "its bias-corrected Adam", table)
        if spec.sum_inside_sqrt:
            gaps.add("optimizer.sum_inside_sqrt", "TPU adds epsilon² under the root; jax-tpu-embedding adds epsilon "
                     "outside", "epsilon outside the root", table)
        if not spec.lazy_adam:
            gaps.add("optimizer.lazy", "non-lazy TPU Adam moves every row", "jax-tpu-embedding moves looked-up rows",
                     table)
        return es.AdamOptimizerSpec(learning_rate=lr, beta_1=spec.beta_1, beta_2=spec.beta_2, epsilon=spec.epsilon)
    if algo == "adagrad_momentum":
        return es.AdagradMomentumOptimizerSpec(
            learning_rate=lr, momentum=spec.momentum, beta2=spec.beta2, epsilon=spec.epsilon, exponent=spec.exponent,
            use_nesterov=spec.use_nesterov, initial_accumulator_value=0.0, initial_momentum_value=0.0)
    if algo == "ftrl":
        if spec.allow_zero_accumulator:
            gaps.add("optimizer.allow_zero_accumulator", "no FTRLOptimizerSpec field", "dropped", table)
        return es.FTRLOptimizerSpec(
            learning_rate=lr, learning_rate_power=spec.learning_rate_power,
            l1_regularization_strength=spec.l1_regularization_strength,
            l2_regularization_strength=spec.l2_regularization_strength, beta=spec.beta,
            initial_accumulator_value=spec.initial_accumulator_value, initial_linear_value=spec.initial_linear_value,
            multiply_linear_by_learning_rate=spec.multiply_linear_by_learning_rate)
    raise ConfigError(f"Table {table!r}: optimizer {type(spec).__name__} has no jax-tpu-embedding OptimizerSpec. "
                      "Expected SGD, Adagrad, Adam, AdagradMomentum or FTRL.")


def from_jax_tpu_embedding(feature_specs: Any, *, strict: bool = False) -> Translation:
    """jax-tpu-embedding ``FeatureSpec`` (list, dict or one; unstacked) -> ``(EmbeddingConfig, gaps)``."""
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

    gaps = _Gaps("jax-tpu-embedding -> meshembed", strict)
    tables: dict[str, TableConfig] = {}
    features = []
    for f in _features(feature_specs):
        if not isinstance(f, es.FeatureSpec):
            raise ConfigError(f"Invalid feature {f!r}. Expected a jax_tpu_embedding FeatureSpec.")
        t = f.table_spec
        if t.name not in tables:
            if getattr(t, "_stacked_table_spec", None) is not None and t._stacked_table_spec.stack_name != t.name:
                gaps.add("stacking", f"stacked into {t._stacked_table_spec.stack_name!r}",
                         "translated unstacked (meshembed shards tables itself)", t.name)
            for name, default in _SIZING.items():
                if getattr(t, name) != default:
                    gaps.add(name, f"{name}={getattr(t, name)} sizes SparseCore buffers", "dropped", t.name)
            gaps.add("initializer", "a jax initializer is an opaque function", "meshembed's default "
                     "TruncatedNormal(stddev=1/sqrt(dim)); load trained rows with import_table_arrays", t.name)
            q = t.quantization_config
            quant = None if q is None else QuantizationConfig(int(q.num_buckets), float(q.min_value),
                                                              float(q.max_value))
            tables[t.name] = TableConfig(name=t.name, vocabulary_size=t.vocabulary_size, dimension=t.embedding_dim,
                                         optimizer=optimizer_from_jte(t.optimizer, t.name, gaps),
                                         combiner=t.combiner, quantization=quant)
        out = tuple(f.output_shape)
        if len(out) not in (2, 3) or out[-1] != t.embedding_dim:
            raise ConfigError(f"Feature {f.name!r}: output_shape {out} is not (batch, {t.embedding_dim}) or "
                              f"(batch, seq, {t.embedding_dim}).")
        features.append(FeatureConfig(table=t.name, input_shape=out[:-1], name=f.name))
    return gaps.finish(EmbeddingConfig(tables=list(tables.values()), features=features))


def to_jax_tpu_embedding(config: EmbeddingConfig, *, strict: bool = False) -> Translation:
    """``EmbeddingConfig`` -> ``(list of unstacked FeatureSpec, gaps)``; the table's
    initializer is jax's truncated normal, stddev 1/sqrt(dim), unless stated otherwise."""
    import jax
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

    if not isinstance(config, EmbeddingConfig):
        raise ConfigError(f"Invalid `config`. Expected a meshembed EmbeddingConfig. Received: {type(config).__name__}")
    gaps = _Gaps("meshembed -> jax-tpu-embedding", strict)
    specs = {}
    for t in config.tables:
        spec = t.optimizer if t.optimizer is not None else config.optimizer
        if spec is None or not hasattr(spec, "hyperparameters"):
            raise ConfigError(f"Table {t.name!r}: optimizer {spec!r} has no jax-tpu-embedding form.")
        if t.initializer is not None:
            gaps.add("initializer", f"{t.initializer!r} has no jax form", "jax truncated normal, stddev 1/sqrt(dim)",
                     t.name)
        q = t.quantization
        quant = None if q is None or not q.enabled else es.QuantizationConfig(min_value=q.lower, max_value=q.upper, num_buckets=q.num_buckets)
        specs[t.name] = es.TableSpec(
            name=t.name, vocabulary_size=t.vocabulary_size, embedding_dim=t.dimension,
            initializer=jax.nn.initializers.truncated_normal(stddev=1 / math.sqrt(t.dimension)),
            optimizer=optimizer_to_jte(spec, t.name, gaps), combiner=t.combiner, quantization_config=quant)
    features = []
    for i, f in enumerate(config.features):
        t = specs[f.table_name]
        name = f.name or f"{t.name}_feature_{i}"
        if not f.name:
            gaps.add("feature.name", f"feature {i} has no name", f"named {name!r}", t.name)
        features.append(es.FeatureSpec(name=name, table_spec=t, input_shape=list(f.input_shape),
                                       output_shape=[*f.input_shape, t.embedding_dim]))
    return gaps.finish(features)


# --------------------------------------------------------------------- per-table arrays
#: Foreign slot names -> TPU slot names, per source. keras-rs (on its Keras path) keeps the
#: Keras optimizer's variables; jax-tpu-embedding its ``*SlotVariables`` fields.
SLOT_NAMES = {
    "keras_rs": {"accumulator": "accumulators", "momentum": "momenta", "velocity": "velocities",
                 "linear": "linears"},
    "jax_tpu_embedding": {"accumulator": "accumulators", "momentum": "momenta", "velocity": "velocities",
                          "linear": "linears"},
}


def _source(source: str) -> dict[str, str]:
    if source not in SLOT_NAMES:
        raise InputError(f"Invalid `source`. Expected one of {sorted(SLOT_NAMES)}. Received: source={source!r}")
    return SLOT_NAMES[source]


def import_table_arrays(engine: Any, arrays: Mapping[str, Mapping[str, Any]], *, source: str) -> None:
    """Load ``{table: {"parameters" | "table" | foreign slot name: array}}`` into ``engine``
    (unstacked, whole tables). Every array is checked before any table is written."""
    names = _source(source)
    loads = []
    for table, slots in arrays.items():
        if table not in engine.table_names:
            raise InputError(f"Unknown table {table!r} in the {source} arrays. Expected one of {engine.table_names}.")
        have = engine.retrieve_parameters(table)
        out = {}
        for key, value in slots.items():
            name = "parameters" if key in ("parameters", "table", "embedding") else names.get(key, key)
            if name not in have:
                raise InputError(f"Table {table!r}: {source} slot {key!r} has no counterpart among the engine's "
                                 f"{sorted(have)}. Expected one of {sorted(names)} or 'parameters'.")
            value = np.asarray(value)
            if value.shape != have[name].shape:
                raise InputError(f"Table {table!r}: {key} has shape {value.shape}, the engine's {name} "
                                 f"{have[name].shape}. Unstack the table first (shapes must match).")
            check_finite(value, table, key)
            out[name] = value
        loads.append((table, out))
    for table, out in loads:
        engine.load_parameters(table, **out)


def export_table_arrays(engine: Any, *, source: str) -> dict[str, dict[str, np.ndarray]]:
    """The inverse of ``import_table_arrays``: ``{table: {"parameters": ..., foreign slot: ...}}``."""
    back = {v: k for k, v in _source(source).items()}
    return {t: {back.get(k, k): v for k, v in engine.retrieve_parameters(t).items()} for t in engine.table_names}
