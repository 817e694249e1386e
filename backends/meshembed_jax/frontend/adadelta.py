"""``me.jax.adadelta``: the dense ``me.optimizers.Adadelta`` as an ``optax.GradientTransformation``.

Nothing here is Adadelta- or Keras-specific math of its own: the step is the core's
``meshembed.math.adadelta``, clipping and EMA are ``meshembed.optimizers.options.clip`` / ``ema``
and the hyper-parameter checks are the host optimizer's (``check_rho_epsilon``,
``check_learning_rate``, ``check_in_dtype``), so this front end gives the host's numbers and
errors, NaN/Inf included (``global_clipnorm`` follows ``tf.clip_by_global_norm``).

Works under ``optax.inject_hyperparams``: the learning rate, ``rho`` and ``epsilon`` may be
0-d arrays, traced inside ``jax.jit``; a traced value cannot be checked (it was checked where
``inject_hyperparams`` made it concrete, in ``init``). ``rho`` and ``epsilon`` may also be
callables, of the step count like an optax schedule or with no argument (tf_keras' legacy
``rho=lambda: 0.95``). Complex parameters are optimised as ``torch.optim.Adadelta`` does: as
their real view, real and imaginary parts two independent reals (the slots, complex like the
parameter, hold ``E[re(g)²] + i·E[im(g)²]``). The complex gradient it takes is torch's,
``∂L/∂re + i·∂L/∂im``; ``jax.grad`` returns its conjugate, so pass ``jnp.conj(grads)`` for complex
leaves (raw ``jax.grad`` output makes the imaginary parts climb, as it does with ``optax.sgd``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshembed.errors import ConfigError, InputError
from meshembed.math.adadelta import AdadeltaSlots
from meshembed.math.adadelta import adadelta as adadelta_step
from meshembed.optimizers.adadelta import call_hyperparameter, check_rho_epsilon, hyperparameter
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


def _real(x: Any) -> Any:
    """A complex array as its real view ``[..., 2]`` (real, imaginary); a real one as it is."""
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1) if jnp.iscomplexobj(x) else x


def _unreal(x: Any, like: Any) -> Any:
    """Inverse of :func:`_real` for an array shaped like ``like``."""
    return jax.lax.complex(x[..., 0], x[..., 1]) if jnp.iscomplexobj(like) else x


def _at_step(value: Any, count: Any) -> Any:
    """A hyper-parameter's value at step ``count``: a callable called (of the count, or of nothing)."""
    return call_hyperparameter(value, lambda: count) if hyperparameter(value) else value


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
    known = {"rho": None if hyperparameter(rho) else _concrete(rho),
             "epsilon": None if hyperparameter(epsilon) else _concrete(epsilon)}
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
        rho_now, eps_now = _at_step(rho, state.iteration), _at_step(epsilon, state.iteration)
        if hyperparameter(rho) or hyperparameter(epsilon):  # checked where the values are concrete
            check_rho_epsilon(*(_concrete(n) if hyperparameter(v) else None
                                for v, n in ((rho, rho_now), (epsilon, eps_now))))
        real = [_real(p) for p in leaves]  # a complex leaf as its real view, throughout (torch's rule)
        grads = clip(jnp, [_real(g) for g in grads], clip_option)
        accs, deltas = jax.tree.leaves(state.accumulated_grad), jax.tree.leaves(state.accumulated_delta_var)
        new_p, new_a, new_u = [], [], []
        for p, g, a, u in zip(real, grads, accs, deltas):
            q, slots = adadelta_step(jnp, p, g, AdadeltaSlots(_real(a), _real(u)), lr=lr, rho=rho_now, epsilon=eps_now)
            new_p.append(q)
            new_a.append(slots.accumulators)
            new_u.append(slots.updates)
        average = state.average
        if ema_opt.use_ema:
            average, new_p = ema(jnp, [_real(x) for x in jax.tree.leaves(state.average)], new_p, ema_opt.ema_momentum,
                                 state.iteration, overwrite_frequency=ema_opt.ema_overwrite_frequency)
            average = jax.tree.unflatten(tree, [_unreal(x, p) for x, p in zip(average, leaves)])
        back = [_unreal(q, p) for q, p in zip(new_p, leaves)]
        out = jax.tree.unflatten(tree, [q - p for q, p in zip(back, leaves)])
        return out, AdadeltaState(state.iteration + 1,
                                  jax.tree.unflatten(tree, [_unreal(x, p) for x, p in zip(new_a, leaves)]),
                                  jax.tree.unflatten(tree, [_unreal(x, p) for x, p in zip(new_u, leaves)]), average)

    return optax.GradientTransformation(init_fn, update_fn)


def _matched_gradients(updates: Any, params: Any) -> list[Any]:
    """The gradients as leaves in the params' order, cast to each param's dtype. The trees must
    match exactly (zipping the leaves of two different trees would pair a gradient with the
    wrong parameter), each gradient have its param's shape and a real or integer dtype (or a
    complex one for a complex param)."""
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
        complex_ok = jnp.iscomplexobj(p) and jnp.issubdtype(dtype, jnp.complexfloating)
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer) or complex_ok):
            raise InputError(
                f"Invalid gradient for {where}. Expected an integer or real floating array (complex for a complex "
                f"param). Received: dtype={dtype} for a param of dtype {jnp.result_type(p)}"
            )
        if jnp.shape(g) != jnp.shape(p):
            raise InputError(f"Invalid gradient for {where}. Expected shape {jnp.shape(p)}. Received: shape={jnp.shape(g)}")
        out.append(jnp.asarray(g).astype(jnp.result_type(p)))
    return out
