"""Keras-3-style optimizer base: variables, iterations, clipping, EMA and config live here once.

Algorithm files (``adadelta.py``) only create their slots in ``build`` and write
``update_step`` by calling the core's pure math function. Everything else — validation,
gradient conversion and placement, sparse gradients, clipping, the learning-rate schedule,
EMA, the step counter and configs — is here.

State changes are transactional: ``apply_gradients`` validates every input, computes every
new value, and only then assigns them all, so an error leaves every variable and slot as
it was.

The per-variable step always goes through ``backend.compile`` (the backend decides where
compiling pays: ``jax.jit``; torch compiles once a step touches ~10⁶ elements; NumPy runs as
is). On a backend with mutable arrays that compiles (torch), a dense step without EMA is
compiled *in place*: one fused pass reads the gradient, the variable and its slots and writes
the new values over the old ones — no fresh arrays (each a page-faulting ``mmap`` above 32 MiB)
and a fraction of the memory traffic (docs/benchmarks.md). Those in-place updates are staged
like every other write and only run at commit, after every step of every variable has been
built and validated, so an error still leaves everything unchanged. Variables updated this
way keep their array object: a reference taken from ``variable.value`` sees the new values
(as with Keras and torch.optim).
On JAX (immutable arrays) the staged step is jitted with the old buffers donated and the
variables hold the results: a reference taken before the step is then a deleted array, as
with any donating ``jax.jit`` step (``optax`` training loops alike).
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import re
import warnings
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import array_api_compat
import numpy as np

from meshembed.errors import CheckpointError, ConfigError, InputError, StateError
from meshembed.backend.protocol import call_values
from meshembed.math import get_math
from meshembed.math.common import decay_weights
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed.optimizers import schedules
from meshembed.optimizers.options import EMAOption, GradientsClipOption, sum_squares
from meshembed.sharding.mesh import Layout, Mesh
from meshembed.variable import IndexedSlices, Variable, _Fresh, _to_backend, dtype_name

__all__ = ["Optimizer"]

_CLIP_KEYS = ("clipnorm", "global_clipnorm", "clipvalue")
_EMA_KEYS = ("use_ema", "ema_momentum", "ema_overwrite_frequency")
#: Keras 3 arguments with no DTensor-option form; any of them (or a flat clip/EMA argument)
#: selects Keras 3's semantics, and they cannot be mixed with the two option objects.
_KERAS3_KEYS = (*_CLIP_KEYS, *_EMA_KEYS, "loss_scale_factor", "gradient_accumulation_steps")


def _optional_number(name: str, value: Any, positive: bool) -> float | None:
    if value is None:
        return None
    bad = isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value)
    if bad or value < 0 or (positive and value == 0):
        raise ConfigError(
            f"Invalid `{name}`. Expected a {'positive' if positive else 'non-negative'} finite number or None. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def _check_learning_rate(value: Any) -> Any:
    if isinstance(value, schedules.LearningRateSchedule) or (callable(value) and not isinstance(value, numbers.Real)):
        return value
    if isinstance(value, Variable) and value.shape == ():  # Keras: a learning-rate variable
        value = value.numpy().item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not np.isfinite(value) or value < 0:
        raise ConfigError(
            "Invalid `learning_rate`. Expected a non-negative float, a LearningRateSchedule or a "
            f"callable of the step. Received: learning_rate={value!r}"
        )
    return float(value)


class Optimizer:
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
        self._learning_rate = _check_learning_rate(learning_rate)
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
        self._step_lr: float | None = None
        self._compile_cache: dict[tuple, Callable[..., Any]] = {}  # (backend, rule, in_place)

    # -- Keras option properties (read through to the option objects) -------------------
    clipnorm = property(lambda self: self.gradients_clip_option.clipnorm)
    clipvalue = property(lambda self: self.gradients_clip_option.clipvalue)
    global_clipnorm = property(lambda self: self.gradients_clip_option.global_clipnorm)
    use_ema = property(lambda self: self.ema_option.use_ema)
    ema_momentum = property(lambda self: self.ema_option.ema_momentum)
    ema_overwrite_frequency = property(lambda self: self.ema_option.ema_overwrite_frequency)

    # -- state ----------------------------------------------------------------------------
    @property
    def iterations(self) -> Variable:
        """Steps taken so far: an int64 variable replicated over the mesh. With
        ``gradient_accumulation_steps=n`` (Keras 3) it counts updates: a snapshot of the calls
        so far floor-divided by ``n`` (the variable itself counts calls)."""
        it = self._counter
        if self.gradient_accumulation_steps:
            return Variable(np.asarray(self._calls() // self.gradient_accumulation_steps, np.int64),
                            name="iteration", trainable=False, backend=it.backend, dtype="int64")
        return it

    @iterations.setter
    def iterations(self, value: Any) -> None:
        """tf_keras: a start value (an int or a scalar integer variable) before the first step."""
        if self.built or (self._iterations is not None and self._calls() != 0):
            raise StateError("Cannot set `iterations` after the optimizer was built (tf_keras refuses it too).")
        start = value.numpy() if isinstance(value, Variable) else np.asarray(value)
        if start.shape != () or start.dtype.kind not in "iu" or int(start) < 0:
            raise InputError(f"Invalid `iterations`. Expected a non-negative integer scalar. Received: {value!r}")
        from meshembed.backend import get_backend

        self._iterations = self._make_iterations(get_backend(self._backend), int(start))

    lr = property(lambda self: self.learning_rate,
                  lambda self, value: setattr(self, "learning_rate", value),
                  doc="tf_keras' legacy alias of ``learning_rate``.")

    @property
    def _counter(self) -> Variable:
        """The step-counter variable (apply_gradients calls; what ``variables[0]`` holds)."""
        if self._iterations is None:
            from meshembed.backend import get_backend

            self._iterations = self._make_iterations(get_backend(self._backend), 0)
        return self._iterations

    def _make_iterations(self, backend: Any, start: int) -> Variable:
        layout = None if self.mesh is None else Layout.replicated(self.mesh, 0)
        return Variable(np.asarray(start, dtype=np.int64), name="iteration", layout=layout,
                        trainable=False, backend=backend, dtype="int64")

    @property
    def variables(self) -> list[Variable]:
        """``[iterations, *optimizer variables in creation order]``: Keras 3's order (EMA
        averages, gradient accumulators, then each variable's slots, variable by variable)
        without Keras 3's learning-rate variable (meshembed keeps the learning rate a float
        or schedule; ``load_own_variables`` reads Keras 3's layout too)."""
        return [self._counter, *self._variables]

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next step (a schedule evaluated at the call counter
        before the update, as Keras 3 and tf_keras do)."""
        if self._step_lr is not None:
            return self._step_lr
        lr = self._learning_rate
        if callable(lr):  # a schedule of the step, or (Keras legacy) a zero-argument callable
            value = lr(self._calls()) if _required_positional(lr) else lr()
            return _check_schedule_value(value, lr)
        return lr

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        """A float, or a new schedule / callable (Keras 3 and tf_keras allow replacing a
        schedule; only a float over a schedule is refused, as both do)."""
        new = _check_learning_rate(value)
        if callable(self._learning_rate) and not callable(new):
            raise TypeError(
                "This optimizer was created with a learning-rate schedule, so its learning rate "
                "is not settable to a float; assign a new schedule, or create the optimizer with a "
                f"float `learning_rate`. Received: learning_rate={value!r}"
            )
        self._learning_rate = new

    def _calls(self) -> int:
        return int(self._counter.numpy())

    def _step(self) -> int:
        """Keras 3's ``iterations``: updates so far (calls // accumulation steps)."""
        return self._calls() // (self.gradient_accumulation_steps or 1)

    # -- building ---------------------------------------------------------------------------
    def build(self, var_list: Sequence[Variable]) -> None:
        """Create the optimizer's variables for ``var_list`` (once; later calls are no-ops).

        Subclasses check ``self.built``, call this, then add their slots."""
        if self.built:
            return
        var_list = self._check_var_list(var_list, "var_list")
        self._resolve_backend(var_list)
        self._trainable = list(var_list)
        self._index = {id(v): i for i, v in enumerate(var_list)}
        for v in var_list:
            self._check_trainable(v)
        if self.use_ema:  # tf_keras starts the average at the variable; Keras 3 at zeros (unused)
            self._averages = [self.add_variable_from_reference(v, "average", initial_value=None if self.keras3 else v.value)
                              for v in var_list]
        if self.gradient_accumulation_steps:
            self._accumulators = [self.add_variable_from_reference(v, "gradient_accumulator") for v in var_list]
        self.built = True

    @staticmethod
    def _check_trainable(v: Variable) -> None:
        """Only real floating variables: an integer one would truncate every update, and a
        complex one has no Adadelta of its own (torch.optim runs it on the real view)."""
        name = v.dtype
        kind = "f" if "float" in name else "c" if "complex" in name else "i"
        if kind != "f":
            fix = ("optimize torch.view_as_real / the real and imaginary parts as float variables"
                   if kind == "c" else "create it with a float dtype (e.g. dtype='float32')")
            raise InputError(
                f"Invalid variable {v.name!r}. Expected a real floating dtype (float16/bfloat16/float32/float64). "
                f"Received: dtype={v.dtype}. Fix: {fix}."
            )

    def _check_var_list(self, var_list: Any, what: str) -> list[Variable]:
        if isinstance(var_list, Variable) or not isinstance(var_list, Iterable):
            raise InputError(f"Invalid `{what}`. Expected a list of meshembed.Variable. Received: {what}={var_list!r}")
        var_list = list(var_list)
        for v in var_list:
            if not isinstance(v, Variable):
                raise InputError(
                    f"Invalid `{what}`. Expected a list of meshembed.Variable. Received an element {v!r}"
                )
        if len({id(v) for v in var_list}) != len(var_list):
            raise InputError(f"Invalid `{what}`. Expected each variable once. Received: {[v.name for v in var_list]}")
        return var_list

    def _resolve_backend(self, var_list: Sequence[Variable]) -> None:
        """All variables (and the mesh) must share one backend; iterations follow it."""
        backends = {v.backend.name: v.backend for v in var_list}
        if self.mesh is not None:
            backends.setdefault(self.mesh.backend.name, self.mesh.backend)
            for v in var_list:
                if v.layout is not None and v.layout.mesh != self.mesh:
                    raise InputError(
                        f"Invalid `var_list`. Expected variables laid out on the optimizer's mesh "
                        f"{self.mesh!r}. Received: {v.name!r} on {v.layout.mesh!r}"
                    )
        if len(backends) > 1:
            raise InputError(
                f"Invalid `var_list`. Expected variables (and mesh) on one backend. Received backends {sorted(backends)}"
            )
        if backends:
            self._backend = next(iter(backends.values()))
        if self._iterations is not None and self._iterations.backend is not self._backend:
            self._iterations = self._make_iterations(self._backend, self._calls())

    def add_variable(self, shape: Sequence[int], dtype: Any = None, initializer: Any = "zeros",
                     name: str | None = None) -> Variable:
        """A new optimizer variable, replicated over the mesh (Keras DTensor behaviour).

        ``initializer``: ``"zeros"``, ``"ones"`` or a callable ``(shape, dtype) -> array``."""
        from meshembed.backend import get_backend

        shape = tuple(int(d) for d in shape)
        dtype = dtype_name(dtype) if dtype is not None else "float32"
        if initializer == "zeros":
            value = _Fresh(np.zeros(shape, dtype=dtype))
        elif initializer == "ones":
            value = _Fresh(np.ones(shape, dtype=dtype))
        elif callable(initializer):
            value = initializer(shape, dtype)
        else:
            raise ConfigError(
                "Invalid `initializer`. Expected 'zeros', 'ones' or a callable (shape, dtype). "
                f"Received: initializer={initializer!r}"
            )
        layout = None if self.mesh is None else Layout.replicated(self.mesh, len(shape))
        var = Variable(value, name=name, layout=layout, trainable=False, backend=get_backend(self._backend), dtype=dtype)
        self._variables.append(var)
        return var

    def add_variable_from_reference(self, model_variable: Variable, variable_name: str,
                                    initial_value: Any = None) -> Variable:
        """A slot named ``"{variable_name}/{model_variable.name}"`` with the model variable's
        shape, dtype and layout, so it is co-sharded with it (zeros unless ``initial_value``)."""
        if not isinstance(model_variable, Variable):
            raise InputError(
                f"Invalid `model_variable`. Expected a meshembed.Variable. Received: model_variable={model_variable!r}"
            )
        backend = model_variable.backend
        if initial_value is None:  # zeros made for this slot alone, adopted without a copy
            ref, xp = model_variable.value, backend.xp
            initial_value = _Fresh(xp.zeros_like(ref) if backend.sharding_of(ref) is not None else
                                   xp.zeros(ref.shape, dtype=ref.dtype, device=array_api_compat.device(ref)))
        var = Variable(initial_value, name=f"{variable_name}/{model_variable.name}", layout=model_variable.layout,
                       trainable=False, backend=backend, dtype=model_variable.dtype)
        if var.shape != model_variable.shape:
            raise InputError(
                f"Invalid `initial_value`. Expected shape {model_variable.shape}. Received: shape={var.shape}"
            )
        self._variables.append(var)
        return var

    def _slot_index(self, variable: Variable) -> int:
        i = self._index.get(id(variable))
        if i is None or self._trainable[i] is not variable:
            raise InputError(
                f"Invalid variable {getattr(variable, 'name', variable)!r}. Expected one of the variables "
                f"this optimizer was built with ({[v.name for v in self._trainable]}). Create a new "
                "optimizer for a different set of variables."
            )
        return i

    # -- reading/writing inside a step (transactional) -----------------------------------
    def _read(self, variable: Variable) -> Any:
        if self._pending is not None and id(variable) in self._pending:
            return self._pending[id(variable)][1]
        return variable.value

    def _write(self, variable: Variable, value: Any, touched: Any = None) -> None:
        """Stage ``value`` (only the ``touched`` rows, when given) for ``variable``."""
        if touched is not None:
            value = self._xp.where(touched, value, self._read(variable))
        if self._pending is not None:
            self._pending[id(variable)] = (variable, value)
        else:
            variable._assign_fresh(value)

    def _commit(self) -> None:
        pending, self._pending = self._pending or {}, None
        deferred, self._deferred = self._deferred, []
        placed = [(v, v._prepare(val, copy=False)) for v, val in pending.values()]
        # Every step was built and validated; only now do the staged in-place updates run
        # (they cannot fail on valid arrays — a compiler failure falls back to eager inside
        # the backend —, short of running out of memory mid-commit).
        self._run_in_place(deferred)
        for v, val in placed:
            v._value = val

    #: The algorithm's name in ``meshembed.math`` (each subclass sets it).
    _algorithm: str = ""

    def _static_hyperparameters(self) -> dict[str, float]:
        """The algorithm's hyper-parameters besides the learning rate (fixed per optimizer)."""
        return {}

    def _rule(self, variable: Variable, folded: bool) -> UpdateRule:
        """The :class:`UpdateRule` of ``variable``'s step: the algorithm, its slots and static
        hyper-parameters, and, where ``folded`` (a dense gradient inside ``apply_gradients``),
        the element-wise Keras terms — ``clipvalue`` as the gradient clip and the decoupled
        weight decay ``w ← w − w·wd·lr`` — so the backend's one pass applies them. The learning
        rate is the rule's call-time value: a schedule never recompiles. Norm clipping, EMA,
        accumulation and loss scaling are not per element and stay around the rule."""
        clip = self.gradients_clip_option
        clipvalue = clip.clipvalue if folded and not clip.uses_norm else None
        decay = self.weight_decay if folded and self.weight_decay and self._uses_weight_decay(variable) else 0.0
        key = (variable.dtype, clipvalue, decay)
        rule = self._rules.get(key)
        if rule is None:
            math_ = get_math(self._algorithm)
            rule = UpdateRule(
                math=math_, slot_names=math_.slot_names, static=tuple(sorted(self._static_hyperparameters().items())),
                gradient_clip=None if clipvalue is None else (-clipvalue, clipvalue), weight_decay=float(decay or 0.0),
                multiply_weight_decay_by_lr=True, lazy=False, dtype=variable.dtype,
            )
            self._rules[key] = rule
        return rule

    def _compiled(self, backend: Any, rule: UpdateRule, in_place: int = 0) -> Callable[..., Any]:
        """The step of ``rule`` once per backend: ``backend.compile`` of the pure step
        ``(grad, values, *targets) -> new targets`` (compiled where it pays), or with
        ``in_place=n`` the backend's step for ``n`` variables over their storage
        (``Backend.compile_update``). Keyed on the rule, never on a value."""
        key = (backend.name, rule, in_place)
        fn = self._compile_cache.get(key)
        if fn is None:
            fn = backend.compile_update(rule, in_place) if in_place else backend.compile(_pure_step(backend.xp, rule))
            self._compile_cache[key] = fn
        return fn

    def _run_in_place(self, updates: Sequence["_InPlace"]) -> None:
        """Run staged in-place updates, up to ``backend.in_place_group(step)`` consecutive ones
        of the same step in one compiled call: each compiled call pays dispatch and guards, so
        grouping saves time, while a cold XLA compile grows with the group; the backend picks
        the size (figures: docs/benchmarks.md, "Measurements behind design choices")."""
        # A gradient may be another (or the same) variable's own array: copy it before any
        # update overwrites or donates that array, so every step reads the values it was given.
        written = {id(t) for u in updates for t in u.targets}
        updates = [u._replace(grad=u.backend.xp.asarray(u.grad, copy=True)) if id(u.grad) in written else u
                   for u in updates]
        i = 0
        while i < len(updates):
            first = updates[i]
            limit = first.backend.in_place_group(first.rule)
            j = i + 1
            while j < len(updates) and j - i < limit and updates[j].same_kernel(first):
                j += 1
            group = updates[i:j]
            kernel = self._compiled(first.backend, first.rule, in_place=len(group))
            new = kernel([u.grad for u in group], [u.values for u in group],
                         *([u.targets[k] for u in group] for k in range(len(first.targets))))
            if new is not None:  # immutable arrays (JAX): the old buffers were donated
                for k in range(len(first.targets)):
                    for u, value in zip(group, new[k]):
                        u.variables[k]._value = value
            i = j

    def _can_update_in_place(self, targets: Sequence[Variable]) -> bool:
        """A dense step may overwrite ``targets`` in place: the backend updates
        in place (NumPy and torch write into the arrays, JAX donates them), nothing in this step reads
        their staged values back (no EMA), none of them has a staged value already, and the
        backend accepts each array (``can_update_in_place``: not a DTensor, one JAX device)."""
        backend = targets[0].backend
        caps = backend.capabilities
        if not (self._in_place_ok and caps.in_place):
            return False
        for t in targets:
            if t.backend is not backend or not backend.is_native(t.value) or not backend.can_update_in_place(t.value):
                return False
            if self._pending is not None and id(t) in self._pending:
                return False
        return True

    def _apply_step(self, targets: Sequence[Variable], grad: Any, touched: Any) -> None:
        """Run the step of the variable's :meth:`_rule` for ``targets`` (a model variable,
        then its slots) and stage the results; with ``touched`` (a sparse gradient's row
        mask) only those rows change.

        A dense step that may run in place (:meth:`_can_update_in_place`) is staged for the
        backend's ``compile_update`` run at commit. Otherwise the pure step is compiled with
        the learning rate as a 0-d array of the variable's dtype (a Python float for a sharded
        or traced value), so a schedule does not specialise (and recompile) it per value."""
        variable = targets[0]
        backend = variable.backend
        values = (self.learning_rate,)
        rule = self._rule(variable, touched is None and id(variable) in self._folded)
        if touched is None and self._can_update_in_place(targets):
            update = _InPlace(backend, rule, grad, values, tuple(t.value for t in targets), tuple(targets))
            if self._pending is None:  # update_step called on its own: apply now
                self._run_in_place([update])
            else:
                self._deferred.append(update)
            return
        current = [self._read(t) for t in targets]
        plain = self._traced or backend.sharding_of(current[0]) is not None
        step = self._compiled(backend, rule)
        new = step(grad, values if plain else call_values(backend.xp, values, current[0]), *current)
        for t, value in zip(targets, new):
            self._write(t, value, touched)

    @property
    def _xp(self) -> Any:
        from meshembed.backend import get_backend

        return get_backend(self._backend).xp

    # -- gradients ------------------------------------------------------------------------
    def _convert_gradient(self, grad: Any, variable: Variable) -> Any:
        """A backend array (placed on the variable's layout) or IndexedSlices of backend
        arrays, validated against ``variable``; raises before anything changes."""
        backend = variable.backend
        if isinstance(grad, Variable):
            grad = grad.value
        if isinstance(grad, IndexedSlices):
            if grad.dense_shape != variable.shape:
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected IndexedSlices with dense_shape "
                    f"{variable.shape}. Received: dense_shape={grad.dense_shape}"
                )
            idx = np.asarray(backend.to_numpy(grad.indices) if backend.is_native(grad.indices) else grad.indices)
            if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected 1-D integer indices. "
                    f"Received: indices of dtype {idx.dtype} and shape {idx.shape}"
                )
            if idx.size and (idx.min() < 0 or idx.max() >= variable.shape[0]):
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected indices in [0, {variable.shape[0]}). "
                    f"Received: indices from {idx.min()} to {idx.max()}"
                )
            values = self._as_native(grad.values, variable)
            expected = (idx.shape[0], *variable.shape[1:])
            if tuple(values.shape) != expected:
                raise InputError(
                    f"Invalid gradient for {variable.name!r}. Expected IndexedSlices values of shape "
                    f"{expected}. Received: shape={tuple(values.shape)}"
                )
            return IndexedSlices(values, backend.asarray(idx.astype(np.int64), dtype="int64"), grad.dense_shape)
        value = self._as_native(grad, variable)
        if tuple(value.shape) != variable.shape:
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected shape {variable.shape}. "
                f"Received: shape={tuple(value.shape)}"
            )
        return value if variable.layout is None else backend.place(value, variable.layout)

    @staticmethod
    def _as_native(value: Any, variable: Variable) -> Any:
        """A backend array of the variable's dtype from an integer or real floating gradient;
        string, object, bool and complex gradients are refused (never parsed, truncated or
        cast silently)."""
        backend = variable.backend
        native = backend.is_native(value)
        if native:
            name = dtype_name(value.dtype)
            if name == variable.dtype:
                return value
            kind = "f" if "float" in name else ("i" if "int" in name else "c" if "complex" in name else name)
        else:
            try:
                arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            except (TypeError, ValueError) as exc:
                arr, kind = None, f"{type(value).__name__} ({exc})"
            else:
                kind = arr.dtype.kind if arr.dtype.kind in "fiuc" else str(arr.dtype)
                kind = "f" if "float" in str(arr.dtype) else ("i" if kind == "u" else kind)
        if kind not in ("f", "i"):
            what = {"c": "complex"}.get(kind, kind)
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected an integer or real floating array "
                f"(cast to {variable.dtype}). Received: {what} values. Fix: pass the gradient as a float array"
                + (" (the real part, or a real view of both parts)." if kind == "c" else ".")
            )
        try:
            if native:
                return backend.xp.astype(value, variable.value.dtype)
            host = _to_backend(backend, np.asarray(arr, dtype=np.float64) if arr.dtype.kind in "iu" else arr, None)
            return backend.xp.astype(host, variable.value.dtype)
        except (TypeError, ValueError) as exc:
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected a numeric array convertible to "
                f"{variable.dtype}. Received: {type(value).__name__} ({exc})"
            ) from None

    def _densify(self, grad: Any, variable: Variable) -> tuple[Any, Any]:
        """``(dense gradient, touched-row mask or None)``. Duplicate indices are summed first
        (one update per touched row); with the DTensor options untouched rows of the variable
        and slots keep their values, as the TPU embedding and tf_keras' legacy optimizer do;
        with Keras 3's arguments the update is dense, as Keras 3 does."""
        if not isinstance(grad, IndexedSlices):
            return grad, None
        backend = variable.backend
        if self.keras3:  # Keras 3 (and tf_keras' new optimizers) update every row: slots decay
            return self._densify_rows(grad, variable), None
        xp = backend.xp
        n = variable.shape[0]
        dense = backend.segment_sum_to(grad.values, grad.indices, n)
        touched = backend.segment_sum_to(xp.ones_like(grad.values), grad.indices, n) > 0
        if variable.layout is not None:
            dense, touched = backend.place(dense, variable.layout), backend.place(touched, variable.layout)
        return dense, touched

    @staticmethod
    def _densify_rows(grad: IndexedSlices, variable: Variable) -> Any:
        backend = variable.backend
        dense = backend.segment_sum_to(grad.values, grad.indices, variable.shape[0])
        return dense if variable.layout is None else backend.place(dense, variable.layout)

    def _prepare_pairs(self, grads_and_vars: Any) -> list[tuple[Any, Variable]]:
        try:
            pairs = [tuple(p) for p in grads_and_vars]
        except TypeError:
            raise InputError(
                "Invalid `grads_and_vars`. Expected a list of (gradient, variable) pairs. "
                f"Received: grads_and_vars={grads_and_vars!r}"
            ) from None
        if any(len(p) != 2 for p in pairs):
            raise InputError("Invalid `grads_and_vars`. Expected a list of (gradient, variable) pairs.")
        self._check_var_list([v for _, v in pairs], "grads_and_vars")
        return [(g, v) for g, v in pairs]

    # -- steps ----------------------------------------------------------------------------
    def update_step(self, grad: Any, variable: Variable) -> None:
        """Update one variable (and its slots) from one gradient; defined by each algorithm."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_step(grad, variable)")

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Variable]]) -> Variable:
        """One step: unscale, accumulate, clip, check, decay, update, EMA, count the step.

        The order is Keras 3's: gradients divided by ``loss_scale_factor``; with
        ``gradient_accumulation_steps=n`` they are summed into accumulators and every n-th
        call updates with their mean; then clipping, weight decay ``w ← w − w·wd·lr``, the
        update, the EMA. Pairs with a ``None`` gradient are skipped (Keras). Gradients that
        are NaN or Inf after clipping raise ``InputError`` naming the variables, nothing
        changed, unless ``allow_nonfinite=True`` (then they are applied, as Keras does).
        Returns ``iterations``."""
        pairs = self._prepare_pairs(grads_and_vars)
        if not pairs:
            return self.iterations
        given = [(g, v) for g, v in pairs if g is not None]
        if not given:
            raise InputError("No gradients provided for any variable (every gradient is None).")
        if len(given) < len(pairs):
            warnings.warn(f"Gradients do not exist for variables {[v.name for g, v in pairs if g is None]} when "
                          "minimizing the loss; they are not updated (Keras' behaviour).", stacklevel=2)
        if not self.built:  # build checks the variables (dtype) before any gradient is read
            self._check_var_list([v for _, v in pairs], "grads_and_vars")
            for _, v in pairs:
                self._check_trainable(v)
        grads = [self._convert_gradient(g, v) for g, v in given]  # validate before any state exists
        if not self.built:
            self.build([v for _, v in pairs])
        variables = [v for _, v in given]
        for v in variables:
            self._slot_index(v)
        lr = self.learning_rate
        self._check_in_dtype(lr, variables)
        self._step_lr = lr
        self._pending = {}
        self._deferred = []
        self._in_place_ok = not self.use_ema and not self._stateless  # EMA reads the new values back
        try:
            if self.loss_scale_factor is not None:
                grads = [_map_values(g, lambda x: x / self.loss_scale_factor) for g in grads]
            update = True
            if self.gradient_accumulation_steps:
                grads, update = self._accumulate(grads, variables)
            if update:  # the rule applies clipvalue and weight decay to dense gradients
                self._folded = {id(v) for g, v in zip(grads, variables) if not isinstance(g, IndexedSlices)}
                grads = self._clip_and_check(grads, variables)
                self._decay_weights(variables, lr)
                for g, v in zip(grads, variables):
                    self.update_step(g, v)
            if self.use_ema:
                self._update_averages(self._trainable if self.keras3 else variables)
            it = self._counter
            self._write(it, self._read(it) + 1)
            self._commit()
        finally:
            self._pending = None
            self._deferred = []
            self._folded = set()
            self._in_place_ok = True
            self._step_lr = None
        return self.iterations

    def _check_in_dtype(self, lr: float, variables: Sequence[Variable]) -> None:
        """The learning rate and the algorithm's scalars must be finite in each variable's
        dtype (1e39 is finite in float64 and Inf in float32)."""
        scalars = {"learning_rate": lr, **self._dtype_checked_scalars()}
        for v in variables:
            try:
                dt = np.dtype(v.dtype)
            except TypeError:
                dt = np.dtype("float32")  # bfloat16 without ml_dtypes: float32's range
            with np.errstate(over="ignore"):
                for key, value in scalars.items():
                    if value is not None and not np.isfinite(np.asarray(value, dtype=dt)):
                        raise ConfigError(
                            f"Invalid `{key}` for variable {v.name!r}. Expected a value finite in its dtype "
                            f"{v.dtype} (at most {float(np.finfo(dt).max):.4g}). Received: {key}={value!r}"
                        )

    def _dtype_checked_scalars(self) -> dict[str, float | None]:
        """Hyper-parameters that must be finite in the variables' dtype (algorithms add theirs)."""
        return {"weight_decay": self.weight_decay}

    def _accumulate(self, grads: list[Any], variables: Sequence[Variable]) -> tuple[list[Any], bool]:
        """Keras 3's gradient accumulation: add into the accumulators; every n-th call return
        the mean of the n gradients (accumulators reset) and update. Sparse gradients are
        densified first, so the update is then dense, as in Keras."""
        n = self.gradient_accumulation_steps
        dense = [self._densify(g, v)[0] for g, v in zip(grads, variables)]
        accs = [self._accumulators[self._slot_index(v)] for v in variables]
        if (self._calls() + 1) % n != 0:
            if not self.allow_nonfinite and not self._traced:  # never bank a NaN for a later update
                bad = [v.name for v, g in zip(variables, dense) if not _all_finite(self._xp, g)]
                if bad:
                    raise InputError(
                        f"Invalid gradients for {bad}: NaN or Inf. Nothing was accumulated. Fix: check the "
                        "loss, lower the loss scale, or pass `allow_nonfinite=True` to apply them anyway."
                    )
            for acc, g in zip(accs, dense):
                self._write(acc, g + self._read(acc))
            return grads, False
        out = [(g + self._read(acc)) / n for acc, g in zip(accs, dense)]
        for acc in self._accumulators:
            self._write(acc, self._xp.zeros_like(self._read(acc)))
        return out, True

    def _clip_and_check(self, grads: list[Any], variables: Sequence[Variable]) -> list[Any]:
        """Clip (GradientsClipOption), then the NaN policy on the clipped values. ``clipvalue``
        of a gradient the rule clips (``_folded``) is left to the rule: checked here only when
        a raw value is not finite (clipping maps ±Inf into range)."""
        option = self.gradients_clip_option
        xp = self._xp
        values = [g.values if isinstance(g, IndexedSlices) else g for g in grads]
        sums = [sum_squares(xp, x) for x in values] if option.uses_norm else None
        in_rule = [option.active and not option.uses_norm and id(v) in self._folded for v in variables]
        if any(in_rule):
            clipped = [x if r else option.clip(xp, [x])[0] for x, r in zip(values, in_rule)]
        else:
            clipped = option.clip(xp, values, sums) if option.active else values
        if not self.allow_nonfinite and not self._traced:  # traced: values unknown, NaN propagates
            if sums is not None and all(math.isfinite(x) for x in sums):
                bad = []  # Σg² finite: every element finite, and so is the clipped gradient
            elif self._finite(variables, clipped):
                bad = []
            else:
                final = [option.clip(xp, [c])[0] if r else c for c, r in zip(clipped, in_rule)]
                bad = [v.name for v, c in zip(variables, final) if not _all_finite(xp, c)]
            if bad:
                raw = [v.name for v, x in zip(variables, values) if not _all_finite(xp, x)]
                why = (f" (the raw gradients of {raw} are not finite"
                       + (", and global_clipnorm spreads a NaN/Inf norm to every gradient)" if option.global_clipnorm else ")")
                       if raw else " (their norm overflowed the dtype)")
                raise InputError(
                    f"Invalid gradients for {bad}: NaN or Inf after clipping{why}. Nothing was updated. "
                    "Fix: check the loss, lower the loss scale, or pass `allow_nonfinite=True` to apply them anyway."
                )
        return [IndexedSlices(c, g.indices, g.dense_shape) if isinstance(g, IndexedSlices) else c
                for g, c in zip(grads, clipped)]

    def exclude_from_weight_decay(self, var_list: Sequence[Variable] | None = None,
                                  var_names: Sequence[str] | None = None) -> None:
        """Keras: no weight decay for these variables, or for variables whose name contains
        one of ``var_names`` (a regular-expression search). Call before the first step."""
        if self.built:
            raise StateError("Invalid call: exclude_from_weight_decay() after the optimizer was built. Call it first.")
        self._wd_excluded = {id(v) for v in self._check_var_list(var_list or [], "var_list")}
        names = list(var_names or [])
        if any(not isinstance(n, str) for n in names):
            raise ConfigError(f"Invalid `var_names`. Expected strings. Received: var_names={var_names!r}")
        self._wd_pattern = re.compile("|".join(sorted(set(names)))) if names else None

    def _uses_weight_decay(self, v: Variable) -> bool:
        if id(v) in getattr(self, "_wd_excluded", ()):
            return False
        pattern = getattr(self, "_wd_pattern", None)
        return pattern is None or pattern.search(v.name) is None

    def _finite(self, variables: Sequence[Variable], values: Sequence[Any]) -> bool:
        """All of ``values`` finite, in one backend check where the backend has one (JAX: an
        FFI pass on XLA's threads); a torch DTensor goes through its all-reduced sums."""
        backend = variables[0].backend
        if all(backend.sharding_of(x) is None or backend.name == "jax" for x in values):
            return bool(backend.finite_guard(list(values)))
        return all(_all_finite(self._xp, x) for x in values)

    def _decay_weights(self, variables: Sequence[Variable], lr: float) -> None:
        """Keras' decoupled weight decay ``w ← w − w·(wd·lr)`` before the update (core math)."""
        if not self.weight_decay:
            return
        for v in variables:
            if self._uses_weight_decay(v) and id(v) not in self._folded:  # else the rule decays it
                self._write(v, decay_weights(self._xp, self._read(v), self.weight_decay * lr))

    def _update_averages(self, variables: Sequence[Variable]) -> None:
        """tf_keras: ``avg ← m·avg + (1−m)·var`` from an average built at the variable.
        Keras 3: the same, except that the first update (``iterations == 0``) sets the average
        to the variable (momentum 0). Overwrite after updates k, 2k, ... (``ema_overwrite_frequency``)."""
        step = self._step()
        m = self.ema_momentum if (step != 0 or not self.keras3) else 0.0
        freq = self.ema_overwrite_frequency
        overwrite = bool(freq) and (step + 1) % freq == 0
        for v in variables:
            avg = self._averages[self._slot_index(v)]
            new = m * self._read(avg) + (1 - m) * self._read(v)
            self._write(avg, new)
            if overwrite:
                self._write(v, new)

    def finalize_variable_values(self, var_list: Sequence[Variable]) -> None:
        """With EMA, set each variable to its moving average (call once training ends)."""
        var_list = self._check_var_list(var_list, "var_list")
        if not self.use_ema:
            return
        if not self.built:
            raise StateError("Invalid call: finalize_variable_values() before the optimizer was built.")
        indices = [self._slot_index(v) for v in var_list]
        for v, i in zip(var_list, indices):
            v._assign_fresh(self._averages[i].value)

    def compute_gradients(self, loss: Callable[..., Any], var_list: Sequence[Variable],
                          tape: Any = None) -> list[tuple[Any, Variable]]:
        """``[(d loss/d var, var), ...]`` through the backend's own autodiff.

        ``loss`` is a zero-argument callable reading ``var.value`` (Keras style) or a callable
        taking the variables' values positionally (JAX style). NumPy has no autodiff: compute
        the gradients yourself and call ``apply_gradients``."""
        if tape is not None:
            raise InputError(
                "Invalid `tape`. meshembed differentiates with the backend's own autodiff "
                f"(torch autograd, jax.grad); expected None. Received: tape={tape!r}"
            )
        if not callable(loss):
            raise InputError(
                "Invalid `loss`. Expected a callable returning a scalar (zero arguments, or one "
                f"argument per variable). Received: loss={loss!r}"
            )
        var_list = self._check_var_list(var_list, "var_list")
        if not var_list:
            return []
        backend = var_list[0].backend
        if any(v.backend is not backend for v in var_list):
            raise InputError("Invalid `var_list`. Expected variables on one backend.")
        positional = _required_positional(loss) > 0

        def fn(*values: Any) -> Any:
            if positional:
                return loss(*values)
            saved = [v._value for v in var_list]
            try:  # let a Keras-style loss read the traced / graph-tracked values
                for v, x in zip(var_list, values):
                    v._value = x
                return loss()
            finally:
                for v, s in zip(var_list, saved):
                    v._value = s

        _, grads = backend.value_and_grad(fn, [v.value for v in var_list])
        return list(zip(grads, var_list))

    def minimize(self, loss: Callable[..., Any], var_list: Sequence[Variable], tape: Any = None) -> Variable:
        """``apply_gradients(compute_gradients(loss, var_list))``; returns ``iterations``."""
        return self.apply_gradients(self.compute_gradients(loss, var_list, tape=tape))

    # -- config -----------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Keras' config keys: Keras 3's (``loss_scale_factor``, ``gradient_accumulation_steps``,
        which Keras 3 itself reads back) when built from Keras 3's arguments, else tf_keras'
        (``jit_compile``, ``is_legacy_optimizer``; clip and EMA options flattened)."""
        lr = self._learning_rate
        config = {
            "name": self.name,
            "learning_rate": lr if isinstance(lr, float) else schedules.serialize(lr),
            "weight_decay": self.weight_decay,
            **self.gradients_clip_option.get_config(),
            **self.ema_option.get_config(),
        }
        if self.keras3:
            config.update(loss_scale_factor=self.loss_scale_factor,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        else:
            config.update(jit_compile=self.jit_compile, is_legacy_optimizer=False)
        if self.allow_nonfinite:  # meshembed's own key, written only when not the default
            config["allow_nonfinite"] = True
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None,
                    mesh: Mesh | None = None) -> "Optimizer":
        """Inverse of ``get_config``; reads the configs Keras 3 and tf_keras write.

        A config with ``loss_scale_factor`` / ``gradient_accumulation_steps`` is Keras 3's and
        gives Keras 3's semantics; otherwise (tf_keras) the clip/EMA keys become the DTensor
        options. The mesh is not part of a config; pass it here."""
        if not isinstance(config, dict):
            raise ConfigError(f"Invalid `config`. Expected a dict. Received: config={config!r}")
        config = {k: (v.item() if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0 else v)
                  for k, v in config.items()}
        if config.pop("is_legacy_optimizer", False):
            raise ConfigError(
                "Invalid `config`. Expected a config of a new-style (non-legacy) Keras optimizer. "
                "Received: is_legacy_optimizer=True"
            )
        config.pop("decay", None)  # Keras 3 ignores it too (with a warning)
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            config["learning_rate"] = schedules.deserialize(lr, custom_objects)
        keras3 = "loss_scale_factor" in config or "gradient_accumulation_steps" in config
        if not keras3:
            clip = config.pop("gradients_clip_option", None)
            flat_clip = {k: config.pop(k) for k in _CLIP_KEYS if k in config}
            ema = config.pop("ema_option", None)
            flat_ema = {k: config.pop(k) for k in _EMA_KEYS if k in config}
            if isinstance(clip, dict):
                clip = GradientsClipOption.from_config(clip)
            if isinstance(ema, dict):
                ema = EMAOption.from_config(ema)
            if clip is None and any(v is not None for v in flat_clip.values()):
                with warnings.catch_warnings():  # tf_keras wrote it; its warning is for new code
                    warnings.simplefilter("ignore")
                    clip = GradientsClipOption(**{k: (None if v is None else float(v)) for k, v in flat_clip.items()})
            if ema is None and flat_ema:
                ema = EMAOption(**{k: (float(v) if k == "ema_momentum" else v) for k, v in flat_ema.items()})
            config.update(gradients_clip_option=clip, ema_option=ema)
        else:
            config.pop("jit_compile", None)
        try:
            return cls(**config, mesh=mesh)
        except TypeError as exc:
            raise ConfigError(f"Invalid `config` for {cls.__name__}: {exc}. Received keys: {sorted(config)}") from None

    # -- state: Keras 3's variable store and stateless step ------------------------------------
    def save_own_variables(self, store: Any) -> None:
        """``store[str(i)] = variables[i].numpy()`` (Keras 3's layout, without its learning-rate
        variable): a dict or an h5 group; loads on any backend and mesh."""
        for i, v in enumerate(self.variables):
            store[str(i)] = v.numpy()

    def load_own_variables(self, store: Any) -> None:
        """Assign ``variables`` from a store written by ``save_own_variables`` (any backend or
        mesh) or by Keras 3 (one more entry: its learning-rate variable at "1", which sets a
        float learning rate). Everything is checked before anything is assigned."""
        if not self.built:
            raise StateError(
                f"Invalid call: load_own_variables() before optimizer {self.name!r} was built. "
                "Call build(var_list) (or one apply_gradients) first, then load."
            )
        variables = self.variables
        try:
            keys = list(store.keys())
            values = {k: np.asarray(store[k]) for k in keys}
        except Exception as exc:  # noqa: BLE001 - any store failure is the store's
            raise CheckpointError(f"Invalid `store`. Expected a mapping of '0', '1', ... to arrays ({exc}).") from None
        lr_value = None
        if len(keys) == len(variables) + 1 and "1" in values and values["1"].shape == ():
            lr_value = float(values["1"])  # Keras 3: [iteration, learning_rate, ...]
            order = ["0", *[str(i) for i in range(2, len(keys))]]
        else:
            order = [str(i) for i in range(len(keys))]
        if len(order) != len(variables) or set(order) - set(values):
            raise CheckpointError(
                f"Invalid `store` for optimizer {self.name!r}. Expected {len(variables)} variables "
                f"({[v.name for v in variables]}) under keys '0'..'{len(variables) - 1}' (or Keras 3's layout with "
                f"its learning rate at '1'). Received keys: {sorted(keys)}"
            )
        for v, k in zip(variables, order):
            x = values[k]
            kind_ok = x.dtype.kind in ("i", "u") if v is variables[0] else x.dtype.kind == "f" or "float" in str(x.dtype)
            if tuple(x.shape) != v.shape or not kind_ok:
                raise CheckpointError(
                    f"Invalid `store` entry '{k}' for {v.name!r}. Expected shape {v.shape} and a "
                    f"{'integer' if v is variables[0] else 'float'} dtype. Received: shape={tuple(x.shape)}, dtype={x.dtype}"
                )
        if lr_value is not None and not callable(self._learning_rate):
            _check_learning_rate(lr_value)
        for v, k in zip(variables, order):
            v.assign(values[k])
        if lr_value is not None and not callable(self._learning_rate):
            self._learning_rate = lr_value

    def scale_loss(self, loss: Any) -> Any:
        """Keras 3: ``loss · loss_scale_factor`` (the gradients are divided by it again)."""
        return loss if self.loss_scale_factor is None else loss * self.loss_scale_factor

    def __getstate__(self) -> dict:
        """Pickle by backend name (a backend holds modules); compiled kernels are rebuilt."""
        state = dict(self.__dict__)
        state["_backend"] = getattr(self._backend, "name", self._backend)
        state["_compile_cache"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self._backend, str):
            from meshembed.backend import get_backend

            self._backend = get_backend(self._backend)
        self._index = {id(v): i for i, v in enumerate(self._trainable)}

    def get_weights(self) -> list[np.ndarray]:
        """NumPy copies of ``variables`` (tf_keras / Keras 3)."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``variables`` from arrays in their order (checked first, as ``load_own_variables``)."""
        if not self.built:
            raise StateError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. Call "
                "`optimizer.build(trainable_variables)` first."
            )
        self.load_own_variables({str(i): w for i, w in enumerate(weights)})

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Keras 3's pure step: ``(new trainable values, new optimizer values)`` from values
        given in the order of the built variables and of ``variables``. Nothing of this
        optimizer or its variables changes, and the given arrays are never written or donated."""
        if not self.built:
            raise StateError(
                f"Invalid call: stateless_apply() before {type(self).__name__} was built. "
                "Call optimizer.build(trainable_variables) first."
            )
        opt_vars = list(optimizer_variables)
        train = list(trainable_variables)
        grads = list(grads)
        if len(opt_vars) != len(self.variables):
            raise InputError(
                f"Invalid `optimizer_variables`. Expected {len(self.variables)} values, one per "
                f"optimizer.variables. Received: {len(opt_vars)}"
            )
        if len(train) != len(self._trainable) or len(grads) != len(self._trainable):
            raise InputError(
                f"Invalid `trainable_variables`/`grads`. Expected {len(self._trainable)} of each (the variables "
                f"the optimizer was built with). Received: {len(train)} values and {len(grads)} gradients"
            )
        traced = not all(_concrete(x) for x in [*train, *opt_vars, *grads] if x is not None)
        if traced:  # inside jax.jit: only what needs no host value of the step or the norms
            needs = [k for k, on in (("a learning-rate schedule", callable(self._learning_rate)),
                                     ("EMA", self.use_ema), ("gradient accumulation", self.gradient_accumulation_steps),
                                     ("norm clipping", self.gradients_clip_option.uses_norm)) if on]
            if needs:
                raise StateError(
                    f"Invalid call: stateless_apply() under tracing (jax.jit) with {', '.join(needs)}, which "
                    "need host values of the step counter or the gradient norms. Fix: call it outside jit, "
                    "or use me.jax.adadelta (an optax transformation) inside jit."
                )
        targets = [*self._trainable, *self.variables]
        saved = [v._value for v in targets]
        self._stateless = True
        self._traced = traced
        try:
            for v, x in zip(targets, [*train, *opt_vars]):
                v._value = v._prepare(x, copy=False)
            self.apply_gradients(zip(grads, self._trainable))
            return [v._value for v in self._trainable], [v._value for v in self.variables]
        finally:
            for v, x in zip(targets, saved):
                v._value = x
            self._stateless = False
            self._traced = False

    def __deepcopy__(self, memo: dict) -> "Optimizer":
        """A copy with its own variables; the backend, mesh and compiled kernels are shared
        (they are process-wide objects, not state)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in ("_backend", "mesh"):
                new.__dict__[key] = value
            elif key == "_compile_cache":
                new.__dict__[key] = {}
            else:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._index = {id(v): i for i, v in enumerate(new._trainable)}
        return new


