"""The step loop: ``apply_gradients`` (unscale, accumulate, clip, check, update, EMA, count),
the per-variable :class:`~meshembed.math.UpdateRule` handed to the backend with the learning
rate as a call-time value, the staged in-place updates run at commit, ``stateless_apply``,
``compute_gradients`` and ``minimize``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from meshembed.backend import memory
from meshembed.errors import ConfigError, InputError, StateError
from meshembed.math.rule import UpdateRule, apply_rule, build_rule
from meshembed.optimizers.config import _required_positional
from meshembed.optimizers.gradients import _divide, _map_values
from meshembed.variable import IndexedSlices, Variable

__all__ = ["StepMixin", "check_in_dtype", "real_dtype"]


def real_dtype(name: str) -> str:
    """The dtype a variable of dtype ``name`` is optimised in: itself for a real one, the
    dtype of its parts for a complex one (``"complex64"`` -> ``"float32"``, ``"complex128"`` ->
    ``"float64"``, a namespace prefix kept). A complex variable is optimised as
    ``torch.optim`` optimises a complex parameter: as its real view ``[..., 2]``, real and
    imaginary parts two independent reals (``Backend.real_view``); its slots stay complex
    (``accumulated_grad`` holds ``E[re(g)²] + i·E[im(g)²]``, as torch's ``square_avg``)."""
    if name.endswith("complex64"):
        return name[: -len("complex64")] + "float32"
    if name.endswith("complex128"):
        return name[: -len("complex128")] + "float64"
    return name


def check_in_dtype(scalars: dict[str, Any], variable: str, dtype: Any) -> None:
    """Each of ``scalars`` (None: unset) must be finite in ``dtype``: 1e39 is finite in float64
    and Inf in float32, and would turn every update of that variable into Inf/NaN. A
    ``ConfigError`` names the scalar and the variable (one check for every front end)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = np.dtype("float32")  # bfloat16 without ml_dtypes: float32's range
    with np.errstate(over="ignore"):
        for key, value in scalars.items():
            if value is not None and not np.isfinite(np.asarray(value, dtype=dt)):
                raise ConfigError(
                    f"Invalid `{key}` for variable {variable!r}. Expected a value finite in its dtype "
                    f"{dtype} (at most {float(np.finfo(dt).max):.4g}). Received: {key}={value!r}"
                )


class StepMixin:
    """The step loop and the update rule handed to the backend.

    One part of :class:`~meshembed.optimizers.Optimizer`."""

    #: The algorithm's name in ``meshembed.math`` (each subclass sets it).
    _algorithm: str = ""

    def _static_hyperparameters(self) -> dict[str, float]:
        """The algorithm's hyper-parameters besides the learning rate (fixed per optimizer)."""
        return {}

    def _dynamic_hyperparameters(self) -> dict[str, float]:
        """Hyper-parameters given as callables (tf_keras), by name, evaluated for this step:
        call-time values of the rule after the learning rate (changing them never recompiles)."""
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
        dtype = real_dtype(variable.dtype)  # a complex variable's rule runs on its real view
        key = (dtype, clipvalue, decay)
        rule = self._rules.get(key)
        if rule is None:
            rule = build_rule(
                self._algorithm, self._static_hyperparameters(), tuple(self._dynamic_hyperparameters()),
                gradient_clip=None if clipvalue is None else (-clipvalue, clipvalue), weight_decay=float(decay or 0.0),
                multiply_weight_decay_by_lr=True, lazy=False, dtype=dtype,
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
        """Run staged in-place updates, up to ``backend.in_place_group(rule)`` consecutive ones
        of the same rule in one call: each compiled call pays dispatch and guards, so
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
                        u.variables[k].adopt(u.backend.from_real_view(value) if u.real_view else value)
            else:  # written in place; where a complex variable's real view was a copy: back
                for u in (u for u in group if u.real_view):
                    for v, view in zip(u.variables, u.targets):
                        if not u.backend.real_view_aliases(v.value):
                            v.adopt(u.backend.from_real_view(view))
            i = j

    def _can_update_in_place(self, targets: Sequence[Variable]) -> bool:
        """A dense step may overwrite ``targets`` in place: the backend updates
        in place (NumPy and torch write into the arrays, JAX donates them), nothing in this step reads
        their staged values back (no EMA), none of them has a staged value already, and the
        backend accepts each array (``can_update_in_place``: not a DTensor, one JAX device)."""
        backend = targets[0].backend
        if not self._in_place_ok:
            return False
        in_place = self._in_place_backends.get(backend)
        if in_place is None:  # asked once a step, not once a variable (each ask ~2 us on torch)
            in_place = backend.capabilities.in_place
            if self._pending is not None:
                self._in_place_backends[backend] = in_place
        if not in_place:
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
        the learning rate as ``backend.step_values`` gives it (a Python float for a sharded or
        traced value), so a schedule does not specialise (and recompile) it per value."""
        variable = targets[0]
        backend = variable.backend
        dynamic = self._dynamic_hyperparameters()
        values = (self.learning_rate, *(dynamic[k] for k in sorted(dynamic)))  # the rule's `dynamic` order
        rule = self._rule(variable, touched is None and id(variable) in self._folded)
        if real_dtype(variable.dtype) != variable.dtype:
            self._apply_complex_step(rule, values, targets, grad, touched)
            return
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
        new = step(grad, values if plain else backend.step_values(values, current[0]), *current)
        for t, value in zip(targets, new):
            self._write(t, value, touched)

    def _apply_complex_step(self, rule: UpdateRule, values: tuple, targets: Sequence[Variable], grad: Any,
                            touched: Any) -> None:
        """:meth:`_apply_step` of a complex variable: ``rule`` (built for the real dtype) over
        the real views ``[..., 2]`` of the gradient, the variable and its slots, as torch.optim
        runs a complex parameter. A dense step that may run in place runs the backend's fast
        path of a real variable of that shape on the views: NumPy and torch write through them
        into the complex storage (:meth:`Backend.real_view_aliases`), JAX donates the views
        (fresh arrays) and its new real arrays are made complex again. Otherwise (an Array API
        namespace, EMA, a sparse step) the pure step runs on the views, the results made complex."""
        backend = targets[0].backend
        if touched is None and self._can_update_in_place(targets):
            real_grad = backend.real_view(grad)
            if backend.real_view_aliases(grad):  # it may view an array this step overwrites
                real_grad = backend.xp.asarray(real_grad, copy=True)
            views = tuple(backend.real_view(t.value) for t in targets)
            update = _InPlace(backend, rule, real_grad, values, views, tuple(targets), real_view=True)
            if self._pending is None:  # update_step called on its own: apply now
                self._run_in_place([update])
            else:
                self._deferred.append(update)
            return
        current = [backend.real_view(self._read(t)) for t in targets]
        plain = self._traced or backend.sharding_of(current[0]) is not None
        step = self._compiled(backend, rule)
        new = step(backend.real_view(grad), values if plain else backend.step_values(values, current[0]), *current)
        for t, value in zip(targets, new):
            self._write(t, backend.from_real_view(value), touched)

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
        grads = []
        for g, v in given:  # validate (and place) before any state exists
            with memory.allocating(f"the gradient of variable {v.name!r} on backend {v.backend.name!r}",
                                   tuple(v.shape), v.dtype, nothing="The variables and the optimizer are unchanged."):
                grads.append(self._convert_gradient(g, v))
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
                grads = [_map_values(g, lambda x, v=v: _divide(v.backend, x, self.loss_scale_factor))
                         for g, v in zip(grads, variables)]
            update = True
            if self.gradient_accumulation_steps:
                grads, update = self._accumulate(grads, variables)
            if update:  # the rule applies clipvalue and weight decay to dense gradients
                self._folded = {id(v) for g, v in zip(grads, variables) if not isinstance(g, IndexedSlices)}
                grads = self._clip_and_check(grads, variables)
                self._decay_weights(variables, lr)
                for g, v in zip(grads, variables):  # the new values (and temporaries): nothing is written before commit
                    with memory.allocating(f"the {self.name!r} step of variable {v.name!r} (its new value and slots)",
                                           tuple(v.shape), v.dtype, arrays=1 + len(self._variables) // max(1, len(self._trainable)),
                                           nothing="The variables, slots and step counter are unchanged."):
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
            self._in_place_backends = {}
            self._step_lr = None
        return self.iterations

    def _check_in_dtype(self, lr: float, variables: Sequence[Variable]) -> None:
        """The learning rate and the algorithm's scalars must be finite in each variable's dtype."""
        scalars = {"learning_rate": lr, **self._dtype_checked_scalars()}
        first_of_dtype = {}  # one check per dtype (a step of many variables asked per variable)
        for v in variables:
            first_of_dtype.setdefault(v.dtype, v)
        for dtype, v in first_of_dtype.items():
            check_in_dtype(scalars, v.name, dtype)

    def _dtype_checked_scalars(self) -> dict[str, float | None]:
        """Hyper-parameters that must be finite in the variables' dtype (algorithms add theirs)."""
        return {"weight_decay": self.weight_decay}

    def compute_gradients(self, loss: Callable[..., Any], var_list: Sequence[Variable],
                          tape: Any = None) -> list[tuple[Any, Variable]]:
        """``[(d loss/d var, var), ...]`` through the backend's own autodiff.

        ``loss`` is a zero-argument callable reading ``var.value`` (Keras style) or a callable
        taking the variables' values positionally (JAX style); ``var_list`` a list of variables
        or one variable. NumPy has no autodiff: compute
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
        if isinstance(var_list, Variable):  # one variable, as tf_keras' legacy minimize takes (tf.nest.flatten)
            var_list = [var_list]
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
            saved = [v.value for v in var_list]
            try:  # let a Keras-style loss read the traced / graph-tracked values
                for v, x in zip(var_list, values):
                    v.adopt(x)
                return loss()
            finally:
                for v, s in zip(var_list, saved):
                    v.adopt(s)

        _, grads = backend.value_and_grad(fn, [v.value for v in var_list])
        return list(zip(grads, var_list))

    def minimize(self, loss: Callable[..., Any], var_list: Sequence[Variable], tape: Any = None) -> Variable:
        """``apply_gradients(compute_gradients(loss, var_list))``; returns ``iterations``."""
        return self.apply_gradients(self.compute_gradients(loss, var_list, tape=tape))

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
        saved = [v.value for v in targets]
        self._stateless = True
        self._traced = traced
        try:
            for v, x in zip(targets, [*train, *opt_vars]):
                v.adopt(v.prepare_value(x, copy=False))
            self.apply_gradients(zip(grads, self._trainable))
            return [v.value for v in self._trainable], [v.value for v in self.variables]
        finally:
            for v, x in zip(targets, saved):
                v.adopt(x)
            self._stateless = False
            self._traced = False


def _concrete(x: Any) -> bool:
    """Whether ``x`` has values on the host now (False for a tracer inside ``jax.jit``)."""
    try:
        np.asarray(x) if not hasattr(x, "aval") else x.__array__()  # noqa: B018
        return True
    except Exception:  # noqa: BLE001 - a tracer's conversion error (jax's own exception types)
        return False


class _InPlace(NamedTuple):
    """One staged in-place update: ``rule`` on ``grad`` with the call-time ``values``
    (floats), written over ``targets`` (the variable's array, then its slots'), the arrays of
    ``variables`` (rebound to the results where the backend returns new arrays). With
    ``real_view`` the variables are complex and ``targets`` (and ``grad``) their real views."""

    backend: Any
    rule: UpdateRule
    grad: Any
    values: tuple
    targets: tuple
    variables: tuple
    real_view: bool = False  # complex variables: ``targets`` are their real views

    def same_kernel(self, other: "_InPlace") -> bool:
        return self.backend is other.backend and self.rule == other.rule and len(self.targets) == len(other.targets)


def _pure_step(xp: Any, rule: UpdateRule) -> Callable[..., tuple]:
    """``step(grad, values, *targets) -> new targets``: :func:`apply_rule` over ``xp``."""

    def step(grad: Any, values: Sequence[Any], *targets: Any) -> tuple:
        return apply_rule(xp, rule, values, grad, *targets)

    return step
