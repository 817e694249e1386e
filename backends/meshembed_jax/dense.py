"""Dense mesh support of the JAX backend: ``jax.sharding.Mesh`` + ``NamedSharding``, jax.grad,
and the dense optimizer's donated step.

Mixed into ``JaxBackend`` so ``me.Mesh``/``me.Layout``/``me.Variable`` map onto real JAX
shardings: a layout ``["model", UNSHARDED]`` becomes ``NamedSharding(mesh, P("model", None))``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from meshembed.errors import ConfigError


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

    def compile_update(self, step: Callable[..., Any], count: int) -> Callable[..., Any]:
        """``jax.jit`` of ``step`` over ``count`` variables with every target donated; returns
        the new arrays by position (see ``Backend.compile_update``).

        XLA's CPU compiler splits a step with several outputs, such as Adadelta's, into
        loop fusions with full-size intermediates (W2, 16.7M floats: five fusions, 60 ms).
        On a CPU device an ``elementwise`` step therefore runs as one compiled *pass per
        output*: pass ``k`` computes only output ``k`` (XLA fuses it into one loop, written
        in place into the donated target ``k``), and the passes run in an order where no
        later pass reads a target an earlier one overwrote (Adadelta: parameters, then
        ``accumulated_delta_var``, then ``accumulated_grad``; W2: 18 ms). Every pass is
        compiled before the first one runs, so a failure changes nothing."""
        import jax

        compiled: dict[tuple, Any] = {}

        def update_all(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> list:
            out: list[list[Any]] = [[] for _ in targets]
            for n in range(count):
                for k, v in enumerate(step(grads[n], lrs[n], *(t[n] for t in targets))):
                    out[k].append(v)
            return out

        def run(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> Any:
            key = tuple((x.shape, x.dtype) for x in (*grads, *lrs, *(y for t in targets for y in t)))
            plan = compiled.get(key)
            if plan is None:
                order = self._pass_order(step, grads, lrs, targets)
                if order is None:
                    plan = [(None, jax.jit(update_all, donate_argnums=tuple(range(2, 2 + len(targets)))))]
                else:
                    plan = [(k, jax.jit(lambda g, lr, *t, k=k: update_all(g, lr, *t)[k], donate_argnums=(2 + k,)))
                            for k in order]
                compiled[key] = plan = [(k, fn.lower(grads, lrs, *targets).compile()) for k, fn in plan]
            if plan[0][0] is None:
                return plan[0][1](grads, lrs, *targets)
            targets = list(targets)
            for k, fn in plan:
                targets[k] = fn(grads, lrs, *targets)
            return targets

        run.__wrapped__ = step  # type: ignore[attr-defined]
        return run

    def _pass_order(self, step: Callable[..., Any], grads: Sequence[Any], lrs: Sequence[Any],
                    targets: Sequence[Sequence[Any]]) -> list[int] | None:
        """The order of :meth:`compile_update`'s passes, or None for one pass: an
        ``elementwise`` step on CPU arrays whose outputs can be written one by one (output
        ``k`` overwrites target ``k`` only once no remaining output reads target ``k``)."""
        import jax

        arrays = [*grads, *(x for t in targets for x in t)]
        if not getattr(step, "elementwise", False) or len(targets) < 2:
            return None
        if any(d.platform != "cpu" for x in arrays for d in x.sharding.device_set):
            return None
        reads = _reads_of_outputs(jax.make_jaxpr(step)(grads[0], lrs[0], *(t[0] for t in targets)))
        reads = [{i - 2 for i in r if i >= 2} for r in reads]  # the targets each output reads
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
        gradients keep the values' shardings under SPMD propagation."""
        import jax

        loss, grads = jax.value_and_grad(lambda vals: fn(*vals))(list(values))
        return loss, list(grads)


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
