"""JAX backend: tables as sharded ``jax.Array``s on a ``jax.sharding.Mesh``, row kernels
compiled with ``jax.jit`` (donated buffers) and routed with ``shard_map``.

Importing this package does not import jax; ``JaxBackend.unavailable_reason()`` says why
the backend cannot run when jax is missing.
"""

from meshembed_jax.backend import JaxBackend
from meshembed_jax.table import JaxShardedTable

__all__ = ["JaxBackend", "JaxShardedTable"]
