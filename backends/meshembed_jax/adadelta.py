"""``me.jax.adadelta``: the dense ``me.optimizers.Adadelta`` as an ``optax.GradientTransformation``.

Nothing here is Adadelta- or Keras-specific math of its own: the step is the core's
``meshembed.math.adadelta``, clipping and EMA are ``meshembed.optimizers.options.clip`` / ``ema``
and the hyper-parameter checks are the host optimizer's (``check_rho_epsilon``,
``check_learning_rate``, ``check_in_dtype``), so this front end gives the host's numbers and
errors, NaN/Inf included (``global_clipnorm`` follows ``tf.clip_by_global_norm``).

Works under ``optax.inject_hyperparams``: the learning rate, ``rho`` and ``epsilon`` may be
0-d arrays, traced inside ``jax.jit``; a traced value cannot be checked (it was checked where
``inject_hyperparams`` made it concrete, in ``init``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshembed.errors import ConfigError, InputError
from meshembed.math.adadelta import AdadeltaSlots
from meshembed.math.adadelta import adadelta as adadelta_step
from meshembed.optimizers.adadelta import check_rho_epsilon
from meshembed.optimizers.config import check_learning_rate
from meshembed.optimizers.options import EMAOption, GradientsClipOption, clip, ema
from meshembed.optimizers.step import check_in_dtype

__all__ = ["AdadeltaState", "adadelta"]


class AdadeltaState(NamedTuple):
    """Keras' slot names; ``average`` holds the EMA of the params (empty tuple without EMA)."""

    iteration: Any
    accumulated_grad: Any
    accumulated_delta_var: Any
    average: Any


def _concrete(x: Any) -> Any:
    """``x`` as a Python scalar where it has a value now (a 0-d array becomes its item);
    None for a traced value (inside ``jax.jit``), which cannot be checked."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and np.ndim(x) == 0:
        return np.asarray(x).item()
    return x


def _counter_dtype() -> Any:
    """int64 with the user's x64, else int32 (meshembed never turns x64 on)."""
    return jnp.int64 if jax.config.jax_enable_x64 else jnp.int32


