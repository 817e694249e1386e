"""meshembed: TPU-style embedding training (SendTPUEmbeddingGradients semantics) and a
mesh-aware Keras Adadelta, on NumPy, Torch, JAX and CuPy.

The public names are loaded lazily so that ``import meshembed`` stays cheap and never
imports torch, jax or cupy.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshembed.backend import available_backends, get_backend, set_backend, use_backend
from meshembed.errors import (
    BackendUnavailableError,
    CapacityError,
    CheckpointError,
    ConfigError,
    InputError,
    MeshembedError,
    ResourceError,
    StateError,
)

__version__ = "0.1.0"

_LAZY = {
    # config
    "EmbeddingConfig": "meshembed.config:EmbeddingConfig",
    "TableConfig": "meshembed.config:TableConfig",
    "FeatureConfig": "meshembed.config:FeatureConfig",
    # embedding engine
    "TPUEmbedding": "meshembed.embedding:TPUEmbedding",
    "SparseIds": "meshembed.embedding:SparseIds",
    "RaggedIds": "meshembed.embedding:RaggedIds",
    "DynamicVocabulary": "meshembed.embedding.dynamic:DynamicVocabulary",
    # dense side
    "Mesh": "meshembed.sharding.mesh:Mesh",
    "Layout": "meshembed.sharding.mesh:Layout",
    "UNSHARDED": "meshembed.sharding.mesh:UNSHARDED",
    "Variable": "meshembed.variable:Variable",
    "IndexedSlices": "meshembed.variable:IndexedSlices",
    # sub-packages
    "embedding": "meshembed.embedding",
    "optimizers": "meshembed.optimizers",
    "ops": "meshembed.ops",
    "math": "meshembed.math",
    "config": "meshembed.config",
    "sharding": "meshembed.sharding",
    "interop": "meshembed.interop",
    # front ends, one per framework idiom (the JAX and torch ones live in their backend packages)
    "tpu": "meshembed.tpu",
    "jax": "meshembed_jax.frontend",
    "torch": "meshembed_torch.frontend",
}

__all__ = [
    "BackendUnavailableError", "CapacityError", "CheckpointError", "ConfigError", "InputError", "MeshembedError",
    "ResourceError", "StateError", "available_backends", "get_backend", "set_backend", "use_backend", *_LAZY,
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'meshembed' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
