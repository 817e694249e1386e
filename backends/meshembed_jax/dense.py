"""Dense mesh support of the JAX backend: ``jax.sharding.Mesh`` + ``NamedSharding``, jax.grad.

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

    def value_and_grad(self, fn: Callable[..., Any], values: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Loss and gradients of ``fn(*values)`` by ``jax.value_and_grad`` over all values;
        gradients keep the values' shardings under SPMD propagation."""
        import jax

        loss, grads = jax.value_and_grad(lambda vals: fn(*vals))(list(values))
        return loss, list(grads)
