"""Typed TPU-embedding configuration, wire-compatible with ``tensorflow.tpu.TPUEmbeddingConfiguration``.

``EmbeddingConfig`` (tables, features, system settings) converts to and from the proto;
the 19 optimizer spec classes mirror the proto's ``parameters`` oneof; RowWiseAdagrad and
RowWiseAdam are meshembed extensions with no proto form (``config/rowwise.py``). All are frozen,
hashable dataclasses; invalid values raise ``meshembed.errors.ConfigError``.
"""

from __future__ import annotations

from meshembed.config.embedding import EmbeddingConfig
from meshembed.config.optimizers import (
    FTRL,
    MAX_AUXILIARY_SLOTS,
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
    UserDefinedProgram,
)
from meshembed.config.rowwise import RowWiseAdagrad, RowWiseAdam
from meshembed.config.tables import FeatureConfig, SpmdSharding, TableConfig

__all__ = [
    "FTRL", "MAX_AUXILIARY_SLOTS", "OPTIMIZER_CLASSES", "SGD", "Adadelta", "Adagrad",
    "AdagradMomentum", "Adam", "Assign", "BoundedAdagrad", "CenteredRMSProp", "DynamicLearningRate",
    "EmbeddingConfig", "FeatureConfig", "FrequencyAwareAdagrad", "FrequencyEstimator", "Lion",
    "MDLAdagradLight", "Momentum", "OnlineYogi", "OptimizerSpec", "ProximalAdagrad", "ProximalYogi",
    "QuantizationConfig", "RMSProp", "RowWiseAdagrad", "RowWiseAdam", "SpmdSharding", "TableConfig", "UserDefinedProgram",
]
