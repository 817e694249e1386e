"""PyTorch backend of meshembed: torch tensors on CPU/CUDA, sharded over torch.distributed ranks.

Importing this package never imports torch; ``TorchBackend.unavailable_reason()`` reports a
missing install instead (so ``me.available_backends()`` simply omits ``"torch"``).

No process-wide side effects: nothing here sets environment variables or allocator options.
Two tunings measured on small CPUs are the user's to opt into (see README.md): glibc malloc
thresholds (``MESHEMBED_TORCH_MALLOC_TUNING=1``, applied on the first table of ≥ 32 MiB), and
``KMP_BLOCKTIME=0`` for torch builds on Intel OpenMP (set it before importing torch; the
default libgomp build ignores it, ``OMP_WAIT_POLICY=passive`` is its counterpart).
"""

from meshembed_torch.backend import TorchBackend
from meshembed_torch.table import TorchShardedTable

__all__ = ["TorchBackend", "TorchShardedTable"]