def adadelta(learning_rate: Any = 0.001, rho: float = 0.95, epsilon: float = 1e-7,
             gradients_clip_option: Any = None, ema_option: Any = None) -> Any:
    """``me.optimizers.Adadelta`` (Keras' defaults: lr 1e-3, rho 0.95, eps 1e-7, tf_keras' clip
    and EMA options) as an ``optax.GradientTransformation``: pure, jit-able, state sharded
    like the params (``init`` outside jit puts each slot on its param's sharding; a jitted
    ``init`` needs ``out_shardings``). ``learning_rate`` may be a float, an optax schedule or
    (``optax.inject_hyperparams``) a 0-d array.

    The step is the core's ``meshembed.math.adadelta`` (``a' = ρa + (1−ρ)g²``,
    ``d = √(u+ε)/√(a'+ε)·g``, ``u' = ρu + (1−ρ)d²``, ``p' = p − lr·d``); the update returned is
    ``p' − p`` (optax adds it). Gradients must have the params' tree structure and shapes
    (``InputError``, as optax refuses mismatched trees); ``rho``, ``epsilon`` and a constant
    learning rate are checked as the host optimizer checks them (``ConfigError``)."""
    import optax

    clip_option = gradients_clip_option or GradientsClipOption()
    ema_opt = ema_option or EMAOption()
    if not isinstance(clip_option, GradientsClipOption) or not isinstance(ema_opt, EMAOption):
        raise ConfigError("Invalid `gradients_clip_option`/`ema_option`. Expected me.optimizers.GradientsClipOption "
                          f"/ EMAOption or None. Received: {gradients_clip_option!r}, {ema_option!r}")
    known = {"rho": _concrete(rho), "epsilon": _concrete(epsilon)}
    check_rho_epsilon(known["rho"], known["epsilon"])
    lr_known = _concrete(learning_rate)
    if lr_known is not None:
        check_learning_rate(lr_known)
    in_dtype = {"learning_rate": None if callable(lr_known) else lr_known, "epsilon": known["epsilon"]}

    def init_fn(params: Any) -> AdadeltaState:
        for path, p in jax.tree_util.tree_leaves_with_path(params):  # static: dtypes are known in a trace
            check_in_dtype(in_dtype, jax.tree_util.keystr(path), jnp.result_type(p))

        def zeros(p: Any) -> Any:  # each slot on its param's sharding (inside jit: XLA propagates it)
            where = None if isinstance(p, jax.core.Tracer) else getattr(p, "sharding", None)
            return jnp.zeros(jnp.shape(p), jnp.result_type(p), device=where)

        average = jax.tree.map(lambda p: jnp.array(p, copy=True), params) if ema_opt.use_ema else ()
        first = next(iter(jax.tree.leaves(params)), None)
        where = None if isinstance(first, jax.core.Tracer) else getattr(first, "sharding", None)
        if isinstance(where, jax.sharding.NamedSharding):  # the counter replicated on the params' mesh
            where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
        return AdadeltaState(jnp.zeros((), _counter_dtype(), device=where), jax.tree.map(zeros, params),
                             jax.tree.map(zeros, params), average)

    def update_fn(updates: Any, state: AdadeltaState, params: Any = None) -> tuple[Any, AdadeltaState]:
        if params is None:
            raise InputError("me.jax.adadelta needs `params` in update(grads, state, params) (for the EMA and p' − p).")
        leaves, tree = jax.tree.flatten(params)
        grads = _matched_gradients(updates, params)
        lr = learning_rate(state.iteration) if callable(learning_rate) else learning_rate
        grads = clip(jnp, grads, clip_option)
        accs, deltas = jax.tree.leaves(state.accumulated_grad), jax.tree.leaves(state.accumulated_delta_var)
        new_p, new_a, new_u = [], [], []
        for p, g, a, u in zip(leaves, grads, accs, deltas):
            q, slots = adadelta_step(jnp, p, g, AdadeltaSlots(a, u), lr=lr, rho=rho, epsilon=epsilon)
            new_p.append(q)
            new_a.append(slots.accumulators)
            new_u.append(slots.updates)
        average = state.average
        if ema_opt.use_ema:
            average, new_p = ema(jnp, jax.tree.leaves(state.average), new_p, ema_opt.ema_momentum, state.iteration,
                                 overwrite_frequency=ema_opt.ema_overwrite_frequency)
            average = jax.tree.unflatten(tree, average)
        out = jax.tree.unflatten(tree, [q - p for q, p in zip(new_p, leaves)])
        return out, AdadeltaState(state.iteration + 1, jax.tree.unflatten(tree, new_a),
                                  jax.tree.unflatten(tree, new_u), average)

    return optax.GradientTransformation(init_fn, update_fn)


def _matched_gradients(updates: Any, params: Any) -> list[Any]:
    """The gradients as leaves in the params' order, cast to each param's dtype. The trees must
    match exactly (zipping the leaves of two different trees would pair a gradient with the
    wrong parameter), each gradient have its param's shape and a real or integer dtype."""
    g_tree, p_tree = jax.tree.structure(updates), jax.tree.structure(params)
    if g_tree != p_tree:
        raise InputError(
            "Invalid `updates`. Expected gradients with the tree structure of `params` (as optax requires). "
            f"Received: updates {g_tree} for params {p_tree}"
        )
    out = []
    for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params)):
        where = jax.tree_util.keystr(path)
        dtype = g.dtype if hasattr(g, "dtype") else np.asarray(g).dtype
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
            raise InputError(
                f"Invalid gradient for {where}. Expected an integer or real floating array. Received: dtype={dtype}"
            )
        if jnp.shape(g) != jnp.shape(p):
            raise InputError(f"Invalid gradient for {where}. Expected shape {jnp.shape(p)}. Received: shape={jnp.shape(g)}")
        out.append(jnp.asarray(g).astype(jnp.result_type(p)))
    return out
