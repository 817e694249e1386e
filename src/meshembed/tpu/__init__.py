"""``me.tpu``: TensorFlow 2's ``tf.tpu.experimental.embedding`` API over meshembed's engine.

Port TF code by changing the import::

    import meshembed as me
    table = me.tpu.TableConfig(vocabulary_size=1000, dim=16, name="user")
    emb = me.tpu.TPUEmbedding(feature_config={"user": me.tpu.FeatureConfig(table)},
                              optimizer=me.tpu.Adagrad(learning_rate=0.1))
    emb.enqueue({"user": ids}); acts = emb.dequeue(); emb.apply_gradients({"user": grads})

Nests go in and come back out unchanged (dicts by key, never by position); see
docs/tpu.md, "Porting from tf.tpu.experimental.embedding", for what maps and what differs.
"""

from __future__ import annotations

from typing import Any

from meshembed.tpu._config import OPTIMIZERS, FeatureConfig, QuantizationConfig, RowIdInitializer, TableConfig
from meshembed.tpu._embedding import TPUEmbedding, flat_features, is_feature  # the last two: for me.torch
from meshembed.tpu._serving import TPUEmbeddingForServing, serving_embedding_lookup
from meshembed.tpu.dryrun import dry_run

SGD = OPTIMIZERS["SGD"]
Adagrad = OPTIMIZERS["Adagrad"]
AdagradMomentum = OPTIMIZERS["AdagradMomentum"]
FTRL = OPTIMIZERS["FTRL"]
Adam = OPTIMIZERS["Adam"]
Adadelta = OPTIMIZERS["Adadelta"]
Assign = OPTIMIZERS["Assign"]
BoundedAdagrad = OPTIMIZERS["BoundedAdagrad"]
CenteredRMSProp = OPTIMIZERS["CenteredRMSProp"]
FrequencyAwareAdagrad = OPTIMIZERS["FrequencyAwareAdagrad"]
FrequencyEstimator = OPTIMIZERS["FrequencyEstimator"]
Lion = OPTIMIZERS["Lion"]
MDLAdagradLight = OPTIMIZERS["MDLAdagradLight"]
Momentum = OPTIMIZERS["Momentum"]
OnlineYogi = OPTIMIZERS["OnlineYogi"]
ProximalAdagrad = OPTIMIZERS["ProximalAdagrad"]
ProximalYogi = OPTIMIZERS["ProximalYogi"]
RMSProp = OPTIMIZERS["RMSProp"]



def __getattr__(name: str) -> Any:
    """``TPUEmbeddingConfiguration``: the generated proto class (package ``meshembed.tpu``)."""
    if name == "TPUEmbeddingConfiguration":
        from meshembed._proto.tpu_embedding_configuration_pb2 import TPUEmbeddingConfiguration

        return TPUEmbeddingConfiguration
    raise AttributeError(f"module 'meshembed.tpu' has no attribute {name!r}")


__all__ = [
    "FTRL", "SGD", "Adadelta", "Adagrad", "AdagradMomentum", "Adam", "Assign", "BoundedAdagrad",
    "CenteredRMSProp", "FeatureConfig", "FrequencyAwareAdagrad", "FrequencyEstimator", "Lion",
    "MDLAdagradLight", "Momentum", "OnlineYogi", "ProximalAdagrad", "ProximalYogi", "QuantizationConfig",
    "RMSProp", "RowIdInitializer", "TPUEmbedding", "TPUEmbeddingForServing", "TableConfig",
    "TPUEmbeddingConfiguration", "dry_run", "serving_embedding_lookup",
]
