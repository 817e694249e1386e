"""Keras-3-style optimizer base: variables, iterations, clipping, EMA and config live here once.

Algorithm files (``adadelta.py``) only create their slots in ``build``, name their algorithm
in ``meshembed.math`` and its hyper-parameters, and write ``update_step``. Everything else is
in this base, assembled from one module per responsibility:

* :mod:`~meshembed.optimizers.variables` — the step counter, the learning rate, slots, and the
  staged (transactional) reads and writes of a step;
* :mod:`~meshembed.optimizers.gradients` — gradient validation, conversion, sparse gradients;
* :mod:`~meshembed.optimizers.regularization` — loss scale, accumulation, norm clipping, the
  NaN policy, weight decay and EMA (what is not per element, around the update rule);
* :mod:`~meshembed.optimizers.step` — ``apply_gradients`` and the per-variable
  :class:`~meshembed.math.UpdateRule` the backend compiles (the learning rate a call-time
  value: a schedule recompiles nothing), ``stateless_apply``, ``minimize``;
* :mod:`~meshembed.optimizers.config` — Keras configs, variable stores, pickling.

State changes are transactional: ``apply_gradients`` validates every input, computes every
new value, and only then assigns them all, so an error leaves every variable and slot as
it was.

A dense step without EMA runs *in place* through ``backend.compile_update(rule, n)``: one
pass reads the gradient, the variable and its slots and writes the new values over the old
ones — no fresh arrays (each a page-faulting ``mmap`` above 32 MiB) and a fraction of the
memory traffic (docs/benchmarks.md); a backend runs a generated fused kernel of the rule
where it has one, else the core function compiled. Those in-place updates are staged like
every other write and only run at commit, after every step of every variable has been built
and validated, so an error still leaves everything unchanged. Variables updated this way
keep their array object: a reference taken from ``variable.value`` sees the new values (as
with Keras and torch.optim). On JAX (immutable arrays) the staged step is jitted with the
old buffers donated and the variables hold the results: a reference taken before the step
is then a deleted array, as with any donating ``jax.jit`` step (``optax`` loops alike).
"""
from __future__ import annotations

import numbers
from typing import Any, Callable

from meshembed.errors import ConfigError
from meshembed.math.rule import UpdateRule
from meshembed.optimizers.config import ConfigMixin, _CLIP_KEYS, _KERAS3_KEYS, check_learning_rate, _optional_number
from meshembed.optimizers.gradients import GradientsMixin
from meshembed.optimizers.options import EMAOption, GradientsClipOption
from meshembed.optimizers.regularization import RegularizationMixin
from meshembed.optimizers.step import StepMixin, _InPlace
from meshembed.optimizers.variables import VariablesMixin
from meshembed.sharding.mesh import Mesh
from meshembed.variable import Variable

__all__ = ["Optimizer"]


