"""``me.torch``: the PyTorch front end — an ``nn.Module`` over the embedding engine whose
backward applies the TPU optimizer, and a ``torch.optim.Optimizer`` for the dense part.

``import meshembed`` imports no torch; ``me.torch`` is a lazy alias to this module.
"""

from meshembed_torch.module import EmbeddingCollection
from meshembed_torch.optim import Adadelta

__all__ = ["Adadelta", "EmbeddingCollection"]
