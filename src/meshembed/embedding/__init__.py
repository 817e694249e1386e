"""The TPU embedding engine (``me.TPUEmbedding``), its input types, and the optimizer spec
classes re-exported from ``meshembed.config`` so ``me.embedding.Adadelta(...)`` works as in
``tf.tpu.experimental.embedding``."""

from __future__ import annotations

import importlib
from typing import Any

from meshembed.embedding.engine import TPUEmbedding
from meshembed.embedding.initializers import Constant, RowIdInitializer, TruncatedNormal, Zeros
from meshembed.embedding.inputs import RaggedIds, SparseIds

#: Optimizer spec classes and helpers that live in meshembed.config (loaded on first use).
_FROM_CONFIG = (
    "SGD", "Adagrad", "AdagradMomentum", "BoundedAdagrad", "FrequencyAwareAdagrad", "FTRL",
    "Adam", "Momentum", "Lion", "RMSProp", "CenteredRMSProp", "MDLAdagradLight", "Adadelta",
    "ProximalAdagrad", "OnlineYogi", "ProximalYogi", "FrequencyEstimator",
    "UserDefinedProgram", "Assign", "DynamicLearningRate", "QuantizationConfig",
    "EmbeddingConfig", "TableConfig", "FeatureConfig",
)
_LAZY = {name: "meshembed.config" for name in _FROM_CONFIG}
_LAZY["CustomOptimizer"] = "meshembed.math.custom"
# dynamic vocabularies: raw int64 keys mapped to rows (docs/dynamic_vocab.md)
_LAZY.update({name: "meshembed.embedding.dynamic" for name in (
    "DynamicVocabulary", "Always", "AfterOccurrences", "Probability", "LRU", "LFU", "TTL", "NormBelow")})
_LAZY["Precision"] = "meshembed.config.precision"  # 16-bit tables (docs/low_precision.md)
# row-wise optimizers, no proto form (docs/optimizers.md "Row-wise extensions")
_LAZY.update({name: "meshembed.config.rowwise" for name in ("RowWiseAdagrad", "RowWiseAdam")})

__all__ = [
    "Constant", "RaggedIds", "RowIdInitializer", "SparseIds", "TPUEmbedding", "TruncatedNormal",
    "Zeros", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshembed.embedding' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
