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

        XLA splits a step such as Adadelta into several loop fusions with full-size
        intermediates and fresh outputs (W2: 60 ms for 16.7M floats). On a CPU device an
        ``elementwise`` step over float32/float64 therefore runs in pieces of
        ``PIECE_BYTES``: each piece is the step on slices (cache-sized intermediates) and
        all its results are written into the donated buffers by one FFI call
        (``cpu_kernels.write_slices``), so no array is copied or allocated."""
        import jax

        compiled: dict[tuple, Callable[..., Any]] = {}

        def run(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> Any:
            pieces = self._update_in_pieces(step, grads, targets)
            key = (len(targets), pieces)
            fn = compiled.get(key)
            if fn is None:
                def update_all(grads: Sequence[Any], lrs: Sequence[Any], *targets: Sequence[Any]) -> list:
                    out: list[list[Any]] = [[] for _ in targets]
                    for n in range(count):
                        own = [t[n] for t in targets]
                        new = _step_in_pieces(step, grads[n], lrs[n], own) if pieces else step(grads[n], lrs[n], *own)
                        for k, v in enumerate(new):
                            out[k].append(v)
                    return out

                fn = compiled[key] = jax.jit(update_all, donate_argnums=tuple(range(2, 2 + len(targets))))
            return fn(grads, lrs, *targets)

        run.__wrapped__ = step  # type: ignore[attr-defined]
        return run

    def _update_in_pieces(self, step: Callable[..., Any], grads: Sequence[Any], targets: Sequence[Sequence[Any]]) -> bool:
        """Whether :meth:`compile_update` runs ``step`` in pieces for these arrays."""
        from meshembed_jax import cpu_kernels

        if not getattr(step, "elementwise", False):
            return False
        arrays = [*grads, *(x for t in targets for x in t)]
        first = arrays[0]
        if any(x.shape != first.shape for x in arrays) or first.size < 2 * _piece(first.dtype):
            return False
        platform = next(iter(first.sharding.device_set)).platform
        return cpu_kernels.usable(platform, *{x.dtype for x in arrays})

    def value_and_grad(self, fn: Callable[..., Any], values: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Loss and gradients of ``fn(*values)`` by ``jax.value_and_grad`` over all values;
        gradients keep the values' shardings under SPMD propagation."""
        import jax

        loss, grads = jax.value_and_grad(lambda vals: fn(*vals))(list(values))
        return loss, list(grads)


#: Bytes of one piece of an elementwise dense step (see ``JaxDenseMixin.compile_update``):
#: measured at W2 (16.7M float32, 2-core CPU): 256 KiB pieces 33 ms, 1 MiB 23 ms, 2 MiB 21 ms,
#: 4 MiB 33 ms, one piece (XLA alone) 60 ms.
PIECE_BYTES = 1 << 21


def _piece(dtype: Any) -> int:
    return max(1, PIECE_BYTES // np.dtype(dtype).itemsize)


def _step_in_pieces(step: Callable[..., Any], grad: Any, lr: Any, own: Sequence[Any]) -> list[Any]:
    """``step`` on consecutive slices of the flattened arrays, each piece's results written
    in place into the (donated) targets; traced inside ``jax.jit``."""
    import jax.numpy as jnp
    from jax import lax

    from meshembed_jax import cpu_kernels

    shape, n = own[0].shape, int(own[0].size)
    c = _piece(own[0].dtype)
    g = grad.reshape(-1)
    flat = tuple(x.reshape(-1) for x in own)

    def piece(start: Any, size: int, outs: tuple) -> tuple:
        sl = [lax.dynamic_slice_in_dim(x, start, size) for x in (g, *outs)]
        new = step(sl[0], lr, *sl[1:])
        if len(new) != len(outs):
            raise ValueError(f"Invalid step result. Expected {len(outs)} arrays. Received: {len(new)}")
        return cpu_kernels.write_slices(outs, start, tuple(jnp.asarray(v).astype(o.dtype) for o, v in zip(outs, new)))

    full = n // c
    outs = lax.fori_loop(0, full, lambda i, outs: piece(i * c, c, outs), flat)
    if n % c:
        outs = piece(full * c, n % c, outs)
    return [o.reshape(shape) for o in outs]
