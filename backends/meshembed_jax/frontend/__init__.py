"""``me.jax``: the TPU embedding as pure functions over pytrees, for a user's own ``jax.jit``,
and the dense Adadelta as an optax transformation.

``init`` -> :class:`EmbeddingState`; ``prepare`` (host, outside jit) -> :class:`Batch`;
``lookup(state, batch)`` -> activations; ``apply_gradients(state, batch, grads,
learning_rates)`` -> the new state; ``map_keys`` / ``vocabulary`` for dynamic vocabularies;
``from_engine`` / ``to_engine`` / ``save`` / ``restore`` / ``place`` / ``export``; and
``adadelta`` / ``AdadeltaState``. ``import meshembed`` imports no jax; ``me.jax`` is a lazy
alias to this package. The modules: ``step.py`` (the step functions and pytrees),
``dynamic.py`` (dynamic vocabularies inside ``jax.jit``), ``adadelta.py`` (the optax
transformation). The engine side (``meshembed_jax.backend`` and its kernels) never imports
them (tests/test_layering.py).
"""

from meshembed_jax.frontend.adadelta import AdadeltaState, adadelta
from meshembed_jax.frontend.step import (
    Batch,
    EmbeddingState,
    apply_gradients,
    export,
    from_engine,
    init,
    lookup,
    map_keys,
    place,
    prepare,
    restore,
    save,
    to_engine,
    vocabulary,
)

__all__ = ["EmbeddingState", "Batch", "init", "prepare", "map_keys", "vocabulary", "lookup", "apply_gradients",
           "from_engine", "to_engine", "save", "restore", "place", "export", "adadelta", "AdadeltaState"]
