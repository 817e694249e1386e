"""Dense mesh support of the JAX backend: ``jax.sharding.Mesh`` + ``NamedSharding``, jax.grad,
and the dense optimizer's donated step.

Mixed into ``JaxBackend`` so ``me.Mesh``/``me.Layout``/``me.Variable`` map onto real JAX
shardings: a layout ``["model", UNSHARDED]`` becomes ``NamedSharding(mesh, P("model", None))``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from meshembed.backend.protocol import call_values
from meshembed.errors import ConfigError
from meshembed.math.rule import UpdateRule, apply_rule


class JaxDenseMixin:
    """``make_mesh`` / ``place`` / ``sharding_of`` / ``value_and_grad`` for JAX."""

    def make_mesh(self, dim_names: Sequence[str], shape: Sequence[int], devices: Any = None) -> Any:
        """A ``jax.sharding.Mesh`` over ``devices`` (default: the first ``prod(shape)``
        devices of the default platform), laid out row-major in ``shape``."""
        import jax
        from jax.sharding import Mesh

        shape = tuple(int(s) for s in shape)
        n = math.prod(shape)
        if devices is None:
            available = jax.devices()
            if len(available) < n:
                raise ConfigError(
                    f"Invalid `shape`. Expected at most {len(available)} devices (the JAX devices "
                    f"here), e.g. set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                    f"importing jax for CPU devices. Received: shape={shape}"
                )
            devices = available[:n]
        devices = np.asarray(list(np.ravel(np.asarray(devices, dtype=object))), dtype=object)
        if devices.size != n:
            raise ConfigError(
                f"Invalid `devices`. Expected {n} devices for shape={shape}. Received: {devices.size} devices"
            )
        return Mesh(devices.reshape(shape), axis_names=tuple(dim_names))

    def named_sharding(self, layout: Any) -> Any:
        """The ``NamedSharding`` of a meshembed Layout."""
        from jax.sharding import NamedSharding, PartitionSpec

        from meshembed.sharding.mesh import UNSHARDED

        spec = PartitionSpec(*[None if s == UNSHARDED else s for s in layout.sharding_specs])
        return NamedSharding(layout.mesh.native, spec)

    def place(self, value: Any, layout: Any) -> Any:
        """``jax.device_put`` onto the layout's ``NamedSharding`` (no-op if already there)."""
        import jax
        import jax.numpy as jnp

        if layout is None or layout.mesh.native is None:
            return jnp.asarray(value)
        sharding = self.named_sharding(layout)
        if isinstance(value, jax.Array) and value.sharding == sharding:
            return value
        return jax.device_put(value, sharding)

    def sharding_of(self, value: Any) -> Any:
        """The array's ``jax.sharding.Sharding``."""
        return getattr(value, "sharding", None)

    # -- the dense optimizer's step ------------------------------------------------------------
    def can_update_in_place(self, value: Any) -> bool:
        """Single-device arrays: their buffers are donated to the compiled step."""
        import jax

        return isinstance(value, jax.Array) and len(value.sharding.device_set) == 1

    def in_place_group(self, rule: UpdateRule) -> int:
        """64 where the generated fused update may run (one FFI call, compiled in no time,
        faster than groups of 8: docs/benchmarks.md, "Measurements behind design choices in
        the code", JAX backend, W2 grouping); else the default,
        which keeps XLA's compile time down (:meth:`compile_update` splits larger groups)."""
        if self._row_kernel(rule) is not None:
            return 64
        return super().in_place_group(rule)  # type: ignore[misc]

    def compile_update(self, rule: UpdateRule, count: int) -> Callable[..., Any]:
        """``jax.jit`` of ``rule``'s step over ``count`` variables with every target donated;
        returns the new arrays by position (see ``Backend.compile_update``).

        Where a generated fused kernel computes ``rule`` (CPU arrays; see :meth:`_fused_dense`)
        it is one FFI call, its parameter block built on the host from the values. Otherwise
        XLA compiles the core's step with the values as 0-d array inputs, and its CPU compiler
        splits a step with several outputs, such as Adadelta's, into loop fusions with
        full-size intermediates (W2: five fusions; figures in docs/benchmarks.md, W2
        grouping). On a CPU device an
        element-wise rule therefore runs as one compiled *pass per output*: pass ``k``
        computes only output ``k`` (XLA fuses it into one loop, written in place into the
        donated target ``k``), and the passes run in an order where no later pass reads a
        target an earlier one overwrote (Adadelta: parameters, then ``accumulated_delta_var``,
        then ``accumulated_grad``). XLA plans take at most the default
        :meth:`in_place_group` variables each. Every plan is compiled before the first one
        runs, so a failure changes nothing."""
        import jax
        import jax.numpy as jnp

        from meshembed.backend.protocol import Backend

        compiled: dict[tuple, Any] = {}
        xla_group = Backend.in_place_group(self, rule)  # type: ignore[arg-type]

        def step(grad: Any, values: Any, *targets: Any) -> tuple:
            return apply_rule(jnp, rule, values, grad, *targets)

        def update_all(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> list:
            out: list[list[Any]] = [[] for _ in targets]
            for n in range(len(grads)):
                for k, v in enumerate(step(grads[n], values[n], *(t[n] for t in targets))):
                    out[k].append(v)
            return out

        def xla_plan(grads: Sequence[Any], values: Sequence[Any], targets: Sequence[Sequence[Any]]) -> list:
            order = self._pass_order(step, grads, values, targets) if rule.elementwise else None
            if order is None:
                plan = [(None, jax.jit(update_all, donate_argnums=tuple(range(2, 2 + len(targets)))))]
            else:
                plan = [(k, jax.jit(lambda g, v, *t, k=k: update_all(g, v, *t)[k], donate_argnums=(2 + k,)))
                        for k in order]
            return [(k, fn.lower(grads, values, *targets).compile()) for k, fn in plan]

        def run_plan(plan: list, grads: Sequence[Any], values: Sequence[Any], targets: list) -> list:
            if plan[0][0] is None:
                return plan[0][1](grads, values, *targets)
            for k, fn in plan:
                targets[k] = fn(grads, values, *targets)
            return targets

        def run(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> Any:
            key = tuple((x.shape, x.dtype) for x in (*grads, *(y for t in targets for y in t)))
            if key not in compiled:
                fused = self._fused_dense(rule, grads, values, targets)
                if fused is not None:
                    compiled[key] = (fused, [])
                else:
                    arrays = [call_values(jnp, v, t) for v, t in zip(values, targets[0])]
                    pieces = [(lo, min(lo + xla_group, len(grads))) for lo in range(0, len(grads), xla_group)]
                    compiled[key] = (None, [(lo, hi, xla_plan(grads[lo:hi], arrays[lo:hi], [t[lo:hi] for t in targets]))
                                            for lo, hi in pieces])
            fused, plans = compiled[key]
            if fused is not None:
                self._stats["fused_dense_updates"] += 1  # type: ignore[attr-defined]
                return fused(grads, values, *targets)
            arrays = [call_values(jnp, v, t) for v, t in zip(values, targets[0])]
            out: list[list[Any]] = [[] for _ in targets]
            for lo, hi, plan in plans:
                for k, new in enumerate(run_plan(plan, grads[lo:hi], arrays[lo:hi], [list(t[lo:hi]) for t in targets])):
                    out[k].extend(new)
            return out

        return run

    def _row_kernel(self, rule: UpdateRule) -> Any:
        """The generated row kernel of ``rule`` (``meshembed_native.codegen``) where the FFI
        kernels run here and the backend's ``fused`` and ``use_cpu_kernels`` are on, else None."""
        from meshembed_jax import native

        if not (rule.elementwise and self.fused and self.use_cpu_kernels  # type: ignore[attr-defined]
                and native.usable("cpu", rule.dtype)):
            return None
        from meshembed_native import codegen

        return codegen.row_kernel(rule, 1 + len(rule.slot_names))

    def _fused_dense(self, rule: UpdateRule, grads: Sequence[Any], values: Sequence[Any],
                     targets: Sequence[Sequence[Any]]) -> Callable[..., Any] | None:
        """``run(grads, values, *targets) -> new targets``: the generated fused kernel of
        ``rule`` over these arrays in one FFI call, where it computes ``rule``: every array
        of the rule's dtype on a CPU device, the kernels built. One pass over each tensor
        that reads every input once and writes every output once, in place; the parameter
        block (``kernel.params`` of each variable's values) is an input, so new values
        recompile nothing. None where the core function must run."""
        import jax

        from meshembed_jax import native

        kernel = self._row_kernel(rule)
        arrays = [*grads, *(x for t in targets for x in t)]
        if kernel is None or len(targets) != kernel.n_arrays or any(x.dtype != np.dtype(kernel.dtype) for x in arrays):
            return None
        if any(d.platform != "cpu" for x in arrays for d in x.sharding.device_set):
            return None

        def update(hp: Any, grads: Sequence[Any], *targets: Sequence[Any]) -> list:
            return native.dense_update(hp, list(grads), [list(t) for t in targets], kernel)

        def block(values: Sequence[Any]) -> np.ndarray:
            return native.hp_block([kernel.params(v) for v in values])

        compiled = jax.jit(update, donate_argnums=tuple(range(2, 2 + len(targets)))).lower(
            block(values), grads, *targets).compile()
        return lambda grads, values, *targets: compiled(block(values), grads, *targets)

    def _pass_order(self, step: Callable[..., Any], grads: Sequence[Any], values: Sequence[Any],
                    targets: Sequence[Sequence[Any]]) -> list[int] | None:
        """The order of :meth:`compile_update`'s passes for an element-wise ``step``, or None
        for one pass: CPU arrays whose outputs can be written one by one (output ``k``
        overwrites target ``k`` only once no remaining output reads target ``k``)."""
        import jax

        arrays = [*grads, *(x for t in targets for x in t)]
        if len(targets) < 2:
            return None
        if any(d.platform != "cpu" for x in arrays for d in x.sharding.device_set):
            return None
        reads = _reads_of_outputs(jax.make_jaxpr(step)(grads[0], values[0], *(t[0] for t in targets)))
        n_values = len(values[0])
        reads = [{i - 1 - n_values for i in r if i >= 1 + n_values} for r in reads]  # the targets each output reads
        order, left = [], list(range(len(targets)))
        while left:
            k = next((k for k in left if not any(k in reads[j] for j in left if j != k)), None)
            if k is None:
                return None
            order.append(k)
            left.remove(k)
        return order

    def value_and_grad(self, fn: Callable[..., Any], values: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Loss and gradients of ``fn(*values)`` by ``jax.value_and_grad`` over all values;
        gradients keep the values' shardings under SPMD propagation. The gradient of a complex
        value is conjugated: JAX returns ``∂L/∂re − i·∂L/∂im``, torch (whose complex semantics
        the optimizer follows) ``∂L/∂re + i·∂L/∂im``, the steepest ascent of the real view."""
        import jax
        import jax.numpy as jnp

        from meshembed.errors import InputError

        def summed(vals: Any) -> Any:  # a non-scalar loss is summed, as tf.GradientTape does
            loss = fn(*vals)
            if not hasattr(loss, "dtype") or not jnp.issubdtype(loss.dtype, jnp.floating):
                raise InputError(
                    "Invalid `loss`. Expected a callable returning a floating array (a non-scalar one is "
                    f"summed). Received: loss value of type {type(loss).__name__}"
                )
            return jnp.sum(loss)

        loss, grads = jax.value_and_grad(summed)(list(values))
        return loss, [jnp.conj(g) if jnp.iscomplexobj(g) else g for g in grads]


def _reads_of_outputs(closed: Any) -> list[set[int]]:
    """For each output of a traced function, the positions of the inputs it depends on
    (an equation's outputs are taken to depend on all of its inputs)."""
    jaxpr = closed.jaxpr
    deps: dict[Any, set[int]] = {v: {i} for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        used = set().union(*(deps.get(v, set()) for v in eqn.invars if not hasattr(v, "val")))
        for v in eqn.outvars:
            deps[v] = used
    return [set(deps.get(v, set())) if not hasattr(v, "val") else set() for v in jaxpr.outvars]