def _map_values(grad: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` of a dense gradient, or of an ``IndexedSlices``' values."""
    if isinstance(grad, IndexedSlices):
        return IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def _all_finite(xp: Any, x: Any) -> bool:
    """Every element finite; one sum first (NaN/Inf propagate), the element test only when
    that sum is not finite. Works on a torch DTensor (the reductions are all-reduced)."""
    def host(v: Any) -> bool:
        full = getattr(v, "full_tensor", None)
        return bool(full() if callable(full) else v)

    return host(xp.isfinite(xp.sum(x))) or host(xp.all(xp.isfinite(x)))


def _concrete(x: Any) -> bool:
    """Whether ``x`` has values on the host now (False for a tracer inside ``jax.jit``)."""
    try:
        np.asarray(x) if not hasattr(x, "aval") else x.__array__()  # noqa: B018
        return True
    except Exception:  # noqa: BLE001 - a tracer's conversion error (jax's own exception types)
        return False


def _check_schedule_value(value: Any, schedule: Any) -> float:
    try:
        ok = not isinstance(value, (str, bytes, bool)) and np.ndim(value) == 0
        out = float(value) if ok else math.nan
    except (TypeError, ValueError):
        out = math.nan
    if not (math.isfinite(out) and out >= 0):
        raise ConfigError(
            f"Invalid learning rate from {schedule!r}. Expected a non-negative finite number. Received: {value!r}"
        )
    return out


class _InPlace(NamedTuple):
    """One staged in-place update: ``rule`` on ``grad`` with the call-time ``values``
    (floats), written over ``targets`` (the variable's array, then its slots'), the arrays of
    ``variables`` (rebound to the results where the backend returns new arrays)."""

    backend: Any
    rule: UpdateRule
    grad: Any
    values: tuple
    targets: tuple
    variables: tuple

    def same_kernel(self, other: "_InPlace") -> bool:
        return self.backend is other.backend and self.rule == other.rule and len(self.targets) == len(other.targets)


def _pure_step(xp: Any, rule: UpdateRule) -> Callable[..., tuple]:
    """``step(grad, values, *targets) -> new targets``: :func:`apply_rule` over ``xp``."""

    def step(grad: Any, values: Sequence[Any], *targets: Any) -> tuple:
        return apply_rule(xp, rule, values, grad, *targets)

    return step


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return 1
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is inspect.Parameter.empty)