class Optimizer(StepMixin, RegularizationMixin, GradientsMixin, VariablesMixin, ConfigMixin):
    """Base class of meshembed's dense, mesh-aware optimizers (Keras optimizer surface)."""

    def __init__(
        self,
        learning_rate: Any,
        name: str,
        gradients_clip_option: GradientsClipOption | None = None,
        ema_option: EMAOption | None = None,
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
        keras3 = {k: v for k, v in dict(
            clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm, use_ema=use_ema,
            ema_momentum=ema_momentum, ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor, gradient_accumulation_steps=gradient_accumulation_steps,
        ).items() if v is not None}
        if keras3 and (gradients_clip_option is not None or ema_option is not None):
            given = "gradients_clip_option" if gradients_clip_option is not None else "ema_option"
            raise ConfigError(
                f"Invalid arguments. Expected either the DTensor options (`gradients_clip_option`, "
                f"`ema_option`: tf_keras semantics) or Keras 3's arguments ({', '.join(_KERAS3_KEYS)}), "
                f"not both. Received: {given}= together with {', '.join(f'{k}={v!r}' for k, v in keras3.items())}"
            )
        clip_given = [k for k in _CLIP_KEYS if k in keras3]
        if len(clip_given) > 1:  # Keras 3 refuses this; tf_keras' option warns and ignores clipvalue
            raise ConfigError(
                "Invalid clipping arguments. Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be "
                f"set. Received: clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
            )
        if keras3:
            gradients_clip_option = GradientsClipOption(clipnorm=clipnorm, clipvalue=clipvalue,
                                                        global_clipnorm=global_clipnorm)
            ema_option = EMAOption(use_ema=False if use_ema is None else use_ema,
                                   ema_momentum=0.99 if ema_momentum is None else ema_momentum,
                                   ema_overwrite_frequency=ema_overwrite_frequency)
        steps = gradient_accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 2):
            raise ConfigError(
                "Invalid `gradient_accumulation_steps`. Expected an integer >= 2 or None. "
                f"Received: gradient_accumulation_steps={steps!r}"
            )
        if not isinstance(allow_nonfinite, bool):
            raise ConfigError(
                f"Invalid `allow_nonfinite`. Expected True or False. Received: allow_nonfinite={allow_nonfinite!r}"
            )
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Invalid `name`. Expected a non-empty string. Received: name={name!r}")
        if gradients_clip_option is not None and not isinstance(gradients_clip_option, GradientsClipOption):
            raise ConfigError(
                "Invalid `gradients_clip_option`. Expected a meshembed.optimizers.GradientsClipOption "
                f"or None. Received: gradients_clip_option={gradients_clip_option!r}"
            )
        if ema_option is not None and not isinstance(ema_option, EMAOption):
            raise ConfigError(
                "Invalid `ema_option`. Expected a meshembed.optimizers.EMAOption or None. "
                f"Received: ema_option={ema_option!r}"
            )
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ConfigError(f"Invalid `mesh`. Expected a meshembed.Mesh or None. Received: mesh={mesh!r}")
        self.name = name
        self.weight_decay = _optional_number("weight_decay", weight_decay, positive=False)
        self.loss_scale_factor = _optional_number("loss_scale_factor", loss_scale_factor, positive=True)
        self.gradient_accumulation_steps = None if steps is None else int(steps)
        self.allow_nonfinite = allow_nonfinite
        #: True when built from Keras 3's arguments: Keras 3's EMA (the average starts from the
        #: variable on the first step) and config format; False: the DTensor options (tf_keras).
        self.keras3 = bool(keras3)
        self._learning_rate = check_learning_rate(learning_rate)
        self.gradients_clip_option = gradients_clip_option or GradientsClipOption()
        self.ema_option = ema_option or EMAOption()
        self.mesh = mesh
        self.jit_compile = bool(jit_compile)
        self.built = False
        self._backend: Any = None if mesh is None else mesh.backend
        self._iterations: Variable | None = None
        self._variables: list[Variable] = []
        self._trainable: list[Variable] = []
        self._index: dict[int, int] = {}
        self._averages: list[Variable] = []
        self._accumulators: list[Variable] = []
        self._stateless = False  # inside stateless_apply: never write into the given arrays
        self._traced = False  # stateless_apply under jax.jit: no host checks of values
        self._pending: dict[int, tuple[Variable, Any]] | None = None
        self._deferred: list[_InPlace] = []  # in-place updates staged for the commit
        self._folded: set[int] = set()  # ids of variables whose clipvalue / weight decay the rule applies
        self._rules: dict[tuple, UpdateRule] = {}
        self._in_place_ok = True  # False while a step must read staged values back (EMA)
        self._in_place_backends: dict[Any, bool] = {}  # within a step: capabilities.in_place of each backend
        self._step_lr: float | None = None
        self._compile_cache: dict[tuple, Callable[..., Any]] = {}  # (backend, rule, in_place)

    # -- Keras option properties (read through to the option objects) -------------------
    clipnorm = property(lambda self: self.gradients_clip_option.clipnorm)

    clipvalue = property(lambda self: self.gradients_clip_option.clipvalue)

    global_clipnorm = property(lambda self: self.gradients_clip_option.global_clipnorm)

    use_ema = property(lambda self: self.ema_option.use_ema)

    ema_momentum = property(lambda self: self.ema_option.ema_momentum)

    ema_overwrite_frequency = property(lambda self: self.ema_option.ema_overwrite_frequency)
