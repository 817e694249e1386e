"""The optimizer's state: the step counter, the learning rate of the step, building the
slots (co-sharded with their variables), and the transactional read/write of a step (values are
staged and assigned together at commit, so an error changes nothing).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import array_api_compat
import numpy as np

from meshembed.backend import memory
from meshembed.errors import ConfigError, InputError, StateError
from meshembed.optimizers.config import check_learning_rate, _check_schedule_value, _required_positional
from meshembed.sharding.mesh import Layout
from meshembed.variable import Variable, Fresh, dtype_name

__all__ = ["VariablesMixin"]


#: What a dense slot too large to allocate should be changed to.
_SLOT_FIX = ("free memory, shard the variables over more devices (a larger `mesh`), or use a lower-precision "
             "dtype for them (the slots take the variable's dtype).")


def _all_or_nothing(build: Callable[..., None]) -> Callable[..., None]:
    """``build`` either completes or leaves the optimizer as it was (a failed slot allocation
    half-way through would otherwise leave some slots made and ``built`` half set)."""

    @functools.wraps(build)
    def wrapper(self: Any, var_list: Any) -> None:
        if self.__dict__.get("_building") or self.__dict__.get("built"):
            return build(self, var_list)
        saved = {k: (v.copy() if type(v) in (list, dict) else v) for k, v in self.__dict__.items()}
        self._building = True
        try:
            build(self, var_list)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise
        finally:
            self.__dict__.pop("_building", None)

    return wrapper


class VariablesMixin:
    """The step counter, the learning rate, the slots and the staged reads/writes of a step.

    One part of :class:`~meshembed.optimizers.Optimizer`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "build" in cls.__dict__:  # every algorithm's build is all-or-nothing (_all_or_nothing)
            cls.build = _all_or_nothing(cls.__dict__["build"])

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
    def step_counter(self) -> Variable:
        """The variable counting ``apply_gradients`` calls (``variables[0]``; ``iterations``
        divides it by ``gradient_accumulation_steps``)."""
        return self._counter

    @property
    def averages(self) -> list[Variable]:
        """The EMA averages of the variables, in ``build`` order (empty without EMA)."""
        return list(self._averages)

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
        new = check_learning_rate(value)
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
    @_all_or_nothing
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
        """Floating variables: real, or complex64/complex128 (optimised as torch.optim does, on
        their real view: :func:`~meshembed.optimizers.step.real_dtype`). An integer one
        would truncate every update."""
        name = v.dtype
        if "float" not in name and not name.endswith(("complex64", "complex128")):
            raise InputError(
                f"Invalid variable {v.name!r}. Expected a floating dtype (float16/bfloat16/float32/float64, "
                f"or complex64/complex128). Received: dtype={v.dtype}. Fix: create it with a float dtype "
                "(e.g. dtype='float32')."
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
        if initializer not in ("zeros", "ones") and not callable(initializer):
            raise ConfigError(
                "Invalid `initializer`. Expected 'zeros', 'ones' or a callable (shape, dtype). "
                f"Received: initializer={initializer!r}"
            )
        layout = None if self.mesh is None else Layout.replicated(self.mesh, len(shape))
        with memory.allocating(f"optimizer variable {name!r} of {self.name!r}", shape, dtype, fix=_SLOT_FIX,
                               nothing="The optimizer is unchanged."):
            if initializer == "zeros":
                value = Fresh(np.zeros(shape, dtype=dtype))
            elif initializer == "ones":
                value = Fresh(np.ones(shape, dtype=dtype))
            else:
                value = initializer(shape, dtype)
            var = Variable(value, name=name, layout=layout, trainable=False, backend=get_backend(self._backend),
                           dtype=dtype)
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
        name = f"{variable_name}/{model_variable.name}"
        with memory.allocating(f"optimizer slot {name!r} of {self.name!r} on backend {backend.name!r}",
                               tuple(model_variable.shape), model_variable.dtype, fix=_SLOT_FIX,
                               nothing="The optimizer is unchanged."):
            if initial_value is None:  # zeros made for this slot alone, adopted without a copy
                ref, xp = model_variable.value, backend.xp
                initial_value = Fresh(xp.zeros_like(ref) if backend.sharding_of(ref) is not None else
                                       xp.zeros(ref.shape, dtype=ref.dtype, device=array_api_compat.device(ref)))
            var = Variable(initial_value, name=name, layout=model_variable.layout,
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
            variable.assign_fresh(value)

    def _commit(self) -> None:
        pending, self._pending = self._pending or {}, None
        deferred, self._deferred = self._deferred, []
        placed = [(v, v.prepare_value(val, copy=False)) for v, val in pending.values()]
        # Every step was built and validated; only now do the staged in-place updates run
        # (they cannot fail on valid arrays — a compiler failure falls back to eager inside
        # the backend —, short of running out of memory mid-commit).
        self._run_in_place(deferred)
        for v, val in placed:
            v.adopt(val)

    @property
    def _xp(self) -> Any:
        from meshembed.backend import get_backend

        return get_backend(self._backend).xp
