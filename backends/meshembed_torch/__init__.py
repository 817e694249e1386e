"""PyTorch backend of meshembed: torch tensors on CPU/CUDA, sharded over torch.distributed ranks.

Importing this package never imports torch; ``TorchBackend.unavailable_reason()`` reports a
missing install instead (so ``me.available_backends()`` simply omits ``"torch"``).
"""

import os
import sys

# Intel OpenMP threads spin for KMP_BLOCKTIME (200 ms) after each parallel region; on a small
# CPU the compiled update kernels and ATen's pool then wait on each other, and a W1 step
# measured 190 ms instead of 8 ms. Only effective before torch is first imported, and a
# user's own setting wins.
if "torch" not in sys.modules:
    os.environ.setdefault("KMP_BLOCKTIME", "0")

from meshembed_torch.backend import TorchBackend  # noqa: E402
from meshembed_torch.table import TorchShardedTable  # noqa: E402

__all__ = ["TorchBackend", "TorchShardedTable"]
