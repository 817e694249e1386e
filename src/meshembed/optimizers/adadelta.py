"""Mesh-aware Adadelta with the Keras optimizer surface (``tf.keras.dtensor.experimental.optimizers.Adadelta``).

Slots (Keras names; TPU and other frameworks call them differently):

====================  ======================  ====================  =================
meshembed / Keras      TPU proto slot          Optax state           torch state
====================  ======================  ====================  =================
accumulated_grad       accumulators (E[g²])    ``e_g``               ``square_avg``
accumulated_delta_var  updates (E[Δx²])        ``e_x``               ``acc_delta``
====================  ======================  ====================  =================

Defaults are Keras' (lr 1e-3, ρ 0.95, ε 1e-7); torch (1.0, 0.9, 1e-6) and Optax (ρ 0.9, ε 1e-6)
differ, so pass the hyper-parameters explicitly when comparing. The rule itself is the core's
``meshembed.math.adadelta``, shared with the embedding engine.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from meshembed.errors import ConfigError
from meshembed.optimizers.base import Optimizer
from meshembed.optimizers.config import _required_positional
from meshembed.optimizers.options import EMAOption, GradientsClipOption
from meshembed.sharding.mesh import Mesh
from meshembed.variable import Variable

__all__ = ["Adadelta", "call_hyperparameter", "check_rho_epsilon", "hyperparameter"]


def _number(name: str, value: Any, low: float, high: float | None = None) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if not ok or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low} and finite"
        raise ConfigError(f"Invalid `{name}`. Expected a number {bounds}. Received: {name}={value!r}")
    return float(value)


def hyperparameter(value: Any) -> bool:
    """Whether ``value`` is a hyper-parameter given as a callable (tf_keras' legacy optimizers
    take ``rho=lambda: 0.95``): a zero-argument callable, or one of the step like a schedule."""
    return callable(value) and not isinstance(value, numbers.Real)


def call_hyperparameter(fn: Any, step: Any) -> Any:
    """A callable hyper-parameter's value now: ``fn()``, or ``fn(step())`` for one of the step
    (``step`` is called only then: reading the step counter may cost a host sync)."""
    return fn(step()) if _required_positional(fn) else fn()


def check_rho_epsilon(rho: Any, epsilon: Any) -> tuple[float | None, float | None]:
    """Adadelta's domain, one check for ``me.optimizers.Adadelta``, ``me.torch.Adadelta`` and
    ``me.jax.adadelta``: ``rho`` in [0, 1] (a decay rate) and ``epsilon`` finite and >= 0 (it
    sits inside both square roots). Returns them as floats; raises ``ConfigError``. ``None``
    stands for a value traced inside ``jax.jit`` (unknown there; checked where it was concrete)."""
    return (None if rho is None else _number("rho", rho, 0.0, 1.0),
            None if epsilon is None else _number("epsilon", epsilon, 0.0))


class Adadelta(Optimizer):
    """Adadelta: ``a ← ρa + (1−ρ)g²``; ``d = √(u+ε)/√(a+ε)·g``; ``u ← ρu + (1−ρ)d²``; ``w ← w − lr·d``.

    Slots are created from each variable's reference, so they share its layout (sharding).
    A complex variable is optimised as ``torch.optim.Adadelta`` does: on its real view, real
    and imaginary parts two independent reals (clipping norms over both parts); its slots stay
    complex, ``E[re(g)²] + i·E[im(g)²]`` (docs/optimizers.md, "Complex variables").

    Args:
        learning_rate: float, a ``schedules.LearningRateSchedule`` or a callable of the step.
        rho, epsilon: decay rate and the ε inside both roots (Keras defaults 0.95, 1e-7);
            ε must be finite (also in the variables' dtype: 1e39 is Inf in float32); ``None``
            is 1e-7, as in tf_keras' legacy Adadelta (Keras 3 refuses it at the first step). Either may
            be a callable, zero-argument (tf_keras' legacy ``rho=lambda: 0.95``) or of the step
            like a schedule, called once per step and its value checked then; a changing value
            is a call-time input of the compiled step (no recompilation). As with a callable
            learning rate, ``get_config`` refuses it (tf_keras would write its value now).
        gradients_clip_option, ema_option: the DTensor options, honoured with tf_keras'
            semantics (Keras' DTensor optimizer ignored them).
        name: Keras name, also in the config.
        mesh: the ``me.Mesh`` whose backend holds the state; ``iterations`` and
            ``add_variable`` results are replicated over it.
        jit_compile: a tf_keras config key, kept and round-tripped. The per-variable step
            always goes through ``backend.compile``, which compiles where it pays.
        weight_decay: ``w ← w − w·wd·lr`` before each update (Keras 3 and tf_keras).
        clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum, ema_overwrite_frequency,
        loss_scale_factor, gradient_accumulation_steps: Keras 3's arguments with Keras 3's
            semantics (at most one clip argument; the EMA average starts from the variable on
            the first step); they cannot be combined with the two option objects.
        allow_nonfinite: apply NaN/Inf gradients instead of raising ``InputError``.
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        rho: float = 0.95,
        epsilon: float = 1e-7,
        gradients_clip_option: GradientsClipOption | None = None,
        ema_option: EMAOption | None = None,
        name: str = "Adadelta",
        mesh: Mesh | None = None,
        jit_compile: bool = False,
        *,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool | None = None,
        ema_momentum: float | None = None,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        allow_nonfinite: bool = False,
    ) -> None:
        super().__init__(
            learning_rate, name, gradients_clip_option, ema_option, mesh, jit_compile,
            weight_decay=weight_decay, clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm,
            use_ema=use_ema, ema_momentum=ema_momentum, ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor, gradient_accumulation_steps=gradient_accumulation_steps,
            allow_nonfinite=allow_nonfinite,
        )
        if epsilon is None:  # tf_keras' legacy Adadelta: `epsilon or backend.epsilon()`
            epsilon = 1e-7
        if not hyperparameter(rho):
            _number("rho", rho, 0.0, 1.0)  # None too: check_rho_epsilon takes None for "traced"
        check_rho_epsilon(None, None if hyperparameter(epsilon) else epsilon)
        self.rho: Any = rho if hyperparameter(rho) else float(rho)
        self.epsilon: Any = epsilon if hyperparameter(epsilon) else float(epsilon)
        self._hypers_now: dict[str, float] | None = None  # the callables' values during one step
        self._callables = tuple(k for k in ("epsilon", "rho") if hyperparameter(getattr(self, k)))  # sorted

    def _hyperparameters_now(self) -> dict[str, float]:
        """``rho`` and ``epsilon`` for this step: the callables called (once per step) and checked."""
        if self._hypers_now is not None:
            return self._hypers_now
        if not self._callables:  # checked at construction
            return {"rho": self.rho, "epsilon": self.epsilon}
        now = {}
        for name in ("rho", "epsilon"):
            value = getattr(self, name)
            if hyperparameter(value):
                value = call_hyperparameter(value, self._calls)
                if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
                    value = value.item()  # a 0-d array or tensor of the user's framework
            now[name] = value
        rho, eps = check_rho_epsilon(now["rho"], now["epsilon"])
        return {"rho": rho, "epsilon": eps}

    def apply_gradients(self, grads_and_vars: Any) -> Variable:
        """The base's step, with callable ``rho``/``epsilon`` called once and checked first."""
        if not self._callables or self._hypers_now is not None:
            return super().apply_gradients(grads_and_vars)
        self._hypers_now = self._hyperparameters_now()
        try:
            return super().apply_gradients(grads_and_vars)
        finally:
            self._hypers_now = None

    def _dtype_checked_scalars(self) -> dict[str, float | None]:
        return {**super()._dtype_checked_scalars(), "epsilon": self._hyperparameters_now()["epsilon"]}

    def _dynamic_hyperparameters(self) -> dict[str, float]:
        if not self._callables:
            return {}
        now = self._hyperparameters_now()
        return {k: now[k] for k in self._callables}

    def build(self, var_list: list[Variable]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._accumulated_grads, self._accumulated_delta_vars = [], []
        for v in var_list:  # tf_keras' order: both slots of one variable, then the next
            self._accumulated_grads.append(self.add_variable_from_reference(v, "accumulated_grad"))
            self._accumulated_delta_vars.append(self.add_variable_from_reference(v, "accumulated_delta_var"))

    @property
    def accumulated_grads(self) -> list[Variable]:
        """Each variable's ``accumulated_grad`` slot, in ``build`` order (Keras' names)."""
        return list(self._accumulated_grads)

    @property
    def accumulated_delta_vars(self) -> list[Variable]:
        """Each variable's ``accumulated_delta_var`` slot, in ``build`` order."""
        return list(self._accumulated_delta_vars)

    _algorithm = "adadelta"  # meshembed.math.adadelta, shared with the embedding engine

    def _static_hyperparameters(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("rho", "epsilon") if k not in self._callables}

    def update_step(self, grad: Any, variable: Variable) -> None:
        i = self._slot_index(variable)
        grad, touched = self._densify(self._convert_gradient(grad, variable), variable)
        targets = (variable, self._accumulated_grads[i], self._accumulated_delta_vars[i])
        self._apply_step(targets, grad, touched)

    def get_config(self) -> dict[str, Any]:
        for name in ("rho", "epsilon"):
            if hyperparameter(getattr(self, name)):  # as for a callable learning rate
                raise ConfigError(
                    f"Invalid `{name}` for get_config(). Expected a float, which can be written to a config; a "
                    f"callable cannot (its value now would freeze it). Received: {name}={getattr(self, name)!r}"
                )
        return {**super().get_config(), "rho": self.rho, "epsilon": self.epsilon}
