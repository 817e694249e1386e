"""``me.torch``: the PyTorch front end — an ``nn.Module`` over the embedding engine whose
backward applies the TPU optimizer (``EmbeddingBagCollection``: torchrec's name for it when
every feature is pooled), and a ``torch.optim.Optimizer`` for the dense part.

``import meshembed`` imports no torch; ``me.torch`` is a lazy alias to this package
(``module.py``: the ``nn.Module``s; ``optim.py``: the dense optimizer).
"""

from meshembed_torch.frontend.module import EmbeddingBagCollection, EmbeddingCollection
from meshembed_torch.frontend.optim import Adadelta

__all__ = ["Adadelta", "EmbeddingBagCollection", "EmbeddingCollection"]
