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

#: Registered fused dense updates run in this process (tests check the path was taken).
fused_dense_calls = [0]


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

    def in_place_group(self, step: Callable[..., Any]) -> int:
        """64 where the registered fused update may run (one FFI call, compiled in no time:
        W2 with 64 tensors 12.7 ms in one call, 17-20 ms in groups of 8); else the default,
        which keeps XLA's compile time down (:meth:`compile_update` splits larger groups)."""
        from meshembed.embedding.updates import REGISTERED_FUSED
        from meshembed_jax import cpu_kernels

        if getattr(step, "registered", (None,))[0] in REGISTERED_FUSED and cpu_kernels.fused_enabled():
            return 64
        return super().in_place_group(step)  # type: ignore[misc]

    def compile_update(self, step: Callable[..., Any], count: int) -> Callable[..., Any]:
        """``jax.jit`` of ``step`` over ``count`` variables with every target donated; returns
        the new arrays by position (see ``Backend.compile_update``).

        Where a registered fused update computes ``step`` (float32 CPU arrays; see
        :meth:`_fused_dense`) it is one FFI call. Otherwise XLA compiles the core's step, and
        its CPU compiler splits a step with several outputs, such as Adadelta's, into loop
        fusions with full-size intermediates (W2, 16.7M floats: five fusions, 60 ms). On a CPU
        device an ``elementwise`` step therefore runs as one compiled *pass per output*: pass
        ``k`` computes only output ``k`` (XLA fuses it into one loop, written in place into
        the donated target ``k``), and the passes run in an order where no later pass reads a
        target an earlier one overwrote (Adadelta: parameters, then ``accumulated_delta_var``,
        then ``accumulated_grad``; W2: 18 ms). XLA plans take at most the default
        :meth:`in_place_group` variables each. Every plan is compiled before the first one
        runs, so a failure changes nothing."""
        import jax

        from meshembed.backend.protocol import Backend

        compiled: dict[tuple, Any] = {}
        xla_group = Backend.in_place_group(self, step)  # type: ignore[arg-type]

        def update_all(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> list:
            out: list[list[Any]] = [[] for _ in targets]
            for n in range(len(grads)):
                for k, v in enumerate(step(grads[n], lrs[n], *(t[n] for t in targets))):
                    out[k].append(v)
            return out

        def xla_plan(grads: Sequence[Any], lrs: Sequence[Any], targets: Sequence[Sequence[Any]]) -> list:
            order = self._pass_order(step, grads, lrs, targets)
            if order is None:
                plan = [(None, jax.jit(update_all, donate_argnums=tuple(range(2, 2 + len(targets)))))]
            else:
                plan = [(k, jax.jit(lambda g, lr, *t, k=k: update_all(g, lr, *t)[k], donate_argnums=(2 + k,)))
                        for k in order]
            return [(k, fn.lower(grads, lrs, *targets).compile()) for k, fn in plan]

        def run_plan(plan: list, grads: Sequence[Any], lrs: Sequence[Any], targets: list) -> list:
            if plan[0][0] is None:
                return plan[0][1](grads, lrs, *targets)
            for k, fn in plan:
                targets[k] = fn(grads, lrs, *targets)
            return targets

        def run(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> Any:
            key = tuple((x.shape, x.dtype) for x in (*grads, *lrs, *(y for t in targets for y in t)))
            if key not in compiled:
                fused = self._fused_dense(step, grads, lrs, targets)
                if fused is not None:
                    compiled[key] = (True, [(0, len(grads), [(None, fused)])])
                else:
                    pieces = [(lo, min(lo + xla_group, len(grads))) for lo in range(0, len(grads), xla_group)]
                    compiled[key] = (False, [(lo, hi, xla_plan(grads[lo:hi], lrs[lo:hi], [t[lo:hi] for t in targets]))
                                             for lo, hi in pieces])
            is_fused, plans = compiled[key]
            fused_dense_calls[0] += is_fused
            out: list[list[Any]] = [[] for _ in targets]
            for lo, hi, plan in plans:
                for k, new in enumerate(run_plan(plan, grads[lo:hi], lrs[lo:hi], [list(t[lo:hi]) for t in targets])):
                    out[k].extend(new)
            return out

        run.__wrapped__ = step  # type: ignore[attr-defined]
        return run

    def _fused_dense(self, step: Callable[..., Any], grads: Sequence[Any], lrs: Sequence[Any],
                     targets: Sequence[Sequence[Any]]) -> Callable[..., Any] | None:
        """The registered fused update of ``step`` (``step.registered``; see
        ``meshembed.embedding.updates.REGISTERED_FUSED``), compiled for these arrays, where it
        computes ``step``: float32 arrays on CPU devices, the FFI kernels built,
        ``MESHEMBED_JAX_FUSED`` on. One pass over each tensor that reads every input once and
        writes every output once, in place; None where the core function must run."""
        import jax
        import jax.numpy as jnp

        from meshembed.embedding.updates import registered_code
        from meshembed_jax import cpu_kernels

        name, hp = getattr(step, "registered", (None, {}))
        code = registered_code(name, hp, len(targets)) if cpu_kernels.fused_enabled() else None
        arrays = [*grads, *(x for t in targets for x in t)]
        if code is None or any(x.dtype != np.float32 for x in arrays):
            return None
        if any(d.platform != "cpu" for x in arrays for d in x.sharding.device_set) or not cpu_kernels.usable("cpu"):
            return None
        rho = float(hp.get("rho", 0.0))
        # float32 as the core's Python floats become; 1 - rho rounded once from double
        consts = np.asarray([rho, float(hp.get("epsilon", 0.0)), 1.0 - rho], np.float32)

        def update(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> list:
            table = jnp.stack([jnp.concatenate([jnp.asarray(lr).astype(jnp.float32).reshape(1), consts]) for lr in lrs])
            return cpu_kernels.dense_update(table, list(grads), [list(t) for t in targets], code)

        fn = jax.jit(update, donate_argnums=tuple(range(2, 2 + len(targets))))
        return fn.lower(grads, lrs, *targets).compile()

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
