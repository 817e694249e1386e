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
and ~3× less memory traffic. Those in-place updates are staged like every other write and only
run at commit, after every step of every variable has been built and validated, so an error
still leaves everything unchanged. Variables updated this way keep their array object: a
reference taken from ``variable.value`` sees the new values (as with Keras and torch.optim).
On JAX (immutable arrays) the staged step is jitted with the old buffers donated and the
variables hold the results: a reference taken before the step is then a deleted array, as
with any donating ``jax.jit`` step (``optax`` training loops alike).
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import array_api_compat
import numpy as np

from meshembed.errors import ConfigError, InputError, StateError
from meshembed.optimizers import schedules
from meshembed.optimizers.options import EMAOption, GradientsClipOption
from meshembed.sharding.mesh import Layout, Mesh
from meshembed.variable import IndexedSlices, Variable, _Fresh, dtype_name

__all__ = ["Optimizer"]

_CLIP_KEYS = ("clipnorm", "global_clipnorm", "clipvalue")
_EMA_KEYS = ("use_ema", "ema_momentum", "ema_overwrite_frequency")


def _check_learning_rate(value: Any) -> Any:
    if isinstance(value, schedules.LearningRateSchedule) or (callable(value) and not isinstance(value, numbers.Real)):
        return value
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
    ) -> None:
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
        self._pending: dict[int, tuple[Variable, Any]] | None = None
        self._deferred: list[_InPlace] = []  # in-place updates staged for the commit
        self._lr_arrays: dict[tuple, Any] = {}  # this step's learning rate as 0-d arrays
        self._in_place_ok = True  # False while a step must read staged values back (EMA)
        self._step_lr: float | None = None
        self._compile_cache: dict[tuple, Callable[..., Any]] = {}  # (backend, make, in_place)

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
        """Steps taken so far: an int64 variable replicated over the mesh."""
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
        """``[iterations, *optimizer variables in creation order]``."""
        return [self.iterations, *self._variables]

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next step (a schedule evaluated at ``iterations``)."""
        if self._step_lr is not None:
            return self._step_lr
        lr = self._learning_rate
        if callable(lr):  # a schedule of the step, or (Keras legacy) a zero-argument callable
            return float(lr(self._step()) if _required_positional(lr) else lr())
        return lr

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if callable(self._learning_rate):
            raise TypeError(
                "This optimizer was created with a learning-rate schedule, so its learning rate "
                "is not settable; create the optimizer with a float `learning_rate` instead."
            )
        self._learning_rate = _check_learning_rate(value)

    def _step(self) -> int:
        return int(self.iterations.numpy())

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
        if self.use_ema:
            self._averages = [self.add_variable_from_reference(v, "average", initial_value=v.value) for v in var_list]
        self.built = True

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
            self._iterations = self._make_iterations(self._backend, self._step())

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

    def _compiled(self, backend: Any, make: Callable[[Any], Callable[..., Any]],
                  in_place: int = 0) -> Callable[..., Any]:
        """``make(xp)`` once per backend, through ``backend.compile`` (which compiles where it
        pays). ``in_place=n``: instead, one function that runs the step for ``n`` variables
        and writes each result over its array (see ``Backend.compile_update``)."""
        key = (backend.name, make, in_place)
        fn = self._compile_cache.get(key)
        if fn is None:
            fn = make(backend.xp)
            fn = backend.compile_update(fn, in_place) if in_place else backend.compile(fn)
            self._compile_cache[key] = fn
        return fn

    def _run_in_place(self, updates: Sequence["_InPlace"]) -> None:
        """Run staged in-place updates, up to ``backend.in_place_group(step)`` consecutive ones
        of the same step in one compiled call: a compiled call costs ~0.1 ms of dispatch and
        guards, so 64 variables of 2¹⁸ floats took 16 ms one by one and 9.6 ms in groups of 8
        (16: 8.8 ms, but a cold XLA compile grows with the group: 12 s for 8, 15 s for 16;
        JAX's fused kernel compiles in no time and takes 64)."""
        # A gradient may be another (or the same) variable's own array: copy it before any
        # update overwrites or donates that array, so every step reads the values it was given.
        written = {id(t) for u in updates for t in u.targets}
        updates = [u._replace(grad=u.backend.xp.asarray(u.grad, copy=True)) if id(u.grad) in written else u
                   for u in updates]
        i = 0
        while i < len(updates):
            first = updates[i]
            limit = first.backend.in_place_group(first.make(first.backend.xp))
            j = i + 1
            while j < len(updates) and j - i < limit and updates[j].same_kernel(first):
                j += 1
            group = updates[i:j]
            kernel = self._compiled(first.backend, first.make, in_place=len(group))
            new = kernel([u.grad for u in group], [u.lr for u in group],
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

    def _apply_step(self, targets: Sequence[Variable], grad: Any, touched: Any,
                    make: Callable[[Any], Callable[..., Any]]) -> None:
        """Run ``make(xp)``'s step ``step(grad, lr, *target_values) -> new target values``
        for ``targets`` (a model variable, then its slots) and stage the results; with
        ``touched`` (a sparse gradient's row mask) only those rows change.

        A dense step that may run in place (:meth:`_can_update_in_place`) is staged as a
        compiled in-place update run at commit; the learning rate is then passed as a 0-d
        array, so a schedule does not specialise (and recompile) the kernel per value."""
        variable = targets[0]
        backend = variable.backend
        lr = self.learning_rate
        if touched is None and self._can_update_in_place(targets):
            value = variable.value
            key = (backend.name, value.dtype, array_api_compat.device(value))
            lr_arg = self._lr_arrays.get(key) if self._pending is not None else None
            if lr_arg is None:  # one 0-d array per step and dtype, shared by every variable
                lr_arg = backend.xp.asarray(lr, dtype=value.dtype, device=key[2])
                if self._pending is not None:
                    self._lr_arrays[key] = lr_arg
            update = _InPlace(backend, make, grad, lr_arg, tuple(t.value for t in targets), tuple(targets))
            if self._pending is None:  # update_step called on its own: apply now
                self._run_in_place([update])
            else:
                self._deferred.append(update)
            return
        step = self._compiled(backend, make)
        new = step(grad, lr, *(self._read(t) for t in targets))
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
        backend = variable.backend
        try:
            if backend.is_native(value) and dtype_name(value.dtype) == variable.dtype:
                return value
            if backend.is_native(value):
                return backend.xp.astype(value, backend.asarray(np.zeros((), variable.dtype)).dtype)
            arr = np.asarray(value)
            if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
                raise TypeError(arr.dtype)
            return backend.asarray(arr, dtype=variable.dtype)
        except (TypeError, ValueError) as exc:
            raise InputError(
                f"Invalid gradient for {variable.name!r}. Expected a numeric array convertible to "
                f"{variable.dtype}. Received: {type(value).__name__} ({exc})"
            ) from None

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        """Apply the GradientsClipOption to the dense arrays / slices' rows."""
        if not self.gradients_clip_option.active:
            return grads
        values = [g.values if isinstance(g, IndexedSlices) else g for g in grads]
        clipped = self.gradients_clip_option.clip(self._xp, values)
        return [IndexedSlices(c, g.indices, g.dense_shape) if isinstance(g, IndexedSlices) else c
                for g, c in zip(grads, clipped)]

    def _densify(self, grad: Any, variable: Variable) -> tuple[Any, Any]:
        """``(dense gradient, touched-row mask or None)``. Duplicate indices are summed first
        (one update per touched row); untouched rows of the variable and slots keep their
        values, as the TPU embedding and tf_keras' legacy optimizer do."""
        if not isinstance(grad, IndexedSlices):
            return grad, None
        backend = variable.backend
        xp = backend.xp
        n = variable.shape[0]
        dense = backend.segment_sum_to(grad.values, grad.indices, n)
        touched = backend.segment_sum_to(xp.ones_like(grad.values), grad.indices, n) > 0
        if variable.layout is not None:
            dense, touched = backend.place(dense, variable.layout), backend.place(touched, variable.layout)
        return dense, touched

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
        """One step: clip, update every variable, update EMA, count the step.

        Pairs with a ``None`` gradient are skipped (Keras). Returns ``iterations``."""
        pairs = self._prepare_pairs(grads_and_vars)
        if not pairs:
            return self.iterations
        given = [(g, v) for g, v in pairs if g is not None]
        if not given:
            raise InputError("No gradients provided for any variable (every gradient is None).")
        grads = [self._convert_gradient(g, v) for g, v in given]  # validate before any state exists
        if not self.built:
            self.build([v for _, v in pairs])
        variables = [v for _, v in given]
        for v in variables:
            self._slot_index(v)
        self._step_lr = self.learning_rate
        self._pending = {}
        self._deferred = []
        self._in_place_ok = not self.use_ema  # EMA reads the new values back before the commit
        try:
            grads = self._clip_gradients(grads)
            for g, v in zip(grads, variables):
                self.update_step(g, v)
            if self.use_ema:
                self._update_averages(variables)
            it = self.iterations
            self._write(it, self._read(it) + 1)
            self._commit()
        finally:
            self._pending = None
            self._deferred = []
            self._lr_arrays = {}
            self._in_place_ok = True
            self._step_lr = None
        return self.iterations

    def _update_averages(self, variables: Sequence[Variable]) -> None:
        m = self.ema_momentum
        overwrite = self.ema_overwrite_frequency is not None and (self._step() + 1) % self.ema_overwrite_frequency == 0
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
        """Keras' config keys (clip and EMA options flattened as Keras writes them)."""
        lr = self._learning_rate
        return {
            "name": self.name,
            "weight_decay": None,
            **self.gradients_clip_option.get_config(),
            **self.ema_option.get_config(),
            "jit_compile": self.jit_compile,
            "is_legacy_optimizer": False,
            "learning_rate": lr if isinstance(lr, float) else schedules.serialize(lr),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None,
                    mesh: Mesh | None = None) -> "Optimizer":
        """Inverse of ``get_config``; also reads tf_keras / Keras 3 optimizer configs.

        The mesh is not part of a config; pass it here."""
        if not isinstance(config, dict):
            raise ConfigError(f"Invalid `config`. Expected a dict. Received: config={config!r}")
        config = dict(config)
        if config.pop("is_legacy_optimizer", False):
            raise ConfigError(
                "Invalid `config`. Expected a config of a new-style (non-legacy) Keras optimizer. "
                "Received: is_legacy_optimizer=True"
            )
        wd = config.pop("weight_decay", None)
        if wd not in (None, 0, 0.0):
            raise ConfigError(
                f"Invalid `weight_decay`. Expected None ({cls.__name__} has no weight decay). Received: weight_decay={wd!r}"
            )
        clip = config.pop("gradients_clip_option", None)
        flat_clip = {k: config.pop(k) for k in _CLIP_KEYS if k in config}
        ema = config.pop("ema_option", None)
        flat_ema = {k: config.pop(k) for k in _EMA_KEYS if k in config}
        if isinstance(clip, dict):
            clip = GradientsClipOption.from_config(clip)
        if isinstance(ema, dict):
            ema = EMAOption.from_config(ema)
        if clip is None and any(v is not None for v in flat_clip.values()):
            clip = GradientsClipOption(**{k: (None if v is None else float(v)) for k, v in flat_clip.items()})
        if ema is None and flat_ema:
            ema = EMAOption(**{k: (float(v) if k == "ema_momentum" else v) for k, v in flat_ema.items()})
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            config["learning_rate"] = schedules.deserialize(lr, custom_objects)
        elif isinstance(lr, (np.generic, np.ndarray)):
            config["learning_rate"] = float(lr)
        for key in ("rho", "epsilon"):
            if isinstance(config.get(key), np.generic):
                config[key] = float(config[key])
        try:
            return cls(**config, gradients_clip_option=clip, ema_option=ema, mesh=mesh)
        except TypeError as exc:
            raise ConfigError(f"Invalid `config` for {cls.__name__}: {exc}. Received keys: {sorted(config)}") from None


class _InPlace(NamedTuple):
    """One staged in-place update: ``make(backend.xp)``'s step on ``grad`` and ``lr``,
    written over ``targets`` (the variable's array, then its slots'), the arrays of
    ``variables`` (rebound to the results where the backend returns new arrays)."""

    backend: Any
    make: Callable[[Any], Callable[..., Any]]
    grad: Any
    lr: Any
    targets: tuple
    variables: tuple

    def same_kernel(self, other: "_InPlace") -> bool:
        return self.backend is other.backend and self.make == other.make and len(self.targets) == len(other.targets)


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return 1
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is inspect.Parameter.empty)
