"""Backend protocol, registry and selection."""

from meshembed.backend.protocol import Array, Backend, Capabilities, ShardedTable
from meshembed.backend.registry import (
    available_backends,
    default_backend_name,
    get_backend,
    register_backend,
    set_backend,
    use_backend,
)

__all__ = [
    "Array", "Backend", "Capabilities", "ShardedTable", "available_backends",
    "default_backend_name", "get_backend", "register_backend", "set_backend", "use_backend",
]
