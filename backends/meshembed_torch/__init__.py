"""PyTorch backend of meshembed: torch tensors on CPU/CUDA, sharded over torch.distributed ranks.

Importing this package never imports torch; ``TorchBackend.unavailable_reason()`` reports a
missing install instead (so ``me.available_backends()`` simply omits ``"torch"``).
"""

from meshembed_torch.backend import TorchBackend
from meshembed_torch.table import TorchShardedTable

__all__ = ["TorchBackend", "TorchShardedTable"]
