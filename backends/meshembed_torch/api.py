"""``me.torch``: the PyTorch front end — an ``nn.Module`` over the embedding engine whose
backward applies the TPU optimizer (``EmbeddingBagCollection``: torchrec's name for it when
every feature is pooled), and a ``torch.optim.Optimizer`` for the dense part.

``import meshembed`` imports no torch; ``me.torch`` is a lazy alias to this module.
"""

from meshembed_torch.module import EmbeddingBagCollection, EmbeddingCollection
from meshembed_torch.optim import Adadelta

__all__ = ["Adadelta", "EmbeddingBagCollection", "EmbeddingCollection"]
